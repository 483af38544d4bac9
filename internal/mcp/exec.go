package mcp

import (
	"context"
	"fmt"
	"strings"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/request"
)

type execArgs struct {
	ID          string            `json:"id" jsonschema:"the sandbox"`
	Command     string            `json:"command,omitempty" jsonschema:"a shell command line, run with /bin/sh -c (give this or args)"`
	Args        []string          `json:"args,omitempty" jsonschema:"the program and its arguments, run without a shell (give this or command)"`
	Cwd         string            `json:"cwd,omitempty" jsonschema:"working directory, absolute (default: the user's home)"`
	Env         map[string]string `json:"env,omitempty" jsonschema:"environment variables added to the default ones"`
	User        string            `json:"user,omitempty" jsonschema:"run as this user (default root)"`
	Stdin       string            `json:"stdin,omitempty" jsonschema:"text given to the process on its standard input"`
	TimeoutSecs float64           `json:"timeout_secs,omitempty" jsonschema:"kill the process after this many seconds (default 60)"`
}

type execResult struct {
	ExitCode    int    `json:"exit_code" jsonschema:"the exit status; -1 when a signal ended the process"`
	Signal      string `json:"signal,omitempty"`
	TimedOut    bool   `json:"timed_out,omitempty" jsonschema:"the process was killed at timeout_secs"`
	DurationMS  int64  `json:"duration_ms"`
	Stdout      string `json:"stdout"`
	Stderr      string `json:"stderr"`
	StdoutBytes int64  `json:"stdout_bytes"`
	StderrBytes int64  `json:"stderr_bytes"`
	Truncated   bool   `json:"truncated,omitempty" jsonschema:"stdout or stderr was longer than 64 KiB: its middle was left out (see the marker in it)"`
}

func (r *execResult) text() string {
	var b strings.Builder
	switch {
	case r.TimedOut:
		fmt.Fprintf(&b, "timed out after %d ms (killed)", r.DurationMS)
	case r.Signal != "":
		fmt.Fprintf(&b, "killed by %s after %d ms", r.Signal, r.DurationMS)
	default:
		fmt.Fprintf(&b, "exit code %d (%d ms)", r.ExitCode, r.DurationMS)
	}
	section(&b, "stdout", r.Stdout, r.StdoutBytes)
	section(&b, "stderr", r.Stderr, r.StderrBytes)
	return b.String()
}

// section appends a labelled output to b, when there is one.
func section(b *strings.Builder, label, s string, n int64) {
	if n == 0 {
		return
	}
	fmt.Fprintf(b, "\n--- %s (%d bytes) ---\n%s", label, n, s)
	if !strings.HasSuffix(s, "\n") {
		b.WriteString("\n")
	}
}

type codeArgs struct {
	ID          string  `json:"id" jsonschema:"the sandbox (its snapshot's image must have Python, such as \"python\")"`
	Code        string  `json:"code" jsonschema:"Python statements; the value of a final expression is returned"`
	TimeoutSecs float64 `json:"timeout_secs,omitempty" jsonschema:"interrupt the code after this many seconds (default 60)"`
}

type codeResult struct {
	Value      string     `json:"value,omitempty" jsonschema:"repr() of the last expression's value"`
	Stdout     string     `json:"stdout"`
	Stderr     string     `json:"stderr"`
	Error      *codeError `json:"error,omitempty" jsonschema:"the exception the code raised"`
	TimedOut   bool       `json:"timed_out,omitempty"`
	Restarted  bool       `json:"restarted,omitempty" jsonschema:"the interpreter was restarted: variables defined before are gone"`
	DurationMS int64      `json:"duration_ms"`
	Truncated  bool       `json:"truncated,omitempty" jsonschema:"a field was longer than 64 KiB and its middle left out"`
}

type codeError struct {
	Name      string `json:"name"`
	Message   string `json:"message"`
	Traceback string `json:"traceback,omitempty"`
}

func (r *codeResult) text() string {
	var b strings.Builder
	switch {
	case r.TimedOut:
		fmt.Fprintf(&b, "timed out after %d ms (interrupted)", r.DurationMS)
	case r.Error != nil:
		fmt.Fprintf(&b, "raised %s: %s (%d ms)", r.Error.Name, r.Error.Message, r.DurationMS)
	default:
		fmt.Fprintf(&b, "ok (%d ms)", r.DurationMS)
	}
	if r.Restarted {
		b.WriteString("; the interpreter was restarted, earlier state is gone")
	}
	if r.Value != "" {
		fmt.Fprintf(&b, "\n--- value ---\n%s\n", r.Value)
	}
	section(&b, "stdout", r.Stdout, int64(len(r.Stdout)))
	section(&b, "stderr", r.Stderr, int64(len(r.Stderr)))
	if r.Error != nil && r.Error.Traceback != "" {
		section(&b, "traceback", r.Error.Traceback, int64(len(r.Error.Traceback)))
	}
	return b.String()
}

// capString bounds a string result field to MaxField bytes.
func capString(s string, truncated *bool) string {
	c := newCapture(MaxField)
	_, _ = c.Write([]byte(s))
	if c.Truncated() {
		*truncated = true
	}
	return c.String()
}

func (t *tools) execTools(s *sdk.Server) {
	add(s, tool[execArgs, execResult]{
		name: "exec_command", title: "Run a command in a sandbox", destructive: true,
		desc: "Run a command in a sandbox and return its exit code, stdout and stderr (each cut to its first and last 32 KiB when longer). " +
			"Give command (a shell line: pipes, redirections, &&) or args (no shell). A non-zero exit code is a normal result, not an error. " +
			"The process and whatever it leaves behind are killed when it exits or at timeout_secs (default 60); use a shell's nohup/& only for work that may die with it.",
		props: map[string][]prop{"id": idProp, "command": {maxLen(1 << 20)}, "args": {maxItems(4096)}, "cwd": pathProp,
			"timeout_secs": {between(0, maxCallSecs), byDefault(defaultCallSecs)}},
		run: t.exec,
	})
	add(s, tool[codeArgs, codeResult]{
		name: "run_code", title: "Run Python in a sandbox's warm interpreter", destructive: true,
		desc: "Run Python code in the sandbox's warm interpreter (already started, modules such as numpy preloaded in the python image). " +
			"Variables, imports and functions persist between calls in the same sandbox. Returns the last expression's value (repr), " +
			"stdout, stderr and any exception with its traceback. Needs a sandbox of an image with Python.",
		props: map[string][]prop{"id": idProp, "code": {minLen(1), maxLen(1 << 20)},
			"timeout_secs": {between(0, maxCallSecs), byDefault(defaultCallSecs)}},
		run: t.runCode,
	})
	add(s, tool[waitArgs, waitResult]{
		name: "wait_for_text", title: "Wait for text to appear in a sandbox file", readOnly: true,
		desc: "Wait until a file in the sandbox contains the given text (e.g. a server's \"listening on\" line in its log), " +
			"reading the file every interval_ms, up to timeout_secs (default 30). The text is matched literally, byte for byte; " +
			"nothing is run in the sandbox. Fails when the text has not appeared in time.",
		props: map[string][]prop{"id": idProp, "path": pathProp, "text": {minLen(1), maxLen(maxMarkerBytes)},
			"timeout_secs": {between(0, maxWaitSecs), byDefault(defaultWaitSecs)},
			"interval_ms":  {between(minIntervalMS, maxIntervalMS), byDefault(defaultInterval)}},
		run: t.waitForText,
	})
}

func (t *tools) exec(ctx context.Context, c *call, in *execArgs) (*execResult, error) {
	if err := checkID(in.ID); err != nil {
		return nil, err
	}
	if (in.Command == "") == (len(in.Args) == 0) {
		return nil, errdefs.InvalidArgument("give exactly one of command (a shell line) and args (a program and its arguments)")
	}
	if len(in.Args) > 0 && in.Args[0] == "" {
		return nil, errdefs.InvalidArgument("args[0] is empty: it names the program to run")
	}
	if in.Cwd != "" {
		if err := checkPath("cwd", in.Cwd); err != nil {
			return nil, err
		}
	}
	for k := range in.Env {
		if k == "" || strings.ContainsAny(k, "=\x00") {
			return nil, errdefs.InvalidArgument("env name %s: want a name without '=' or NUL", errdefs.Quote(k))
		}
	}
	secs := in.TimeoutSecs
	if secs == 0 {
		secs = defaultCallSecs
	}
	if err := checkSecs("timeout_secs", secs, 0, maxCallSecs); err != nil {
		return nil, err
	}
	req := apiv1.ExecRequest{Args: in.Args, Shell: in.Command, Env: in.Env, Cwd: in.Cwd, User: in.User, TimeoutSecs: secs}
	if in.Stdin != "" {
		req.Stdin = []byte(in.Stdin)
	}
	if _, err := request.Exec(&req); err != nil {
		return nil, err
	}
	stdout, stderr := newCapture(MaxField), newCapture(MaxField)
	defer c.progress().heartbeat(ctx, "running")()
	res, err := t.c.ExecStream(ctx, in.ID, req, nil, stdout, stderr)
	if err != nil {
		return nil, notFoundSandbox(in.ID, withHint(err, errdefs.IsDeadlineExceeded,
			"The sandbox did not finish the command in time and may be overloaded: retry, or check it with get_sandbox."))
	}
	return &execResult{ExitCode: res.ExitCode, Signal: res.Signal, TimedOut: res.TimedOut, DurationMS: res.DurationMS,
		Stdout: stdout.String(), Stderr: stderr.String(), StdoutBytes: stdout.total, StderrBytes: stderr.total,
		Truncated: stdout.Truncated() || stderr.Truncated()}, nil
}

func (t *tools) runCode(ctx context.Context, c *call, in *codeArgs) (*codeResult, error) {
	if err := checkID(in.ID); err != nil {
		return nil, err
	}
	if strings.TrimSpace(in.Code) == "" {
		return nil, errdefs.InvalidArgument("code is empty: give Python statements or an expression")
	}
	secs := in.TimeoutSecs
	if secs == 0 {
		secs = defaultCallSecs
	}
	if err := checkSecs("timeout_secs", secs, 0, maxCallSecs); err != nil {
		return nil, err
	}
	stdout, stderr := newCapture(MaxField), newCapture(MaxField)
	defer c.progress().heartbeat(ctx, "running")()
	req := apiv1.EvalRequest{Code: in.Code, TimeoutSecs: secs}
	if _, err := request.Eval(&req); err != nil {
		return nil, err
	}
	res, err := t.c.EvalStream(ctx, in.ID, req, stdout, stderr)
	if err != nil {
		return nil, notFoundSandbox(in.ID, err)
	}
	out := &codeResult{TimedOut: res.TimedOut, Restarted: res.Restarted, DurationMS: res.DurationMS,
		Truncated: stdout.Truncated() || stderr.Truncated() || res.Truncated}
	out.Stdout, out.Stderr = stdout.String(), stderr.String()
	// A buffered answer (an older daemon's stream) carries the output in
	// the result itself.
	if stdout.total == 0 && res.Stdout != "" {
		out.Stdout = capString(res.Stdout, &out.Truncated)
	}
	if stderr.total == 0 && res.Stderr != "" {
		out.Stderr = capString(res.Stderr, &out.Truncated)
	}
	out.Value = capString(res.Value, &out.Truncated)
	if e := res.Error; e != nil {
		out.Error = &codeError{Name: e.Name, Message: capString(e.Message, &out.Truncated), Traceback: capString(e.Traceback, &out.Truncated)}
	}
	return out, nil
}

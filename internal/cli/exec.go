package cli

import (
	"io"
	"time"

	"github.com/spf13/cobra"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/request"
)

func newExecCmd(g *globals) *cobra.Command {
	var timeout time.Duration
	var env []string
	var cwd, user string
	var stdin bool
	cmd := &cobra.Command{
		Use:   "exec ID -- CMD [ARGS...]",
		Short: "Run a command in a sandbox; its output and exit code become ours",
		Args:  cobra.MinimumNArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			if cmd.ArgsLenAtDash() != 1 {
				return errdefs.InvalidArgument("usage: forkd exec ID -- CMD [ARGS...]")
			}
			envMap, err := parseKV(env, "--env")
			if err != nil {
				return err
			}
			if _, err := request.CallTimeout("--timeout", timeout.Seconds()); err != nil {
				return err
			}
			c, done, err := g.api(cmd.Context())
			if err != nil {
				return err
			}
			defer done()
			req := apiv1.ExecRequest{Args: args[1:], Env: envMap, Cwd: cwd, User: user, TimeoutSecs: timeout.Seconds()}
			var in io.Reader
			if stdin {
				// Streamed while the output streams, as in a shell; it
				// ends when the command does.
				s := newStoppable(g.stdin)
				defer s.stop()
				in = s
			}
			res, err := c.ExecStream(cmd.Context(), args[0], req, in, g.stdout, g.stderr)
			if err != nil {
				return err
			}
			return exitFor(res.ExitCode, res.Signal, res.TimedOut)
		},
	}
	f := cmd.Flags()
	timeoutFlag(f, &timeout, "timeout", "kill the command after this long, at most 24h (0: no limit)")
	f.StringArrayVar(&env, "env", nil, "KEY=VALUE for the command (repeatable)")
	f.StringVar(&cwd, "cwd", "", "working directory in the guest")
	f.StringVar(&user, "user", "", "user to run as in the guest")
	f.BoolVarP(&stdin, "interactive", "i", false, "pass our stdin to the command")
	return cmd
}

// exitFor maps a guest process's end to our exit: its code, 128+signal as
// shells do, 124 on timeout as timeout(1) does.
func exitFor(code int, sig string, timedOut bool) error {
	switch {
	case timedOut:
		return &exitError{code: 124}
	case sig != "":
		return &exitError{code: 128 + signalNumber(sig)}
	case code < 0: // ended without a status the guest could read
		return &exitError{code: 1}
	case code != 0:
		return &exitError{code: code}
	}
	return nil
}

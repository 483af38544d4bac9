package cli

import (
	"time"

	"github.com/spf13/cobra"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/agent"
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
			if rc, err := g.remote(cmd.Context()); err != nil {
				return err
			} else if rc != nil {
				defer rc.Close()
				req := apiv1.ExecRequest{Args: args[1:], Env: envMap, Cwd: cwd, User: user, TimeoutSecs: timeout.Seconds()}
				if stdin {
					// The API takes stdin whole, in the request.
					if req.Stdin, err = readInput(cmd.Context(), g.stdin, "stdin through the daemon", 16<<20); err != nil {
						return err
					}
				}
				res, err := rc.ExecStream(cmd.Context(), args[0], req, g.stdout, g.stderr)
				if err != nil {
					return err
				}
				return exitFor(res.ExitCode, res.Signal, res.TimedOut)
			}
			c, release, err := g.localAgent(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			defer release()
			req := agent.ExecRequest{
				Args: args[1:], Env: envMap, Dir: cwd, User: user,
				Stdout: g.stdout, Stderr: g.stderr, Timeout: timeout,
			}
			if stdin {
				req.Stdin = g.stdin
			}
			res, err := c.Exec(cmd.Context(), req)
			if err != nil {
				return err
			}
			return exitFor(res.ExitCode, res.Signal, res.TimedOut)
		},
	}
	f := cmd.Flags()
	f.DurationVar(&timeout, "timeout", 0, "kill the command after this long (e.g. 30s; at most 24h; 0 = no limit)")
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

package cli

import (
	"fmt"
	"strings"
	"time"

	apiv1 "github.com/forkd/forkd/api/v1"

	"github.com/spf13/cobra"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/request"
)

func newEvalCmd(g *globals) *cobra.Command {
	var timeout time.Duration
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "eval ID [--timeout 30s] [-- CODE]",
		Short: "Run Python in the sandbox's warm interpreter (code from the arguments or stdin)",
		Args:  cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			code := strings.Join(args[1:], " ")
			if len(args) == 1 {
				b, err := readInput(cmd.Context(), g.stdin, "code on stdin", 16<<20)
				if err != nil {
					return err
				}
				code = string(b)
			}
			if strings.TrimSpace(code) == "" {
				return errdefs.InvalidArgument("no code: give it after -- or on stdin")
			}
			d, err := request.CallTimeout("--timeout", timeout.Seconds())
			if err != nil {
				return err
			}
			c, done, err := g.api(cmd.Context())
			if err != nil {
				return err
			}
			defer done()
			req := apiv1.EvalRequest{Code: code, TimeoutSecs: d.Seconds()}
			var res *apiv1.EvalResult
			if asJSON {
				res, err = c.Eval(cmd.Context(), args[0], req)
			} else {
				res, err = c.EvalStream(cmd.Context(), args[0], req, g.stdout, g.stderr)
			}
			if err != nil {
				return err
			}
			return printEval(g, res, asJSON)
		},
	}
	timeoutFlag(cmd.Flags(), &timeout, "timeout", "interrupt the code after this long, at most 24h (0: no limit)")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the whole result as JSON")
	return cmd
}

// printEval prints an eval's result and maps it to our exit.
func printEval(g *globals, res *apiv1.EvalResult, asJSON bool) error {
	if asJSON {
		if err := writeJSON(g.stdout, res); err != nil {
			return err
		}
	} else if res.Value != "" {
		fmt.Fprintln(g.stdout, res.Value)
	}
	return evalExit(g, res, asJSON)
}

// evalExit reports a failed eval on stderr and maps it to exit 1.
func evalExit(g *globals, res *apiv1.EvalResult, quiet bool) error {
	if res.Restarted && !quiet {
		fmt.Fprintln(g.stderr, "forkd: the interpreter was restarted; its state is lost")
	}
	switch {
	case res.TimedOut:
		if !quiet {
			fmt.Fprintln(g.stderr, "TimeoutError: eval timed out")
		}
		return &exitError{code: 1}
	case res.Error != nil:
		if !quiet {
			if res.Error.Traceback != "" {
				fmt.Fprint(g.stderr, strings.TrimRight(res.Error.Traceback, "\n")+"\n")
			} else {
				fmt.Fprintf(g.stderr, "%s: %s\n", res.Error.Name, res.Error.Message)
			}
		}
		return &exitError{code: 1}
	}
	return nil
}

package cli

import (
	"encoding/json"
	"os"
	"path/filepath"

	"github.com/spf13/cobra"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/client"
	"github.com/forkd/forkd/internal/doctor"
)

func newDoctorCmd(g *globals) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "doctor [--json]",
		Short: "Check this host for what forkd needs; exits non-zero on any FAIL",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			dir, err := g.resolveDataDir()
			if err != nil {
				return err
			}
			rep := doctor.Run(cmd.Context(), doctor.Options{
				QEMU:       envOr(g.qemuBin, "FORKD_QEMU", "qemu-system-x86_64"),
				DataDir:    dir,
				CacheDir:   os.Getenv("FORKD_CACHE"),
				Controller: controllerAddr(dir),
				AgentPath:  agentPath(),
				VMMUser:    vmmUser(),
			})
			if asJSON {
				b, err := rep.JSON()
				if err != nil {
					return err
				}
				if _, err := g.stdout.Write(append(b, '\n')); err != nil {
					return err
				}
			} else if err := rep.WriteText(g.stdout); err != nil {
				return err
			}
			if rep.Failed() {
				return &exitError{code: 1}
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the report as JSON")
	return cmd
}

// controllerAddr is where a controller for dir should answer: FORKD_URL,
// the socket a daemon recorded in dir, or the default socket when it
// exists. "" (the check is skipped) when nothing says a controller should
// run: forkd works without one.
func controllerAddr(dir string) string {
	if u := os.Getenv("FORKD_URL"); u != "" {
		return u
	}
	if b, err := os.ReadFile(filepath.Join(dir, apiv1.ControllerFile)); err == nil {
		var info apiv1.ControllerInfo
		if json.Unmarshal(b, &info) == nil && info.Socket != "" {
			return info.Socket
		}
	}
	if s := client.DefaultSocket(); s != "" {
		if _, err := os.Stat(s); err == nil {
			return s
		}
	}
	return ""
}

// Package cli is the forkd command line: one file per command, each a thin
// shell over the sandbox engine (or, when a controller runs, its client).
// stdout carries only what was asked for; progress goes to stderr.
package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"os/user"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/sandbox"
	"github.com/forkd/forkd/internal/vmm/backend"
	"github.com/forkd/forkd/internal/vmm/qemu"
)

// Version is forkd's version, set at build time.
var Version = "0.1.0-dev"

// globals are the flags every command shares.
type globals struct {
	dataDir  string
	accel    string
	qemuBin  string
	machine  string
	logLevel string
	stdout   io.Writer
	stderr   io.Writer
	stdin    io.Reader
}

// exitError carries a process exit code up to Main without printing.
type exitError struct{ code int }

func (e *exitError) Error() string { return fmt.Sprintf("exit status %d", e.code) }

// Main runs the CLI with args and returns the process exit code.
func Main(args []string) int {
	g := &globals{stdout: os.Stdout, stderr: os.Stderr, stdin: os.Stdin}
	root := newRoot(g)
	root.SetArgs(args)
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	err := root.ExecuteContext(ctx)
	if err == nil {
		return 0
	}
	var ee *exitError
	if errors.As(err, &ee) {
		return ee.code
	}
	if ctx.Err() != nil && errors.Is(err, context.Canceled) {
		fmt.Fprintln(g.stderr, "forkd: interrupted")
		return 130 // as shells report an interrupted command
	}
	fmt.Fprintf(g.stderr, "forkd: %v\n", err)
	if errdefs.IsInvalidArgument(err) {
		return 2
	}
	return 1
}

func newRoot(g *globals) *cobra.Command {
	root := &cobra.Command{
		Use:           "forkd",
		Short:         "Hundreds of microVM sandboxes forked from warm snapshots",
		SilenceUsage:  true,
		SilenceErrors: true,
		Version:       Version,
		// Global flags are checked before any command acts.
		PersistentPreRunE: func(*cobra.Command, []string) error {
			_, err := parseLogLevel(g.logLevel)
			return err
		},
	}
	// A flag that does not parse (a malformed or overflowing number or
	// duration) is an invalid argument, as a value out of range is.
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error {
		return errdefs.InvalidArgument("%w", err)
	})
	root.SetOut(g.stdout)
	root.SetErr(g.stderr)
	pf := root.PersistentFlags()
	pf.StringVar(&g.dataDir, "data-dir", "", "data directory (default $FORKD_DATA, /var/lib/forkd as root, ~/.local/share/forkd otherwise)")
	pf.StringVar(&g.accel, "accel", "", "accelerator: auto, kvm or tcg (default $FORKD_ACCEL or auto)")
	pf.StringVar(&g.qemuBin, "qemu", "", "qemu-system-x86_64 binary (default $FORKD_QEMU or from PATH)")
	pf.StringVar(&g.machine, "machine", "", "QEMU machine type: microvm or q35 (default $FORKD_MACHINE or microvm)")
	pf.StringVar(&g.logLevel, "log-level", "warn", "log level on stderr: debug, info, warn, error")
	root.AddCommand(
		newSnapshotCmd(g),
		newForkCmd(g),
		newLsCmd(g),
		newKillCmd(g),
		newExecCmd(g),
		newEvalCmd(g),
		newCpCmd(g),
		newFromImageCmd(g),
		newImagesCmd(g),
		newRmiCmd(g),
		newBenchCmd(g),
		newQuickstartCmd(g),
		newServeCmd(g),
		newSpawnCmd(g),
		newDoctorCmd(g),
		newNetCmd(g),
		newPublishCmd(g),
		newCleanupCmd(g),
		newBranchCmd(g),
		newSnapshotInfoCmd(g),
		newSnapshotCompactCmd(g),
		newWorkspaceCmd(g),
		newRunCmd(g),
		newPingCmd(g),
		newMCPCmd(g),
		newPushCmd(g),
		newPullCmd(g),
		newPackCmd(g),
		newUnpackCmd(g),
		newE2BCmd(g),
	)
	return root
}

func envOr(v, env, def string) string {
	if v != "" {
		return v
	}
	if e := os.Getenv(env); e != "" {
		return e
	}
	return def
}

// resolveDataDir picks the data dir from the flag, $FORKD_DATA or the
// default for this user.
func (g *globals) resolveDataDir() (string, error) {
	if d := envOr(g.dataDir, "FORKD_DATA", ""); d != "" {
		return filepath.Abs(d)
	}
	if os.Geteuid() == 0 {
		return "/var/lib/forkd", nil
	}
	home, err := os.UserHomeDir()
	if err != nil {
		return "", fmt.Errorf("no data dir: set --data-dir or FORKD_DATA")
	}
	return filepath.Join(home, ".local", "share", "forkd"), nil
}

// parseLogLevel parses --log-level.
func parseLogLevel(s string) (slog.Level, error) {
	switch strings.ToLower(s) {
	case "debug":
		return slog.LevelDebug, nil
	case "info":
		return slog.LevelInfo, nil
	case "", "warn", "warning":
		return slog.LevelWarn, nil
	case "error":
		return slog.LevelError, nil
	}
	return 0, errdefs.InvalidArgument("--log-level %q: want debug, info, warn or error", s)
}

// logger is the logger of a command; the level was checked before it ran.
func (g *globals) logger() *slog.Logger {
	lvl, err := parseLogLevel(g.logLevel)
	if err != nil {
		lvl = slog.LevelWarn
	}
	return slog.New(slog.NewTextHandler(g.stderr, &slog.HandlerOptions{Level: lvl}))
}

// openEngine opens the sandbox engine; tune, if set, adjusts its config.
func (g *globals) openEngine(tune func(*sandbox.Config)) (*sandbox.Engine, error) {
	dir, err := g.resolveDataDir()
	if err != nil {
		return nil, err
	}
	be, err := backend.New(backend.Options{QEMU: qemu.Options{
		Binary:  envOr(g.qemuBin, "FORKD_QEMU", ""),
		Accel:   envOr(g.accel, "FORKD_ACCEL", "auto"),
		Machine: envOr(g.machine, "FORKD_MACHINE", ""),
		Sandbox: os.Getenv("FORKD_QEMU_SECCOMP") != "0",
	}})
	if err != nil {
		return nil, err
	}
	nm, cm, err := sandbox.HostIsolation(dir, g.logger())
	if err != nil {
		return nil, err
	}
	cfg := sandbox.Config{
		Net:       nm,
		Cgroups:   cm,
		DataDir:   dir,
		Backend:   be,
		AgentPath: agentPath(),
		CacheDir:  os.Getenv("FORKD_CACHE"),
		VMMUser:   vmmUser(),
		Progress:  g.stderr,
		Logger:    g.logger(),
	}
	if tune != nil {
		tune(&cfg)
	}
	return sandbox.New(cfg)
}

// DefaultVMMUser is the system user QEMU processes drop to (see
// packaging/sysusers.d/forkd.conf); "nobody" stands in where it is missing.
const DefaultVMMUser = "forkd-vmm"

// vmmUser picks the user VMMs run as: $FORKD_VMM_USER ("-" for none), else
// forkd-vmm or nobody when we are root; as another user QEMU simply runs as
// that user.
func vmmUser() string {
	if v := os.Getenv("FORKD_VMM_USER"); v != "" {
		if v == "-" {
			return ""
		}
		return v
	}
	if os.Geteuid() != 0 {
		return ""
	}
	for _, u := range []string{DefaultVMMUser, "nobody"} {
		if _, err := user.Lookup(u); err == nil {
			return u
		}
	}
	return ""
}

// agentPath finds the forkd-agent binary: $FORKD_AGENT, next to this
// executable, or the system library dirs.
func agentPath() string {
	if p := os.Getenv("FORKD_AGENT"); p != "" {
		return p
	}
	cands := []string{}
	if exe, err := os.Executable(); err == nil {
		cands = append(cands, filepath.Join(filepath.Dir(exe), "forkd-agent"))
	}
	cands = append(cands, "/usr/local/lib/forkd/forkd-agent", "/usr/lib/forkd/forkd-agent")
	for _, c := range cands {
		if st, err := os.Stat(c); err == nil && st.Mode().IsRegular() {
			return c
		}
	}
	return cands[0]
}

func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// requireFlag marks cmd's flag name, defined just before, as required.
// Cobra fails only for a name the command does not define: a bug.
func requireFlag(cmd *cobra.Command, name string) {
	if err := cmd.MarkFlagRequired(name); err != nil {
		panic(err)
	}
}

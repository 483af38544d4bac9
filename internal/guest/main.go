package guest

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"time"
)

// Version is the agent's build version, set at link time with
// -ldflags "-X github.com/forkd/forkd/internal/guest.Version=...".
var Version = "dev"

// Main runs the agent and returns the process exit status. As PID 1 it
// sets up the machine first and never returns.
//
//	forkd-agent                 serve on the console (PID 1, or under a tiny init)
//	forkd-agent --serve-stdio   serve on stdin/stdout, for debugging
//	forkd-agent --console PATH  serve on another tty
//	forkd-agent --version
func Main(args []string) int {
	fs := flag.NewFlagSet("forkd-agent", flag.ContinueOnError)
	serveStdio := fs.Bool("serve-stdio", false, "serve on stdin and stdout instead of the console")
	console := fs.String("console", "", "serve on this tty (default from "+KeyConsole+" or "+DefaultConsole+")")
	showVersion := fs.Bool("version", false, "print the version and exit")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if *showVersion {
		fmt.Println(Version)
		return 0
	}
	if os.Getpid() == 1 {
		runPID1()
		return 1 // not reached
	}
	level := new(slog.LevelVar)
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	cmdline := map[string]string{}
	if b, err := os.ReadFile("/proc/cmdline"); err == nil && !*serveStdio {
		cmdline = parseCmdline(string(b))
	}
	bc, err := loadBootConfig(cmdline, AgentConfigPath)
	if err != nil {
		log.Warn("config", "err", err)
	}
	if bc.debug {
		level.Set(slog.LevelDebug)
	}
	cfg := bc.agent
	cfg.Version, cfg.Logger = Version, log
	a := New(cfg)
	defer a.Close()
	ctx := context.Background()
	if *serveStdio {
		err := a.Serve(ctx, stdStream{os.Stdin, os.Stdout})
		if errors.Is(err, io.EOF) {
			return 0
		}
		log.Error("serve", "err", err)
		return 1
	}
	path := bc.console
	if *console != "" {
		path = *console
	}
	f, err := OpenConsole(path)
	if err != nil {
		log.Error("console", "err", err)
		return 1
	}
	err = a.Serve(ctx, f)
	log.Error("serve", "err", err)
	return 1
}

// stdStream joins stdin and stdout into one stream.
type stdStream struct {
	io.Reader
	io.Writer
}

// runPID1 sets the machine up and serves forever.
func runPID1() {
	level := new(slog.LevelVar)
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	reapAllChildren = true
	processReaper()
	absorbSignals(log)
	if err := mountBase(log); err != nil {
		log.Error("mounts", "err", err)
	}
	cmdline := map[string]string{}
	if b, err := os.ReadFile("/proc/cmdline"); err == nil {
		cmdline = parseCmdline(string(b))
	} else {
		log.Error("read /proc/cmdline", "err", err)
	}
	loadModules(log, ModulesPath, "/lib/modules")
	budget, err := bootBudget()
	if err != nil {
		log.Error("memory budget", "err", err)
	} else {
		log.Info("memory budget", "ram", budget.ram, "workload", budget.workload, "files", budget.files)
		applyKernelBudget(log, budget)
	}
	switched := false
	if dev := cmdline[KeyRoot]; dev != "" {
		fstype := cmdline[KeyRootFSType]
		if fstype == "" {
			fstype = "ext4"
		}
		if err := switchRoot(log, dev, fstype, budget.shared); err != nil {
			log.Error("switch root; staying in the initramfs", "err", err)
		} else {
			switched = true
		}
	}
	if !switched {
		if err := sizeInitramfs(budget.shared); err != nil {
			log.Error("initramfs root", "err", err)
		}
	}
	cgroup := WorkloadCgroup
	if err := setupWorkloadCgroup(log, budget); err != nil {
		log.Error("workload cgroup; processes run in the agent's", "err", err)
		cgroup = ""
	}
	bc, err := loadBootConfig(cmdline, AgentConfigPath)
	if err != nil {
		log.Warn("config", "err", err)
	}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		bc.agent.Env = emulatedCPUEnv(string(b), bc.agent.Env)
	}
	if bc.debug {
		level.Set(slog.LevelDebug)
	}
	if err := loopbackUp(); err != nil {
		log.Warn("loopback", "err", err)
	}
	if nc, ok, err := parseNetConfig(cmdline); err != nil {
		log.Error("network", "err", err)
	} else if ok {
		if err := configureNetwork(nc, 5*time.Second); err != nil {
			log.Error("network", "err", err)
		}
	}
	cfg := bc.agent
	cfg.Version, cfg.Logger, cfg.Cgroup, cfg.PIDsLimit = Version, log, cgroup, budget.pids
	a := New(cfg)
	if err := waitFor(bc.console, 5*time.Second); err != nil {
		log.Error("console", "err", err)
	}
	var f *os.File
	for f == nil {
		if f, err = OpenConsole(bc.console); err != nil {
			log.Error("console", "err", err)
			time.Sleep(5 * time.Second) // a VM without its channel is of no use
		}
	}
	if tid, err := relaxSysmon(sysmonSlack); err != nil {
		log.Warn("sysmon timer slack", "err", err)
	} else {
		log.Debug("sysmon timer slack", "tid", tid, "slack", sysmonSlack)
	}
	log.Info("serving", "console", bc.console, "version", Version)
	for {
		// The console never ends; a read error is unexpected and retried.
		err := a.Serve(context.Background(), f)
		log.Error("serve", "err", err)
		time.Sleep(time.Second)
	}
}

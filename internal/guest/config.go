package guest

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"regexp"
	"strconv"
	"strings"
	"time"
)

// Files and kernel command line keys the guest reads.
const (
	// AgentConfigPath is the optional JSON configuration in the final root
	// (FileConfig).
	AgentConfigPath = "/etc/forkd/agent.json"
	// ModulesPath lists kernel modules to load at boot, one path relative to
	// /lib/modules/ per line, in load order ('#' starts a comment).
	ModulesPath = "/etc/forkd/modules"
	// DefaultConsole is the agent's stream inside a VM.
	DefaultConsole = "/dev/hvc0"
	// DefaultPython is used for eval when it exists and nothing else is
	// configured.
	DefaultPython = "/usr/bin/python3"
)

// Kernel command line keys.
const (
	KeyRoot       = "forkd.root"       // block device with the root file system (overlaid)
	KeyRootFSType = "forkd.rootfstype" // its type; ext4 when absent
	KeyPython     = "forkd.python"     // interpreter path; "none" disables eval
	KeyPreload    = "forkd.preload"    // comma-separated modules to preload
	KeyConsole    = "forkd.console"    // the agent's tty; /dev/hvc0 when absent
	KeyDebug      = "forkd.debug"      // "1": debug logging
)

// FileConfig is the JSON of AgentConfigPath. Absent fields keep defaults;
// kernel command line keys override it.
type FileConfig struct {
	Python      *string  `json:"python,omitempty"`
	Preload     []string `json:"preload,omitempty"`
	PythonDir   string   `json:"python_dir,omitempty"`
	Env         []string `json:"env,omitempty"`
	Console     string   `json:"console,omitempty"`
	EvalGraceMS int      `json:"eval_grace_ms,omitempty"`
	Debug       bool     `json:"debug,omitempty"`
}

// bootConfig is the merged configuration of a booting guest.
type bootConfig struct {
	root, rootFSType string
	console          string
	debug            bool
	agent            Config
}

// parseCmdline splits a kernel command line into key=value pairs; a key
// without '=' maps to "". Double quotes group words, as the kernel does.
func parseCmdline(s string) map[string]string {
	out := map[string]string{}
	var words []string
	var cur strings.Builder
	inQuote, inWord := false, false
	for _, r := range s {
		switch {
		case r == '"':
			inQuote = !inQuote
			inWord = true
		case (r == ' ' || r == '\n' || r == '\t') && !inQuote:
			if inWord {
				words = append(words, cur.String())
				cur.Reset()
				inWord = false
			}
		default:
			cur.WriteRune(r)
			inWord = true
		}
	}
	if inWord {
		words = append(words, cur.String())
	}
	for _, w := range words {
		k, v, _ := strings.Cut(w, "=")
		out[k] = v
	}
	return out
}

// loadBootConfig merges defaults, the file at configPath (if present) and
// the command line keys.
func loadBootConfig(cmdline map[string]string, configPath string) (bootConfig, error) {
	bc := bootConfig{rootFSType: "ext4", console: DefaultConsole}
	var fc FileConfig
	var errs []error
	if b, err := os.ReadFile(configPath); err == nil {
		if err := json.Unmarshal(b, &fc); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", configPath, err))
		}
	} else if !os.IsNotExist(err) {
		errs = append(errs, err)
	}
	python := ""
	if _, err := os.Stat(DefaultPython); err == nil {
		python = DefaultPython
	}
	if fc.Python != nil {
		python = *fc.Python
	}
	preload := fc.Preload
	if fc.Console != "" {
		bc.console = fc.Console
	}
	bc.debug = fc.Debug
	if v, ok := cmdline[KeyPython]; ok {
		python = v
	}
	if v, ok := cmdline[KeyPreload]; ok {
		preload = nil
		for _, m := range strings.Split(v, ",") {
			if m = strings.TrimSpace(m); m != "" {
				preload = append(preload, m)
			}
		}
	}
	if v, ok := cmdline[KeyConsole]; ok && v != "" {
		bc.console = v
	}
	if v, ok := cmdline[KeyDebug]; ok {
		bc.debug, _ = strconv.ParseBool(v)
	}
	bc.root = cmdline[KeyRoot]
	if v := cmdline[KeyRootFSType]; v != "" {
		bc.rootFSType = v
	}
	switch python {
	case "none", "off", "false", "0":
		python = ""
	}
	if python != "" {
		if _, err := os.Stat(python); err != nil {
			errs = append(errs, fmt.Errorf("python %s: %w; eval disabled", python, err))
			python = ""
		}
	}
	bc.agent = Config{
		Python:    python,
		Preload:   preload,
		PythonDir: fc.PythonDir,
		Env:       fc.Env,
	}
	if fc.EvalGraceMS > 0 {
		bc.agent.EvalGrace = time.Duration(fc.EvalGraceMS) * time.Millisecond
	}
	if len(fc.Env) > 0 {
		bc.agent.Env = append(append([]string(nil), DefaultEnv...), fc.Env...)
	}
	return bc, errors.Join(errs...)
}

// qemuCPU matches /proc/cpuinfo of QEMU's own CPU models.
var qemuCPU = regexp.MustCompile(`(?m)^model name\s*: QEMU Virtual CPU`)

// emulatedCPUEnv returns env (DefaultEnv when nil) with
// OPENBLAS_CORETYPE=Prescott added when cpuinfo is QEMU's emulated CPU (the
// qemu64 model forkd gives TCG guests) and env does not set it. OpenBLAS
// takes that CPU for an Opteron and runs kernels TCG does not emulate:
// numpy.dot, and so matplotlib's drawing, died of SIGILL. Prescott's
// kernels need only SSE3, which qemu64 has. Under KVM (-cpu host) nothing
// changes.
func emulatedCPUEnv(cpuinfo string, env []string) []string {
	if env == nil {
		env = DefaultEnv
	}
	if !qemuCPU.MatchString(cpuinfo) {
		return env
	}
	for _, kv := range env {
		if strings.HasPrefix(kv, "OPENBLAS_CORETYPE=") {
			return env
		}
	}
	return append(append([]string(nil), env...), "OPENBLAS_CORETYPE=Prescott")
}

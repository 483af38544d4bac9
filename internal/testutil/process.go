package testutil

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// ProcessesUnder returns the live processes (zombies excluded) whose
// working directory is below dir, each as "PID (CWD)": a VMM works in its
// run dir, or in a jail below it, so a test finds the VMMs a data dir left
// behind with ProcessesUnder(<data>/run).
func ProcessesUnder(dir string) []string {
	var out []string
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		cwd, err := os.Readlink(filepath.Join("/proc", e.Name(), "cwd"))
		if err != nil || !strings.HasPrefix(strings.TrimSuffix(cwd, " (deleted)"), dir+"/") {
			continue
		}
		if st, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat")); err == nil && bytes.Contains(st, []byte(") Z ")) {
			continue
		}
		out = append(out, fmt.Sprintf("%s (%s)", e.Name(), cwd))
	}
	return out
}

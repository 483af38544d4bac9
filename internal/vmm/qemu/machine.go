package qemu

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/proc"
	"github.com/forkd/forkd/internal/vmm"
)

// Machine is one QEMU process.
type Machine struct {
	b          *Backend
	handle     vmm.Handle
	cfg        machineConfig
	memoryFile string

	// done is closed when the process has exited, if it is our child;
	// nil for an attached machine. status is valid after done.
	done   chan struct{}
	status vmm.ExitStatus

	mu      sync.Mutex // guards stopped
	stopped bool
}

// newChild wraps a QEMU process this process started, and reaps it in the
// background so it never lingers as a zombie.
func newChild(b *Backend, cmd *exec.Cmd, runDir string, cfg machineConfig) *Machine {
	m := &Machine{b: b, cfg: cfg, done: make(chan struct{})}
	id, _ := proc.Self(cmd.Process.Pid)
	m.handle = vmm.Handle{Backend: "qemu", Process: id, RunDir: runDir, Config: cfg.encode()}
	go func() {
		err := cmd.Wait()
		st := vmm.ExitStatus{Exited: true, Known: true, ExitedAt: time.Now()}
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
				st.Signal = ws.Signal().String()
			} else {
				st.Code = ee.ExitCode()
			}
		}
		m.status = st
		close(m.done)
	}()
	return m
}

// Attach implements vmm.Backend.
func (b *Backend) Attach(ctx context.Context, h vmm.Handle) (vmm.Machine, error) {
	if h.Backend != "qemu" {
		return nil, errdefs.InvalidArgument("handle of backend %q given to qemu", h.Backend)
	}
	cfg, err := decodeShape(h.Config)
	if err != nil {
		return nil, err
	}
	m := &Machine{b: b, handle: h, cfg: cfg}
	if !proc.Alive(h.Process) {
		return m, errdefs.NotFound("qemu process %d is gone", h.Process.PID)
	}
	m.memoryFile = m.mappedMemoryFile()
	return m, nil
}

// Handle implements vmm.Machine.
func (m *Machine) Handle() vmm.Handle { return m.handle }

func (m *Machine) exited() bool {
	if m.done != nil {
		select {
		case <-m.done:
			return true
		default:
			return false
		}
	}
	return !proc.Alive(m.handle.Process)
}

func (m *Machine) check() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.stopped {
		return errdefs.FailedPrecondition("machine %d: %w", m.handle.Process.PID, errStopped)
	}
	return nil
}

// monitor opens a QMP connection to the machine.
func (m *Machine) monitor(ctx context.Context) (*qmp, error) {
	if err := m.check(); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	q, err := dialQMP(ctx, filepath.Join(m.handle.RunDir, qmpSocket), m.exited)
	if err != nil {
		if m.exited() {
			return nil, errdefs.Unavailable("qemu exited: %s", m.lastWords())
		}
		return nil, err
	}
	return q, nil
}

func (m *Machine) lastWords() string {
	if t := logTail(m.handle.RunDir); t != "" {
		return t
	}
	return "no output"
}

// fail stops a machine that could not be set up and returns err, adding
// QEMU's own last words when it died.
func (m *Machine) fail(err error) error {
	dead := m.exited()
	words := ""
	if dead {
		words = m.lastWords()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	serr := m.Stop(ctx)
	if dead {
		err = fmt.Errorf("%w (qemu: %s)", err, words)
	}
	if serr != nil {
		// A QEMU left running (or its run dir left behind) must not go
		// unseen; err keeps its class.
		err = fmt.Errorf("%w (and stopping it: %w)", err, serr)
	}
	return err
}

func (m *Machine) simple(ctx context.Context, cmd string) error {
	q, err := m.monitor(ctx)
	if err != nil {
		return err
	}
	defer q.close()
	return q.execute(ctx, cmd, nil, nil, -1)
}

// Pause implements vmm.Machine.
func (m *Machine) Pause(ctx context.Context) error { return m.simple(ctx, "stop") }

// Resume implements vmm.Machine.
func (m *Machine) Resume(ctx context.Context) error { return m.simple(ctx, "cont") }

// SaveState implements vmm.Machine: it migrates device state (with
// x-ignore-shared, so no RAM) to spec.StateFile.
func (m *Machine) SaveState(ctx context.Context, spec vmm.SaveSpec) error {
	q, err := m.monitor(ctx)
	if err != nil {
		return err
	}
	defer q.close()
	st, err := q.runStatus(ctx)
	if err != nil {
		return err
	}
	if st != "paused" {
		return errdefs.FailedPrecondition("save state: machine is %s, not paused", st)
	}
	if spec.MemoryFile != "" && spec.MemoryFile != m.memoryFile {
		return errdefs.NotImplemented("qemu saves RAM only through its backing file %q", m.memoryFile)
	}
	f, err := os.OpenFile(spec.StateFile, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := q.execute(ctx, "migrate-set-capabilities", ignoreShared, nil, -1); err != nil {
		return err
	}
	if err := q.execute(ctx, "getfd", map[string]any{"fdname": "save"}, nil, int(f.Fd())); err != nil {
		return err
	}
	if err := q.execute(ctx, "migrate", map[string]any{"uri": "fd:save"}, nil, -1); err != nil {
		return err
	}
	if err := q.waitMigration(ctx); err != nil {
		return err
	}
	return f.Sync()
}

// Memory implements vmm.Machine by reading the process's memory map.
func (m *Machine) Memory(ctx context.Context) (vmm.MemoryMap, error) {
	if err := m.check(); err != nil {
		return vmm.MemoryMap{}, err
	}
	mm := vmm.MemoryMap{PID: m.handle.Process.PID, File: m.memoryFile}
	ram, err := m.ramMapping()
	if err != nil {
		return mm, err
	}
	mm.Regions = []vmm.Region{ram.Region}
	return mm, nil
}

// ramMapping finds guest RAM in the process's memory map: the mapping of
// the memory file, or an anonymous one of the RAM's size.
func (m *Machine) ramMapping() (mapping, error) {
	pid := m.handle.Process.PID
	f, err := os.Open(filepath.Join(proc.Root, strconv.Itoa(pid), "maps"))
	if err != nil {
		return mapping{}, err
	}
	defer f.Close()
	want := uint64(m.cfg.MemoryMiB) << 20
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		mp, ok := parseMapsLine(sc.Text())
		if !ok {
			continue
		}
		if (m.memoryFile != "" && mp.Path == m.memoryFile) || (m.memoryFile == "" && mp.Size == want && mp.Path == "") {
			return mp, nil
		}
	}
	if err := sc.Err(); err != nil {
		return mapping{}, err
	}
	return mapping{}, errdefs.NotFound("guest RAM mapping not found in process %d", pid)
}

// mappedMemoryFile finds the file an attached machine maps its RAM from.
func (m *Machine) mappedMemoryFile() string {
	b, err := os.ReadFile(filepath.Join(proc.Root, strconv.Itoa(m.handle.Process.PID), "maps"))
	if err != nil {
		return ""
	}
	want := uint64(m.cfg.MemoryMiB) << 20
	for _, line := range strings.Split(string(b), "\n") {
		if mp, ok := parseMapsLine(line); ok && mp.Size == want && strings.HasPrefix(mp.Path, "/") {
			return mp.Path
		}
	}
	return ""
}

// mapping is one line of /proc/PID/maps.
type mapping struct {
	vmm.Region
	Perms string // "rw-p": the last letter says shared (s) or private (p)
	Path  string
}

// Shared reports whether the mapping is MAP_SHARED.
func (mp mapping) Shared() bool { return strings.HasSuffix(mp.Perms, "s") }

// parseMapsLine parses one /proc/PID/maps line.
func parseMapsLine(line string) (mapping, bool) {
	f := strings.Fields(line)
	if len(f) < 5 {
		return mapping{}, false
	}
	lo, hi, ok := strings.Cut(f[0], "-")
	if !ok {
		return mapping{}, false
	}
	start, err1 := strconv.ParseUint(lo, 16, 64)
	end, err2 := strconv.ParseUint(hi, 16, 64)
	if err1 != nil || err2 != nil || end <= start {
		return mapping{}, false
	}
	mp := mapping{Region: vmm.Region{HostAddr: start, Size: end - start}, Perms: f[1]}
	if len(f) >= 6 {
		mp.Path = strings.Join(f[5:], " ")
	}
	return mp, true
}

// DialAgent implements vmm.Machine.
func (m *Machine) DialAgent(ctx context.Context) (net.Conn, error) {
	if err := m.check(); err != nil {
		return nil, err
	}
	c, err := dialUnix(ctx, filepath.Join(m.handle.RunDir, agentSocket))
	if err != nil {
		if m.exited() {
			return nil, errdefs.Unavailable("machine has exited")
		}
		return nil, errdefs.Unavailable("agent socket: %w", err)
	}
	return c, nil
}

// Stop implements vmm.Machine: SIGKILL through a pidfd (never a bare pid),
// wait for the exit, remove the run dir.
func (m *Machine) Stop(ctx context.Context) error {
	m.mu.Lock()
	m.stopped = true
	m.mu.Unlock()
	if err := proc.Kill(ctx, m.handle.Process); err != nil {
		return fmt.Errorf("stop qemu %d: %w", m.handle.Process.PID, err)
	}
	if m.done != nil {
		select {
		case <-m.done:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if err := os.RemoveAll(m.handle.RunDir); err != nil {
		return fmt.Errorf("remove run dir: %w", err)
	}
	return nil
}

// Wait implements vmm.Machine.
func (m *Machine) Wait(ctx context.Context) (vmm.ExitStatus, error) {
	if m.done != nil {
		select {
		case <-m.done:
			return m.status, nil
		case <-ctx.Done():
			return vmm.ExitStatus{}, ctx.Err()
		}
	}
	p, err := proc.Open(m.handle.Process)
	if err != nil {
		if errdefs.IsNotFound(err) {
			return vmm.ExitStatus{Exited: true}, nil
		}
		return vmm.ExitStatus{}, err
	}
	defer p.Close()
	if err := p.Wait(ctx); err != nil {
		return vmm.ExitStatus{}, err
	}
	return vmm.ExitStatus{Exited: true, ExitedAt: time.Now()}, nil
}

// CPUs implements vmm.CPUReader, from the monitor's register dump.
func (m *Machine) CPUs(ctx context.Context) ([]vmm.CPU, error) {
	q, err := m.monitor(ctx)
	if err != nil {
		return nil, err
	}
	defer q.close()
	var dump string
	if err := q.execute(ctx, "human-monitor-command", map[string]any{"command-line": "info registers -a"}, &dump, -1); err != nil {
		return nil, err
	}
	cpus := parseRegisters(dump)
	if len(cpus) == 0 {
		return nil, fmt.Errorf("qemu's register dump names no vCPU: %.200q", dump)
	}
	return cpus, nil
}

// parseRegisters reads the instruction pointer and halt flag of each vCPU
// from x86 QEMU's "info registers -a": a "CPU#n" line, then lines of
// NAME=value fields, RIP= and HLT= among them.
func parseRegisters(dump string) []vmm.CPU {
	var cpus []vmm.CPU
	for line := range strings.Lines(dump) {
		if strings.HasPrefix(line, "CPU#") {
			cpus = append(cpus, vmm.CPU{})
			continue
		}
		if len(cpus) == 0 {
			continue
		}
		c := &cpus[len(cpus)-1]
		for _, f := range strings.Fields(line) {
			switch {
			case strings.HasPrefix(f, "RIP="):
				c.PC, _ = strconv.ParseUint(f[len("RIP="):], 16, 64)
			case f == "HLT=1":
				c.Halted = true
			}
		}
	}
	return cpus
}

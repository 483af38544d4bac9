package guest

import (
	"errors"
	"log/slog"
	"os"
	"os/signal"
	"strconv"
	"sync"
	"syscall"

	"github.com/forkd/forkd/internal/agent/proto"
)

// exitStatus is how a child ended. err is set when its status could not be
// collected (someone else reaped it).
type exitStatus struct {
	ws  syscall.WaitStatus
	err error
}

// reaper is the one place that waits for the agent's children. Every process
// the agent starts goes through reaper.start; nothing else in this package
// calls wait4, exec.Cmd.Wait or os.Process.Wait.
//
// On SIGCHLD (or after a start) it collects exit statuses with WNOHANG:
//
//   - reapAll (PID 1): wait4(-1) until none is left, so orphans re-parented
//     to PID 1 are reaped too; statuses of pids nobody registered are
//     orphans' and are dropped.
//   - otherwise: wait4(pid) for each registered pid only, so a process that
//     embeds the agent (tests, --serve-stdio) keeps its other children.
//
// start holds startMu shared across fork and registration and a reap pass
// holds it exclusively, so a pass never sees a status of ours before its pid
// is registered. (Keeping statuses of unregistered pids for later instead
// would hand a stale status to a new process that reuses an orphan's pid.)
type reaper struct {
	reapAll bool
	log     *slog.Logger

	startMu sync.RWMutex
	mu      sync.Mutex
	waiting map[int]chan exitStatus // guarded by mu
	kick    chan struct{}
}

var (
	reaperOnce   sync.Once
	sharedReaper *reaper
	// reapAllChildren selects wait4(-1); Main sets it when running as PID 1
	// before anything starts a process.
	reapAllChildren bool
)

// processReaper returns the process-wide reaper, starting it on first use.
func processReaper() *reaper {
	reaperOnce.Do(func() {
		r := &reaper{
			reapAll: reapAllChildren,
			log:     slog.Default(),
			waiting: map[int]chan exitStatus{},
			kick:    make(chan struct{}, 1),
		}
		sig := make(chan os.Signal, 1)
		signal.Notify(sig, syscall.SIGCHLD)
		go r.loop(sig)
		sharedReaper = r
	})
	return sharedReaper
}

// start runs fork, which must create exactly one child and return its pid,
// and registers that pid. The channel receives the child's exit status
// once.
func (r *reaper) start(fork func() (int, error)) (int, <-chan exitStatus, error) {
	r.startMu.RLock()
	// As PID 1 the agent relaxed sysmon's slack, which threads it starts
	// inherit: every child is forked with the default (relaxSysmon).
	var slackNS int64
	if r.reapAll {
		slackNS = defaultTimerSlack.Nanoseconds()
	}
	pid, err := forkWithSlack(r.log, fork, slackNS)
	if err != nil {
		r.startMu.RUnlock()
		return 0, nil, err
	}
	ch := make(chan exitStatus, 1)
	r.mu.Lock()
	r.waiting[pid] = ch
	r.mu.Unlock()
	r.startMu.RUnlock()
	// The child may have exited before it was registered; look again.
	select {
	case r.kick <- struct{}{}:
	default:
	}
	return pid, ch, nil
}

func (r *reaper) loop(sig <-chan os.Signal) {
	for {
		select {
		case <-sig:
		case <-r.kick:
		}
		r.pass()
	}
}

// pass collects every status available now.
func (r *reaper) pass() {
	r.startMu.Lock()
	defer r.startMu.Unlock()
	if r.reapAll {
		for {
			var ws syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
			if errors.Is(err, syscall.EINTR) {
				continue
			}
			if err != nil || pid <= 0 {
				return
			}
			r.deliver(pid, exitStatus{ws: ws}, true)
		}
	}
	r.mu.Lock()
	pids := make([]int, 0, len(r.waiting))
	for pid := range r.waiting {
		pids = append(pids, pid)
	}
	r.mu.Unlock()
	for _, pid := range pids {
		var ws syscall.WaitStatus
		got, err := syscall.Wait4(pid, &ws, syscall.WNOHANG, nil)
		for errors.Is(err, syscall.EINTR) {
			got, err = syscall.Wait4(pid, &ws, syscall.WNOHANG, nil)
		}
		switch {
		case err != nil:
			r.deliver(pid, exitStatus{err: err}, false)
		case got == pid:
			r.deliver(pid, exitStatus{ws: ws}, false)
		}
	}
}

func (r *reaper) deliver(pid int, st exitStatus, mayBeOrphan bool) {
	r.mu.Lock()
	ch, ok := r.waiting[pid]
	delete(r.waiting, pid)
	r.mu.Unlock()
	if !ok {
		if mayBeOrphan {
			r.log.Debug("reaped orphan", "pid", pid, "status", describeStatus(st.ws))
		}
		return
	}
	ch <- st
}

// describeStatus renders a wait status for logs.
func describeStatus(ws syscall.WaitStatus) string {
	switch {
	case ws.Exited():
		return "exit " + strconv.Itoa(ws.ExitStatus())
	case ws.Signaled():
		return "signal " + proto.SignalName(ws.Signal())
	}
	return "status " + strconv.Itoa(int(ws))
}

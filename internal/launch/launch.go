// Package launch starts a process from an OS thread placed in a network
// namespace and in other thread-bound host contexts (cgroup v1 groups
// joined by thread id), so that the process is born there.
//
// It is what a VMM backend needs to start its process inside a sandbox's
// network namespace, and nothing more: it depends on golang.org/x/sys only,
// not on the netlink and nftables libraries that build those namespaces
// (package netns).
package launch

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/cleanup"
	"github.com/forkd/forkd/internal/errdefs"
)

// Step moves the calling (locked) OS thread into some host context and
// returns how to move it back. Steps follow the contract of EnterNetNS.
type Step func() (restore func() error, err error)

// EnterNetNS moves the calling goroutine's OS thread into the network
// namespace at path and locks the goroutine to it. The returned restore
// moves the thread back and unlocks it; if moving back fails the thread
// stays locked, so the runtime discards it when the goroutine exits, and no
// other goroutine ever runs in the wrong namespace. Call restore from the
// same goroutine, exactly once.
//
// Sockets and processes created between EnterNetNS and restore belong to
// the namespace; Go may still run other goroutines' work elsewhere, so do
// not start goroutines that expect to be inside.
func EnterNetNS(path string) (restore func() error, err error) {
	target, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil, errdefs.NotFound("open netns %s: %w", path, os.ErrNotExist)
		}
		return nil, fmt.Errorf("open netns %s: %w", path, err)
	}
	defer unix.Close(target)
	runtime.LockOSThread()
	orig, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		runtime.UnlockOSThread()
		return nil, fmt.Errorf("open own netns: %w", err)
	}
	if err := unix.Setns(target, unix.CLONE_NEWNET); err != nil {
		unix.Close(orig)
		runtime.UnlockOSThread()
		return nil, fmt.Errorf("setns %s: %w", path, err)
	}
	return func() error {
		defer unix.Close(orig)
		if err := unix.Setns(orig, unix.CLONE_NEWNET); err != nil {
			return fmt.Errorf("setns back from %s: %w", path, err)
		}
		runtime.UnlockOSThread()
		return nil
	}, nil
}

// Start starts cmd with its network namespace set to the one at nsPath
// ("" keeps the caller's), after running the extra thread-bound steps in
// order. It works on a goroutine of its own whose OS thread is locked for
// the start and, should restoring fail, discarded; the caller's thread is
// never touched. Because the child is forked from that thread, do not set
// SysProcAttr.Pdeathsig together with Start: the signal fires when the
// forking thread exits.
func Start(nsPath string, cmd *exec.Cmd, steps ...Step) error {
	if nsPath != "" {
		steps = append([]Step{func() (func() error, error) { return EnterNetNS(nsPath) }}, steps...)
	}
	errc := make(chan error, 1)
	go func() {
		// This lock is released only once every step was undone;
		// otherwise the goroutine exits locked and the runtime discards
		// its thread, which cannot harm cmd once started.
		runtime.LockOSThread()
		var undo cleanup.Stack
		for _, step := range steps {
			restore, err := step()
			if err != nil {
				uerr := undo.Run()
				if uerr == nil {
					runtime.UnlockOSThread()
				}
				errc <- errors.Join(err, uerr)
				return
			}
			undo.Add(restore)
		}
		err := cmd.Start()
		if undo.Run() == nil {
			runtime.UnlockOSThread()
		}
		errc <- err
	}()
	return <-errc
}

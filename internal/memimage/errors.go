package memimage

import (
	"errors"
	"fmt"
	"io/fs"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/errdefs"
)

// procError classes an error from a file of proc.Root/PID or from a syscall
// on process pid.
func procError(pid int, what string, err error) error {
	switch {
	case errors.Is(err, fs.ErrNotExist), errors.Is(err, unix.ESRCH):
		return errdefs.NotFound("process %d %s: %w", pid, what, err)
	case errors.Is(err, fs.ErrPermission), errors.Is(err, unix.EPERM):
		return errdefs.FailedPrecondition("process %d %s (reading another process's memory needs root): %w", pid, what, err)
	}
	return fmt.Errorf("process %d %s: %w", pid, what, err)
}

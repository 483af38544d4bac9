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

// fileError classes an error of opening or creating a file.
func fileError(what string, err error) error {
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return errdefs.NotFound("%s: %w", what, err)
	case errors.Is(err, fs.ErrExist):
		return errdefs.AlreadyExists("%s: %w", what, err)
	case errors.Is(err, fs.ErrPermission):
		return errdefs.FailedPrecondition("%s: %w", what, err)
	}
	return writeError(fmt.Errorf("%s: %w", what, err))
}

// writeError classes an error of writing a file: a full filesystem (or
// quota) is ResourceExhausted. The message is err's.
func writeError(err error) error {
	if errors.Is(err, unix.ENOSPC) || errors.Is(err, unix.EDQUOT) {
		return errdefs.ResourceExhausted("%w", err)
	}
	return err
}

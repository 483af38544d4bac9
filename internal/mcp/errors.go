package mcp

import (
	"context"
	"errors"

	"github.com/forkd/forkd/internal/errdefs"
)

// hinted is an error with what the model should do about it.
type hinted struct {
	err  error
	hint string
}

func (h *hinted) Error() string { return h.err.Error() }
func (h *hinted) Unwrap() error { return h.err }

// withHint attaches hint to err when err is of class (an errdefs.Is*
// function), so that explain says it instead of the class's generic
// advice.
func withHint(err error, is func(error) bool, hint string) error {
	if err == nil || !is(err) {
		return err
	}
	return &hinted{err: err, hint: hint}
}

// classHints is the generic advice for each error class.
var classHints = []struct {
	is   func(error) bool
	hint string
}{
	{errdefs.IsInvalidArgument, "Fix the argument and call again."},
	{errdefs.IsNotFound, "Check the id or tag: list_sandboxes and list_snapshots show what exists."},
	{errdefs.IsAlreadyExists, "Pick another name, or use the existing one."},
	{errdefs.IsFailedPrecondition, "The target is not in a state that allows this; get_sandbox or list_snapshots shows its state."},
	{errdefs.IsResourceExhausted, "A limit was reached: kill sandboxes you no longer need (kill_sandbox), or retry later."},
	{errdefs.IsDeadlineExceeded, "It took too long: raise timeout_secs, or do less per call."},
	{errdefs.IsNotImplemented, "This sandbox cannot do that (e.g. run_code needs a snapshot of an image with Python, such as \"python\")."},
	{errdefs.IsUnavailable, "forkd could not be reached or the sandbox did not answer; retry, and check that forkd serve runs."},
	{errdefs.IsUnauthenticated, "The daemon refused the credentials of this MCP server."},
}

// explain is the text of a failed call: "<code>: <message>", then what
// to do.
func explain(err error) string {
	if errors.Is(err, context.Canceled) {
		return "cancelled: the call was cancelled before it finished"
	}
	if errors.Is(err, context.DeadlineExceeded) && !errdefs.Classed(err) {
		err = errdefs.DeadlineExceeded("%v", err)
	}
	msg := errdefs.Code(err) + ": " + err.Error()
	if h, ok := errors.AsType[*hinted](err); ok {
		return msg + "\n" + h.hint
	}
	for _, c := range classHints {
		if c.is(err) {
			return msg + "\n" + c.hint
		}
	}
	return msg
}

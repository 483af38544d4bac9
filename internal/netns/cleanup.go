package netns

import "errors"

// cleanup is a stack of undo functions: after each acquisition its undo is
// added; run undoes in reverse order and joins the errors. Not safe for
// concurrent use.
type cleanup struct{ fns []func() error }

func (c *cleanup) add(f func() error) { c.fns = append(c.fns, f) }

// release forgets the undo functions: the work is kept.
func (c *cleanup) release() { c.fns = nil }

// run undoes everything added, last first, and returns the joined errors.
func (c *cleanup) run() error {
	var errs []error
	for i := len(c.fns) - 1; i >= 0; i-- {
		errs = append(errs, c.fns[i]())
	}
	c.fns = nil
	return errors.Join(errs...)
}

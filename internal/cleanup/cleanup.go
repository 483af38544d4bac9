// Package cleanup rolls back partial work: after each acquisition its undo
// is added to a Stack; on failure Run undoes everything in reverse order
// and joins the errors, never hiding the first; on success Release keeps
// the work. (After gVisor's pkg/cleanup.)
//
//	var cl cleanup.Stack
//	defer func() {
//		if err != nil {
//			err = errors.Join(err, cl.Run())
//		}
//	}()
//	x, err := acquire()
//	if err != nil {
//		return err
//	}
//	cl.Add(x.Close)
//	...
//	cl.Release()
package cleanup

import "errors"

// Stack is a stack of undo functions. The zero value is empty and ready to
// use. Not safe for concurrent use.
type Stack struct{ fns []func() error }

// Add pushes the undo of an acquisition.
func (s *Stack) Add(f func() error) { s.fns = append(s.fns, f) }

// Release forgets the undo functions (the work is kept) and returns a
// function that runs them, last first, joining their errors, for a caller
// that hands the undo on. Each call of the returned function runs them
// all again.
func (s *Stack) Release() func() error {
	fns := s.fns
	s.fns = nil
	return func() error { return runAll(fns) }
}

// Run undoes everything added, last first, empties the stack and returns
// the joined errors (nil when every undo succeeded). Every undo runs even
// when an earlier one failed.
func (s *Stack) Run() error {
	fns := s.fns
	s.fns = nil
	return runAll(fns)
}

func runAll(fns []func() error) error {
	var errs []error
	for i := len(fns) - 1; i >= 0; i-- {
		errs = append(errs, fns[i]())
	}
	return errors.Join(errs...)
}

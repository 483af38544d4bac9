package sandbox

import (
	"os"
	"sync"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/proc"
	"github.com/forkd/forkd/internal/state"
)

// self is this process's identity, recorded as the starter of the records
// it makes.
var self = sync.OnceValue(func() *proc.Identity {
	id, err := proc.Self(os.Getpid())
	if err != nil {
		return nil // no /proc: records carry no starter and are never "in flight"
	}
	return &id
})

// starter returns the identity to record as a new record's Starter.
func starter() *proc.Identity {
	if id := self(); id != nil {
		c := *id
		return &c
	}
	return nil
}

// inFlight reports whether sb (starting, building or parked) is still
// being made or held by a live forkd process, this one included. A record
// whose starter has gone was abandoned by a crash.
func inFlight(sb *state.Sandbox) bool {
	return sb.Starter != nil && proc.Alive(*sb.Starter)
}

// ownedElsewhere reports whether sb is in flight in another live process.
func ownedElsewhere(sb *state.Sandbox) bool {
	return inFlight(sb) && sb.Starter.PID != os.Getpid()
}

// stillStarting applies fn to child id's record if it is still starting,
// in one transaction; a record killed or reclaimed meanwhile is an
// FailedPrecondition-class error, so that the fork releases what it made.
func (e *Engine) stillStarting(id string, fn func(*state.Sandbox)) error {
	_, err := e.state.Update(id, func(r *state.Sandbox) error {
		if r.Status != state.StatusStarting {
			return errdefs.FailedPrecondition("sandbox %s became %s while starting", id, r.Status)
		}
		fn(r)
		return nil
	})
	if errdefs.IsNotFound(err) {
		return errdefs.FailedPrecondition("sandbox %s was removed while starting", id)
	}
	return err
}

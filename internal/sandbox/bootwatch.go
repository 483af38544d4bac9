package sandbox

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/proc"
	"github.com/forkd/forkd/internal/vmm"
)

// errStuck marks the error of a parent VM whose guest stopped before its
// agent answered: every vCPU halted and its VMM idle for a whole window.
// CI has seen cold boots under TCG fall silent after the kernel's first
// lines until the boot's deadline (a few times in many runs; none in 640
// boots in a row by hand, 400 of them beside two busy loops), and the
// same test pass when run again.
var errStuck = errors.New("the guest is stuck: every vCPU halted and its VMM idle")

// stuckWatch judges a booting guest stuck. From after on, every every it
// reads its VMM's CPU time and its vCPUs: once over a span of window the
// VMM used under stuckCPU of a core and every vCPU was halted at each
// reading, the guest is waiting for an interrupt nothing sends. A booting
// guest computes (its VMM runs flat out under TCG) until its agent
// answers; one that has answered idles this way too, so the watch is only
// for a guest that has not.
type stuckWatch struct{ after, every, window time.Duration }

// stuckCPU is the share of a core under which a VMM counts as idle: an
// idle guest's takes 0.2–0.7 % here.
const stuckCPU = 0.02

// parentStuck watches parents: a minimal one answers in 4–12 s here.
var parentStuck = stuckWatch{after: time.Minute, every: 5 * time.Second, window: 30 * time.Second}

// wait returns an error wrapping errStuck, with what the vCPUs were doing,
// once m's guest is stuck; nil when ctx ends first, or when m cannot tell
// where its vCPUs are.
func (w stuckWatch) wait(ctx context.Context, m vmm.Machine) error {
	r, ok := m.(vmm.CPUReader)
	if !ok {
		return nil
	}
	pid := m.Handle().Process
	type reading struct {
		at     time.Time
		cpu    time.Duration
		halted bool
	}
	var span []reading
	wait := w.after
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(wait):
		}
		wait = w.every
		cpu, err := proc.CPUTime(pid)
		if errdefs.IsNotFound(err) {
			return nil // the VMM is gone: the dial's error tells
		}
		if err != nil {
			span = span[:0]
			continue
		}
		cpus, err := r.CPUs(ctx)
		if err != nil {
			span = span[:0] // unknown: start the window again
			continue
		}
		now := time.Now()
		span = append(span, reading{now, cpu, allHalted(cpus)})
		if !span[len(span)-1].halted {
			span = span[:0]
			continue
		}
		for len(span) > 1 && now.Sub(span[1].at) >= w.window {
			span = span[1:]
		}
		took, over := span[len(span)-1].cpu-span[0].cpu, now.Sub(span[0].at)
		if over >= w.window && float64(took) < stuckCPU*float64(over) {
			return fmt.Errorf("%w for %s (%s of CPU): %s", errStuck, over.Round(time.Second), took.Round(time.Millisecond), describeCPUs(cpus))
		}
	}
}

func allHalted(cpus []vmm.CPU) bool {
	for _, c := range cpus {
		if !c.Halted {
			return false
		}
	}
	return len(cpus) > 0
}

// describeCPUs says where each vCPU is: "vCPU 0 halted at 0x…".
func describeCPUs(cpus []vmm.CPU) string {
	var b strings.Builder
	for i, c := range cpus {
		if i > 0 {
			b.WriteString(", ")
		}
		state := "running"
		if c.Halted {
			state = "halted"
		}
		fmt.Fprintf(&b, "vCPU %d %s at %#x", i, state, c.PC)
	}
	return b.String()
}

// GuestReport describes what a guest that did not answer is doing: where
// its vCPUs are, twice a second apart, and the CPU its VMM used between
// ("" when m cannot tell).
func GuestReport(ctx context.Context, m vmm.Machine) string {
	r, ok := m.(vmm.CPUReader)
	if !ok {
		return ""
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	pid := m.Handle().Process
	cpu0, err0 := proc.CPUTime(pid)
	first, err := r.CPUs(ctx)
	if err != nil {
		return "\nguest vCPUs: unknown (" + err.Error() + ")"
	}
	time.Sleep(time.Second)
	cpu1, err1 := proc.CPUTime(pid)
	second, err := r.CPUs(ctx)
	if err != nil {
		return "\nguest vCPUs: " + describeCPUs(first)
	}
	out := "\nguest vCPUs: " + describeCPUs(first) + "; a second later: " + describeCPUs(second)
	if err0 == nil && err1 == nil {
		out += fmt.Sprintf("; its VMM used %s of CPU in that second", (cpu1 - cpu0).Round(time.Millisecond))
	}
	return out
}

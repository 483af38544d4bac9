package mcp

import (
	"context"
	"fmt"
	"sync"
	"time"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"
)

// heartbeatEvery is how often a long call that has nothing else to say
// reports that it still runs: clients reset their request timeouts on
// progress, and people see that something happens.
const heartbeatEvery = 2 * time.Second

// progress sends a call's progress notifications, when its caller asked
// for them (a progress token); otherwise it does nothing. Safe for
// concurrent use.
type progress struct {
	c     *call
	token any
	mu    sync.Mutex // guards n, total
	n     float64    // progress sent so far; each notification must exceed it
	total float64    // the last total sent
}

func (c *call) progress() *progress {
	p := &progress{c: c}
	if c != nil && c.req != nil && c.req.Params != nil {
		p.token = c.req.Params.GetProgressToken()
	}
	return p
}

// report sends progress done of total (0: unknown) with a message. done
// must grow from one report to the next; a report that does not is sent
// with its done raised just above the last.
func (p *progress) report(ctx context.Context, done, total float64, msg string) {
	if p.token == nil || p.c.req.Session == nil {
		return
	}
	p.mu.Lock()
	if done <= p.n {
		done = p.n + 0.001
	}
	p.n, p.total = done, total
	p.mu.Unlock()
	// A notification the client cannot take fails the call no more than
	// silence would.
	_ = p.c.req.Session.NotifyProgress(ctx, &sdk.ProgressNotificationParams{
		ProgressToken: p.token, Progress: done, Total: total, Message: msg,
	})
}

// heartbeat reports "what: Ns" every heartbeatEvery until stop is called,
// its progress a hair above the last report's.
func (p *progress) heartbeat(ctx context.Context, what string) (stop func()) {
	if p.token == nil {
		return func() {}
	}
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	start := time.Now()
	go func() {
		defer close(done)
		t := time.NewTicker(heartbeatEvery)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				p.mu.Lock()
				n, total := p.n, p.total
				p.mu.Unlock()
				p.report(ctx, n, total, fmt.Sprintf("%s: %.0fs", what, time.Since(start).Seconds()))
			}
		}
	}()
	return func() {
		cancel()
		<-done
	}
}

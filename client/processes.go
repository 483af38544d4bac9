package client

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/url"
	"strconv"

	apiv1 "github.com/forkd/forkd/api/v1"
)

// StartProcess starts a background process.
func (c *Client) StartProcess(ctx context.Context, id string, req apiv1.StartProcessRequest) (*apiv1.Process, error) {
	var p apiv1.Process
	return &p, c.do(ctx, "POST", sandboxPath(id, "/processes"), nil, req, &p)
}

// ListProcesses lists background processes.
func (c *Client) ListProcesses(ctx context.Context, id string) ([]apiv1.Process, error) {
	var l apiv1.ProcessList
	return l.Processes, c.do(ctx, "GET", sandboxPath(id, "/processes"), nil, nil, &l)
}

func processPath(id string, pid int, rest string) string {
	return sandboxPath(id, "/processes/"+strconv.Itoa(pid)+rest)
}

// WaitProcess waits for a background process to end.
func (c *Client) WaitProcess(ctx context.Context, id string, pid int) (*apiv1.ExecResult, error) {
	var r apiv1.ExecResult
	return &r, c.do(ctx, "POST", processPath(id, pid, "/wait"), nil, nil, &r)
}

// StreamProcess attaches to a background process: its recent output, then
// live output, to stdout and stderr, until it ends.
func (c *Client) StreamProcess(ctx context.Context, id string, pid int, stdout, stderr io.Writer) (*apiv1.ExecResult, error) {
	path := processPath(id, pid, "/stream")
	ev, err := c.streamFrom(ctx, "GET", path, nil, "", stdout, stderr)
	if err != nil {
		return nil, err
	}
	if ev.Type != apiv1.EventExit || ev.Exec == nil {
		return nil, fmt.Errorf("process stream ended with a %q event", ev.Type)
	}
	return ev.Exec, nil
}

// SendStdin writes data to a background process's stdin, closing it after
// when eof.
func (c *Client) SendStdin(ctx context.Context, id string, pid int, data []byte, eof bool) error {
	q := url.Values{}
	if eof {
		q.Set("eof", "true")
	}
	resp, err := c.request(ctx, "POST", processPath(id, pid, "/stdin"), q, bytes.NewReader(data), "application/octet-stream")
	if err != nil {
		return err
	}
	resp.Body.Close()
	return nil
}

// SignalProcess sends a signal to a background process's group.
func (c *Client) SignalProcess(ctx context.Context, id string, pid int, signal string) error {
	return c.do(ctx, "POST", processPath(id, pid, "/signal"), nil, apiv1.SignalRequest{Signal: signal}, nil)
}

// KillProcess kills a background process's group.
func (c *Client) KillProcess(ctx context.Context, id string, pid int) error {
	return c.do(ctx, "DELETE", processPath(id, pid, ""), nil, nil, nil)
}

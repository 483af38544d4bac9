// Package loopback tells whether an address names this machine, for the
// rules that depend on it: a tokenless daemon serves only loopback, and
// the CLI sends the data dir's token only to a loopback daemon.
package loopback

import (
	"net"
	"strings"
)

// Host reports whether a host or host:port (an HTTP Host header, a URL's
// or a listen address's host) names this machine: localhost or a loopback
// address.
func Host(hostport string) bool {
	h := hostport
	if hh, _, err := net.SplitHostPort(hostport); err == nil {
		h = hh
	}
	if strings.EqualFold(h, "localhost") {
		return true
	}
	ip := net.ParseIP(strings.Trim(h, "[]"))
	return ip != nil && ip.IsLoopback()
}

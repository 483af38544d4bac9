package mcp

import (
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/sandbox"
	"github.com/forkd/forkd/internal/snapshot"
)

// Bounds of the tools' arguments. The daemon checks its own (REST
// validation is the authority); these are the MCP face's, tighter where a
// model calling in a loop should not go further in one call.
const (
	maxPathBytes     = 4096
	maxSpawn         = 100 // children per spawn or fork call
	maxCallSecs      = 3600
	defaultCallSecs  = 60
	maxTTLSecs       = int(sandbox.MaxTimeout / time.Second)
	maxReadBytes     = 1 << 20
	maxWriteBytes    = 16 << 20
	maxListDepth     = 5
	maxListEntries   = 1000
	maxMarkerBytes   = 4096
	maxWaitSecs      = 600
	defaultWaitSecs  = 30
	minIntervalMS    = 100
	maxIntervalMS    = 10000
	defaultInterval  = 500
	maxBuildWaitSecs = 3600
	defaultBuildWait = 900
)

// checkID checks a sandbox id argument.
func checkID(id string) error {
	if id == "" {
		return errdefs.InvalidArgument("id is empty: give a sandbox id such as sb-abcdefgh23 (list_sandboxes lists them)")
	}
	if err := sandbox.ValidateID(id); err != nil {
		return withHint(fmt.Errorf("id: %w", err), errdefs.IsInvalidArgument,
			"A sandbox id is \"sb-\" and 10 characters of a-z and 2-7, as spawn_sandboxes and list_sandboxes give them.")
	}
	return nil
}

// checkTag checks a snapshot tag argument named name.
func checkTag(name, tag string) error {
	if err := snapshot.ValidateTag(tag); err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	return nil
}

// checkPath checks a guest path argument named name: absolute, at most
// maxPathBytes, no NUL.
func checkPath(name, p string) error {
	switch {
	case p == "":
		return errdefs.InvalidArgument("%s is empty: give an absolute path in the sandbox, such as /root/file.txt", name)
	case !strings.HasPrefix(p, "/"):
		return errdefs.InvalidArgument("%s %s is relative: give an absolute path in the sandbox, such as /root/%s", name, errdefs.Quote(p), strings.TrimPrefix(p, "./"))
	case len(p) > maxPathBytes:
		return errdefs.InvalidArgument("%s is %d bytes long; the limit is %d", name, len(p), maxPathBytes)
	case strings.ContainsRune(p, 0):
		return errdefs.InvalidArgument("%s holds a NUL byte", name)
	}
	return nil
}

// checkInt checks that integer argument name is within lo..hi.
func checkInt(name string, v, lo, hi int) error {
	if v < lo || v > hi {
		return errdefs.InvalidArgument("%s = %d: want %d to %d", name, v, lo, hi)
	}
	return nil
}

// checkSecs checks a duration in seconds argument name: lo < v <= hi
// when lo is 0 (zero excluded), else lo <= v <= hi; never NaN or
// infinite.
func checkSecs(name string, v, lo, hi float64) error {
	ok := v >= lo && v <= hi && !math.IsNaN(v)
	if lo == 0 {
		ok = ok && v > 0
	}
	if !ok {
		if lo == 0 {
			return errdefs.InvalidArgument("%s = %v: want more than 0 and at most %v seconds", name, v, hi)
		}
		return errdefs.InvalidArgument("%s = %v: want %v to %v seconds", name, v, lo, hi)
	}
	return nil
}

// checkOneOf checks that argument name, when set, is one of vals.
func checkOneOf(name, v string, vals ...string) error {
	if v == "" {
		return nil
	}
	for _, ok := range vals {
		if v == ok {
			return nil
		}
	}
	return errdefs.InvalidArgument("%s %s: want one of %s", name, errdefs.Quote(v), strings.Join(vals, ", "))
}

// parseMode parses an octal permission argument ("0644", "755").
func parseMode(name, s string) (uint32, error) {
	if s == "" {
		return 0, nil
	}
	v, err := strconv.ParseUint(s, 8, 32)
	if err != nil || v > 0o7777 || v == 0 {
		return 0, errdefs.InvalidArgument("%s %s: want octal permission bits such as \"0644\" or \"0755\"", name, errdefs.Quote(s))
	}
	return uint32(v), nil
}

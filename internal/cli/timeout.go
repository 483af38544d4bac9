package cli

import (
	"math"
	"strconv"
	"time"

	"github.com/spf13/pflag"

	"github.com/forkd/forkd/internal/errdefs"
)

// timeoutValue is the one spelling of every time flag: a Go duration
// ("30s", "1m30s", "2h"), or a bare number of seconds ("90", "2.5"), the
// older spelling of eval --timeout.
type timeoutValue struct{ d *time.Duration }

func (v timeoutValue) String() string {
	if v.d == nil || *v.d == 0 {
		return "0"
	}
	return v.d.String()
}

func (v timeoutValue) Set(s string) error {
	d, err := parseTimeout(s)
	if err != nil {
		return err
	}
	*v.d = d
	return nil
}

func (v timeoutValue) Type() string { return "duration" }

// parseTimeout parses a duration or a bare number of seconds; it refuses
// negative, NaN and overflowing values.
func parseTimeout(s string) (time.Duration, error) {
	if secs, err := strconv.ParseFloat(s, 64); err == nil {
		if !(secs >= 0 && secs <= math.MaxInt64/float64(time.Second)) {
			return 0, errdefs.InvalidArgument("%q: want a duration such as 30s or 5m, or seconds", s)
		}
		return time.Duration(secs * float64(time.Second)), nil
	}
	d, err := time.ParseDuration(s)
	if err != nil || d < 0 {
		return 0, errdefs.InvalidArgument("%q: want a duration such as 30s or 5m, or seconds", s)
	}
	return d, nil
}

// timeoutFlag registers a time flag named name on fs.
func timeoutFlag(fs *pflag.FlagSet, d *time.Duration, name, usage string) {
	fs.Var(timeoutValue{d}, name, usage+" (a duration such as 30s or 5m; a bare number is seconds)")
}

// secondsAlias registers a hidden older spelling: name takes whole
// seconds into d.
func secondsAlias(fs *pflag.FlagSet, d *time.Duration, name string) {
	fs.Var(timeoutValue{d}, name, "seconds (older spelling)")
	_ = fs.MarkHidden(name) // the flag was just added
}

package snapshot

import (
	"regexp"

	"github.com/forkd/forkd/internal/errdefs"
)

// MaxTagLen is the longest tag accepted.
const MaxTagLen = 63

var tagRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]*$`)

// ValidateTag is the one check every tag passes before it names anything:
// 1–63 characters from [A-Za-z0-9._-], starting with a letter or digit, so
// a tag is always a single path element inside the store (no "/", no "..",
// no leading "." that would collide with staging entries).
func ValidateTag(tag string) error {
	switch {
	case tag == "":
		return errdefs.InvalidArgument("tag is empty")
	case len(tag) > MaxTagLen:
		return errdefs.InvalidArgument("tag is %d characters long; the limit is %d", len(tag), MaxTagLen)
	case !tagRE.MatchString(tag):
		return errdefs.InvalidArgument("tag %s: use letters, digits, '.', '_' and '-', starting with a letter or digit", errdefs.Quote(tag))
	}
	return nil
}

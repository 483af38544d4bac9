// Package mountinfo parses the mount table of /proc/<pid>/mountinfo
// (proc(5)).
package mountinfo

import (
	"bufio"
	"io"
	"os"
	"strings"
)

// Mount is one mount: one line of mountinfo, with the octal escapes of its
// paths (\040 for a space) undone.
type Mount struct {
	Root         string // the directory of the filesystem that is the mount's root
	MountPoint   string // where it is mounted, in the reader's mount namespace
	Options      string // per-mount options, such as "rw,nosuid"
	FSType       string // such as "ext4", "cgroup2"
	Source       string // such as "/dev/sda1", "cgroup"; may be ""
	SuperOptions string // per-superblock options; a v1 cgroup's controllers are here
}

// Parse reads a mount table in the format of /proc/self/mountinfo:
//
//	ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPEROPTIONS
//
// Lines of another shape are skipped. The error is the reader's.
func Parse(r io.Reader) ([]Mount, error) {
	var out []Mount
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		if m, ok := parseLine(sc.Text()); ok {
			out = append(out, m)
		}
	}
	return out, sc.Err()
}

// ParseFile parses the mount table in the file at path, such as
// "/proc/self/mountinfo".
func ParseFile(path string) ([]Mount, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return Parse(f)
}

func parseLine(line string) (Mount, bool) {
	pre, post, ok := strings.Cut(line, " - ")
	if !ok {
		return Mount{}, false
	}
	pf := strings.Fields(pre)
	// The fields after the separator are split on single spaces: the
	// kernel prints an empty source as nothing between two spaces.
	qf := strings.SplitN(post, " ", 3)
	if len(pf) < 5 || len(qf) < 3 {
		return Mount{}, false
	}
	m := Mount{
		Root:         Unescape(pf[3]),
		MountPoint:   Unescape(pf[4]),
		FSType:       qf[0],
		Source:       Unescape(qf[1]),
		SuperOptions: qf[2],
	}
	if len(pf) > 5 {
		m.Options = pf[5]
	}
	return m, true
}

// Unescape undoes mountinfo's octal escapes (\040 for a space); a
// backslash not followed by three octal digits stays as it is.
func Unescape(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			var v byte
			ok := true
			for j := 1; j <= 3; j++ {
				c := s[i+j]
				if c < '0' || c > '7' {
					ok = false
					break
				}
				v = v*8 + (c - '0')
			}
			if ok {
				b.WriteByte(v)
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

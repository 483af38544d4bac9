package guest

import (
	"bufio"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"github.com/forkd/forkd/internal/errdefs"
)

// account is a user from the guest's /etc/passwd.
type account struct {
	name     string
	uid, gid uint32
	home     string
	shell    string
	groups   []uint32 // supplementary groups from /etc/group
}

// lookupUser finds name (or a numeric uid) in root/etc/passwd and its
// supplementary groups in root/etc/group. A numeric uid absent from passwd
// is accepted with gid = uid and home "/".
func lookupUser(root, name string) (*account, error) {
	f, err := os.Open(filepath.Join(root, "etc/passwd"))
	if err != nil && !os.IsNotExist(err) {
		return nil, errdefs.FailedPrecondition("read /etc/passwd: %w", err)
	}
	uid, numErr := strconv.ParseUint(name, 10, 32)
	if f != nil {
		defer f.Close()
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			fs := strings.Split(sc.Text(), ":")
			if len(fs) < 7 {
				continue
			}
			u, err1 := strconv.ParseUint(fs[2], 10, 32)
			g, err2 := strconv.ParseUint(fs[3], 10, 32)
			if err1 != nil || err2 != nil {
				continue
			}
			if fs[0] == name || (numErr == nil && u == uid) {
				a := &account{name: fs[0], uid: uint32(u), gid: uint32(g), home: fs[5], shell: fs[6]}
				a.groups = groupsOf(root, a.name, a.gid)
				return a, nil
			}
		}
	}
	if numErr == nil {
		return &account{name: name, uid: uint32(uid), gid: uint32(uid), home: "/"}, nil
	}
	return nil, errdefs.NotFound("user %q not found in /etc/passwd", name)
}

// groupsOf returns the gids of root/etc/group entries listing user, besides
// its primary group.
func groupsOf(root, user string, primary uint32) []uint32 {
	f, err := os.Open(filepath.Join(root, "etc/group"))
	if err != nil {
		return nil
	}
	defer f.Close()
	var gids []uint32
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fs := strings.Split(sc.Text(), ":")
		if len(fs) < 4 || fs[3] == "" {
			continue
		}
		g, err := strconv.ParseUint(fs[2], 10, 32)
		if err != nil || uint32(g) == primary {
			continue
		}
		for _, m := range strings.Split(fs[3], ",") {
			if m == user {
				gids = append(gids, uint32(g))
				break
			}
		}
	}
	return gids
}

// credential returns the Credential that switches to a, or nil when the
// agent already runs as a.
func (a *account) credential() *syscall.Credential {
	if uint32(os.Geteuid()) == a.uid && uint32(os.Getegid()) == a.gid && len(a.groups) == 0 {
		return nil
	}
	return &syscall.Credential{Uid: a.uid, Gid: a.gid, Groups: a.groups}
}

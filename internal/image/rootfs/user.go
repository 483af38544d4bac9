package rootfs

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"strconv"
	"strings"

	"github.com/forkd/forkd/internal/errdefs"
)

// User is an account to add to a tree.
type User struct {
	Name     string
	UID, GID int
	Home     string // absolute, e.g. /home/user
	Shell    string // e.g. /bin/bash
}

// AddUser adds u to the tree's /etc/passwd, /etc/group (a group of its
// own name) and /etc/shadow when it has one (password locked), and makes
// its home directory (mode 0755, its own) with the files of /etc/skel.
// It refuses a name or id already there.
func AddUser(t *Tree, u User) error {
	if u.Name == "" || strings.ContainsAny(u.Name, ":\n/") || !path.IsAbs(u.Home) || u.UID <= 0 || u.GID <= 0 {
		return errdefs.InvalidArgument("user %+v: want a name without ':', '/' or newlines, positive ids and an absolute home", u)
	}
	for _, f := range []struct {
		file string
		id   int
		line string
	}{
		{"etc/passwd", u.UID, fmt.Sprintf("%s:x:%d:%d::%s:%s", u.Name, u.UID, u.GID, u.Home, u.Shell)},
		{"etc/group", u.GID, fmt.Sprintf("%s:x:%d:", u.Name, u.GID)},
		{"etc/shadow", -1, u.Name + ":!:19000:0:99999:7:::"},
	} {
		old, err := t.ReadFile(f.file, 16<<20)
		if errors.Is(err, fs.ErrNotExist) {
			if f.file == "etc/shadow" {
				continue
			}
			old = nil
		} else if err != nil {
			return err
		}
		for _, l := range strings.Split(string(old), "\n") {
			fields := strings.Split(l, ":")
			if fields[0] == u.Name || f.id >= 0 && len(fields) > 2 && fields[2] == strconv.Itoa(f.id) {
				return errdefs.AlreadyExists("%s already has %s or id %d", f.file, u.Name, f.id)
			}
		}
		if len(old) > 0 && !bytes.HasSuffix(old, []byte("\n")) {
			old = append(old, '\n')
		}
		perm := uint32(0o644)
		if f.file == "etc/shadow" {
			perm = 0o640
		}
		st, err := t.Lstat(f.file)
		if err == nil {
			perm = st.Mode & 0o7777
		}
		if err := t.MkdirAll(path.Dir(f.file), 0o755); err != nil {
			return err
		}
		if err := t.WriteFile(f.file, append(old, f.line+"\n"...), perm); err != nil {
			return err
		}
		if err == nil && os.Geteuid() == 0 {
			if err := t.Lchown(f.file, int(st.Uid), int(st.Gid)); err != nil {
				return err
			}
		}
	}
	home := strings.TrimPrefix(path.Clean(u.Home), "/")
	if err := t.MkdirAll(path.Dir(home), 0o755); err != nil {
		return err
	}
	if err := t.Mkdir(home, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
		return err
	}
	owned := []string{home}
	names, err := t.ReadDirNames("etc/skel")
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	for _, n := range names {
		st, err := t.Lstat("etc/skel/" + n)
		if err != nil || st.Mode&0o170000 != 0o100000 {
			continue // only the regular files
		}
		b, err := t.ReadFile("etc/skel/"+n, 1<<20)
		if err != nil {
			return err
		}
		if err := t.WriteFile(home+"/"+n, b, st.Mode&0o777); err != nil {
			return err
		}
		owned = append(owned, home+"/"+n)
	}
	if os.Geteuid() != 0 {
		return nil
	}
	for _, p := range owned {
		if err := t.Lchown(p, u.UID, u.GID); err != nil {
			return err
		}
	}
	return nil
}

package guest

import (
	"bufio"
	"bytes"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/forkd/forkd/internal/agent/proto"
)

// idNames names uids and gids from the guest's /etc/passwd and
// /etc/group, read again when either file changes. Safe for concurrent
// use.
type idNames struct {
	root string

	mu           sync.Mutex
	passwdMod    time.Time         // guarded by mu
	groupMod     time.Time         // guarded by mu
	users, group map[uint32]string // guarded by mu
}

// names returns the names of uid and gid, their numbers when unnamed.
func (n *idNames) names(uid, gid uint32) (string, string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.users = n.reload(n.users, "etc/passwd", &n.passwdMod)
	n.group = n.reload(n.group, "etc/group", &n.groupMod)
	user, ok := n.users[uid]
	if !ok {
		user = strconv.FormatUint(uint64(uid), 10)
	}
	grp, ok := n.group[gid]
	if !ok {
		grp = strconv.FormatUint(uint64(gid), 10)
	}
	return user, grp
}

// reload reads the name:x:id: lines of file when it changed since *mod.
func (n *idNames) reload(cur map[uint32]string, file string, mod *time.Time) map[uint32]string {
	path := filepath.Join(n.root, file)
	st, err := os.Stat(path)
	if err != nil {
		return cur
	}
	if cur != nil && st.ModTime().Equal(*mod) {
		return cur
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return cur
	}
	m := map[uint32]string{}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		fs := strings.Split(sc.Text(), ":")
		if len(fs) < 3 {
			continue
		}
		id, err := strconv.ParseUint(fs[2], 10, 32)
		if err != nil {
			continue
		}
		if _, dup := m[uint32(id)]; !dup {
			m[uint32(id)] = fs[0]
		}
	}
	*mod = st.ModTime()
	return m
}

// info describes path p from its stat result, with owner and group names.
func (a *Agent) info(p string, st fs.FileInfo) proto.FileInfo {
	fi := fileInfo(p, st)
	if sys, ok := st.Sys().(*syscall.Stat_t); ok {
		fi.Owner, fi.Group = a.ids.names(sys.Uid, sys.Gid)
	}
	return fi
}

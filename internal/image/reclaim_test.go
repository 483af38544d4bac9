package image

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/testutil"
)

func TestReclaim(t *testing.T) {
	cache := t.TempDir()
	b := &Builder{CacheDir: cache}
	old := time.Now().Add(-2 * StaleTempAge)
	mkdir := func(p string) string {
		p = filepath.Join(cache, p)
		if err := os.MkdirAll(filepath.Join(p, "sub"), 0o700); err != nil {
			t.Fatal(err)
		}
		testutil.WriteFile(t, filepath.Join(p, "sub", "f"), []byte("x"), 0o644)
		return p
	}
	write := func(p string, mtime time.Time) {
		p = filepath.Join(cache, p)
		testutil.MkdirAll(t, filepath.Dir(p), 0o755)
		if err := os.WriteFile(p, []byte("x"), 0o644); err != nil {
			t.Fatal(err)
		}
		testutil.Chtimes(t, p, mtime, mtime)
	}
	mkdir("rootfs/" + hashKey("crashed"))
	mkdir("rootfs/.staging-" + hashKey("crashed") + "-123456")
	mkdir("rootfs/.staging-" + hashKey("replaced") + "-old-a1b2c3")
	mkdir("kernel/.staging-linux-image-6.8.0-1_6.8.0-1.1-98765")
	busy := mkdir("rootfs/.staging-" + hashKey("busy") + "-4242")
	write("images/.tmp-mine.json-777", old)
	write("initramfs/.tmp-"+hashKey("i")+".cpio.gz-888", old)
	fresh := filepath.Join(cache, "images/.tmp-other.json-999")
	write("images/.tmp-other.json-999", time.Now())
	write("images/mine.json", old)

	// Another builder holds the busy entry.
	unlock, err := b.lock(context.Background(), kindRootfs, hashKey("busy"))
	if err != nil {
		t.Fatal(err)
	}
	// A mount left below a crashed staging directory is detached, not
	// crossed (root only).
	mounted := ""
	if os.Geteuid() == 0 {
		p := mkdir("rootfs/.staging-" + hashKey("mounted") + "-555")
		if err := unix.Mount("tmpfs", filepath.Join(p, "sub"), "tmpfs", 0, ""); err == nil {
			mounted = p
			t.Cleanup(func() { unix.Unmount(filepath.Join(p, "sub"), unix.MNT_DETACH) })
		}
	}

	if err := b.Reclaim(); err != nil {
		t.Fatal(err)
	}
	got := listCache(t, cache)
	want := []string{"images/.tmp-other.json-999", "images/mine.json", "rootfs/" + hashKey("crashed"), "rootfs/" + filepath.Base(busy)}
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Errorf("after Reclaim:\n got %v\nwant %v", got, want)
	}
	if _, err := os.Stat(fresh); err != nil {
		t.Errorf("a fresh temporary file was removed: %v", err)
	}
	if mounted != "" {
		if m, _ := mountsBelow(mounted); len(m) != 0 {
			t.Errorf("mounts left: %v", m)
		}
	}

	// Once its builder is gone, the busy staging directory goes too.
	unlock()
	if err := b.Reclaim(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(busy); !os.IsNotExist(err) {
		t.Errorf("staging of a released entry kept: %v", err)
	}
	// An empty or missing cache is fine.
	if err := (&Builder{CacheDir: filepath.Join(cache, "none")}).Reclaim(); err != nil {
		t.Errorf("missing cache: %v", err)
	}
}

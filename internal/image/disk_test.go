package image

import (
	"context"
	"encoding/binary"
	"os"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/testutil"
)

func TestDiskBase(t *testing.T) {
	testutil.RequireCommand(t, "mkfs.ext4")
	b := &Builder{CacheDir: t.TempDir()}
	ctx := context.Background()
	p, err := b.DiskBase(ctx, 256)
	testutil.Check(t, err)
	fi, err := os.Stat(p)
	testutil.Check(t, err)
	if fi.Size() != 256<<20 {
		t.Fatalf("size %d", fi.Size())
	}
	var st unix.Stat_t
	testutil.Check(t, unix.Stat(p, &st))
	if used := st.Blocks * 512; used > 16<<20 {
		t.Errorf("an empty 256 MiB file system takes %d MiB: not sparse", used>>20)
	}
	sb := make([]byte, 2)
	f, err := os.Open(p)
	testutil.Check(t, err)
	_, err = f.ReadAt(sb, 1024+56) // the superblock's s_magic
	f.Close()
	testutil.Check(t, err)
	if binary.LittleEndian.Uint16(sb) != 0xef53 {
		t.Fatalf("no ext4 superblock: magic %#x", sb)
	}
	// Made once per size.
	again, err := b.DiskBase(ctx, 256)
	if fi2, _ := os.Stat(again); err != nil || again != p || !os.SameFile(fi, fi2) {
		t.Fatalf("DiskBase again: %s, %v", again, err)
	}
	if _, err := b.DiskBase(ctx, 1); err == nil {
		t.Fatal("a 1 MiB disk base accepted")
	}
	ph, err := b.DiskPlaceholder(ctx)
	testutil.Check(t, err)
	if fi, err := os.Stat(ph); err != nil || fi.Size() != PlaceholderBytes {
		t.Fatalf("placeholder: %v %v", fi, err)
	}
}

package proc

import (
	"bufio"
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/testutil"
)

func TestPrivateMappings(t *testing.T) {
	maps := []byte(`55d0c0000000-55d0c0001000 r--p 00000000 fe:01 123 /usr/bin/qemu
55d0c0001000-55d0c0002000 rw-s 00000000 00:01 7 /memfd:ram (deleted)
7f0000000000-7f0000400000 rw-p 00000000 00:00 0
garbage
7f0000500000-7f0000400000 rw-p 00000000 00:00 0
ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0                  [vsyscall]
`)
	got := privateMappings(maps)
	want := []mapping{{0x55d0c0000000, 0x55d0c0001000}, {0x7f0000000000, 0x7f0000400000}}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("privateMappings = %x, want %x", got, want)
	}
}

// pageOutChildEnv makes the test binary a child holding 24 MiB of random
// bytes, at the start of one 3 GiB mapping and 2.5 GiB into it (past what
// one process_madvise call advises): it prints their digest, waits for a
// line on stdin, then prints the digest again (after its pages went to
// swap and came back).
const pageOutChildEnv = "FORKD_TEST_PAGEOUT_CHILD"

// TestPageOut pages a child out and reads its resident pages back in
// (ResidentAnon, PageIn): its data is whole.
func TestPageOut(t *testing.T) {
	if os.Getenv(pageOutChildEnv) == "1" {
		m, err := unix.Mmap(-1, 0, 3<<30, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		if err != nil {
			panic(err)
		}
		parts := [][]byte{m[:16<<20], m[5<<29 : 5<<29+8<<20]}
		digest := func() string {
			h := sha256.New()
			for _, p := range parts {
				h.Write(p)
			}
			return fmt.Sprintf("%x", h.Sum(nil))
		}
		for _, p := range parts {
			rand.Read(p)
		}
		fmt.Println(digest())
		bufio.NewReader(os.Stdin).ReadString('\n')
		fmt.Println(digest())
		os.Exit(0)
	}
	testutil.RequireRoot(t)
	if total, free, err := Swap(); err != nil || total == 0 || free < 64<<20 {
		testutil.Unavailable(t, fmt.Sprintf("PageOut needs swap with 64 MiB free (have %d of %d, %v): scripts/zram-swap.sh", free, total, err))
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestPageOut$")
	cmd.Env = append(os.Environ(), pageOutChildEnv+"=1")
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	pipe, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	out := bufio.NewReader(pipe)
	before, err := out.ReadString('\n')
	if err != nil {
		t.Fatal(err)
	}
	id, err := Self(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	// What PageIn brings back below: the pages resident now.
	hot, err := ResidentAnon(id, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := PageOut(id, func() bool { return false }); !errors.Is(err, ErrStopped) {
		t.Fatalf("PageOut told to stop at once: %v, want ErrStopped", err)
	}
	moved, err := PageOut(id, nil)
	if err != nil {
		t.Fatal(err)
	}
	// Random bytes do not compress; all 24 MiB of them go, the 8 past
	// 2 GiB included.
	if swap, _ := SwapBytes(id.PID); moved < 23<<20 || swap < moved {
		t.Fatalf("PageOut moved %d KiB to swap (VmSwap %d KiB), want the child's 24 MiB of data", moved>>10, swap>>10)
	}
	// Read back without the child running: its data leaves swap.
	read, err := PageIn(id, hot)
	if err != nil {
		t.Fatal(err)
	}
	swap, _ := SwapBytes(id.PID)
	if read < 24<<20 || swap > moved-23<<20 {
		t.Fatalf("PageIn read %d KiB and left %d KiB in swap (of %d KiB paged out), want the child's 24 MiB of data back", read>>10, swap>>10, moved>>10)
	}
	fmt.Fprintln(in)
	after, err := out.ReadString('\n')
	if err != nil {
		t.Fatal(err)
	}
	if after != before {
		t.Fatalf("the child's data changed across PageOut: digest %q, then %q", before, after)
	}
	// Its pages came back from swap, leaving holes in a zram pool.
	if _, _, err := CompactZramSwap(); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Wait(); err != nil {
		t.Fatal(err)
	}
	if _, err := PageOut(id, nil); !errdefs.IsNotFound(err) {
		t.Fatalf("PageOut of an exited process: %v, want NotFound", err)
	}
}

package mountinfo

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/forkd/forkd/internal/testutil"
)

func TestParse(t *testing.T) {
	in := strings.Join([]string{
		"22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw,errors=remount-ro",
		`35 31 0:32 /process_api /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory`,
		`40 22 0:40 / /mnt/a\040b\134c rw master:3 shared:7 - tmpfs  rw,size=10k`,
		"not a mount line",
		"1 2 3 4 - too short",
		"",
	}, "\n")
	got, err := Parse(strings.NewReader(in))
	if err != nil {
		t.Fatal(err)
	}
	want := []Mount{
		{Root: "/", MountPoint: "/", Options: "rw,relatime", FSType: "ext4", Source: "/dev/sda1", SuperOptions: "rw,errors=remount-ro"},
		{Root: "/process_api", MountPoint: "/sys/fs/cgroup/memory", Options: "rw,nosuid", FSType: "cgroup", Source: "cgroup", SuperOptions: "rw,memory"},
		{Root: "/", MountPoint: `/mnt/a b\c`, Options: "rw", FSType: "tmpfs", Source: "", SuperOptions: "rw,size=10k"},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("Parse =\n%+v\nwant\n%+v", got, want)
	}
}

func TestParseSelf(t *testing.T) {
	if _, err := os.Stat("/proc/self/mountinfo"); err != nil {
		testutil.Unavailable(t, "no procfs: "+err.Error())
	}
	ms, err := ParseFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	root := false
	for _, m := range ms {
		if m.MountPoint == "/" {
			root = true
		}
		if m.FSType == "" || !strings.HasPrefix(m.MountPoint, "/") {
			t.Errorf("odd mount %+v", m)
		}
	}
	if !root {
		t.Fatalf("no mount on / among %d mounts", len(ms))
	}
}

func TestParseFileMissing(t *testing.T) {
	if _, err := ParseFile(filepath.Join(t.TempDir(), "missing")); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("ParseFile of a missing file = %v, want ErrNotExist", err)
	}
}

func TestUnescape(t *testing.T) {
	for in, want := range map[string]string{
		`/a\040b\\c\01`: `/a b\\c\01`, // a backslash without three octal digits stays
		`plain`:         `plain`,
		`\011tab\012`:   "\ttab\n",
		`\0`:            `\0`,
		`\08a`:          `\08a`,
	} {
		t.Run(in, func(t *testing.T) {
			if got := Unescape(in); got != want {
				t.Errorf("Unescape(%q) = %q, want %q", in, got, want)
			}
		})
	}
}

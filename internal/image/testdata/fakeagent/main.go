// Command fakeagent stands in for forkd-agent in the image tests' boots: as
// /init it loads the modules /etc/forkd/modules lists, mounts the root
// filesystem forkd.root names (read-only), checks forkd.python exists,
// reports on the console and powers the VM off.
package main

import (
	"fmt"
	"os"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

func main() {
	con, err := os.OpenFile("/dev/console", os.O_WRONLY, 0)
	if err != nil {
		con = os.Stdout
	}
	say := func(format string, args ...any) { fmt.Fprintf(con, "FORKD-TEST "+format+"\n", args...) }
	defer func() {
		time.Sleep(100 * time.Millisecond)
		unix.Sync()
		unix.Reboot(unix.LINUX_REBOOT_CMD_POWER_OFF)
	}()
	_ = unix.Mount("devtmpfs", "/dev", "devtmpfs", 0, "")
	_ = unix.Mount("proc", "/proc", "proc", 0, "")
	_ = unix.Mount("sysfs", "/sys", "sysfs", 0, "")

	list, err := os.ReadFile("/etc/forkd/modules")
	if err != nil {
		say("error modules list: %v", err)
		return
	}
	loaded := 0
	for _, m := range strings.Fields(string(list)) {
		f, err := os.Open("/lib/modules/" + m)
		if err != nil {
			say("error open %s: %v", m, err)
			return
		}
		flags := 0
		if !strings.HasSuffix(m, ".ko") {
			flags = unix.MODULE_INIT_COMPRESSED_FILE
		}
		err = unix.FinitModule(int(f.Fd()), "", flags)
		f.Close()
		if err != nil && err != unix.EEXIST {
			say("error load %s: %v", m, err)
			return
		}
		loaded++
	}
	say("modules=%d", loaded)

	cmdline, _ := os.ReadFile("/proc/cmdline")
	args := map[string]string{}
	for _, f := range strings.Fields(string(cmdline)) {
		if k, v, ok := strings.Cut(f, "="); ok {
			args[k] = v
		}
	}
	if _, err := os.Stat("/bin/busybox"); err == nil {
		say("busybox=yes")
	}
	root := args["forkd.root"]
	if root == "" {
		say("done")
		return
	}
	for i := 0; i < 100; i++ {
		if _, err := os.Stat(root); err == nil {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err := unix.Mount(root, "/mnt", args["forkd.rootfstype"], unix.MS_RDONLY, ""); err != nil {
		say("error mount %s: %v", root, err)
		return
	}
	say("root=mounted")
	if py := args["forkd.python"]; py != "" {
		if fi, err := os.Stat("/mnt" + py); err == nil && fi.Mode()&0o111 != 0 {
			say("python=ok")
		} else {
			say("error python %s: %v", py, err)
			return
		}
	}
	say("done")
}

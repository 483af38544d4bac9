package doctor

import (
	"context"
	"debug/elf"
	"os/user"
	"strings"
)

// imageTools checks the host commands images are built with.
func (r *run) imageTools(ctx context.Context) Check {
	tools := []struct{ cmd, pkg, why string }{
		{"dpkg-deb", "dpkg", "extracting the guest kernel"},
		{"apt-get", "apt", "downloading the guest kernel"},
		{"busybox", "busybox-static", "the minimal image"},
		{"mkfs.ext4", "e2fsprogs", "rootfs images"},
		{"debootstrap", "debootstrap", "the python image"},
		{"qemu-img", "qemu-utils", "sandboxes with a writable disk, fork --disk-mib"},
	}
	var missing, pkgs, why []string
	for _, t := range tools {
		if _, err := r.opts.LookPath(t.cmd); err != nil {
			missing = append(missing, t.cmd)
			pkgs = append(pkgs, t.pkg)
			why = append(why, t.why)
		}
	}
	if len(missing) > 0 {
		st := Warn
		if missing[0] == "dpkg-deb" || missing[0] == "apt-get" {
			st = Fail // no kernel, no image at all
		}
		return Check{Status: st, Detail: "missing " + strings.Join(missing, ", ") + " (needed for " + strings.Join(why, "; ") + ")",
			Hint: "apt-get install " + strings.Join(pkgs, " ")}
	}
	return Check{Status: Pass, Detail: "dpkg-deb, apt-get, busybox, mkfs.ext4, debootstrap and qemu-img found"}
}

// agent checks the forkd-agent binary put into every image.
func (r *run) agent(ctx context.Context) Check {
	p := r.opts.AgentPath
	if p == "" {
		return Check{Status: Skip, Detail: "no agent path given"}
	}
	f, err := elf.Open(p)
	if err != nil {
		return Check{Status: Fail, Detail: "forkd-agent at " + p + ": " + err.Error(),
			Hint: "build it (make build) or set FORKD_AGENT"}
	}
	defer f.Close()
	for _, prog := range f.Progs {
		if prog.Type == elf.PT_INTERP {
			return Check{Status: Fail, Detail: p + " is dynamically linked; the guest has no libc for it",
				Hint: "build it with CGO_ENABLED=0 (make build)"}
		}
	}
	return Check{Status: Pass, Detail: p + " (static)"}
}

// vmmUser checks the unprivileged user VMMs drop to.
func (r *run) vmmUser(ctx context.Context) Check {
	u := r.opts.VMMUser
	switch {
	case r.opts.EUID() != 0:
		return Check{Status: Skip, Detail: "not root: QEMU runs as this user"}
	case u == "":
		return Check{Status: Warn, Detail: "QEMU runs as root (FORKD_VMM_USER=-)",
			Hint: "unset FORKD_VMM_USER so QEMU drops to forkd-vmm after opening its files"}
	}
	if _, err := user.Lookup(u); err != nil {
		return Check{Status: Fail, Detail: "VMM user " + u + " does not exist", Hint: "useradd --system --no-create-home --shell /usr/sbin/nologin " + u}
	}
	if u == "nobody" {
		return Check{Status: Warn, Detail: "QEMU drops to nobody, a user other daemons share",
			Hint: "useradd --system --no-create-home --shell /usr/sbin/nologin forkd-vmm"}
	}
	return Check{Status: Pass, Detail: "QEMU drops to " + u + " and chroots into an empty directory once its files are open"}
}

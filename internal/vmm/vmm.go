// Package vmm defines the small interface every virtual machine monitor
// backend implements, and the specs that describe what to start.
//
// A Backend starts Machines in two ways: Boot (a fresh VM whose RAM lives in a
// file that can become a snapshot) and Restore (a VM whose RAM is mapped
// copy-on-write from a snapshot's memory file, with its device state loaded).
// Attach re-adopts a Machine started earlier, possibly by another process,
// from its persisted Handle: VMs run detached from whoever started them.
//
// Nothing here names QMP, HTTP or any other backend protocol. Backends are
// chosen in one factory (package vmm/backend), never by init side effects.
package vmm

import (
	"context"
	"errors"
	"net"
	"os"
	"time"

	"github.com/forkd/forkd/internal/proc"
)

// Backend starts and re-adopts machines of one VMM kind.
type Backend interface {
	// Name is the backend's stable name ("qemu", "firecracker").
	Name() string

	// Version returns the VMM's version string, recorded in snapshots: a
	// snapshot only restores under the same backend and version line.
	Version(ctx context.Context) (string, error)

	// Capabilities says which optional behaviour the backend has.
	Capabilities() Capabilities

	// Boot starts a fresh VM. It returns once the VMM process runs and its
	// control channel answers; the guest may still be booting. If
	// spec.MemoryFile is set, guest RAM is a shared mapping of that file (or
	// is written there by SaveState, see Capabilities.BootMemoryInFile).
	// On error nothing is left running.
	Boot(ctx context.Context, spec BootSpec) (Machine, error)

	// Restore starts a VM from a saved snapshot: RAM mapped privately
	// (copy-on-write) from spec.MemoryFile, device state loaded from
	// spec.StateFile, and the guest resumed. It returns once the guest
	// runs. The memory file is never written. On error nothing is left
	// running.
	Restore(ctx context.Context, spec RestoreSpec) (Machine, error)

	// Attach re-adopts a machine from its Handle. It fails with a
	// NotFound-class error when that VMM process is gone.
	Attach(ctx context.Context, h Handle) (Machine, error)
}

// Machine is one running VM. Methods are safe for concurrent use unless
// noted. After Stop returns, every method but Handle, Stop and Wait fails
// with an error of class FailedPrecondition.
type Machine interface {
	// Handle returns what is needed to Attach to this machine later.
	Handle() Handle

	// Pause stops the guest's vCPUs. Idempotent.
	Pause(ctx context.Context) error

	// Resume restarts the guest's vCPUs. Idempotent.
	Resume(ctx context.Context) error

	// SaveState writes the machine's device state to spec.StateFile. The
	// machine must be paused. RAM is not included when it already lives in
	// a file (Capabilities.BootMemoryInFile); otherwise it is written to
	// spec.MemoryFile. The machine stays paused.
	SaveState(ctx context.Context, spec SaveSpec) error

	// Memory describes where guest RAM is mapped in the VMM process, so a
	// caller can find the pages the guest wrote (via /proc/PID/pagemap).
	Memory(ctx context.Context) (MemoryMap, error)

	// DialAgent connects to the guest agent's channel. The caller owns
	// the connection; at most one is served at a time, later ones queue.
	DialAgent(ctx context.Context) (net.Conn, error)

	// Stop ends the VMM process and removes its runtime files. Idempotent;
	// safe on a machine whose process already died.
	Stop(ctx context.Context) error

	// Wait blocks until the VMM process exits or ctx ends.
	Wait(ctx context.Context) (ExitStatus, error)
}

// RestoreChecker is implemented by backends that can tell, from a
// snapshot's machine identity alone (the Config a Machine's Handle
// returned), whether they can restore that snapshot on this host. It is
// what a snapshot from elsewhere (pulled from a registry) is judged by
// before anything else of it is read.
type RestoreChecker interface {
	// CheckRestore starts nothing and reads no file. A config that is
	// malformed, out of range or not one this backend would have made
	// is InvalidArgument; one made by another VMM version line, under
	// another accelerator, or for a CPU this host lacks is
	// FailedPrecondition, the message saying which.
	CheckRestore(ctx context.Context, config []byte) error
}

// Parker is implemented by backends that can start a VMM process ahead of
// time and restore into it later, cutting process start-up off the fork
// path.
type Parker interface {
	// Park starts a VMM process ready to receive spec's snapshot.
	Park(ctx context.Context, spec ParkSpec) (Parked, error)
}

// Parked is a VMM process waiting for a snapshot.
type Parked interface {
	// Handle identifies the parked process (as Machine.Handle does).
	Handle() Handle
	// Restore loads the snapshot into the parked process and resumes it.
	// A Parked is used at most once.
	Restore(ctx context.Context, spec RestoreSpec) (Machine, error)
	// Discard stops the parked process. Idempotent.
	Discard(ctx context.Context) error
}

// DeviceSaver is implemented by machines that can save their device state
// without their RAM: with it a caller branches a running child into a new
// snapshot, capturing the guest's RAM itself (Memory gives the mapping; the
// pages the child wrote are its private pages in /proc/PID/pagemap).
type DeviceSaver interface {
	// SaveDevices writes the machine's device state, and nothing of its
	// RAM, to spec.StateFile, atomically (it is complete or absent). The
	// machine must be paused (FailedPrecondition otherwise) and stays
	// paused; guest RAM is neither read nor written, so a caller may copy
	// it before or after, as long as the machine is not resumed in
	// between. Backend.Restore (and Parked.Restore) given this StateFile,
	// a MemoryFile holding the guest's RAM as it is while paused, and the
	// Config of the snapshot named in spec.BaseState restores the machine
	// as it was at the pause. A malformed BaseState is InvalidArgument, a
	// missing one NotFound. Other control calls on the machine wait while
	// it runs. As for SaveState, close agent connections first: the
	// device state records whether the agent channel is connected.
	SaveDevices(ctx context.Context, spec DeviceSaveSpec) error
}

// CPUReader is implemented by machines that can tell where each of their
// guest's vCPUs is: what a caller reports of a guest that does not answer,
// and how it tells one waiting for an interrupt that never comes.
type CPUReader interface {
	// CPUs returns the state of each vCPU, in order.
	CPUs(ctx context.Context) ([]CPU, error)
}

// CPU is one vCPU's state: its instruction pointer, and whether it is
// halted (waiting for an interrupt).
type CPU struct {
	PC     uint64
	Halted bool
}

// DeviceSaveSpec says what SaveDevices writes and what it builds on.
type DeviceSaveSpec struct {
	// StateFile is written atomically (temporary file in its directory,
	// fsync, rename).
	StateFile string
	// BaseState is the state file of the snapshot the machine was
	// restored from, or of any snapshot of its lineage (all share one
	// machine identity). It is only read: a backend may reuse parts of it
	// that do not change while a machine runs (QEMU: its configuration and
	// firmware ROM contents).
	BaseState string
}

// LiveSaver is implemented by machines that can be saved whole, RAM
// included, while the guest keeps running: the backend copies RAM in
// rounds while tracking the pages the guest dirties, then pauses the guest
// only to copy the last ones and the device state.
type LiveSaver interface {
	// SaveLive saves the running machine: every page of guest RAM goes to
	// spec.Page, the device state to spec.StateFile (atomically). A memory
	// file holding every page as last delivered, with spec.StateFile and
	// the machine's Handle().Config, restores the machine as it was at the
	// end of the save (Backend.Restore). The machine must be running
	// (FailedPrecondition otherwise) with RAM of its own: a booted parent,
	// whose RAM is its memory file, is FailedPrecondition too (Pause and
	// SaveState it instead).
	//
	// Whatever the outcome, the machine is running when SaveLive returns,
	// spec.Page is no longer called, and on error spec.StateFile is
	// untouched. An error from spec.Page ends the save with that error.
	// Past spec.Timeout (or when ctx ends) the save is abandoned: class
	// DeadlineExceeded (or ctx's error). Other control calls on the
	// machine (Pause, Resume, SaveState) wait while it runs, and may time
	// out; the guest agent stays reachable, but as for SaveDevices its
	// connections are best closed first.
	SaveLive(ctx context.Context, spec LiveSaveSpec) (LiveStats, error)
}

// LiveSaveSpec says where SaveLive puts the machine and how long it may
// pause it.
type LiveSaveSpec struct {
	// StateFile receives the device state.
	StateFile string
	// Disks are switched to new overlays (as DiskSnapshotter.SnapshotDisk
	// does) during the final pause, so that each disk's image as it was at
	// the switch-over stays with the saved state; the machine must then be
	// a DiskSnapshotter. An error from one fails the save.
	Disks []DiskSnapshot
	// Page receives guest RAM: the page at byte offset guestOffset of the
	// memory file (a multiple of 4096), data its 4096 bytes, or nil for a
	// page of zeros. Every page comes at least once; one the guest
	// rewrote comes again, and the last call for an offset wins. Calls
	// come one at a time, never concurrently, and all before SaveLive
	// returns; data is only valid during the call. Keep it fast: the
	// final pause may wait for it to take the last pages.
	Page func(guestOffset uint64, data []byte) error
	// MaxDowntime is the longest the guest should be paused for the final
	// copy (default 50 ms). It is a target: a guest that dirties memory
	// faster than it can be copied is slowed down, and past three
	// quarters of Timeout the rest is copied in one longer pause.
	MaxDowntime time.Duration
	// Timeout bounds the whole save (default 2 minutes).
	Timeout time.Duration
}

// LiveStats describe a finished live save.
type LiveStats struct {
	// Downtime is how long the guest was paused: the final copy, any
	// check of it, and the time until the guest was resumed.
	Downtime time.Duration
	// Total is the time from the start of the copy to its end.
	Total time.Duration
	// Transferred is how many bytes of RAM were copied, repeats included.
	Transferred int64
	// Pages is how many pages went to LiveSaveSpec.Page, repeats included.
	Pages int64
	// Resent is how many of those a final check of the paused guest's
	// RAM sent again because the VMM's dirty tracking had missed their
	// last change (QEMU 7.2 under TCG).
	Resent int64
}

// DiskSnapshotter is implemented by machines whose writable disks can be
// frozen while the machine runs on: the disk's current image becomes the
// read-only backing file of a new overlay that takes the guest's writes
// from then on, so that the current image can be kept (hard-linked under a
// stable name) as a layer other machines start from.
type DiskSnapshotter interface {
	// SnapshotDisk makes the qcow2 image at overlay the top of disk
	// index: the guest's writes go there from now on, its reads fall
	// through to the disk's current image. The overlay must exist, be
	// empty, and name the disk's current image (by a path that stays
	// valid) as its backing file, which is left as it is in its header.
	// The machine must be paused (FailedPrecondition otherwise), so that
	// the current image is complete: every write the guest was told was
	// done is in it. It stays paused. A disk that is read-only or out of
	// range is InvalidArgument. Not idempotent: each call stacks one more
	// overlay.
	SnapshotDisk(ctx context.Context, index int, overlay string) error
	// ResizeDisk sets disk index's size to bytes and tells the guest, which
	// sees the new capacity at once (its device raises a configuration
	// change). A restored machine's guest knows the size its snapshot's
	// disk had, whatever the size of the image it was restored with, until
	// this is called. Growing a qcow2 or raw image grows the file.
	ResizeDisk(ctx context.Context, index int, bytes int64) error
}

// DiskSwitchChecker is implemented by DiskSnapshotters that can tell later,
// from another process too, whether a switch whose outcome was unknown
// (ErrDiskSwitch, or a crash of its caller) was made.
type DiskSwitchChecker interface {
	// DiskSwitched reports whether overlay is the top of disk index: true
	// when SnapshotDisk (or a SaveLive given it) made it the top and no
	// later switch stacked another over it, false when the top is any
	// other image. It is an error when it cannot tell: the disk is absent
	// (InvalidArgument), the machine does not answer, or its top was set
	// in a way it cannot match to overlay. It changes nothing; the
	// machine may be running.
	DiskSwitched(ctx context.Context, index int, overlay string) (bool, error)
}

// ErrDiskSwitch is in the chain of an error of SnapshotDisk, or of a
// SaveLive given Disks, after which a disk may have been switched to its
// new overlay, or was although the call failed later: which image the
// machine writes to is unknown. Without it, a failed call switched none.
var ErrDiskSwitch = errors.New("the disk may have been switched to its new overlay")

// DiskSnapshot names a disk and the overlay that becomes its top.
type DiskSnapshot struct {
	Index   int
	Overlay string
}

// Capabilities lists optional behaviour of a backend.
type Capabilities struct {
	// BootMemoryInFile: a booted machine's RAM is a shared mapping of
	// BootSpec.MemoryFile, so SaveState writes device state only.
	BootMemoryInFile bool `json:"boot_memory_in_file"`
	// Park: the backend implements Parker.
	Park bool `json:"park"`
	// Accelerator in use: "kvm" or "tcg".
	Accelerator string `json:"accelerator"`
}

// Handle is the persisted identity of a running machine.
type Handle struct {
	Backend string        `json:"backend"`
	Process proc.Identity `json:"process"`
	// RunDir holds the machine's sockets and logs; it is removed by Stop.
	RunDir string `json:"run_dir"`
	// Config is the backend's own description of the machine (for QEMU,
	// its argv identity), opaque to callers.
	Config []byte `json:"config,omitempty"`
}

// Resources are the machine's shape; snapshot and child must agree.
type Resources struct {
	MemoryMiB int `json:"memory_mib"`
	VCPUs     int `json:"vcpus"`
}

// Disk is a block device given to the guest. Index 0 is the guest's
// /dev/vda.
type Disk struct {
	Path     string `json:"path"`
	ReadOnly bool   `json:"read_only"`
	// Format is the image format: "raw" (or "") or "qcow2". A qcow2
	// image's backing files are opened by the paths its header names,
	// when the VMM starts.
	Format string `json:"format,omitempty"`
	// SharedBacking: the qcow2 image's backing files are opened without
	// taking QEMU's image locks, as others use them too: they are never
	// written, but the machine whose disk one was (SnapshotDisk) may still
	// hold it open for writing. Only for an image with a backing file.
	SharedBacking bool `json:"shared_backing,omitempty"`
	// Serial is the serial number the guest reads from the device
	// (virtio-blk: /sys/block/vdX/serial, at most 20 bytes). It is part of
	// the machine's identity: given at Boot, it is kept in the machine's
	// Config, and a Restore's own Serial is ignored.
	Serial string `json:"serial,omitempty"`
}

// Disk formats.
const (
	FormatRaw   = "raw"
	FormatQCOW2 = "qcow2"
)

// NIC attaches the guest to a tap device in the netns the VMM runs in.
type NIC struct {
	Tap string `json:"tap"`
	MAC string `json:"mac"`
}

// Launch is how the VMM process is placed on the host.
type Launch struct {
	// NetNS, if set, is a path (/run/netns/NAME) the VMM starts inside.
	NetNS string
	// CgroupFD, if > 0, is a cgroup v2 directory fd the VMM starts in.
	CgroupFD int
	// Enter are thread-bound steps (such as joining cgroup v1 groups by
	// thread id) run on the locked OS thread that forks the VMM, after
	// entering NetNS; each returns its undo, run once the VMM started.
	Enter []EnterFunc
	// User, if set, is the unprivileged user the VMM drops to once it has
	// opened its files, before it runs guest code.
	User string
}

// EnterFunc moves the calling (locked) OS thread into some host context
// and returns how to move it back.
type EnterFunc func() (restore func() error, err error)

// BootSpec describes a fresh VM.
type BootSpec struct {
	Name      string // for logs and process titles
	RunDir    string // created by the backend if missing; removed by Stop
	Resources Resources
	Kernel    string
	Initrd    string
	Cmdline   []string
	Disks     []Disk
	NICs      []NIC
	// MemoryFile, if set, backs guest RAM (see Backend.Boot). Empty means
	// anonymous RAM: the machine can run but not be snapshotted.
	MemoryFile string
	// ConsoleLog, if set, receives the guest's serial console.
	ConsoleLog string
	Launch     Launch
}

// RestoreSpec describes a VM restored from a snapshot.
type RestoreSpec struct {
	Name   string
	RunDir string
	// Config is the snapshot's machine identity as returned by
	// Machine.Handle().Config of the machine it was saved from.
	Config     []byte
	MemoryFile string
	StateFile  string
	Disks      []Disk
	NICs       []NIC
	// Hold are files the VMM process keeps open for its whole life (a
	// snapshot's reference lock); the caller may close its copies once
	// Restore returns.
	Hold   []*os.File
	Launch Launch
}

// ParkSpec is the part of a RestoreSpec known before the device state is
// loaded.
type ParkSpec struct {
	Name       string
	RunDir     string
	Config     []byte
	MemoryFile string
	Disks      []Disk
	NICs       []NIC
	Hold       []*os.File
	Launch     Launch
}

// SaveSpec says where SaveState writes.
type SaveSpec struct {
	StateFile  string
	MemoryFile string
}

// MemoryMap locates guest RAM inside the VMM process.
type MemoryMap struct {
	PID int
	// Regions are the host virtual address ranges holding guest RAM, in
	// guest-physical order.
	Regions []Region
	// File is the file the RAM is mapped from ("" for anonymous).
	File string
}

// Region is one contiguous mapping of guest RAM.
type Region struct {
	HostAddr  uint64
	GuestAddr uint64
	Size      uint64
}

// ExitStatus describes how a VMM process ended, as far as is known.
type ExitStatus struct {
	Exited   bool
	Code     int    // valid when Exited and known
	Signal   string // e.g. "killed", when known
	Known    bool   // false when the process was not our child
	ExitedAt time.Time
}

package cli

import (
	"strings"

	"github.com/spf13/cobra"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/request"
	"github.com/forkd/forkd/internal/sandbox"
)

// batchFlags are the flags fork and spawn share: the snapshot, how many
// children, what is recorded with each, their network and limits. They
// fill the API's create request.
type batchFlags struct {
	req  apiv1.CreateSandboxesRequest
	iso  isoFlags
	meta []string
}

// register adds the flags to cmd; one and many name the children in the
// help ("child", "children").
func (b *batchFlags) register(cmd *cobra.Command, one, many string) {
	f := cmd.Flags()
	f.StringVar(&b.req.SnapshotTag, "tag", "", "snapshot to fork")
	f.IntVarP(&b.req.N, "n", "n", 1, "number of "+many)
	f.BoolVar(&b.req.KeepPartial, "keep-partial", false, "keep the "+many+" that came up when others failed")
	b.iso.register(f)
	// The original forkd's flag; here every child of a snapshot with a NIC
	// has its own network namespace already.
	f.Bool("per-child-netns", false, "accepted for scripts written for the original forkd: every child already has its own network namespace")
	_ = f.MarkHidden("per-child-netns") // just added
	f.StringArrayVar(&b.meta, "metadata", nil, "KEY=VALUE recorded with each "+one+" (repeatable)")
	f.IntVar(&b.req.DiskMiB, "disk-mib", 0, "a writable disk of this many MiB per "+one+" (64 to 1048576): files written to the root file system go there instead of guest RAM (not /tmp); branches carry it, copy-on-write")
	f.StringVar(&b.req.OnUnresponsive, "on-unresponsive", "", "when the "+one+"'s agent stops answering: keep (marked unresponsive) or kill (default: the daemon's --unresponsive, else keep)")
	f.IntVar(&b.req.IdleFreezeSecs, "idle-freeze-secs", 0, "seconds without requests or inbound traffic before the daemon freezes each "+one+" (any request wakes it): 1 to 86400, 0 the daemon's --idle-freeze, -1 never")
}

// request checks the flags and returns the create request they make.
func (b *batchFlags) request() (apiv1.CreateSandboxesRequest, error) {
	md, err := parseKV(b.meta, "--metadata")
	if err != nil {
		return b.req, err
	}
	b.req.Metadata = md
	if b.req.N < 1 {
		return b.req, errdefs.InvalidArgument("-n %d: want at least 1", b.req.N)
	}
	if b.req.SnapshotTag == "" {
		return b.req, errdefs.InvalidArgument("--tag is required: the snapshot to fork")
	}
	if err := b.iso.apply(&b.req); err != nil {
		return b.req, err
	}
	// Checked as the daemon will, before anything is touched; the daemon
	// may allow fewer children per request.
	if _, err := request.ForkSpec(&b.req, sandbox.DefaultMaxChildren); err != nil {
		return b.req, err
	}
	return b.req, nil
}

// parseKV parses KEY=VALUE flags.
func parseKV(kvs []string, flag string) (map[string]string, error) {
	if len(kvs) == 0 {
		return nil, nil
	}
	out := make(map[string]string, len(kvs))
	for _, kv := range kvs {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			return nil, errdefs.InvalidArgument("%s %q: want KEY=VALUE", flag, kv)
		}
		out[k] = v
	}
	return out, nil
}

// forkRequest is the fork-from-a-sandbox request the flags make, with the
// branch mode: the same options, checked as the daemon will.
func (b *batchFlags) forkRequest(mode string) (apiv1.ForkRequest, error) {
	req := b.req
	req.SnapshotTag = "from-sandbox" // checked by ForkFrom, not sent
	b.req = req
	if _, err := b.request(); err != nil {
		return apiv1.ForkRequest{}, err
	}
	req = b.req
	fr := apiv1.ForkRequest{Count: req.N, Mode: mode, TimeoutSecs: req.TimeoutSecs, Metadata: req.Metadata,
		Limits: req.Limits, Network: req.Network, KeepPartial: req.KeepPartial, OnUnresponsive: req.OnUnresponsive,
		DiskMiB: req.DiskMiB, IdleFreezeSecs: req.IdleFreezeSecs}
	if _, _, err := request.ForkFrom(&fr, sandbox.DefaultMaxChildren); err != nil {
		return fr, err
	}
	return fr, nil
}

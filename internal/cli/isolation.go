package cli

import (
	"math"
	"strconv"
	"strings"

	"github.com/spf13/pflag"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/request"
)

// isoFlags are the network and limit flags of fork and spawn. They fill
// the API's create request; the local path validates it the way the
// daemon does (request.ForkSpec).
type isoFlags struct {
	egress    string
	allow     []string
	publish   []int
	memoryMiB int
	cpus      float64
	pids      int
	guestPIDs int
	ioWeight  int
	ioReadMB  float64
	ioWriteMB float64
}

func (f *isoFlags) register(fs *pflag.FlagSet) {
	fs.StringVar(&f.egress, "egress", "", "egress policy: allow (default), deny or allowlist; private, link-local and metadata ranges stay denied unless --allow names them")
	fs.StringArrayVar(&f.allow, "allow", nil, "egress destination CIDR[:PROTO[:PORTS]], e.g. 198.51.100.0/24 or 1.1.1.1/32:udp:53 (repeatable)")
	fs.IntSliceVar(&f.publish, "publish", nil, "guest TCP port to publish on a host port (repeatable)")
	fs.IntVar(&f.memoryMiB, "memory-limit-mib", 0, "host memory limit per sandbox, VMM included (over it: killed, status oom)")
	fs.Float64Var(&f.cpus, "cpus", 0, "CPU limit per sandbox, in cores: 0.01 to 1024 (e.g. 0.5; 0 = no limit)")
	fs.IntVar(&f.pids, "pids-limit", 0, "task limit of each sandbox's VMM process")
	fs.IntVar(&f.guestPIDs, "guest-pids-limit", 0, "limit on processes and threads inside each guest, 16 to 4194304 (0: the guest's default, 1 per 512 KiB of its memory)")
	fs.IntVar(&f.ioWeight, "io-weight", 0, "relative disk share, 1 to 10000 (needs a CFQ/BFQ scheduler on cgroup v1)")
	fs.Float64Var(&f.ioReadMB, "io-read-mbps", 0, "disk read limit per sandbox, MB/s (0 = no limit)")
	fs.Float64Var(&f.ioWriteMB, "io-write-mbps", 0, "disk write limit per sandbox, MB/s (0 = no limit)")
}

// apply sets req's network and limits from the flags.
func (f *isoFlags) apply(req *apiv1.CreateSandboxesRequest) error {
	if f.egress != "" || len(f.allow) > 0 || len(f.publish) > 0 {
		ns := &apiv1.NetworkSpec{Egress: f.egress, Publish: f.publish}
		for _, a := range f.allow {
			r, err := parseRule(a)
			if err != nil {
				return err
			}
			ns.Allow = append(ns.Allow, r)
		}
		req.Network = ns
	}
	if err := request.CheckCPUs("--cpus", f.cpus); err != nil {
		return err
	}
	read, err := bytesPerSecond("--io-read-mbps", f.ioReadMB)
	if err != nil {
		return err
	}
	write, err := bytesPerSecond("--io-write-mbps", f.ioWriteMB)
	if err != nil {
		return err
	}
	req.MemoryLimitMiB, req.CPUs, req.PIDsLimit = f.memoryMiB, f.cpus, f.pids
	req.GuestPIDsLimit = f.guestPIDs
	req.IOWeight = f.ioWeight
	req.IOReadBps, req.IOWriteBps = read, write
	return nil
}

// bytesPerSecond converts the MB/s of flag to bytes per second, checking
// the float before converting: 0 is no limit; a rate that would overflow,
// or round to 0 and so silently mean no limit, is refused.
func bytesPerSecond(flag string, mbps float64) (int64, error) {
	if mbps == 0 {
		return 0, nil
	}
	const maxMBps = request.MaxIOBps / 1e6
	if !(mbps > 0 && mbps <= maxMBps) || math.Round(mbps*1e6) < 1 {
		return 0, errdefs.InvalidArgument("%s %g: want 0 (no limit) or 0.000001 to %g MB/s", flag, mbps, float64(maxMBps))
	}
	return int64(math.Round(mbps * 1e6)), nil
}

// parseRule parses CIDR[:PROTO[:PORTS]] (PORTS: comma-separated ports or
// ranges).
func parseRule(s string) (apiv1.NetworkRule, error) {
	parts := strings.Split(s, ":")
	if len(parts) > 3 || parts[0] == "" {
		return apiv1.NetworkRule{}, errdefs.InvalidArgument("--allow %q: want CIDR[:PROTO[:PORTS]]", s)
	}
	r := apiv1.NetworkRule{CIDR: parts[0]}
	if !strings.Contains(r.CIDR, "/") {
		r.CIDR += "/32"
	}
	if len(parts) > 1 {
		r.Proto = parts[1]
	}
	if len(parts) > 2 {
		for _, p := range strings.Split(parts[2], ",") {
			if p != "" {
				r.Ports = append(r.Ports, p)
			}
		}
	}
	return r, nil
}

// portArg parses a port argument.
func portArg(s string) (int, error) {
	p, err := strconv.Atoi(s)
	if err != nil || p < 1 || p > 65535 {
		return 0, errdefs.InvalidArgument("port %q: want 1 to 65535", s)
	}
	return p, nil
}

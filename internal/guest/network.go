package guest

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Kernel command line keys of the guest's network. The host passes them to
// the parent only; children inherit the configured interface.
const (
	KeyIP  = "forkd.ip"  // address/prefix of the first NIC, e.g. 172.16.0.2/30
	KeyGW  = "forkd.gw"  // default gateway
	KeyDNS = "forkd.dns" // comma-separated resolvers for /etc/resolv.conf
)

// netConfig is the guest's static network configuration.
type netConfig struct {
	addr netip.Prefix
	gw   netip.Addr
	dns  []netip.Addr
}

// parseNetConfig reads the network keys; ok is false when there are none.
func parseNetConfig(cmdline map[string]string) (cfg netConfig, ok bool, err error) {
	ip := cmdline[KeyIP]
	if ip == "" {
		return cfg, false, nil
	}
	if cfg.addr, err = netip.ParsePrefix(ip); err != nil || !cfg.addr.Addr().Is4() {
		return cfg, false, fmt.Errorf("%s=%q: want an IPv4 address/prefix", KeyIP, ip)
	}
	if gw := cmdline[KeyGW]; gw != "" {
		if cfg.gw, err = netip.ParseAddr(gw); err != nil || !cfg.gw.Is4() {
			return cfg, false, fmt.Errorf("%s=%q: want an IPv4 address", KeyGW, gw)
		}
	}
	for _, d := range strings.Split(cmdline[KeyDNS], ",") {
		if d == "" {
			continue
		}
		a, err := netip.ParseAddr(d)
		if err != nil {
			return cfg, false, fmt.Errorf("%s: %q is not an address", KeyDNS, d)
		}
		cfg.dns = append(cfg.dns, a)
	}
	return cfg, true, nil
}

// configureNetwork waits for the first ethernet interface, turns IPv6 off
// on it, gives it cfg's address, brings it up and adds the default route,
// over rtnetlink.
func configureNetwork(cfg netConfig, wait time.Duration) error {
	name, err := firstEther(wait)
	if err != nil {
		return err
	}
	idx, err := ifIndex(name)
	if err != nil {
		return err
	}
	// IPv4 only, like the host's end of the link and the egress policy,
	// which drop IPv6. With it on, each child, once its link's carrier
	// is back after the restore, would configure a link-local address
	// (duplicate address detection, multicast listener reports) and then
	// solicit a router for ever, backing off to once an hour: packets
	// nobody receives, timers that wake an idle child, and under TCG code
	// every child translates. Loopback keeps ::1.
	err = os.WriteFile("/proc/sys/net/ipv6/conf/"+name+"/disable_ipv6", []byte("1"), 0)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("IPv6 off on %s: %w", name, err)
	}
	if err := setUp(name); err != nil {
		return fmt.Errorf("%s up: %w", name, err)
	}
	nl, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_ROUTE)
	if err != nil {
		return err
	}
	defer unix.Close(nl)
	if err := unix.Bind(nl, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return err
	}
	a := cfg.addr.Addr().As4()
	addr := make([]byte, 8)
	addr[0] = unix.AF_INET
	addr[1] = byte(cfg.addr.Bits())
	binary.NativeEndian.PutUint32(addr[4:], uint32(idx))
	addr = appendAttr(addr, unix.IFA_LOCAL, a[:])
	addr = appendAttr(addr, unix.IFA_ADDRESS, a[:])
	if err := nlRequest(nl, unix.RTM_NEWADDR, addr); err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("address %s on %s: %w", cfg.addr, name, err)
	}
	if cfg.gw.IsValid() {
		g := cfg.gw.As4()
		oif := make([]byte, 4)
		binary.NativeEndian.PutUint32(oif, uint32(idx))
		rt := []byte{unix.AF_INET, 0, 0, 0, unix.RT_TABLE_MAIN, unix.RTPROT_BOOT, unix.RT_SCOPE_UNIVERSE, unix.RTN_UNICAST, 0, 0, 0, 0}
		rt = appendAttr(rt, unix.RTA_GATEWAY, g[:])
		rt = appendAttr(rt, unix.RTA_OIF, oif)
		if err := nlRequest(nl, unix.RTM_NEWROUTE, rt); err != nil && !errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("default route via %s: %w", cfg.gw, err)
		}
	}
	if len(cfg.dns) > 0 {
		var b strings.Builder
		for _, d := range cfg.dns {
			fmt.Fprintf(&b, "nameserver %s\n", d)
		}
		// Best effort: an image may keep /etc read-only or link it away.
		_ = os.WriteFile("/etc/resolv.conf", []byte(b.String()), 0o644)
	}
	return nil
}

// firstEther returns the first non-loopback interface, waiting up to wait
// for the NIC driver to register it.
func firstEther(wait time.Duration) (string, error) {
	deadline := time.Now().Add(wait)
	for {
		entries, _ := os.ReadDir("/sys/class/net")
		for _, e := range entries {
			if e.Name() != "lo" {
				return e.Name(), nil
			}
		}
		if time.Now().After(deadline) {
			return "", errors.New("no network interface appeared")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func ifIndex(name string) (int, error) {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return 0, err
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq(name)
	if err != nil {
		return 0, err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFINDEX, ifr); err != nil {
		return 0, err
	}
	return int(ifr.Uint32()), nil
}

// setUp sets IFF_UP on an interface.
func setUp(name string) error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq(name)
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return err
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	return unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr)
}

// appendAttr appends one rtattr (length, type, value, padding to 4).
func appendAttr(b []byte, typ uint16, val []byte) []byte {
	hdr := make([]byte, 4)
	binary.NativeEndian.PutUint16(hdr[0:], uint16(4+len(val)))
	binary.NativeEndian.PutUint16(hdr[2:], typ)
	b = append(b, hdr...)
	b = append(b, val...)
	for len(b)%4 != 0 {
		b = append(b, 0)
	}
	return b
}

// nlRequest sends one create request and waits for its acknowledgement.
func nlRequest(fd int, typ uint16, body []byte) error {
	msg := make([]byte, unix.NLMSG_HDRLEN, unix.NLMSG_HDRLEN+len(body))
	binary.NativeEndian.PutUint32(msg[0:], uint32(unix.NLMSG_HDRLEN+len(body)))
	binary.NativeEndian.PutUint16(msg[4:], typ)
	binary.NativeEndian.PutUint16(msg[6:], unix.NLM_F_REQUEST|unix.NLM_F_ACK|unix.NLM_F_CREATE|unix.NLM_F_EXCL)
	binary.NativeEndian.PutUint32(msg[8:], 1)
	msg = append(msg, body...)
	if err := unix.Sendto(fd, msg, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return err
	}
	buf := make([]byte, 4096)
	n, _, err := unix.Recvfrom(fd, buf, 0)
	if err != nil {
		return err
	}
	msgs, err := syscall.ParseNetlinkMessage(buf[:n])
	if err != nil {
		return err
	}
	for _, m := range msgs {
		if m.Header.Type == syscall.NLMSG_ERROR && len(m.Data) >= 4 {
			if code := int32(binary.NativeEndian.Uint32(m.Data[:4])); code != 0 {
				return unix.Errno(-code)
			}
			return nil
		}
	}
	return errors.New("no netlink acknowledgement")
}

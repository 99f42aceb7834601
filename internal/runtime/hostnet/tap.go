package hostnet

import (
	"errors"
	"fmt"
	"net"
	"os"
	goruntime "runtime"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/errdefs"
)

// The TAP device: one queue, plain Ethernet frames (no packet-info header,
// no virtio-net header, no offloads, so every frame carries full
// checksums), persistent.
//
// Persistent (TUNSETPERSIST) because the device must outlive any one
// descriptor: the gateway may restart and attach again, and under gVisor
// the sentry's packet socket is bound to the device before any gateway
// opened it. A persistent device still dies with its network namespace,
// and the namespace lives as long as a process, a bind mount or a TAP
// descriptor (which references the namespace it was opened in) holds it,
// so nothing of the link outlives the sandbox and the gateway's descriptor.
//
// Single queue: one descriptor at a time. A second attach while the first
// is open fails with EBUSY (reported as errdefs.ErrConflict) rather than
// splitting the sandbox's frames between two readers, one possibly dead.
const tapFlags = unix.IFF_TAP | unix.IFF_NO_PI

// CreateTAP creates the sandbox's NIC in the network namespace at nsPath
// (/proc/PID/ns/net, or a bind-mounted namespace file), or attaches to it
// if it exists, and (re)applies the link configuration: MAC SandboxMAC,
// MTU, address SandboxAddr/PrefixLen, up, default route via GatewayAddr,
// IPv6 off on the device, loopback up. It returns a descriptor of the TAP
// (non-blocking, close-on-exec) that carries one Ethernet frame per read
// and per write. Calling it again after that descriptor was closed returns
// a new descriptor of the same device; while one stays open it fails with
// errdefs.ErrConflict (after retrying for 3 s: see attachTAP).
//
// IPv6 is disabled on the device (its disable_ipv6 sysctl in that
// namespace, set before the link goes up): the sandbox kernel then sends
// no router solicitation, duplicate-address probe or MLD report, and
// accepts no IPv6. The link is IPv4 only for now.
//
// Nothing is added to the host's own network namespace: the device is
// created inside the target namespace by a thread that joined it, and that
// thread is discarded afterwards.
func CreateTAP(nsPath string) (*os.File, error) {
	return inNetNS(nsPath, func(ns netns.NsHandle) (*os.File, error) {
		f, err := attachTAP()
		if err != nil {
			return nil, err
		}
		if err := configure(ns); err != nil {
			f.Close()
			return nil, err
		}
		return f, nil
	})
}

// OpenTAP attaches a new descriptor to the sandbox's existing NIC in the
// namespace at nsPath, without changing its configuration. It is for a
// link whose addresses are not the kernel's to hold: runsc moves them from
// the device into gVisor's own stack, and putting them back would make the
// namespace's kernel answer for the sandbox. errdefs.ErrNotFound when the
// namespace has no such device; errdefs.ErrConflict while another
// descriptor is attached.
func OpenTAP(nsPath string) (*os.File, error) {
	return inNetNS(nsPath, func(ns netns.NsHandle) (*os.File, error) {
		h, err := netlink.NewHandleAt(ns, unix.NETLINK_ROUTE)
		if err != nil {
			return nil, fmt.Errorf("netlink in %s: %w", nsPath, err)
		}
		defer h.Close()
		link, err := h.LinkByName(IfName)
		if err != nil {
			return nil, fmt.Errorf("no %s in %s: %v: %w", IfName, nsPath, err, errdefs.ErrNotFound)
		}
		if _, ok := link.(*netlink.Tuntap); !ok {
			return nil, fmt.Errorf("%s in %s is a %s device, not a TAP: %w", IfName, nsPath, link.Type(), errdefs.ErrConflict)
		}
		return attachTAP()
	})
}

// inNetNS runs fn on an OS thread that has joined the network namespace
// at nsPath (see onThread).
func inNetNS(nsPath string, fn func(ns netns.NsHandle) (*os.File, error)) (*os.File, error) {
	ns, err := netns.GetFromPath(nsPath)
	if err != nil {
		return nil, fmt.Errorf("open network namespace %s: %w", nsPath, err)
	}
	defer ns.Close()
	// Never the host's own namespace (nor this process's, which is the
	// namespace of every thread the scheduler runs): a pid that was
	// reused, or a wrong path, must not put a device there.
	for _, own := range []string{"/proc/1/ns/net", "/proc/thread-self/ns/net"} {
		if o, err := netns.GetFromPath(own); err == nil {
			same := o.Equal(ns)
			o.Close()
			if same {
				return nil, fmt.Errorf("%s is the host's network namespace (%s): %w", nsPath, own, errdefs.ErrInvalidArgument)
			}
		}
	}
	type result struct {
		f   *os.File
		err error
	}
	done := make(chan result, 1)
	go func() {
		err := onThread(func() error { return unix.Setns(int(ns), unix.CLONE_NEWNET) }, func() {
			f, err := fn(ns)
			done <- result{f, err}
		})
		if err != nil {
			done <- result{err: fmt.Errorf("join network namespace %s: %w", nsPath, err)}
		}
	}()
	r := <-done
	return r.f, r.err
}

// onThread runs enter and then, if it succeeded, fn on a locked OS thread,
// and puts the thread back in the network namespace it started in. Only a
// thread that is back in its own namespace returns to the Go scheduler;
// one that could not be restored stays locked and ends with the calling
// goroutine (or, on the main thread, is parked by the runtime for good).
// The calling goroutine must do nothing after onThread returns.
func onThread(enter func() error, fn func()) error {
	goruntime.LockOSThread()
	orig, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(orig)
	if err := enter(); err != nil {
		if unix.Setns(orig, unix.CLONE_NEWNET) == nil {
			goruntime.UnlockOSThread()
		}
		return err
	}
	fn()
	if unix.Setns(orig, unix.CLONE_NEWNET) == nil {
		goruntime.UnlockOSThread()
	}
	return nil
}

// attachTAP opens /dev/net/tun and attaches it to IfName in the calling
// thread's network namespace (creating the device if it does not exist),
// and makes the device persistent.
func attachTAP() (*os.File, error) {
	// A descriptor this process closed a moment ago may still be held by
	// a child forked meanwhile that has not exec'd yet (a sandbox init
	// waiting for its user namespace's id maps holds a copy of every
	// descriptor until it execs): EBUSY from that clears within
	// milliseconds, so it is retried for a while before it is believed.
	deadline := time.Now().Add(3 * time.Second)
	for wait := 5 * time.Millisecond; ; wait = min(2*wait, 200*time.Millisecond) {
		f, err := attachTAPOnce()
		if err == nil || !errors.Is(err, errdefs.ErrConflict) || time.Now().After(deadline) {
			return f, err
		}
		time.Sleep(wait)
	}
}

func attachTAPOnce() (*os.File, error) {
	fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		return nil, fmt.Errorf("open /dev/net/tun: %w", err)
	}
	ifr, err := unix.NewIfreq(IfName)
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	ifr.SetUint16(tapFlags)
	if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
		unix.Close(fd)
		if errors.Is(err, unix.EBUSY) {
			return nil, fmt.Errorf("TAP %s: another descriptor is attached (close it first): %w", IfName, errdefs.ErrConflict)
		}
		return nil, fmt.Errorf("TAP %s: TUNSETIFF: %w", IfName, err)
	}
	if err := unix.IoctlSetInt(fd, unix.TUNSETPERSIST, 1); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("TAP %s: TUNSETPERSIST: %w", IfName, err)
	}
	// Non-blocking: os.NewFile registers it with the runtime poller, so
	// reads wait without a thread and honour deadlines.
	return os.NewFile(uintptr(fd), "tap:"+IfName), nil
}

// configure applies the link addressing to IfName in the calling thread's
// network namespace ns. Every step is idempotent.
func configure(ns netns.NsHandle) error {
	// Before the link goes up, so that IPv6 never starts on it. The net
	// sysctls under /proc/sys resolve in the opening thread's namespace.
	if err := os.WriteFile("/proc/sys/net/ipv6/conf/"+IfName+"/disable_ipv6", []byte("1"), 0); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("disable IPv6 on %s: %w", IfName, err)
	}
	h, err := netlink.NewHandleAt(ns, unix.NETLINK_ROUTE)
	if err != nil {
		return fmt.Errorf("netlink: %w", err)
	}
	defer h.Close()
	link, err := h.LinkByName(IfName)
	if err != nil {
		return fmt.Errorf("find %s: %w", IfName, err)
	}
	mac, _ := net.ParseMAC(SandboxMAC)
	if err := h.LinkSetHardwareAddr(link, mac); err != nil {
		return fmt.Errorf("set MAC of %s: %w", IfName, err)
	}
	if err := h.LinkSetMTU(link, MTU); err != nil {
		return fmt.Errorf("set MTU of %s: %w", IfName, err)
	}
	addr := &netlink.Addr{IPNet: &net.IPNet{IP: net.ParseIP(SandboxAddr).To4(), Mask: net.CIDRMask(PrefixLen, 32)}}
	if err := h.AddrReplace(link, addr); err != nil {
		return fmt.Errorf("address %s on %s: %w", addr, IfName, err)
	}
	if err := h.LinkSetUp(link); err != nil {
		return fmt.Errorf("bring %s up: %w", IfName, err)
	}
	if lo, err := h.LinkByName("lo"); err == nil {
		if err := h.LinkSetUp(lo); err != nil {
			return fmt.Errorf("bring lo up: %w", err)
		}
	}
	route := &netlink.Route{
		LinkIndex: link.Attrs().Index,
		Gw:        net.ParseIP(GatewayAddr).To4(),
		Scope:     netlink.SCOPE_UNIVERSE,
	}
	if err := h.RouteReplace(route); err != nil {
		return fmt.Errorf("default route via %s: %w", GatewayAddr, err)
	}
	return nil
}

// NewNetNS creates an empty network namespace and pins it by a bind mount
// on path (a new file; it must not exist). Nothing else of the host
// changes. RemoveNetNS undoes it.
func NewNetNS(path string) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_RDONLY, 0o600)
	if err != nil {
		return fmt.Errorf("network namespace file: %w", err)
	}
	f.Close()
	done := make(chan error, 1)
	go func() {
		var mountErr error
		err := onThread(func() error { return unix.Unshare(unix.CLONE_NEWNET) }, func() {
			mountErr = unix.Mount("/proc/thread-self/ns/net", path, "", unix.MS_BIND, "")
		})
		switch {
		case err != nil:
			done <- fmt.Errorf("unshare network namespace: %w", err)
		case mountErr != nil:
			done <- fmt.Errorf("pin network namespace on %s: %w", path, mountErr)
		default:
			done <- nil
		}
	}()
	if err := <-done; err != nil {
		os.Remove(path)
		return err
	}
	return nil
}

// RemoveNetNS unpins and removes a namespace file NewNetNS made. The
// namespace itself ends when nothing else (a process, a TAP descriptor)
// holds it. A missing file is not an error.
func RemoveNetNS(path string) error {
	if err := unix.Unmount(path, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("unmount %s: %w", path, err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

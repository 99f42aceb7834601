package vminit

import (
	"errors"
	"fmt"
	"net"
	"os"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The guest's side of the sandbox's NIC, as package hostnet describes the
// link (the values are repeated here so that the agent, which carries this
// package, does not link hostnet's netlink code; a test in package microvm
// checks they agree).
const (
	NICName    = "eth0"
	NICAddr    = "198.18.0.2"
	NICPrefix  = 30
	NICGateway = "198.18.0.1"
	NICMTU     = 1500 // not hostnet.MTU: virtio-net receive buffers are sized for standard frames
	ResolvConf = "nameserver " + NICGateway + "\noptions edns0 trust-ad\n"
)

// nicUp configures the NIC, when the VM has one (virtio_net found a
// device: eth0 exists): IPv6 off on it before it goes up (no router
// solicitation, DAD or MLD frame ever leaves; the link is IPv4 only), MTU,
// address, link up, default route via the gateway. Plain ioctls, as
// loopbackUp: netlink code would grow the agent binary for five calls.
// The sandbox cannot change any of it: the guest's network namespace is
// guest root's, and the agent has no CAP_NET_ADMIN there.
func nicUp() (bool, error) {
	if _, err := os.Stat("/sys/class/net/" + NICName); errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	if err := os.WriteFile("/proc/sys/net/ipv6/conf/"+NICName+"/disable_ipv6", []byte("1"), 0); err != nil && !errors.Is(err, os.ErrNotExist) {
		return true, fmt.Errorf("%s: disabling IPv6: %w", NICName, err)
	}
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return true, err
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq(NICName)
	if err != nil {
		return true, err
	}
	ifr.SetUint32(NICMTU)
	if err := unix.IoctlIfreq(fd, unix.SIOCSIFMTU, ifr); err != nil {
		return true, fmt.Errorf("%s MTU: %w", NICName, err)
	}
	if err := ifr.SetInet4Addr(net.ParseIP(NICAddr).To4()); err != nil {
		return true, err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCSIFADDR, ifr); err != nil {
		return true, fmt.Errorf("%s address: %w", NICName, err)
	}
	if err := ifr.SetInet4Addr(net.IP(net.CIDRMask(NICPrefix, 32))); err != nil {
		return true, err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCSIFNETMASK, ifr); err != nil {
		return true, fmt.Errorf("%s netmask: %w", NICName, err)
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return true, fmt.Errorf("%s flags: %w", NICName, err)
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	if err := unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr); err != nil {
		return true, fmt.Errorf("%s up: %w", NICName, err)
	}
	if err := addDefaultRoute(fd, net.ParseIP(NICGateway).To4()); err != nil {
		return true, fmt.Errorf("%s default route: %w", NICName, err)
	}
	return true, nil
}

// rtentry is struct rtentry of <net/route.h> on x86-64 (SIOCADDRT).
type rtentry struct {
	pad1    uint64
	dst     unix.RawSockaddrInet4
	gateway unix.RawSockaddrInet4
	genmask unix.RawSockaddrInet4
	flags   uint16
	pad2    int16
	_       [4]byte
	pad3    uint64
	pad4    uintptr
	metric  int16
	_       [6]byte
	dev     uintptr
	mtu     uint64
	window  uint64
	irtt    uint16
	_       [6]byte
}

// addDefaultRoute adds 0.0.0.0/0 via gw (the kernel picks the device
// whose subnet holds gw). An existing one is fine.
func addDefaultRoute(fd int, gw net.IP) error {
	var rt rtentry
	rt.dst.Family = unix.AF_INET
	rt.genmask.Family = unix.AF_INET
	rt.gateway.Family = unix.AF_INET
	copy(rt.gateway.Addr[:], gw)
	rt.flags = unix.RTF_UP | unix.RTF_GATEWAY
	_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.SIOCADDRT, uintptr(unsafe.Pointer(&rt)))
	if errno != 0 && errno != unix.EEXIST {
		return errno
	}
	return nil
}

package hostnet_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"net"
	"os"
	"path/filepath"
	goruntime "runtime"
	"sort"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime/hostnet"
	"github.com/spacehq/space/internal/runtime/runtimetest"
	"github.com/spacehq/space/internal/testenv"
)

// newNetNS makes a namespace pinned on a temp file, removed at cleanup.
func newNetNS(t *testing.T) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "netns")
	if err := hostnet.NewNetNS(p); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := hostnet.RemoveNetNS(p); err != nil {
			t.Error(err)
		}
	})
	return p
}

// udpSocketIn opens a UDP socket in the namespace at nsPath (a socket
// stays in the namespace it was made in, whatever thread uses it later).
func udpSocketIn(t *testing.T, nsPath string) int {
	t.Helper()
	ns, err := netns.GetFromPath(nsPath)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	type res struct {
		fd  int
		err error
	}
	ch := make(chan res, 1)
	go func() {
		goruntime.LockOSThread()
		home, err := netns.Get()
		if err != nil {
			ch <- res{-1, err}
			return
		}
		defer home.Close()
		if err := unix.Setns(int(ns), unix.CLONE_NEWNET); err != nil {
			ch <- res{-1, err}
			return
		}
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		// Back home before the thread may run anything else; if that
		// fails it stays locked and ends with this goroutine.
		if netns.Set(home) == nil {
			goruntime.UnlockOSThread()
		}
		ch <- res{fd, err}
	}()
	r := <-ch
	if r.err != nil {
		t.Fatal(r.err)
	}
	t.Cleanup(func() { unix.Close(r.fd) })
	return r.fd
}

func sendTo(t *testing.T, fd int, port int, payload string) {
	t.Helper()
	gw := net.ParseIP(hostnet.GatewayAddr).To4()
	sa := &unix.SockaddrInet4{Port: port}
	copy(sa.Addr[:], gw)
	if err := unix.Sendto(fd, []byte(payload), 0, sa); err != nil {
		t.Fatalf("sendto gateway: %v", err)
	}
}

func mustMAC(s string) net.HardwareAddr { m, _ := net.ParseMAC(s); return m }

func TestCreateTAP(t *testing.T) {
	testenv.RequireRoot(t)
	before := runtimetest.HostNetState(t)
	nsPath := newNetNS(t)

	t0 := time.Now()
	tap, err := hostnet.CreateTAP(nsPath)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("CreateTAP took %v", time.Since(t0))
	defer tap.Close()
	if fl, err := unix.FcntlInt(tap.Fd(), unix.F_GETFD, 0); err != nil || fl&unix.FD_CLOEXEC == 0 {
		t.Errorf("TAP descriptor is not close-on-exec (%#x, %v)", fl, err)
	}

	// The namespace's view: eth0 with the sandbox's MAC, MTU, address;
	// routes only the link's /30 and the default via the gateway.
	ns, err := netns.GetFromPath(nsPath)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	link, err := h.LinkByName(hostnet.IfName)
	if err != nil {
		t.Fatal(err)
	}
	if got := link.Attrs().HardwareAddr.String(); got != hostnet.SandboxMAC {
		t.Errorf("MAC %s, want %s", got, hostnet.SandboxMAC)
	}
	if link.Attrs().MTU != hostnet.MTU {
		t.Errorf("MTU %d", link.Attrs().MTU)
	}
	addrs, err := h.AddrList(link, netlink.FAMILY_ALL)
	if err != nil {
		t.Fatal(err)
	}
	if len(addrs) != 1 || addrs[0].IPNet.String() != hostnet.SandboxAddr+"/30" {
		t.Errorf("addresses on %s: %v (IPv6 must be off)", hostnet.IfName, addrs)
	}
	routes, err := h.RouteList(nil, netlink.FAMILY_ALL)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, r := range routes {
		if ones, _ := r.Dst.Mask.Size(); r.Dst == nil || ones == 0 {
			got = append(got, "default via "+r.Gw.String())
		} else {
			got = append(got, r.Dst.String())
		}
	}
	sort.Strings(got)
	if want := []string{"198.18.0.0/30", "default via " + hostnet.GatewayAddr}; !equal(got, want) {
		t.Errorf("main-table routes in the sandbox's namespace: %v, want %v", got, want)
	}

	// The sandbox sends to the gateway: first its kernel asks for the
	// gateway's MAC.
	sock := udpSocketIn(t, nsPath)
	sendTo(t, sock, 53, "hello")
	fr := runtimetest.ReadFrame(t, tap, runtimetest.IsARPRequestFor(hostnet.GatewayAddr))
	if !bytes.Equal(fr[0:6], []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff}) || !bytes.Equal(fr[6:12], mustMAC(hostnet.SandboxMAC)) {
		t.Errorf("ARP request addressing %x", fr[:12])
	}
	if !bytes.Equal(fr[28:32], net.ParseIP(hostnet.SandboxAddr).To4()) {
		t.Errorf("ARP sender IP %v", net.IP(fr[28:32]))
	}
	// The gateway answers; the datagram follows, to the gateway's MAC.
	if _, err := tap.Write(runtimetest.ARPReply()); err != nil {
		t.Fatal(err)
	}
	udp := runtimetest.ReadFrame(t, tap, func(fr []byte) bool {
		return binary.BigEndian.Uint16(fr[12:14]) == 0x0800 && fr[23] == unix.IPPROTO_UDP
	})
	if !bytes.Equal(udp[0:6], mustMAC(hostnet.GatewayMAC)) || !bytes.Equal(udp[30:34], net.ParseIP(hostnet.GatewayAddr).To4()) ||
		binary.BigEndian.Uint16(udp[36:38]) != 53 || string(udp[42:]) != "hello" {
		t.Errorf("UDP frame %x", udp)
	}

	// One descriptor at a time; after it is closed, a new one carries the
	// same link.
	if _, err := hostnet.OpenTAP(nsPath); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("second attach while the first is open: %v, want ErrConflict", err)
	}
	tap.Close()
	for i := 0; i < 3; i++ {
		t0 = time.Now()
		again, err := hostnet.CreateTAP(nsPath)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("re-attach (CreateTAP) took %v", time.Since(t0))
		// The kernel forgot the gateway's MAC when the link lost its
		// carrier (the descriptor closed): it may ask again first.
		sendTo(t, sock, 54, "again")
		arp := runtimetest.IsARPRequestFor(hostnet.GatewayAddr)
		runtimetest.ReadFrame(t, again, func(fr []byte) bool {
			if arp(fr) {
				if _, err := again.Write(runtimetest.ARPReply()); err != nil {
					t.Fatal(err)
				}
				return false
			}
			return binary.BigEndian.Uint16(fr[12:14]) == 0x0800 && fr[23] == unix.IPPROTO_UDP && string(fr[42:]) == "again"
		})
		again.Close()
	}
	t0 = time.Now()
	reopened, err := hostnet.OpenTAP(nsPath)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("OpenTAP took %v", time.Since(t0))
	reopened.Close()

	if after := runtimetest.HostNetState(t); !equal(before, after) {
		t.Errorf("the host's network namespace changed:\nbefore %v\nafter  %v", before, after)
	}
}

func TestOpenTAPWithoutDevice(t *testing.T) {
	testenv.RequireRoot(t)
	nsPath := newNetNS(t)
	if _, err := hostnet.OpenTAP(nsPath); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("OpenTAP in an empty namespace: %v, want ErrNotFound", err)
	}
}

// TestTAPDiesWithNamespace: once the namespace's last holder is gone
// (bind mount, TAP descriptor), the persistent device goes with it and
// nothing lands in the host's namespace.
func TestTAPDiesWithNamespace(t *testing.T) {
	testenv.RequireRoot(t)
	before := runtimetest.HostNetState(t)
	p := filepath.Join(t.TempDir(), "netns")
	if err := hostnet.NewNetNS(p); err != nil {
		t.Fatal(err)
	}
	tap, err := hostnet.CreateTAP(p)
	if err != nil {
		hostnet.RemoveNetNS(p)
		t.Fatal(err)
	}
	if err := hostnet.RemoveNetNS(p); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(p); !os.IsNotExist(err) {
		t.Errorf("namespace file still there: %v", err)
	}
	tap.Close()
	// Namespace teardown is asynchronous in the kernel.
	deadline := time.Now().Add(5 * time.Second)
	for {
		after := runtimetest.HostNetState(t)
		if equal(before, after) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the host's network namespace changed:\nbefore %v\nafter  %v", before, after)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func equal(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestCreateTAPRefusesHostNamespace(t *testing.T) {
	testenv.RequireRoot(t)
	for _, p := range []string{"/proc/self/ns/net", "/proc/thread-self/ns/net"} {
		// Both are this process's namespace, the host's here.
		if f, err := hostnet.CreateTAP(p); !errors.Is(err, errdefs.ErrInvalidArgument) {
			if f != nil {
				f.Close()
			}
			t.Errorf("CreateTAP(%s): %v, want ErrInvalidArgument", p, err)
		}
	}
}

// BenchmarkNewNetNSCreateTAP is what the gvisor runtime adds to every
// start, restore and fork child: a pinned namespace with a configured TAP,
// then its removal.
func BenchmarkNewNetNSCreateTAP(b *testing.B) {
	testenv.RequireRoot(b)
	dir := b.TempDir()
	for i := 0; i < b.N; i++ {
		p := filepath.Join(dir, "netns")
		if err := hostnet.NewNetNS(p); err != nil {
			b.Fatal(err)
		}
		tap, err := hostnet.CreateTAP(p)
		if err != nil {
			b.Fatal(err)
		}
		tap.Close()
		if err := hostnet.RemoveNetNS(p); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkOpenTAP is NIC's cost under gVisor: attach to the existing TAP.
func BenchmarkOpenTAP(b *testing.B) {
	testenv.RequireRoot(b)
	p := filepath.Join(b.TempDir(), "netns")
	if err := hostnet.NewNetNS(p); err != nil {
		b.Fatal(err)
	}
	defer hostnet.RemoveNetNS(p)
	tap, err := hostnet.CreateTAP(p)
	if err != nil {
		b.Fatal(err)
	}
	tap.Close()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		tap, err := hostnet.OpenTAP(p)
		if err != nil {
			b.Fatal(err)
		}
		tap.Close()
	}
}

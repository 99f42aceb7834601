package runtimetest

import (
	"bytes"
	"encoding/binary"
	"errors"
	"net"
	"os"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/hostnet"
)

// HostNetState lists everything of the calling process's network namespace
// (the host's, in these tests) that creating a NIC could have touched:
// links, addresses and routes of every table.
func HostNetState(t testing.TB) []string {
	t.Helper()
	var out []string
	links, err := netlink.LinkList()
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range links {
		out = append(out, "link "+l.Attrs().Name)
	}
	addrs, err := netlink.AddrList(nil, netlink.FAMILY_ALL)
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range addrs {
		out = append(out, "addr "+a.IPNet.String())
	}
	routes, err := netlink.RouteListFiltered(netlink.FAMILY_ALL, &netlink.Route{Table: unix.RT_TABLE_UNSPEC}, netlink.RT_FILTER_TABLE)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range routes {
		out = append(out, "route "+r.String())
	}
	sort.Strings(out)
	return out
}

// ReadFrame reads Ethernet frames off a NIC descriptor until match accepts
// one (5 s at most). An IPv6 frame fails the test: the link is IPv4 only.
func ReadFrame(t testing.TB, f *os.File, match func([]byte) bool) []byte {
	t.Helper()
	buf := make([]byte, 65536)
	if err := f.SetReadDeadline(time.Now().Add(5 * time.Second)); err != nil {
		t.Fatal(err)
	}
	for {
		n, err := f.Read(buf)
		if err != nil {
			t.Fatalf("read NIC: %v", err)
		}
		fr := buf[:n]
		if len(fr) < 14 {
			t.Fatalf("short frame %x", fr)
		}
		if binary.BigEndian.Uint16(fr[12:14]) == 0x86dd {
			t.Fatalf("IPv6 frame on an IPv4-only link: %x", fr)
		}
		if match(fr) {
			return append([]byte(nil), fr...)
		}
	}
}

// IsARPRequestFor matches an ARP request for ip.
func IsARPRequestFor(ip string) func([]byte) bool {
	want := net.ParseIP(ip).To4()
	return func(fr []byte) bool {
		return len(fr) >= 42 && binary.BigEndian.Uint16(fr[12:14]) == 0x0806 &&
			binary.BigEndian.Uint16(fr[20:22]) == 1 && bytes.Equal(fr[38:42], want)
	}
}

// IsUDPTo matches an IPv4 UDP frame to the gateway's port carrying payload.
func IsUDPTo(port int, payload string) func([]byte) bool {
	return func(fr []byte) bool {
		if len(fr) < 42 || binary.BigEndian.Uint16(fr[12:14]) != 0x0800 || fr[23] != unix.IPPROTO_UDP {
			return false
		}
		ihl := int(fr[14]&0x0f) * 4
		udp := fr[14+ihl:]
		return len(udp) >= 8 && bytes.Equal(fr[30:34], net.ParseIP(hostnet.GatewayAddr).To4()) &&
			int(binary.BigEndian.Uint16(udp[2:4])) == port && string(udp[8:]) == payload
	}
}

func mustMAC(s string) net.HardwareAddr {
	m, err := net.ParseMAC(s)
	if err != nil {
		panic(err)
	}
	return m
}

// ARPReply is the gateway's answer to the sandbox's ARP request for
// GatewayAddr.
func ARPReply() []byte {
	fr := make([]byte, 42)
	copy(fr[0:6], mustMAC(hostnet.SandboxMAC))
	copy(fr[6:12], mustMAC(hostnet.GatewayMAC))
	binary.BigEndian.PutUint16(fr[12:], 0x0806)
	binary.BigEndian.PutUint16(fr[14:], 1)      // Ethernet
	binary.BigEndian.PutUint16(fr[16:], 0x0800) // IPv4
	fr[18], fr[19] = 6, 4
	binary.BigEndian.PutUint16(fr[20:], 2) // reply
	copy(fr[22:28], mustMAC(hostnet.GatewayMAC))
	copy(fr[28:32], net.ParseIP(hostnet.GatewayAddr).To4())
	copy(fr[32:38], mustMAC(hostnet.SandboxMAC))
	copy(fr[38:42], net.ParseIP(hostnet.SandboxAddr).To4())
	return fr
}

// ExpectUDP reads off nic until the sandbox's datagram to the gateway's
// port arrives, answering the sandbox's ARP requests for the gateway on
// the way, and returns the frame.
func ExpectUDP(t testing.TB, nic *os.File, port int, payload string) []byte {
	t.Helper()
	arp := IsARPRequestFor(hostnet.GatewayAddr)
	udp := IsUDPTo(port, payload)
	return ReadFrame(t, nic, func(fr []byte) bool {
		if arp(fr) {
			if !bytes.Equal(fr[6:12], mustMAC(hostnet.SandboxMAC)) || !bytes.Equal(fr[28:32], net.ParseIP(hostnet.SandboxAddr).To4()) {
				t.Errorf("ARP request from %x / %v, want %s / %s", fr[6:12], net.IP(fr[28:32]), hostnet.SandboxMAC, hostnet.SandboxAddr)
			}
			if _, err := nic.Write(ARPReply()); err != nil {
				t.Fatalf("write ARP reply: %v", err)
			}
			return false
		}
		return udp(fr)
	})
}

// sendScript sends one datagram from inside the sandbox to the gateway.
func sendScript(port int, payload string) []string {
	return []string{"python3", "-c", "import socket, sys; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); " +
		"s.sendto(sys.argv[2].encode(), ('" + hostnet.GatewayAddr + "', int(sys.argv[1])))", strconv.Itoa(port), payload}
}

// testNIC checks the sandbox's one NIC (runtime.NICProvider): the sandbox
// sees eth0 with the link addressing and the gateway as its resolver, what
// it sends to the gateway arrives as frames on the descriptor NIC returns
// and frames written there reach it, a second descriptor serves the same
// link once the first is closed, and nothing of it is left on the host
// after Destroy.
func testNIC(t *testing.T, h Harness) {
	rt := h.New(t)
	before := HostNetState(t)
	sb := Start(t, h, rt, DefaultLimits)
	p, ok := sb.Inst.(runtime.NICProvider)
	if !ok {
		t.Skipf("%s instances have no NIC", rt.Name())
	}
	CheckNIC(t, sb, p)
	ctx := ctxFor(t, time.Minute)
	if err := sb.Inst.Destroy(ctx); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		after := HostNetState(t)
		if strings.Join(after, "\n") == strings.Join(before, "\n") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the host's network namespace changed:\nbefore %v\nafter  %v", before, after)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// CheckNIC is testNIC on a running sandbox.
func CheckNIC(t *testing.T, sb *Sandbox, p runtime.NICProvider) {
	t.Helper()
	ctx := ctxFor(t, time.Minute)
	if got := sb.MustSh(t, "cat /etc/resolv.conf"); got != hostnet.ResolvConf {
		t.Errorf("/etc/resolv.conf = %q, want %q", got, hostnet.ResolvConf)
	}
	// eth0's MAC and the default route, as the sandbox sees them.
	view := sb.Exec(t, "python3", "-c", `
import fcntl, socket, struct
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
hw = fcntl.ioctl(s, 0x8927, struct.pack('256s', b'eth0'))[18:24]
print("mac", ':'.join('%02x' % b for b in hw))
addr = fcntl.ioctl(s, 0x8915, struct.pack('256s', b'eth0'))[20:24]
print("addr", socket.inet_ntoa(addr))
for line in open('/proc/net/route').read().splitlines()[1:]:
    f = line.split()
    if f[1] == '00000000':
        print("default", f[0], socket.inet_ntoa(struct.pack('<I', int(f[2], 16))))
`)
	for _, want := range []string{"mac " + hostnet.SandboxMAC, "addr " + hostnet.SandboxAddr, "default eth0 " + hostnet.GatewayAddr} {
		if !strings.Contains(view.Stdout, want) {
			t.Errorf("sandbox's view of eth0 lacks %q: %+v", want, view)
		}
	}

	t0 := time.Now()
	nic, err := p.NIC(ctx)
	if err != nil {
		t.Fatalf("NIC: %v", err)
	}
	t.Logf("NIC took %v", time.Since(t0))
	if res := sb.Exec(t, sendScript(53, "hello")...); res.ExitCode != 0 {
		t.Fatalf("send to the gateway: %+v", res)
	}
	ExpectUDP(t, nic, 53, "hello")

	// One descriptor at a time; a new one after the first is closed.
	if second, err := p.NIC(ctx); !errors.Is(err, errdefs.ErrConflict) {
		if second != nil {
			second.Close()
		}
		t.Errorf("NIC while another descriptor is open: %v, want ErrConflict", err)
	}
	nic.Close()
	t0 = time.Now()
	nic, err = p.NIC(ctx)
	if err != nil {
		t.Fatalf("NIC again: %v", err)
	}
	t.Logf("NIC again took %v", time.Since(t0))
	defer nic.Close()
	if res := sb.Exec(t, sendScript(54, "again")...); res.ExitCode != 0 {
		t.Fatalf("send to the gateway: %+v", res)
	}
	ExpectUDP(t, nic, 54, "again")

	// The sandbox has no CAP_NET_ADMIN: it cannot readdress its link.
	res := sb.Exec(t, "python3", "-c", `
import fcntl, socket, struct
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
try:
    fcntl.ioctl(s, 0x8916, struct.pack('16sH2s4s8s', b'eth0', socket.AF_INET, b'\0\0', socket.inet_aton('198.18.0.3'), b'\0' * 8))
    print("readdressed")
except OSError as e:
    print("refused", e.errno)
`)
	if !strings.Contains(res.Stdout, "refused") {
		t.Errorf("the sandbox changed eth0's address: %+v", res)
	}
}

// nicWorks shows, where the instance has a NIC, that a datagram the
// sandbox sends to the gateway arrives on a new descriptor of it.
func (sb *Sandbox) nicWorks(t *testing.T, payload string) {
	t.Helper()
	p, ok := sb.Inst.(runtime.NICProvider)
	if !ok {
		return
	}
	nic, err := p.NIC(ctxFor(t, time.Minute))
	if err != nil {
		t.Fatalf("NIC: %v", err)
	}
	defer nic.Close()
	if res := sb.Exec(t, sendScript(53, payload)...); res.ExitCode != 0 {
		t.Fatalf("send to the gateway: %+v", res)
	}
	ExpectUDP(t, nic, 53, payload)
}

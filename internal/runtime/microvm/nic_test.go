package microvm

import (
	"errors"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime/hostnet"
	"github.com/spacehq/space/internal/runtime/microvm/vminit"
)

// The guest's init configures the link with its own copy of hostnet's
// addressing (the agent does not link hostnet).
func TestGuestLinkMatchesHostnet(t *testing.T) {
	for _, c := range [][2]string{
		{vminit.NICName, hostnet.IfName},
		{vminit.NICAddr, hostnet.SandboxAddr},
		{vminit.NICGateway, hostnet.GatewayAddr},
		{strconv.Itoa(vminit.NICPrefix), strconv.Itoa(hostnet.PrefixLen)},
		{vminit.ResolvConf, hostnet.ResolvConf},
	} {
		if c[0] != c[1] {
			t.Errorf("vminit has %q, hostnet %q", c[0], c[1])
		}
	}
	// The guest's MTU is its own (virtio-net receive buffers are sized for
	// standard frames); the gateway takes frames up to hostnet.MTU and the
	// guest's MSS keeps its segments within its own MTU.
	if vminit.NICMTU > hostnet.MTU {
		t.Errorf("guest MTU %d above the link's %d", vminit.NICMTU, hostnet.MTU)
	}
}

// The NIC's args: one virtio-net device with the sandbox's MAC on a dgram
// backend between the two paths.
func TestArgsNIC(t *testing.T) {
	v := VM{Kernel: "/k", Initrd: "/i", Accel: AccelTCG, AgentSocket: "/d/a.sock", ConsoleLog: "/d/c.log",
		NetSocket: "/d/net.sock", NetPeer: "/d/gw.sock"}
	args, err := v.Args()
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]bool{
		"dgram,id=net0,local.type=unix,local.path=/d/net.sock,remote.type=unix,remote.path=/d/gw.sock": false,
		"virtio-net-device,netdev=net0,mac=" + hostnet.SandboxMAC:                                      false,
	}
	for _, a := range args {
		if _, ok := want[a]; ok {
			want[a] = true
		}
	}
	for a, seen := range want {
		if !seen {
			t.Errorf("args lack %q: %v", a, args)
		}
	}
	v.NetPeer = ""
	if _, err := v.Args(); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("a NIC with one socket: %v", err)
	}
}

// openNIC against a stand-in for QEMU's socket: one frame per datagram
// both ways, one descriptor at a time, a closed one replaced, a symlink
// planted at the host's path never followed.
func TestOpenNIC(t *testing.T) {
	dir := t.TempDir()
	qemuPath, peer := filepath.Join(dir, "net.sock"), filepath.Join(dir, "gw.sock")
	qemu, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: qemuPath, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	defer qemu.Close()
	uid := uint32(os.Getuid())

	// Whatever the guest's side planted is removed, not followed.
	target := filepath.Join(dir, "target")
	if err := os.WriteFile(target, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(target, peer); err != nil {
		t.Fatal(err)
	}
	nic, err := openNIC(qemuPath, peer, uid)
	if err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(target); err != nil || string(b) != "x" {
		t.Fatalf("the symlink's target: %q %v", b, err)
	}
	exchange := func(nic *os.File, a, b string) {
		t.Helper()
		// QEMU → host: sendto the peer's path.
		if _, err := qemu.WriteToUnix([]byte(a), &net.UnixAddr{Name: peer, Net: "unixgram"}); err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 100)
		_ = nic.SetReadDeadline(time.Now().Add(5 * time.Second))
		n, err := nic.Read(buf)
		if err != nil || string(buf[:n]) != a {
			t.Fatalf("host read %q %v, want %q", buf[:n], err, a)
		}
		// host → QEMU.
		if _, err := nic.Write([]byte(b)); err != nil {
			t.Fatal(err)
		}
		_ = qemu.SetReadDeadline(time.Now().Add(5 * time.Second))
		n, err = qemu.Read(buf)
		if err != nil || string(buf[:n]) != b {
			t.Fatalf("QEMU read %q %v, want %q", buf[:n], err, b)
		}
	}
	exchange(nic, "frame-1", "frame-2")

	if second, err := openNIC(qemuPath, peer, uid); !errors.Is(err, errdefs.ErrConflict) {
		if second != nil {
			second.Close()
		}
		t.Fatalf("a second descriptor while the first is open: %v", err)
	}
	// Only QEMU's socket can send to the host's end.
	other, err := unix.Socket(unix.AF_UNIX, unix.SOCK_DGRAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(other)
	if err := unix.Sendto(other, []byte("spoof"), 0, &unix.SockaddrUnix{Name: peer}); err == nil {
		t.Fatal("another socket sent to the host's end of the NIC")
	}

	nic.Close()
	nic, err = openNIC(qemuPath, peer, uid)
	if err != nil {
		t.Fatalf("after the first was closed: %v", err)
	}
	defer nic.Close()
	exchange(nic, "frame-3", "frame-4")
}

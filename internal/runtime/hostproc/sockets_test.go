package hostproc

import (
	"errors"
	"net"
	"net/netip"
	"os"
	"testing"

	"github.com/spacehq/space/internal/errdefs"
)

// The test process's own connection is found in its socket table and
// named by its executable; the other end of it too (another socket), a
// connection that does not exist is not found, and only pids in the list
// are considered.
func TestSocketOwner(t *testing.T) {
	self, err := os.Readlink("/proc/self/exe")
	if err != nil {
		t.Fatal(err)
	}
	for _, network := range []string{"tcp4", "tcp6"} {
		addr := "127.0.0.1:0"
		if network == "tcp6" {
			addr = "[::1]:0"
		}
		ln, err := net.Listen(network, addr)
		if err != nil {
			t.Logf("%s: %v (skipped)", network, err)
			continue
		}
		defer ln.Close()
		c, err := net.Dial(network, ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		s, err := ln.Accept()
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		local := c.LocalAddr().(*net.TCPAddr).AddrPort()
		remote := c.RemoteAddr().(*net.TCPAddr).AddrPort()
		pid := os.Getpid()
		if exe, err := SocketOwner(pid, []int{1, pid}, "tcp", local, remote); err != nil || exe != self {
			t.Fatalf("%s client end: %q %v, want %q", network, exe, err, self)
		}
		if exe, err := SocketOwner(pid, []int{pid}, "tcp", remote, local); err != nil || exe != self {
			t.Fatalf("%s server end: %q %v", network, exe, err)
		}
		wrong := netip.AddrPortFrom(remote.Addr(), remote.Port()+1)
		if _, err := SocketOwner(pid, []int{pid}, "tcp", local, wrong); !errors.Is(err, errdefs.ErrNotFound) {
			t.Fatalf("%s no such connection: %v", network, err)
		}
		if _, err := SocketOwner(pid, []int{1}, "tcp", local, remote); !errors.Is(err, errdefs.ErrNotFound) {
			t.Fatalf("%s held by a pid not in the list: %v", network, err)
		}
	}
	if _, err := SocketOwner(os.Getpid(), nil, "udp", netip.AddrPort{}, netip.AddrPort{}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("udp: %v", err)
	}
}

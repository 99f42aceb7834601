package agent

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/creack/pty"
	"golang.org/x/term"

	"github.com/spacehq/space/internal/agentclient"
	"github.com/spacehq/space/internal/agentproto"
)

// fileConn adapts a character device to net.Conn for the client side: the
// file's reads, writes, close and deadlines, not its whole method set.
type fileConn struct{ fileIO }

type fileIO interface {
	Read([]byte) (int, error)
	Write([]byte) (int, error)
	Close() error
	SetDeadline(time.Time) error
	SetReadDeadline(time.Time) error
	SetWriteDeadline(time.Time) error
}

func (fileConn) LocalAddr() net.Addr  { return &net.UnixAddr{Name: "serial", Net: "unix"} }
func (fileConn) RemoteAddr() net.Addr { return &net.UnixAddr{Name: "serial", Net: "unix"} }

// TestServeSerial serves over a raw terminal standing in for a
// virtio-serial port (a character device, not a socket).
func TestServeSerial(t *testing.T) {
	a, err := New(Config{Root: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	master, slave, err := pty.Open()
	if err != nil {
		t.Skipf("no pty: %v", err)
	}
	defer master.Close()
	defer slave.Close()
	if _, err := term.MakeRaw(int(slave.Fd())); err != nil {
		t.Fatal(err)
	}
	path := slave.Name()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go a.serveSerial(ctx, path)

	c, err := agentclient.New(fileConn{master})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	cctx, ccancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer ccancel()
	res, err := c.Exec(cctx, agentproto.ExecRequest{Cmd: []string{"echo", "over serial"}})
	if err != nil || res.Stdout != "over serial\n" {
		t.Fatalf("exec %+v %v", res, err)
	}
}

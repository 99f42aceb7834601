package gwctl

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/gateway"
	"github.com/spacehq/space/internal/gateway/gatewaytest"
)

// TestDialOp serves the control protocol in-process over a gateway with
// one link and dials a port of the "sandbox" through Client.DialSandbox:
// the control connection becomes the stream, a half-close reaches the
// service, its answer (sent at once, before any request: the client must
// not swallow it with the reply line) comes back; errors keep their codes.
func TestDialOp(t *testing.T) {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	g, err := gateway.New(gateway.Options{Dialer: &gatewaytest.GuardDialer{T: t}, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(g.Close)
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	nic := os.NewFile(uintptr(fds[0]), "nic")
	if err := g.Attach("sb-aaaaaaaa", nic, api.NetworkPolicy{}); err != nil {
		t.Fatal(err)
	}
	nic.Close()
	sb := gatewaytest.NewSandboxStack(t, fds[1])
	sb.Serve(t, 8080, func(c net.Conn) {
		fmt.Fprint(c, "hello\n") // server speaks first
		b, _ := io.ReadAll(c)
		fmt.Fprintf(c, "echo:%s", b)
	})

	sock := filepath.Join(t.TempDir(), "ctl.sock")
	uln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	go Serve(ctx, uln, g, log)
	cl := &Client{Path: sock}

	c, err := cl.DialSandbox(ctx, "sb-aaaaaaaa", 8080)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	if err := c.(interface{ CloseWrite() error }).CloseWrite(); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	got, err := io.ReadAll(c)
	if err != nil || string(got) != "hello\necho:ping" {
		t.Fatalf("got %q, %v", got, err)
	}

	if _, err := cl.DialSandbox(ctx, "sb-aaaaaaaa", 9); !errors.Is(err, errdefs.ErrUnavailable) || !strings.Contains(err.Error(), "nothing listens on port 9") {
		t.Errorf("closed port: %v", err)
	}
	if _, err := cl.DialSandbox(ctx, "sb-bbbbbbbb", 8080); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("unknown sandbox: %v", err)
	}
	if _, err := cl.DialSandbox(ctx, "sb-aaaaaaaa", 0); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("port 0: %v", err)
	}
}

package containerdtest

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/spacehq/space/internal/server"
	"github.com/spacehq/space/internal/testenv"
	"github.com/spacehq/space/sdk"
)

// SpaceServer starts a space server in this process on a unix socket, for
// the shim that Start's containerd runs, and returns its socket URL, a file
// holding its API key (what a shim config's api_key_file names) and a
// client. Nothing leaves this machine: the gateway's dials are guarded and
// its resolver is a loopback port nobody serves. At cleanup the sandboxes a
// failed test left are deleted, then the server stops.
func SpaceServer(t *testing.T) (url, keyFile string, client *sdk.Client) {
	t.Helper()
	// Not t.TempDir(): sandbox socket paths live under it and must stay short.
	data, err := os.MkdirTemp("", "space-cri-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(data) })
	devnull, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer devnull.Close()
	s, err := server.New(context.Background(), server.Config{
		DataDir: data, CacheDir: testenv.CacheDir(), AgentBinary: testenv.AgentBinary(t), JailBinary: testenv.JailBinary(t),
		APIKeyOut: devnull,
		Network: server.NetworkOptions{
			DialGuard: "loopback", DNSUpstream: "127.0.0.1:9", GatewayBinary: testenv.GatewayBinary(t),
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(data, "space.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		s.Close()
		t.Fatal(err)
	}
	go s.HTTPServer().Serve(l)
	keyFile = filepath.Join(data, "api-key.shim")
	if err := os.WriteFile(keyFile, []byte(s.APIKey()+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if client, err = sdk.New("unix://"+sock, s.APIKey()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		sbs, _ := client.ListSandboxes(ctx, sdk.ListOptions{})
		for _, sb := range sbs {
			if op, err := client.DeleteSandbox(ctx, sb.ID, true); err == nil {
				client.WaitOperation(ctx, op.ID)
			}
		}
		s.Close()
		l.Close()
	})
	return "unix://" + sock, keyFile, client
}

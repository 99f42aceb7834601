package e2e

import (
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/sdk"
)

// slowReader feeds an upload forever, slowly, until closed.
type slowReader struct{ stop chan struct{} }

func (r *slowReader) Read(p []byte) (int, error) {
	select {
	case <-r.stop:
		return 0, io.ErrUnexpectedEOF
	case <-time.After(10 * time.Millisecond):
	}
	n := copy(p, strings.Repeat("z", 4096))
	return n, nil
}

// TestDeleteWhileBusy deletes a sandbox while a command is attached and a
// file upload is streaming: both end with errors, the delete succeeds, and
// nothing is left behind (TestMain checks the host).
func TestDeleteWhileBusy(t *testing.T) {
	e := setup(t)
	ctx := ctxT(t, 3*time.Minute)
	sb, err := e.client.CreateSandboxAndWait(ctx, api.CreateSandboxRequest{})
	if err != nil {
		t.Fatal(err)
	}
	cmd, err := e.client.CreateCommand(ctx, sb.ID, api.CreateCommandRequest{ExecRequest: api.ExecRequest{Cmd: []string{"sh", "-c", "while :; do echo tick; sleep 0.05; done"}}})
	if err != nil {
		t.Fatal(err)
	}
	s, err := e.client.Attach(ctx, cmd, sdk.AttachOptions{Stdout: io.Discard})
	if err != nil {
		t.Fatal(err)
	}
	waitDone := make(chan error, 1)
	go func() { _, err := s.Wait(); waitDone <- err }()
	up := &slowReader{stop: make(chan struct{})}
	defer close(up.stop)
	upDone := make(chan error, 1)
	go func() {
		_, err := e.client.WriteFile(ctx, sb.ID, "/tmp/big", up, 0o644)
		upDone <- err
	}()
	time.Sleep(500 * time.Millisecond)
	op, err := e.client.DeleteSandbox(ctx, sb.ID, true)
	if err != nil {
		t.Fatal(err)
	}
	op, err = e.client.WaitOperation(ctx, op.ID)
	if err != nil || op.State != api.OpSucceeded {
		t.Fatalf("delete while busy: %v %+v", err, op)
	}
	for name, ch := range map[string]chan error{"attach": waitDone, "upload": upDone} {
		select {
		case err := <-ch:
			if err == nil {
				t.Errorf("%s ended without an error although its sandbox was deleted", name)
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("%s still hangs after its sandbox was deleted", name)
		}
	}
	if _, err := e.client.GetSandbox(ctx, sb.ID); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("sandbox still there: %v", err)
	}
}

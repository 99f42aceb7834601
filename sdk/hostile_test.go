package sdk

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/coder/websocket"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

// scripted serves an attach endpoint that sends fixed frames per connection
// and then either closes normally or drops.
func scripted(t *testing.T, conns ...[][]byte) (*Client, *atomic.Int32) {
	t.Helper()
	var n atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasSuffix(r.URL.Path, "/token") {
			writeJSON(w, 200, api.Command{ID: "c1", SandboxID: "sb", AttachToken: "tok-x"})
			return
		}
		i := int(n.Add(1)) - 1
		c, err := websocket.Accept(w, r, nil)
		if err != nil {
			return
		}
		defer c.CloseNow()
		if i >= len(conns) {
			return
		}
		for _, f := range conns[i] {
			if err := c.Write(r.Context(), websocket.MessageBinary, f); err != nil {
				return
			}
		}
	}))
	t.Cleanup(srv.Close)
	c, _ := New(srv.URL, testKey)
	return c, &n
}

func attachScripted(t *testing.T, c *Client) (api.ExitStatus, string, string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10e9)
	defer cancel()
	var out, errb bytes.Buffer
	s, err := c.Attach(ctx, &api.Command{ID: "c1", SandboxID: "sb", AttachToken: "tok-0"}, AttachOptions{Stdout: &out, Stderr: &errb})
	if err != nil {
		t.Fatal(err)
	}
	st, err := s.Wait()
	return st, out.String(), errb.String(), err
}

func TestAttachRejectsMalformedFrames(t *testing.T) {
	bigOffset := make([]byte, 9)
	bigOffset[0] = api.FrameStdout
	binary.BigEndian.PutUint64(bigOffset[1:], 1<<63)
	for name, frame := range map[string][]byte{
		"empty":          {},
		"short output":   {api.FrameStdout, 0, 0, 1},
		"huge offset":    bigOffset,
		"client frame":   {api.FrameStdin, 'x'},
		"unknown":        {200},
		"bad exit json":  append([]byte{api.FrameExit}, "{"...),
		"bad dropped":    append([]byte{api.FrameDropped}, `{"stream":"stdout","from":10,"to":5}`...),
		"dropped stream": append([]byte{api.FrameDropped}, `{"stream":"etc","from":0,"to":5}`...),
	} {
		c, _ := scripted(t, [][]byte{frame})
		_, _, _, err := attachScripted(t, c)
		if !errors.Is(err, errdefs.ErrUnprocessable) {
			t.Errorf("%s: err %v, want a protocol error", name, err)
		}
	}
}

func TestAttachGivesUpAfterFruitlessReattach(t *testing.T) {
	// Connection 1 delivers output then drops; connection 2 drops at once.
	// One re-attach per drop: the second drop without progress is final.
	c, n := scripted(t,
		[][]byte{api.EncodeOutput(api.FrameStdout, 0, []byte("ab"))},
		nil,
	)
	_, out, _, err := attachScripted(t, c)
	if err == nil || !strings.Contains(err.Error(), "connection lost") || out != "ab" {
		t.Fatalf("err %v out %q", err, out)
	}
	if got := n.Load(); got != 2 {
		t.Fatalf("%d connections, want 2 (one re-attach)", got)
	}
}

func TestAttachReportsGapAsDropped(t *testing.T) {
	exit := append([]byte{api.FrameExit}, `{"exit_code":0}`...)
	c, _ := scripted(t, [][]byte{
		api.EncodeOutput(api.FrameStdout, 0, []byte("ab")),
		api.EncodeOutput(api.FrameStdout, 10, []byte("cd")), // 8 bytes silently missing
		api.EncodeOutput(api.FrameStdout, 11, []byte("de")), // overlaps by one
		exit,
	})
	_, out, errOut, err := attachScripted(t, c)
	if err != nil || out != "abcde" || !strings.Contains(errOut, "[space: 8 bytes of output were dropped]") {
		t.Fatalf("err %v out %q stderr %q", err, out, errOut)
	}
}

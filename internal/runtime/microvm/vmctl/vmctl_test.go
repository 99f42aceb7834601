package vmctl

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/internal/errdefs"
)

type fakeHandler struct {
	seed     []byte
	t        int64
	hostname string
}

func (f *fakeHandler) Stats() (Stats, error) {
	return Stats{MemoryBytes: 42, OOMKills: 1, Pids: 3, MemoryCacheBytes: 7, DiskUsedBytes: 4096}, nil
}
func (f *fakeHandler) Restored(seed []byte, t int64, h string) error {
	if h == "bad" {
		return errors.New("refused")
	}
	f.seed, f.t, f.hostname = seed, t, h
	return nil
}

var _ Handler = (*fakeHandler)(nil)

func TestRoundTrip(t *testing.T) {
	host, guest := net.Pipe()
	h := &fakeHandler{}
	go Serve(guest, h)
	c := NewClient(host)
	defer c.Close()
	ctx := context.Background()
	if err := c.Ping(ctx); err != nil {
		t.Fatal(err)
	}
	s, err := c.Stats(ctx)
	if err != nil || s != (Stats{MemoryBytes: 42, OOMKills: 1, Pids: 3, MemoryCacheBytes: 7, DiskUsedBytes: 4096}) {
		t.Fatalf("stats %+v %v", s, err)
	}
	now := time.Unix(1700000000, 5)
	if err := c.Restored(ctx, []byte("0123456789abcdef"), now, "sb-1"); err != nil {
		t.Fatal(err)
	}
	if string(h.seed) != "0123456789abcdef" || h.t != now.UnixNano() || h.hostname != "sb-1" {
		t.Fatalf("handler got %+v", h)
	}
	if err := c.Restored(ctx, nil, now, "bad"); err == nil || !strings.Contains(err.Error(), "refused") {
		t.Fatalf("guest error not surfaced: %v", err)
	}
}

// A hostile guest: oversized lines, garbage, silence.
func TestClientDistrustsGuest(t *testing.T) {
	for name, reply := range map[string][]byte{
		"oversized": bytes.Repeat([]byte("x"), 2*MaxLine),
		"garbage":   []byte("{not json\n"),
		"negative":  []byte(`{"id":1,"stats":{"memory_bytes":-5,"oom_kills":-1,"pids":-9,"memory_cache_bytes":-3,"disk_used_bytes":-1}}` + "\n"),
	} {
		t.Run(name, func(t *testing.T) {
			host, guest := net.Pipe()
			go func() {
				buf := make([]byte, 4096)
				guest.Read(buf)
				guest.Write(reply)
			}()
			c := NewClient(host)
			defer c.Close()
			s, err := c.Stats(context.Background())
			if name == "negative" {
				if err != nil || s != (Stats{}) {
					t.Fatalf("negative counters: %+v %v", s, err)
				}
				return
			}
			if !errors.Is(err, errdefs.ErrUnavailable) {
				t.Fatalf("want ErrUnavailable, got %v", err)
			}
			if err := c.Ping(context.Background()); !errors.Is(err, errdefs.ErrUnavailable) {
				t.Fatalf("a broken connection must stay broken: %v", err)
			}
		})
	}
	t.Run("silent", func(t *testing.T) {
		host, guest := net.Pipe()
		defer guest.Close()
		go func() { buf := make([]byte, 4096); guest.Read(buf) }()
		c := NewClient(host)
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		defer cancel()
		if err := c.Ping(ctx); !errors.Is(err, errdefs.ErrUnavailable) {
			t.Fatalf("silent guest: %v", err)
		}
	})
}

// A reply to an earlier call (one whose caller gave up, or one sent by a
// restored copy of the guest) is skipped, never taken for the current one.
func TestStaleReplySkipped(t *testing.T) {
	host, guest := net.Pipe()
	defer guest.Close()
	go func() {
		buf := make([]byte, 4096)
		n, _ := guest.Read(buf)
		var req Request
		if err := json.Unmarshal(buf[:n], &req); err != nil {
			return
		}
		guest.Write([]byte(`{"id":999,"stats":{"memory_bytes":1}}` + "\n"))
		guest.Write([]byte(fmt.Sprintf(`{"id":%d,"stats":{"memory_bytes":7}}`+"\n", req.ID)))
	}()
	c := NewClient(host)
	s, err := c.Stats(context.Background())
	if err != nil || s.MemoryBytes != 7 {
		t.Fatalf("got %+v %v, want the reply to this call", s, err)
	}
}

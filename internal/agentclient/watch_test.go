package agentclient

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/agentproto"
	"github.com/spacehq/space/internal/errdefs"
)

// TestHostileWatchStream: whatever a hostile agent streams on a watch, the
// host passes on only valid events and ends with ErrUnavailable.
func TestHostileWatchStream(t *testing.T) {
	armed := `{"type":"watching"}` + "\n"
	cases := map[string]string{
		"not armed first":       `{"type":"create","name":"a"}` + "\n",
		"unknown type":          armed + `{"type":"explode","name":"a"}` + "\n",
		"watching twice":        armed + armed,
		"absolute name":         armed + `{"type":"create","name":"/etc/passwd"}` + "\n",
		"dotdot name":           armed + `{"type":"create","name":"../x"}` + "\n",
		"unclean name":          armed + `{"type":"create","name":"a//b"}` + "\n",
		"empty name":            armed + `{"type":"write","name":""}` + "\n",
		"overflow with a name":  armed + `{"type":"overflow","name":"a"}` + "\n",
		"long name":             armed + `{"type":"create","name":"` + strings.Repeat("a", agentproto.MaxPathLen+1) + `"}` + "\n",
		"oversized line":        armed + `{"type":"create","name":"` + strings.Repeat("\\u0061", agentproto.MaxWatchLine) + `"}` + "\n",
		"not JSON":              armed + "garbage\n",
		"event after gone":      armed + `{"type":"remove","name":"."}` + "\n" + `{"type":"create","name":"a"}` + "\n",
		"ends without a reason": armed + `{"type":"create","name":"ok/fine.txt"}` + "\n",
	}
	for name, body := range cases {
		t.Run(name, func(t *testing.T) {
			mux := http.NewServeMux()
			mux.HandleFunc("GET "+agentproto.PathFilesWatch, func(w http.ResponseWriter, r *http.Request) {
				w.Write([]byte(body))
			})
			c := fakeAgent(t, mux, 5*time.Second)
			var got []api.FileEvent
			var err error
			within(t, 10*time.Second, func() {
				err = c.Watch(context.Background(), api.WatchRequest{Path: "/w"}, func(ev api.FileEvent) error {
					got = append(got, ev)
					return nil
				})
			})
			if !errors.Is(err, errdefs.ErrUnavailable) {
				t.Fatalf("error %v, want unavailable", err)
			}
			for _, ev := range got[min(1, len(got)):] {
				if ev.Name != "ok/fine.txt" && ev.Name != "." {
					t.Fatalf("passed on %+v", ev)
				}
			}
		})
	}
	// A clean end after the directory's own removal is ErrNotFound.
	mux := http.NewServeMux()
	mux.HandleFunc("GET "+agentproto.PathFilesWatch, func(w http.ResponseWriter, r *http.Request) {
		w.Write([]byte(armed + `{"type":"remove","name":".","time":"1999-01-01T00:00:00Z"}` + "\n"))
	})
	c := fakeAgent(t, mux, 5*time.Second)
	var last api.FileEvent
	err := c.Watch(context.Background(), api.WatchRequest{Path: "/w"}, func(ev api.FileEvent) error { last = ev; return nil })
	if !errors.Is(err, errdefs.ErrNotFound) || last.Type != api.FileEventRemove {
		t.Fatalf("removed dir: %v, last %+v", err, last)
	}
	if time.Since(last.Time) > time.Minute {
		t.Fatalf("the agent's clock was passed on: %v", last.Time)
	}
}

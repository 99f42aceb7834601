package e2b

import (
	"encoding/json"
	"errors"
	"io"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/internal/errdefs"
)

// TestMergeList: two nodes' listings make one, ordered and paged as one
// server would page it.
func TestMergeList(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	listing := func(ids ...string) io.Reader {
		var out []e2bListed
		for _, id := range ids {
			n := int(id[len(id)-1] - '0')
			out = append(out, e2bListed{SandboxID: id, StartedAt: t0.Add(time.Duration(n) * time.Minute)})
		}
		b, _ := json.Marshal(out)
		return strings.NewReader(string(b))
	}
	ids := func(page []byte) string {
		var l []e2bListed
		if err := json.Unmarshal(page, &l); err != nil {
			t.Fatal(err)
		}
		var s []string
		for _, x := range l {
			s = append(s, x.SandboxID)
		}
		return strings.Join(s, ",")
	}
	q := url.Values{"limit": {"2"}}
	page, next, err := MergeList([]io.Reader{listing("sb-a1", "sb-a4"), listing("sb-b2", "sb-b3")}, q)
	if err != nil || ids(page) != "sb-a1,sb-b2" || next != "sb-b2" {
		t.Fatalf("first page: %s %q %v", page, next, err)
	}
	q.Set("nextToken", next)
	page, next, err = MergeList([]io.Reader{listing("sb-a1", "sb-a4"), listing("sb-b2", "sb-b3")}, q)
	if err != nil || ids(page) != "sb-b3,sb-a4" || next != "" {
		t.Fatalf("second page: %s %q %v", page, next, err)
	}
	if _, _, err := MergeList([]io.Reader{strings.NewReader("{")}, url.Values{}); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("a node's bad listing: %v", err)
	}
	if _, _, err := MergeList(nil, url.Values{"limit": {"0"}}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("a bad limit: %v", err)
	}
}

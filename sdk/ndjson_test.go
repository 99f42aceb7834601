package sdk

import (
	"bufio"
	"context"
	"errors"
	"io"
	"strings"
	"testing"

	"github.com/spacehq/space/internal/errdefs"
)

type ndLine struct {
	N int `json:"n"`
}

// brokenReader yields s, then fails with err.
type brokenReader struct {
	s   io.Reader
	err error
}

func (r *brokenReader) Read(p []byte) (int, error) {
	n, err := r.s.Read(p)
	if err == io.EOF {
		return n, r.err
	}
	return n, err
}

func TestReadNDJSON(t *testing.T) {
	s := ndjsonStream{what: "things of sb", item: "thing", maxLine: 64}
	collect := func(ctx context.Context, body io.Reader, s ndjsonStream, stopAt int) ([]int, error) {
		var got []int
		err := readNDJSON(ctx, body, s, func(l ndLine) error {
			got = append(got, l.N)
			if l.N == stopAt {
				return errStopStream
			}
			return nil
		})
		return got, err
	}
	ctx := context.Background()

	got, err := collect(ctx, strings.NewReader("{\"n\":1}\n\n{\"n\":2}\n{\"n\":3}"), s, -1)
	if err != nil || len(got) != 3 || got[2] != 3 {
		t.Fatalf("whole stream: %v %v", got, err)
	}
	if got, err := collect(ctx, strings.NewReader("{\"n\":1}\n{\"n\":2}\n{\"n\":3}\n"), s, 2); err != nil || len(got) != 2 {
		t.Fatalf("stopped at 2: %v %v", got, err)
	}
	if _, err := collect(ctx, strings.NewReader("{\"n\":1}\nnope\n"), s, -1); err == nil || !strings.HasPrefix(err.Error(), "things of sb: bad thing line: ") {
		t.Fatalf("bad line: %v", err)
	}
	long := "{\"n\":1,\"pad\":\"" + strings.Repeat("x", 64) + "\"}\n"
	if _, err := collect(ctx, strings.NewReader(long), s, -1); !errors.Is(err, bufio.ErrTooLong) || !strings.HasPrefix(err.Error(), "things of sb: ") {
		t.Fatalf("line over the bound: %v", err)
	}
	boom := errors.New("boom")
	if err := readNDJSON(ctx, strings.NewReader("{\"n\":1}\n"), s, func(ndLine) error { return boom }); err != boom {
		t.Fatalf("fn's error: %v, want it as it is", err)
	}

	cut := errors.New("connection reset")
	if _, err := collect(ctx, &brokenReader{strings.NewReader("{\"n\":1}\n"), cut}, s, -1); !errors.Is(err, cut) || errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("broken stream: %v", err)
	}
	sb := s
	sb.broken = errdefs.ErrUnavailable
	if _, err := collect(ctx, &brokenReader{strings.NewReader("{\"n\":1}\n"), cut}, sb, -1); !errors.Is(err, cut) || !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("broken stream with a kind: %v", err)
	}
	// A read failure once the caller's ctx has ended is how a follow ends.
	done, cancel := context.WithCancel(ctx)
	cancel()
	if got, err := collect(done, &brokenReader{strings.NewReader("{\"n\":1}\n"), context.Canceled}, sb, -1); err != nil || len(got) != 1 {
		t.Fatalf("cancelled follow: %v %v", got, err)
	}
}

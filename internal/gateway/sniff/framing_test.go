package sniff

import (
	"errors"
	"strings"
	"testing"
)

// Every request head whose body two HTTP/1.1 readers could frame
// differently is refused, by Peek (the first request) and by
// ParseRequestHead (every later one) alike.
func TestHTTPFraming(t *testing.T) {
	cases := []struct {
		head    string
		err     error
		upgrade bool
		body    bool
	}{
		{"GET / HTTP/1.1\r\nHost: a.com", nil, false, false},
		{"GET / HTTP/1.1\r\nHost: a.com\r\nContent-Length: 0", nil, false, false},
		{"GET / HTTP/1.1\r\nHost: a.com\r\nContent-Length: 000", nil, false, false},
		{"POST / HTTP/1.1\r\nHost: a.com\r\nContent-Length: 12", nil, false, true},
		{"POST / HTTP/1.1\r\nHost: a.com\r\nTransfer-Encoding: Chunked", nil, false, true},
		{"DELETE /x HTTP/1.1\r\nHost: a.com\r\nContent-Length: 2", nil, false, true},
		{"GET /ws HTTP/1.1\r\nHost: a.com\r\nUpgrade: websocket\r\nConnection: Upgrade", nil, true, false},
		{"GET / HTTP/1.1\r\nHost: a.com\r\nConnection: keep-alive, Upgrade", nil, false, false},

		{"GET / HTTP/1.1\r\nHost: a.com\r\nContent-Length: 40", ErrFraming, false, false},
		{"HEAD / HTTP/1.1\r\nHost: a.com\r\nContent-Length: 1", ErrFraming, false, false},
		{"TRACE / HTTP/1.1\r\nHost: a.com\r\nTransfer-Encoding: chunked", ErrFraming, false, false},
		{"CONNECT a.com:443 HTTP/1.1\r\nHost: a.com:443\r\nContent-Length: 5", ErrFraming, false, false},
		{"GET / HTTP/1.1\r\nHost: a.com\r\nTransfer-Encoding: chunked", ErrFraming, false, false},
		{"POST / HTTP/1.1\r\nHost: a.com\r\nContent-Length: 3\r\nTransfer-Encoding: chunked", ErrFraming, false, false},
		{"POST / HTTP/1.1\r\nHost: a.com\r\nTransfer-Encoding: chunked\r\nContent-Length: 3", ErrFraming, false, false},
		{"POST / HTTP/1.1\r\nHost: a.com\r\nContent-Length: 3\r\nContent-Length: 3", ErrFraming, false, false},
		{"POST / HTTP/1.1\r\nHost: a.com\r\nContent-Length: 3\r\nContent-Length: 4", ErrFraming, false, false},
		{"POST / HTTP/1.1\r\nHost: a.com\r\nContent-Length: 3, 3", ErrFraming, false, false},
		{"POST / HTTP/1.1\r\nHost: a.com\r\nContent-Length: +3", ErrFraming, false, false},
		{"POST / HTTP/1.1\r\nHost: a.com\r\nContent-Length: 0x3", ErrFraming, false, false},
		{"POST / HTTP/1.1\r\nHost: a.com\r\nContent-Length: 99999999999999999999", ErrFraming, false, false},
		{"POST / HTTP/1.1\r\nHost: a.com\r\nContent-Length:", ErrFraming, false, false},
		{"POST / HTTP/1.1\r\nHost: a.com\r\nTransfer-Encoding: xchunked", ErrFraming, false, false},
		{"POST / HTTP/1.1\r\nHost: a.com\r\nTransfer-Encoding: chunked, identity", ErrFraming, false, false},
		{"POST / HTTP/1.1\r\nHost: a.com\r\nTransfer-Encoding: identity", ErrFraming, false, false},
		{"POST / HTTP/1.1\r\nHost: a.com\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked", ErrFraming, false, false},
		{"POST / HTTP/1.0\r\nHost: a.com\r\nTransfer-Encoding: chunked", ErrFraming, false, false},
		{"POST / HTTP/1.1\r\nHost: a.com\r\nTransfer-Encoding: chunked\r\nTrailer: Host", ErrFraming, false, false},
		{"GET / HTTP/1.1\r\nHost: a.com\r\nConnection: close, Content-Length", ErrFraming, false, false},
		{"GET / HTTP/1.1\r\nHost: a.com\r\nConnection: host", ErrFraming, false, false},
		{"POST / HTTP/1.1\r\nHost: a.com\r\nContent-Length : 3", ErrMalformed, false, false},
		{"POST / HTTP/1.1\r\nHost: a.com\r\nTransfer-Encoding:\tchunked\r\n x", ErrMalformed, false, false},
		{"GET / HTTP/1.1\r\nHost: a.com\r\n cdn-b.test", ErrMalformed, false, false},
		{"GET / HTTP/1.1\r\nHost: a.com:,b.com", ErrMalformed, false, false},
		{"GET / HTTP/1.1\r\nHost: a.com,b.com", ErrBadName, false, false},
	}
	for _, c := range cases {
		check := func(how string, res Result) {
			t.Helper()
			if res.Kind != HTTP || !errors.Is(res.Err, c.err) || (c.err == nil) != (res.Err == nil) {
				t.Errorf("%s %q: %+v, want err %v", how, c.head, res, c.err)
				return
			}
			if c.err == nil && (res.Upgrade != c.upgrade || res.Body != c.body || res.Name != "a.com") {
				t.Errorf("%s %q: %+v", how, c.head, res)
			}
		}
		_, res, err := Peek(strings.NewReader(c.head+"\r\n\r\n"), 0)
		if err != nil {
			t.Errorf("peek %q: %v", c.head, err)
		}
		check("peek", res)
		check("head", ParseRequestHead([]byte(c.head)))
	}
	// Line ends other than CRLF anywhere in a later request's head.
	for _, h := range []string{"GET / HTTP/1.1\nHost: a.com", "GET / HTTP/1.1\r\nHost: a.com\r", "GET / HTTP/1.1\r\nX: a\rHost: a.com"} {
		if res := ParseRequestHead([]byte(h)); !errors.Is(res.Err, ErrMalformed) {
			t.Errorf("%q: %+v", h, res)
		}
	}
	if res := ParseRequestHead([]byte("get / HTTP/1.1\r\nHost: a.com")); res.Err == nil {
		t.Errorf("lowercase method accepted: %+v", res)
	}
}

package gatewaytest

import (
	"bufio"
	"errors"
	"io"
	"strconv"
	"strings"
)

// ErrLenientBad: even a lenient server cannot read the request.
var ErrLenientBad = errors.New("bad request")

// LenientRequest is one request as a lenient HTTP/1.x server reads it.
type LenientRequest struct {
	Method, Target string
	// Route is the name the server serves: the last item of the last Host
	// value (a list or a folded value), lowercased, without its port.
	Route string
	// Names are every name a lenient router might route by: each item of
	// each Host value, an absolute URI's and a CONNECT's authority, and a
	// Host in the trailer fields — lowercased, without ports.
	Names   []string
	RawHost string // the last Host value as sent
	Upgrade string
	Close   bool
	Body    []byte
	Header  map[string]string // the first value of each field, by lowercased name
}

// Named says whether any name of the request contains s.
func (r *LenientRequest) Named(s string) bool {
	for _, n := range r.Names {
		if strings.Contains(n, s) {
			return true
		}
	}
	return false
}

// Lenient reads requests the way a permissive upstream does — the union of
// what real servers forgive: empty lines before the request line, a method
// in any case, bare LF, obs-fold, white space around a field name, a body
// on GET or HEAD ignored whatever its framing says, the first of several
// lengths, "chunked" anywhere in a Transfer-Encoding, and a length a proxy
// drops when Connection names it. Servers differ on a length together
// with a chunked coding: LengthFirst picks the length.
type Lenient struct {
	LengthFirst bool
}

// Read reads one request from br.
func (l Lenient) Read(br *bufio.Reader) (*LenientRequest, error) {
	readLine := func() (string, error) {
		s, err := br.ReadString('\n')
		if err != nil {
			return "", err
		}
		return strings.TrimRight(s, "\r\n"), nil
	}
	line := ""
	for i := 0; line == ""; i++ {
		if i > 16 {
			return nil, ErrLenientBad
		}
		s, err := readLine()
		if err != nil {
			return nil, err
		}
		line = strings.TrimSpace(s)
	}
	f := strings.Fields(line)
	if len(f) != 3 || !strings.HasPrefix(strings.ToUpper(f[2]), "HTTP/1.") {
		return nil, ErrLenientBad
	}
	r := &LenientRequest{Method: strings.ToUpper(f[0]), Target: f[1], Header: map[string]string{}}
	if i := strings.Index(strings.ToLower(r.Target), "://"); i >= 0 {
		auth := r.Target[i+3:]
		if j := strings.IndexAny(auth, "/?#"); j >= 0 {
			auth = auth[:j]
		}
		r.Names = append(r.Names, nameOf(auth))
	}
	if r.Method == "CONNECT" {
		r.Names = append(r.Names, nameOf(r.Target))
	}
	var fields [][2]string
	for {
		s, err := readLine()
		if err != nil {
			return nil, err
		}
		if s == "" {
			break
		}
		if s[0] == ' ' || s[0] == '\t' { // obs-fold: continues the previous value
			if len(fields) > 0 {
				fields[len(fields)-1][1] += " " + strings.TrimSpace(s)
			}
			continue
		}
		k, v, ok := strings.Cut(s, ":")
		if !ok {
			return nil, ErrLenientBad
		}
		fields = append(fields, [2]string{strings.ToLower(strings.TrimSpace(k)), strings.TrimSpace(v)})
	}
	var cl, te []string
	for _, h := range fields {
		if _, seen := r.Header[h[0]]; !seen {
			r.Header[h[0]] = h[1]
		}
		switch h[0] {
		case "host":
			r.RawHost = h[1]
			for _, tok := range hostItems(h[1]) {
				r.Names = append(r.Names, nameOf(tok))
			}
		case "content-length":
			cl = append(cl, h[1])
		case "transfer-encoding":
			te = append(te, h[1])
		case "connection":
			r.Close = r.Close || strings.Contains(strings.ToLower(h[1]), "close")
		case "upgrade":
			r.Upgrade = h[1]
		}
	}
	if items := hostItems(r.RawHost); len(items) > 0 {
		r.Route = nameOf(items[len(items)-1])
	}
	if strings.Contains(strings.ToLower(r.Header["connection"]), "content-length") {
		cl = nil // a proxy drops the fields Connection names
	}
	chunked := strings.Contains(strings.ToLower(strings.Join(te, ",")), "chunked")
	switch {
	case r.Method == "GET" || r.Method == "HEAD":
		// The body is ignored: what follows is the next request.
	case len(cl) > 0 && (l.LengthFirst || !chunked):
		n, err := strconv.Atoi(strings.TrimLeft(cl[0], "+"))
		if err != nil || n < 0 || n > 1<<20 {
			return nil, ErrLenientBad
		}
		r.Body = make([]byte, n)
		if _, err := io.ReadFull(br, r.Body); err != nil {
			return nil, err
		}
	case chunked:
		for {
			s, err := readLine()
			if err != nil {
				return nil, err
			}
			size, _, _ := strings.Cut(s, ";")
			n, err := strconv.ParseInt(strings.TrimSpace(size), 16, 32)
			if err != nil || n < 0 || n > 1<<20 {
				return nil, ErrLenientBad
			}
			if n == 0 {
				for { // trailer fields: some servers merge them into the header
					t, err := readLine()
					if err != nil {
						return nil, err
					}
					if t == "" {
						return r, nil
					}
					if k, v, ok := strings.Cut(t, ":"); ok && strings.EqualFold(strings.TrimSpace(k), "host") {
						r.Names = append(r.Names, nameOf(strings.TrimSpace(v)))
					}
				}
			}
			chunk := make([]byte, n)
			if _, err := io.ReadFull(br, chunk); err != nil {
				return nil, err
			}
			r.Body = append(r.Body, chunk...)
			if _, err := readLine(); err != nil {
				return nil, err
			}
		}
	}
	return r, nil
}

// hostItems splits a Host value the way a lenient router does: a list, or
// a folded value, is several names.
func hostItems(v string) []string {
	return strings.FieldsFunc(v, func(r rune) bool { return r == ',' || r == ' ' || r == '\t' })
}

// nameOf is the name part of host[:port], lowercased, without a trailing dot.
func nameOf(h string) string {
	if i := strings.LastIndexByte(h, ':'); i >= 0 && !strings.Contains(h[i:], "]") {
		h = h[:i]
	}
	return strings.TrimSuffix(strings.ToLower(h), ".")
}

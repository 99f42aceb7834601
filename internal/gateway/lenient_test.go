package gateway

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
)

// lenientRequest is one request as a lenient HTTP/1.x server reads it: the
// union of what real servers forgive (empty lines and white space before
// the request line, a method in any case, bare LF, obs-fold, white space
// before a header's colon, a body on GET or HEAD ignored whatever its
// length says, the first of several lengths, "chunked" anywhere in a
// Transfer-Encoding). hosts are every name it could route by (each Host
// value and an absolute URI's authority), lowercased.
type lenientRequest struct {
	method, target string
	hosts          []string
	upgrade        bool
	headers        map[string]string
}

// readLenient reads one request the lenient way.
func readLenient(br *bufio.Reader) (*lenientRequest, error) {
	var line string
	for {
		l, err := br.ReadString('\n')
		if err != nil {
			return nil, err
		}
		if line = strings.Trim(l, " \t\r\n"); line != "" {
			break
		}
	}
	f := strings.Fields(line)
	if len(f) < 2 {
		return nil, fmt.Errorf("request line %q", line)
	}
	r := &lenientRequest{method: strings.ToUpper(f[0]), target: f[1], headers: map[string]string{}}
	if i := strings.Index(strings.ToLower(r.target), "://"); i >= 0 {
		auth := r.target[i+3:]
		if j := strings.IndexAny(auth, "/?#"); j >= 0 {
			auth = auth[:j]
		}
		r.hosts = append(r.hosts, strings.ToLower(auth))
	}
	if r.method == "CONNECT" {
		r.hosts = append(r.hosts, strings.ToLower(r.target))
	}
	var last string
	var cl, te []string
	for {
		l, err := br.ReadString('\n')
		if err != nil {
			return nil, err
		}
		l = strings.TrimRight(l, "\r\n")
		if l == "" {
			break
		}
		if (l[0] == ' ' || l[0] == '\t') && last != "" {
			r.headers[last] += " " + strings.TrimSpace(l) // obs-fold
			if last == "host" {
				r.hosts[len(r.hosts)-1] += " " + strings.ToLower(strings.TrimSpace(l))
			}
			continue
		}
		name, value, ok := strings.Cut(l, ":")
		if !ok {
			continue
		}
		name = strings.ToLower(strings.TrimSpace(name))
		value = strings.TrimSpace(value)
		last = name
		switch name {
		case "host":
			r.hosts = append(r.hosts, strings.ToLower(value))
		case "content-length":
			cl = append(cl, value)
		case "transfer-encoding":
			te = append(te, value)
		case "upgrade":
			r.upgrade = true
		}
		if _, seen := r.headers[name]; !seen {
			r.headers[name] = value
		}
	}
	switch {
	case r.method == "GET" || r.method == "HEAD":
		// The body is ignored: what follows is the next request.
	case strings.Contains(strings.ToLower(strings.Join(te, ",")), "chunked"):
		for {
			l, err := br.ReadString('\n')
			if err != nil {
				return nil, err
			}
			l = strings.TrimSpace(l)
			if i := strings.IndexByte(l, ';'); i >= 0 {
				l = l[:i]
			}
			n, err := strconv.ParseInt(l, 16, 64)
			if err != nil || n < 0 {
				return nil, fmt.Errorf("chunk size %q", l)
			}
			if n == 0 {
				for { // trailer fields
					t, err := br.ReadString('\n')
					if err != nil {
						return nil, err
					}
					if strings.TrimRight(t, "\r\n") == "" {
						break
					}
					if h, v, ok := strings.Cut(t, ":"); ok && strings.EqualFold(strings.TrimSpace(h), "host") {
						r.hosts = append(r.hosts, strings.ToLower(strings.TrimSpace(v)))
					}
				}
				break
			}
			if _, err := io.CopyN(io.Discard, br, n); err != nil {
				return nil, err
			}
			if _, err := br.ReadString('\n'); err != nil {
				return nil, err
			}
		}
	case len(cl) > 0 && !strings.Contains(strings.ToLower(r.headers["connection"]), "content-length"):
		// (A proxy drops the fields Connection lists, the length too.)
		v := strings.TrimLeft(cl[0], "+ ")
		end := 0
		for end < len(v) && v[end] >= '0' && v[end] <= '9' {
			end++
		}
		n, _ := strconv.ParseInt(v[:end], 10, 64)
		if _, err := io.CopyN(io.Discard, br, n); err != nil {
			return nil, err
		}
	}
	return r, nil
}

// hostOf is the name part of a Host value as a lenient router takes it.
func hostOf(h string) string {
	if i := strings.LastIndexByte(h, ':'); i >= 0 && !strings.Contains(h[i:], "]") {
		h = h[:i]
	}
	return strings.TrimSuffix(h, ".")
}

// lenientCDN is one "shared CDN address" serving every name, routing by
// Host the lenient way; it records each Host it served. On /ws with
// Upgrade it switches to an echo; a CONNECT with "X-Proxy: yes" gets a 200
// and the tunnel is served by the same lenient server.
type lenientCDN struct {
	mu     sync.Mutex
	served []string
	lns    []net.Listener
}

func startLenientCDN(t *testing.T, addr string, ports int) (*lenientCDN, []uint16) {
	t.Helper()
	cdn := &lenientCDN{}
	var out []uint16
	for range ports {
		ln, err := net.Listen("tcp", addr+":0")
		if err != nil {
			t.Fatal(err)
		}
		cdn.lns = append(cdn.lns, ln)
		out = append(out, uint16(ln.Addr().(*net.TCPAddr).Port))
		go func() {
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				go cdn.serve(c)
			}
		}()
	}
	t.Cleanup(func() {
		for _, ln := range cdn.lns {
			ln.Close()
		}
	})
	return cdn, out
}

func (cdn *lenientCDN) serve(c net.Conn) {
	defer c.Close()
	br := bufio.NewReader(c)
	for {
		r, err := readLenient(br)
		if err != nil {
			return
		}
		host := ""
		if len(r.hosts) > 0 {
			host = r.hosts[len(r.hosts)-1]
		}
		cdn.mu.Lock()
		cdn.served = append(cdn.served, r.hosts...)
		cdn.mu.Unlock()
		switch {
		case r.method == "CONNECT" && r.headers["x-proxy"] == "yes":
			fmt.Fprint(c, "HTTP/1.1 200 Connection established\r\n\r\n")
			continue // the tunnel: more requests, served here
		case r.method == "CONNECT":
			fmt.Fprint(c, "HTTP/1.1 405 Method Not Allowed\r\nContent-Length: 0\r\n\r\n")
			continue
		case r.upgrade && r.target == "/ws":
			fmt.Fprint(c, "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
			_, _ = io.Copy(c, br)
			return
		}
		body := "host=" + hostOf(host)
		fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	}
}

// reached says whether the CDN served a request naming name.
func (cdn *lenientCDN) reached(name string) bool {
	cdn.mu.Lock()
	defer cdn.mu.Unlock()
	for _, h := range cdn.served {
		if strings.Contains(h, name) {
			return true
		}
	}
	return false
}

func (cdn *lenientCDN) forget() {
	cdn.mu.Lock()
	cdn.served = nil
	cdn.mu.Unlock()
}

// lenientAll parses a whole forwarded stream the lenient way.
func lenientAll(b []byte) ([]*lenientRequest, error) {
	br := bufio.NewReader(bytes.NewReader(b))
	var out []*lenientRequest
	for {
		r, err := readLenient(br)
		if err == io.EOF {
			return out, nil
		}
		if err != nil {
			return out, err
		}
		out = append(out, r)
	}
}

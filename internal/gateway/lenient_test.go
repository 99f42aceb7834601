package gateway

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"testing"

	"github.com/spacehq/space/internal/gateway/gatewaytest"
)

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
		r, err := gatewaytest.Lenient{}.Read(br)
		if err != nil {
			return
		}
		cdn.mu.Lock()
		cdn.served = append(cdn.served, r.Names...)
		cdn.mu.Unlock()
		switch {
		case r.Method == "CONNECT" && r.Header["x-proxy"] == "yes":
			fmt.Fprint(c, "HTTP/1.1 200 Connection established\r\n\r\n")
			continue // the tunnel: more requests, served here
		case r.Method == "CONNECT":
			fmt.Fprint(c, "HTTP/1.1 405 Method Not Allowed\r\nContent-Length: 0\r\n\r\n")
			continue
		case r.Upgrade != "" && r.Target == "/ws":
			fmt.Fprint(c, "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
			_, _ = io.Copy(c, br)
			return
		}
		body := "host=" + r.Route
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
func lenientAll(b []byte) ([]*gatewaytest.LenientRequest, error) {
	br := bufio.NewReader(bytes.NewReader(b))
	var out []*gatewaytest.LenientRequest
	for {
		r, err := gatewaytest.Lenient{}.Read(br)
		if err == io.EOF {
			return out, nil
		}
		if err != nil {
			return out, err
		}
		out = append(out, r)
	}
}

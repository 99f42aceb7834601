package sniff

import (
	"bytes"
	"crypto/ecdh"
	"crypto/rand"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"strings"
	"testing"
	"time"
)

// clientHello runs a crypto/tls client handshake into an in-memory pipe
// and returns the first record it writes (Go writes the ClientHello in one).
func clientHello(t testing.TB, cfg *tls.Config) []byte {
	t.Helper()
	c, s := net.Pipe()
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = tls.Client(c, cfg).Handshake()
		c.Close()
	}()
	hdr := make([]byte, 5)
	if _, err := io.ReadFull(s, hdr); err != nil {
		t.Fatal(err)
	}
	body := make([]byte, binary.BigEndian.Uint16(hdr[3:]))
	if _, err := io.ReadFull(s, body); err != nil {
		t.Fatal(err)
	}
	s.Close()
	<-done
	return append(hdr, body...)
}

// refragment re-splits the handshake bytes of rec (one record) into
// records of at most n bytes each.
func refragment(rec []byte, n int) []byte {
	hs := rec[5:]
	var out []byte
	for len(hs) > 0 {
		k := min(n, len(hs))
		out = append(out, 0x16, 3, 1, byte(k>>8), byte(k))
		out = append(out, hs[:k]...)
		hs = hs[k:]
	}
	return out
}

type oneByteReader struct{ r io.Reader }

func (o oneByteReader) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	return o.r.Read(p[:1])
}

// echConfigList builds a syntactically valid ECHConfigList (RFC 9849) for
// a fresh X25519 key, so crypto/tls sends a real ECH ClientHello.
func echConfigList(t testing.TB, publicName string) []byte {
	t.Helper()
	key, err := ecdh.X25519().GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	pub := key.PublicKey().Bytes()
	var c []byte
	c = append(c, 7)          // config_id
	c = append(c, 0x00, 0x20) // DHKEM(X25519, HKDF-SHA256)
	c = binary.BigEndian.AppendUint16(c, uint16(len(pub)))
	c = append(c, pub...)
	c = append(c, 0, 4, 0, 1, 0, 1) // HKDF-SHA256, AES-128-GCM
	c = append(c, 0)                // maximum_name_length
	c = append(c, byte(len(publicName)))
	c = append(c, publicName...)
	c = append(c, 0, 0) // extensions
	var cfg []byte
	cfg = append(cfg, 0xfe, 0x0d)
	cfg = binary.BigEndian.AppendUint16(cfg, uint16(len(c)))
	cfg = append(cfg, c...)
	return append(binary.BigEndian.AppendUint16(nil, uint16(len(cfg))), cfg...)
}

func TestTLSReal(t *testing.T) {
	withSNI := clientHello(t, &tls.Config{ServerName: "Example.COM."})
	noSNI := clientHello(t, &tls.Config{InsecureSkipVerify: true})
	ipSNI := clientHello(t, &tls.Config{ServerName: "192.0.2.1"}) // Go sends no SNI for IPs
	ech := clientHello(t, &tls.Config{ServerName: "secret.example.com", MinVersion: tls.VersionTLS13, EncryptedClientHelloConfigList: echConfigList(t, "public.example.net")})
	cases := []struct {
		label string
		in    []byte
		r     func([]byte) io.Reader
		name  string
		ech   bool
	}{
		{"sni", withSNI, nil, "example.com", false},
		{"no sni", noSNI, nil, "", false},
		{"ip", ipSNI, nil, "", false},
		{"ech", ech, nil, "public.example.net", true},
		{"sni 1-byte reads", withSNI, func(b []byte) io.Reader { return oneByteReader{bytes.NewReader(b)} }, "example.com", false},
		{"sni 7-byte records", refragment(withSNI, 7), nil, "example.com", false},
		{"sni 1-byte records, 1-byte reads", refragment(withSNI, 1), func(b []byte) io.Reader { return oneByteReader{bytes.NewReader(b)} }, "example.com", false},
		{"ech 100-byte records", refragment(ech, 100), nil, "public.example.net", true},
	}
	for _, c := range cases {
		in := append(append([]byte(nil), c.in...), "trailing application bytes"...)
		var r io.Reader = bytes.NewReader(in)
		if c.r != nil {
			r = c.r(in)
		}
		out, res, err := Peek(r, 64<<10)
		if err != nil || res.Err != nil || res.Kind != TLS || res.Name != c.name || res.ECH != c.ech {
			t.Errorf("%s: %+v, %v", c.label, res, err)
		}
		rest, _ := io.ReadAll(r)
		if !bytes.Equal(append(out, rest...), in) {
			t.Errorf("%s: returned bytes + unread != input", c.label)
		}
	}
}

// hello builds a ClientHello record around the given extensions block
// (nil: no extensions field at all).
func hello(exts []byte) []byte {
	var b []byte
	b = append(b, 3, 3)
	b = append(b, make([]byte, 32)...)
	b = append(b, 0)             // session id
	b = append(b, 0, 2, 0x13, 1) // one cipher suite
	b = append(b, 1, 0)          // null compression
	if exts != nil {
		b = binary.BigEndian.AppendUint16(b, uint16(len(exts)))
		b = append(b, exts...)
	}
	hs := []byte{1, byte(len(b) >> 16), byte(len(b) >> 8), byte(len(b))}
	hs = append(hs, b...)
	rec := []byte{0x16, 3, 1, byte(len(hs) >> 8), byte(len(hs))}
	return append(rec, hs...)
}

func ext(typ uint16, data []byte) []byte {
	b := binary.BigEndian.AppendUint16(nil, typ)
	b = binary.BigEndian.AppendUint16(b, uint16(len(data)))
	return append(b, data...)
}

func sni(names ...string) []byte {
	var list []byte
	for _, n := range names {
		list = append(list, 0)
		list = binary.BigEndian.AppendUint16(list, uint16(len(n)))
		list = append(list, n...)
	}
	return ext(0, append(binary.BigEndian.AppendUint16(nil, uint16(len(list))), list...))
}

func TestTLSCrafted(t *testing.T) {
	cat := func(bs ...[]byte) []byte { return bytes.Join(bs, nil) }
	cases := []struct {
		label string
		in    []byte
		kind  Kind
		name  string
		err   error
	}{
		{"no extensions", hello(nil), TLS, "", nil},
		{"empty extensions", hello([]byte{}), TLS, "", nil},
		{"sni", hello(sni("a.example.com")), TLS, "a.example.com", nil},
		{"sni trailing dot", hello(sni("A.Example.com.")), TLS, "a.example.com", nil},
		{"sni ip literal", hello(sni("2001:db8::1")), TLS, "2001:db8::1", nil},
		{"sni other name type skipped", hello(ext(0, []byte{0, 4, 9, 0, 1, 'x'})), TLS, "", nil},
		{"ech outer", hello(cat(sni("pub.example.net"), ext(0xfe0d, []byte{1, 2, 3}))), TLS, "pub.example.net", nil},
		{"sni bad char", hello(sni("a_b!.com")), TLS, "", ErrBadName},
		{"sni nul", hello(sni("evil.com\x00.good.com")), TLS, "", ErrBadName},
		{"sni empty", hello(sni("")), TLS, "", ErrBadName},
		{"sni two", hello(sni("a.com", "b.com")), TLS, "", ErrDuplicateSNI},
		{"repeated extension", hello(cat(sni("a.com"), sni("b.com"))), TLS, "", ErrMalformed},
		{"sni empty list", hello(ext(0, []byte{0, 0})), TLS, "", ErrMalformed},
		{"sni list too long", hello(ext(0, []byte{0xff, 0xff, 0, 0, 1, 'a'})), TLS, "", ErrMalformed},
		{"sni name too long", hello(ext(0, []byte{0, 4, 0, 0xff, 0xff, 'a'})), TLS, "", ErrMalformed},
		{"sni trailing bytes", hello(ext(0, []byte{0, 4, 0, 0, 1, 'a', 9})), TLS, "", ErrMalformed},
		{"extension too long", hello([]byte{0, 0, 0xff, 0xff}), TLS, "", ErrMalformed},
		{"extension header cut", hello([]byte{0, 0, 0}), TLS, "", ErrMalformed},
		{"not a ClientHello", []byte{0x16, 3, 1, 0, 4, 2, 0, 0, 0}, TLS, "", ErrMalformed},
		{"zero-length record", []byte{0x16, 3, 1, 0, 0}, TLS, "", ErrMalformed},
		{"record length over 2^14", []byte{0x16, 3, 1, 0x40, 0x01}, TLS, "", ErrMalformed},
		{"alert inside the hello", cat(refragment(hello(sni("a.com")), 10)[:15], []byte{0x15, 3, 3, 0, 2, 2, 40}), TLS, "", ErrMalformed},
		{"handshake length 16 MiB", []byte{0x16, 3, 1, 0, 4, 1, 0xff, 0xff, 0xff}, TLS, "", ErrTooLarge},
		{"not TLS version", []byte("\x16\x09garbage"), Unknown, "", nil},
		{"session id too long", func() []byte {
			h := hello(nil)
			h[5+4+34] = 33
			return h
		}(), TLS, "", ErrMalformed},
		{"ssh", []byte("SSH-2.0-OpenSSH_9.6\r\n"), Unknown, "", nil},
		{"sslv2", []byte{0x80, 0x2e, 1, 3, 1}, Unknown, "", nil},
	}
	for _, c := range cases {
		_, res, err := Peek(bytes.NewReader(c.in), 0)
		if err != nil || res.Kind != c.kind || res.Name != c.name || !errors.Is(res.Err, c.err) || (c.err == nil) != (res.Err == nil) {
			t.Errorf("%s: %+v, %v", c.label, res, err)
		}
	}
}

func TestTLSTruncated(t *testing.T) {
	full := clientHello(t, &tls.Config{ServerName: "example.com"})
	for _, n := range []int{1, 3, 5, 6, 9, 50, len(full) - 1} {
		out, res, err := Peek(bytes.NewReader(full[:n]), 0)
		if !errors.Is(err, io.ErrUnexpectedEOF) || res.Kind != TLS || res.Name != "" || !bytes.Equal(out, full[:n]) {
			t.Errorf("cut at %d: %+v, %v", n, res, err)
		}
	}
	// A ClientHello bigger than the bound is refused without reading it.
	big := refragment(hello(ext(0x1234, make([]byte, 20000))), 1<<14)
	out, res, err := Peek(bytes.NewReader(big), 4096)
	if err != nil || res.Kind != TLS || !errors.Is(res.Err, ErrTooLarge) || len(out) > 4096 {
		t.Errorf("big: %+v, %v, %d bytes", res, err, len(out))
	}
}

type timeoutReader struct{ data []byte }

func (r *timeoutReader) Read(p []byte) (int, error) {
	if len(r.data) == 0 {
		return 0, os.ErrDeadlineExceeded
	}
	n := copy(p, r.data)
	r.data = r.data[n:]
	return n, nil
}

func TestSilentPeerAndErrors(t *testing.T) {
	out, res, err := Peek(&timeoutReader{}, 0)
	if !errors.Is(err, os.ErrDeadlineExceeded) || res.Kind != Unknown || len(out) != 0 {
		t.Errorf("silent: %+v, %v", res, err)
	}
	out, res, err = Peek(&timeoutReader{data: []byte("GET / HTTP/1.1\r\nHo")}, 0)
	if !errors.Is(err, os.ErrDeadlineExceeded) || res.Kind != HTTP || res.Name != "" || string(out) != "GET / HTTP/1.1\r\nHo" {
		t.Errorf("stalled http: %+v, %v", res, err)
	}
	if _, res, err = Peek(bytes.NewReader(nil), 0); err != io.EOF || res.Kind != Unknown {
		t.Errorf("empty: %+v, %v", res, err)
	}
	// A reader that returns 0, nil forever does not hang Peek.
	if _, _, err = Peek(zeroReader{}, 0); !errors.Is(err, io.ErrNoProgress) {
		t.Errorf("zero reader: %v", err)
	}
	// Real connection with a deadline and a silent peer.
	c, s := net.Pipe()
	defer c.Close()
	defer s.Close()
	_ = s.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
	_, res, err = Peek(s, 0)
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() || res.Kind != Unknown {
		t.Errorf("pipe: %+v, %v", res, err)
	}
}

type zeroReader struct{}

func (zeroReader) Read([]byte) (int, error) { return 0, nil }

func TestHTTP(t *testing.T) {
	cases := []struct {
		in   string
		kind Kind
		name string
		port int
		err  error
	}{
		{"GET / HTTP/1.1\r\nHost: Example.COM\r\n\r\n", HTTP, "example.com", 0, nil},
		{"GET / HTTP/1.1\r\nhost: example.com.:8080\r\nAccept: */*\r\n\r\n", HTTP, "example.com", 8080, nil},
		{"POST /x?y HTTP/1.1\r\nContent-Length: 3\r\nHOST:   example.com  \r\n\r\nabc", HTTP, "example.com", 0, nil},
		{"GET / HTTP/1.1\r\nHost: 192.0.2.1:80\r\n\r\n", HTTP, "192.0.2.1", 80, nil},
		{"GET / HTTP/1.1\r\nHost: [2001:DB8::1]:443\r\n\r\n", HTTP, "2001:db8::1", 443, nil},
		{"OPTIONS * HTTP/1.1\r\nHost: a.com\r\n\r\n", HTTP, "a.com", 0, nil},
		{"GET / HTTP/1.0\r\n\r\n", HTTP, "", 0, nil},
		{"GET / HTTP/1.0\r\nUser-Agent: x\r\n\r\n", HTTP, "", 0, nil},
		{"GET http://a.com/x HTTP/1.1\r\nHost: a.com\r\n\r\n", HTTP, "a.com", 0, nil},
		{"GET http://a.com:80/x HTTP/1.1\r\nHost: A.com\r\n\r\n", HTTP, "a.com", 0, nil}, // Host has no port
		{"CONNECT a.com:8443 HTTP/1.1\r\nHost: a.com\r\n\r\n", HTTP, "a.com", 8443, nil},
		{"GET https://a.com/x HTTP/1.1\r\nHost: a.com:443\r\n\r\n", HTTP, "a.com", 443, nil},
		{"GET http://a.com:8080 HTTP/1.0\r\n\r\n", HTTP, "a.com", 8080, nil},
		{"CONNECT a.com:443 HTTP/1.1\r\nHost: a.com:443\r\n\r\n", HTTP, "a.com", 443, nil},
		{"CONNECT [2001:db8::1]:443 HTTP/1.1\r\nHost: [2001:db8::1]:443\r\n\r\n", HTTP, "2001:db8::1", 443, nil},
		{"CONNECT a.com:443 HTTP/1.0\r\n\r\n", HTTP, "a.com", 443, nil},

		{"GET / HTTP/1.1\r\nHost: a.com\r\nHost: b.com\r\n\r\n", HTTP, "", 0, ErrDuplicateHost},
		{"GET / HTTP/1.1\r\nHost: a.com\r\nhost: a.com\r\n\r\n", HTTP, "", 0, ErrDuplicateHost},
		{"GET / HTTP/1.1\r\nAccept: */*\r\n\r\n", HTTP, "", 0, ErrMissingHost},
		{"GET http://other.com/ HTTP/1.1\r\nHost: a.com\r\n\r\n", HTTP, "", 0, ErrHostMismatch},
		{"GET http://a.com:8080/ HTTP/1.1\r\nHost: a.com\r\n\r\n", HTTP, "", 0, ErrHostMismatch},
		{"CONNECT evil.com:443 HTTP/1.1\r\nHost: a.com:443\r\n\r\n", HTTP, "", 0, ErrHostMismatch},
		{"GET http://a.com@evil.com/ HTTP/1.1\r\nHost: evil.com\r\n\r\n", HTTP, "", 0, ErrMalformed},
		{"GET ftp://a.com/ HTTP/1.1\r\nHost: a.com\r\n\r\n", HTTP, "", 0, ErrMalformed},
		{"GET a.com:443 HTTP/1.1\r\nHost: a.com\r\n\r\n", HTTP, "", 0, ErrMalformed},
		{"CONNECT a.com HTTP/1.1\r\nHost: a.com\r\n\r\n", HTTP, "", 0, ErrMalformed},
		{"GET / HTTP/1.1\r\nHost: a.com\nHost: evil.com\r\n\r\n", HTTP, "", 0, ErrMalformed},
		{"GET / HTTP/1.1\nHost: a.com\n\n", HTTP, "", 0, ErrMalformed},
		{"GET / HTTP/1.1\r\nHost: a.com\rX: y\r\n\r\n", HTTP, "", 0, ErrMalformed},
		{"GET / HTTP/1.1\r\nHost : a.com\r\n\r\n", HTTP, "", 0, ErrMalformed},
		{"GET / HTTP/1.1\r\nX: a\r\n b\r\nHost: a.com\r\n\r\n", HTTP, "", 0, ErrMalformed},
		{"GET / HTTP/1.1\r\nHost: a.com\x00evil\r\n\r\n", HTTP, "", 0, ErrMalformed},
		{"GET / HTTP/1.1\r\nHost: a com\r\n\r\n", HTTP, "", 0, ErrBadName},
		{"GET / HTTP/1.1\r\nHost: a.com:99999\r\n\r\n", HTTP, "", 0, ErrMalformed},
		{"GET / HTTP/1.1\r\nHost: a.com:0\r\n\r\n", HTTP, "", 0, ErrMalformed},
		{"GET / HTTP/1.1\r\nHost: [::1\r\n\r\n", HTTP, "", 0, ErrMalformed},
		{"GET / HTTP/1.1\r\nHost: [a.com]\r\n\r\n", HTTP, "", 0, ErrBadName},
		{"GET / HTTP/1.1\r\nHost: ::1\r\n\r\n", HTTP, "", 0, ErrBadName},
		{"GET / HTTP/2.0\r\nHost: a.com\r\n\r\n", HTTP, "", 0, ErrMalformed},
		{"GET  / HTTP/1.1\r\nHost: a.com\r\n\r\n", HTTP, "", 0, ErrMalformed},
		{"GET / HTTP/1.1 x\r\nHost: a.com\r\n\r\n", HTTP, "", 0, ErrMalformed},

		{"get / HTTP/1.1\r\nHost: a.com\r\n\r\n", Unknown, "", 0, nil},
		{"GETX / HTTP/1.1\r\n\r\n", Unknown, "", 0, nil},
		{"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", Unknown, "", 0, nil},
		{"\x00\x01", Unknown, "", 0, nil},
	}
	for _, c := range cases {
		for _, slow := range []bool{false, true} {
			var r io.Reader = strings.NewReader(c.in)
			if slow {
				r = oneByteReader{r}
			}
			out, res, err := Peek(r, 0)
			if err != nil || res.Kind != c.kind || res.Name != c.name || res.HostPort != c.port || !errors.Is(res.Err, c.err) || (c.err == nil) != (res.Err == nil) {
				t.Errorf("%q (slow %v): %+v, %v", c.in, slow, res, err)
			}
			if !strings.HasPrefix(c.in, string(out)) {
				t.Errorf("%q: returned bytes are not what was read", c.in)
			}
		}
	}
}

func TestHTTPTooLarge(t *testing.T) {
	in := "GET / HTTP/1.1\r\nHost: a.com\r\nX: " + strings.Repeat("a", 5000) + "\r\n\r\n"
	out, res, err := Peek(strings.NewReader(in), 1024)
	if err != nil || res.Kind != HTTP || !errors.Is(res.Err, ErrTooLarge) || len(out) != 1024 {
		t.Errorf("%+v, %v, %d", res, err, len(out))
	}
	if _, res, _ = Peek(strings.NewReader(in), 0); res.Err != nil || res.Name != "a.com" {
		t.Errorf("%+v", res)
	}
}

func TestTrickleIsLinear(t *testing.T) {
	// 16 KiB of headers one byte at a time: must finish quickly.
	in := "GET / HTTP/1.1\r\nHost: a.com\r\n" + strings.Repeat("X-A: b\r\n", 3000)
	start := time.Now()
	_, res, err := Peek(oneByteReader{strings.NewReader(in)}, 0)
	if err != nil || !errors.Is(res.Err, ErrTooLarge) {
		t.Errorf("%+v %v", res, err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("took %v", d)
	}
}

func FuzzPeek(f *testing.F) {
	f.Add(clientHello(f, &tls.Config{ServerName: "example.com"}), 0, false)
	f.Add(hello(sni("a.com")), 100, true)
	f.Add([]byte("GET http://a.com/ HTTP/1.1\r\nHost: a.com\r\n\r\n"), 0, false)
	f.Add([]byte("CONNECT a.com:443 HTTP/1.1\r\nHost: a.com:443\r\n\r\n"), 30, true)
	f.Add([]byte{0x16, 3, 1, 0, 4, 1, 0xff, 0xff, 0xff}, 0, false)
	f.Fuzz(func(t *testing.T, in []byte, max int, slow bool) {
		max %= 64 << 10
		var r io.Reader = bytes.NewReader(in)
		if slow {
			r = oneByteReader{r}
		}
		out, res, err := Peek(r, max)
		bound := max
		if bound <= 0 {
			bound = DefaultMax
		}
		if len(out) > bound || !bytes.HasPrefix(in, out) {
			t.Fatalf("returned %d bytes (bound %d), prefix %v", len(out), bound, bytes.HasPrefix(in, out))
		}
		if err == nil && res.Err == nil && res.Name != "" {
			if n, ok := canonicalHost(res.Name); !ok || n != res.Name {
				t.Fatalf("uncanonical name %q", res.Name)
			}
		}
		if err != nil && res.Name != "" {
			t.Fatalf("name %q with an error", res.Name)
		}
	})
}

package sniff

import (
	"bytes"
	"fmt"
	"net/netip"
	"strings"

	"github.com/spacehq/space/internal/netpolicy"
)

var methods = []string{"GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH", "CONNECT", "TRACE"}

// methodPrefix: buf could be the start of "METHOD " for a known method.
func methodPrefix(buf []byte) bool {
	for _, m := range methods {
		n := min(len(buf), len(m)+1)
		if string(buf[:n]) == (m + " ")[:n] {
			return true
		}
	}
	return false
}

// decideHTTP waits for the end of the header block (CRLF CRLF), refusing
// bare CR or LF as soon as one arrives, then parses it.
func decideHTTP(buf []byte, st *state) (Result, bool, int) {
	if st.kind != HTTP {
		if !methodPrefix(buf) {
			return Result{Kind: Unknown}, true, 0
		}
		if bytes.IndexByte(buf, ' ') < 0 {
			return Result{Kind: Unknown}, false, len(buf) + 1
		}
		st.kind = HTTP
	}
	for i := st.scan; i < len(buf); i++ {
		switch buf[i] {
		case '\r':
			if i+1 == len(buf) {
				st.scan = i
				return Result{Kind: HTTP}, false, len(buf) + 1
			}
			if buf[i+1] != '\n' {
				return Result{Kind: HTTP, Err: malformed("bare CR")}, true, 0
			}
		case '\n':
			if i == 0 || buf[i-1] != '\r' {
				return Result{Kind: HTTP, Err: malformed("bare LF")}, true, 0
			}
			if i >= 3 && buf[i-3] == '\r' && buf[i-2] == '\n' {
				res := parseRequest(string(buf[:i-3]))
				res.Kind = HTTP
				return res, true, 0
			}
		}
	}
	st.scan = len(buf)
	return Result{Kind: HTTP}, false, len(buf) + 1
}

// parseRequest parses the request line and header fields (without the
// final CRLF CRLF); every line end is CRLF (decideHTTP checked).
func parseRequest(head string) Result {
	reqLine, fields, _ := strings.Cut(head, "\r\n")
	method, rest, _ := strings.Cut(reqLine, " ")
	target, version, ok := strings.Cut(rest, " ")
	if !ok || target == "" || strings.ContainsAny(version, " ") {
		return Result{Err: malformed("request line")}
	}
	for i := 0; i < len(target); i++ {
		if c := target[i]; c <= ' ' || c == 0x7f {
			return Result{Err: malformed("request target")}
		}
	}
	if version != "HTTP/1.1" && version != "HTTP/1.0" {
		return Result{Err: malformed("version %.16q", version)}
	}

	// The authority the request target names, if any.
	var (
		uriName     string
		uriPort     int
		uriAuth     bool
		defaultPort = 80
	)
	switch {
	case method == "CONNECT":
		n, p, err := parseHostPort(target)
		if err != nil {
			return Result{Err: err}
		}
		if n == "" || p == 0 {
			return Result{Err: malformed("CONNECT needs host:port")}
		}
		uriName, uriPort, uriAuth = n, p, true
	case target[0] == '/':
	case target == "*" && method == "OPTIONS":
	default:
		scheme, after, ok := strings.Cut(target, "://")
		switch strings.ToLower(scheme) {
		case "http":
		case "https":
			defaultPort = 443
		default:
			ok = false
		}
		if !ok {
			return Result{Err: malformed("request target")}
		}
		auth := after
		if i := strings.IndexAny(after, "/?#"); i >= 0 {
			auth = after[:i]
		}
		if strings.Contains(auth, "@") {
			return Result{Err: malformed("userinfo in the request URI")}
		}
		n, p, err := parseHostPort(auth)
		if err != nil {
			return Result{Err: err}
		}
		if n == "" {
			return Result{Err: malformed("empty host in the request URI")}
		}
		uriName, uriPort, uriAuth = n, p, true
	}

	hostSeen := false
	var host string
	var fr framing
	for fields != "" {
		var line string
		line, fields, _ = strings.Cut(fields, "\r\n")
		if line == "" {
			return Result{Err: malformed("empty header line")}
		}
		if line[0] == ' ' || line[0] == '\t' {
			return Result{Err: malformed("folded header")}
		}
		name, value, ok := strings.Cut(line, ":")
		if !ok || !isToken(name) {
			return Result{Err: malformed("header name")}
		}
		value = strings.Trim(value, " \t")
		for i := 0; i < len(value); i++ {
			if c := value[i]; c < ' ' && c != '\t' || c == 0x7f {
				return Result{Err: malformed("control character in header %.64q", name)}
			}
		}
		if strings.EqualFold(name, "Host") {
			if hostSeen {
				return Result{Err: ErrDuplicateHost}
			}
			hostSeen, host = true, value
		}
		if err := fr.field(name, value); err != nil {
			return Result{Err: err}
		}
	}
	if err := fr.check(method, version); err != nil {
		return Result{Err: err}
	}

	res := Result{Method: method, Upgrade: fr.upgrade, Body: fr.body()}
	if hostSeen {
		n, p, err := parseHostPort(host)
		if err != nil {
			return Result{Err: err}
		}
		res.Name, res.HostPort = n, p
	} else if version == "HTTP/1.1" {
		return Result{Err: ErrMissingHost}
	}
	if uriAuth {
		if hostSeen {
			hp := res.HostPort
			if hp == 0 && method != "CONNECT" {
				hp = defaultPort
			}
			up := uriPort
			if up == 0 {
				up = defaultPort
			}
			if res.Name != uriName || (hp != 0 && hp != up) {
				return Result{Err: ErrHostMismatch}
			}
		}
		res.Name = uriName
		if !hostSeen || method == "CONNECT" {
			res.HostPort = uriPort
		}
	}
	return res
}

// framing collects the header fields that decide where a request's body
// ends and whether it asks to switch protocols.
type framing struct {
	cl, te  []string
	upgrade bool
}

func (f *framing) field(name, value string) error {
	switch {
	case strings.EqualFold(name, "Content-Length"):
		f.cl = append(f.cl, value)
	case strings.EqualFold(name, "Transfer-Encoding"):
		f.te = append(f.te, value)
	case strings.EqualFold(name, "Upgrade"):
		f.upgrade = true
	case strings.EqualFold(name, "Connection"):
		// A proxy drops the fields Connection lists before it forwards:
		// listing a framing field would make the next hop frame the
		// message differently from us.
		for _, tok := range strings.Split(value, ",") {
			switch strings.ToLower(strings.Trim(tok, " \t")) {
			case "host", "content-length", "transfer-encoding", "trailer", "te":
				return fmt.Errorf("%w: Connection lists %.32q", ErrFraming, strings.Trim(tok, " \t"))
			}
		}
	case strings.EqualFold(name, "Trailer"):
		// Fields after the body are read by some servers as headers (a
		// Host there would be a second, unchecked one).
		return fmt.Errorf("%w: Trailer", ErrFraming)
	}
	return nil
}

// noBody are the methods whose requests carry no content here: RFC 9110
// gives a body on them no meaning, and servers that ignore it read the
// body as the next request (a second, unchecked Host).
var noBody = map[string]bool{"GET": true, "HEAD": true, "TRACE": true, "CONNECT": true}

// check refuses every framing that two RFC 9112 readers could read
// differently (RFC 9112 §6.1, §6.3): more than one length, a length and a
// transfer coding, a coding other than chunked, a coding in HTTP/1.0, a
// length that is not plain digits, and a body where the method has none.
func (f *framing) check(method, version string) error {
	if len(f.cl) > 1 {
		return fmt.Errorf("%w: more than one Content-Length", ErrFraming)
	}
	if len(f.te) > 1 {
		return fmt.Errorf("%w: more than one Transfer-Encoding", ErrFraming)
	}
	if len(f.cl) == 1 && len(f.te) == 1 {
		return fmt.Errorf("%w: Content-Length with Transfer-Encoding", ErrFraming)
	}
	if len(f.te) == 1 {
		if !strings.EqualFold(f.te[0], "chunked") {
			return fmt.Errorf("%w: Transfer-Encoding %.32q (only chunked)", ErrFraming, f.te[0])
		}
		if version == "HTTP/1.0" {
			return fmt.Errorf("%w: Transfer-Encoding in HTTP/1.0", ErrFraming)
		}
	}
	if len(f.cl) == 1 {
		v := f.cl[0]
		if v == "" || len(v) > 15 {
			return fmt.Errorf("%w: Content-Length %.32q", ErrFraming, v)
		}
		for i := 0; i < len(v); i++ {
			if v[i] < '0' || v[i] > '9' {
				return fmt.Errorf("%w: Content-Length %.32q", ErrFraming, v)
			}
		}
	}
	if noBody[method] && f.body() {
		return fmt.Errorf("%w: a %s request with a body", ErrFraming, method)
	}
	return nil
}

// body: the request has content (a chunked coding or a non-zero length).
func (f *framing) body() bool {
	if len(f.te) > 0 {
		return true
	}
	return len(f.cl) == 1 && strings.TrimLeft(f.cl[0], "0") != ""
}

func isToken(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0) {
			return false
		}
	}
	return true
}

// parseHostPort parses "host[:port]" (host a name, an IPv4 address or a
// bracketed IPv6 address). An empty string is no host; an empty port is
// no port.
func parseHostPort(s string) (string, int, error) {
	if s == "" {
		return "", 0, nil
	}
	var h, p string
	if s[0] == '[' {
		end := strings.IndexByte(s, ']')
		if end < 0 {
			return "", 0, malformed("unclosed '[' in host")
		}
		h, p = s[1:end], s[end+1:]
		ip, err := netip.ParseAddr(h)
		if err != nil || !ip.Is6() || ip.Zone() != "" {
			return "", 0, fmt.Errorf("%w: not an IPv6 address in brackets", ErrBadName)
		}
		h = ip.String()
		if p != "" {
			if p[0] != ':' {
				return "", 0, malformed("text after ']' in host")
			}
			p = p[1:]
		}
	} else {
		h = s
		if i := strings.LastIndexByte(s, ':'); i >= 0 {
			h, p = s[:i], s[i+1:]
		}
		n, ok := canonicalHost(h)
		if !ok || strings.Contains(n, ":") {
			return "", 0, fmt.Errorf("%w in host", ErrBadName)
		}
		h = n
	}
	port := 0
	if p != "" {
		if len(p) > 5 {
			return "", 0, malformed("port")
		}
		for i := 0; i < len(p); i++ {
			if p[i] < '0' || p[i] > '9' {
				return "", 0, malformed("port")
			}
			port = port*10 + int(p[i]-'0')
		}
		if port < 1 || port > 65535 {
			return "", 0, malformed("port %d", port)
		}
	}
	return h, port, nil
}

// canonicalHost: an IP literal in its canonical form, or a DNS name
// lowercased without its trailing dot.
func canonicalHost(s string) (string, bool) {
	if ip, err := netip.ParseAddr(s); err == nil {
		if ip.Zone() != "" {
			return "", false
		}
		return ip.String(), true
	}
	return netpolicy.CanonicalName(s)
}

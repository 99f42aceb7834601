package netpolicy

import (
	"errors"
	"fmt"
	"net/netip"
	"net/url"
	"slices"
	"strings"

	"github.com/spacehq/space/api"
)

// forbiddenHeaders may not be set or removed by a rule: they frame the
// request or route it, and rewriting them would let a rule smuggle a
// second request or redirect one past the name check.
var forbiddenHeaders = map[string]bool{
	"host": true, "content-length": true, "transfer-encoding": true,
	"connection": true, "upgrade": true, "te": true, "trailer": true,
	"keep-alive": true, "proxy-connection": true,
}

// checkRules validates p's header rules against the already parsed
// allow_out (each rule's domain must be reachable under the policy).
func (p *Policy) checkRules(rules []api.HeaderRule) error {
	if len(rules) > MaxRules {
		return invalid("network.rules: %d rules, at most %d", len(rules), MaxRules)
	}
	for i, r := range rules {
		field := fmt.Sprintf("network.rules[%d]", i)
		if err := p.checkRuleDomain(r.Domain); err != nil {
			return invalid("%s.domain: %q: %v", field, clip(r.Domain), err)
		}
		if n := len(r.SetHeaders) + len(r.RemoveHeaders); n > MaxRuleHeaders {
			return invalid("%s: %d headers, at most %d", field, n, MaxRuleHeaders)
		}
		seen := map[string]string{}
		keys := make([]string, 0, len(r.SetHeaders))
		for k := range r.SetHeaders {
			keys = append(keys, k)
		}
		slices.Sort(keys) // deterministic errors
		for _, k := range keys {
			f := fmt.Sprintf("%s.set_headers[%q]", field, clip(k))
			if err := checkHeaderName(k); err != nil {
				return invalid("%s: %v", f, err)
			}
			lk := strings.ToLower(k)
			if prev, dup := seen[lk]; dup {
				return invalid("%s: same header as %q (names are case-insensitive)", f, prev)
			}
			seen[lk] = k
			// Never echo the value: it is likely a credential.
			if err := checkHeaderValue(r.SetHeaders[k]); err != nil {
				return invalid("%s: value %v", f, err)
			}
		}
		for j, k := range r.RemoveHeaders {
			f := fmt.Sprintf("%s.remove_headers[%d]", field, j)
			if err := checkHeaderName(k); err != nil {
				return invalid("%s: %q: %v", f, clip(k), err)
			}
			lk := strings.ToLower(k)
			if prev, dup := seen[lk]; dup {
				return invalid("%s: %q is already set or removed as %q", f, k, prev)
			}
			seen[lk] = k
		}
	}
	return nil
}

func (p *Policy) checkRuleDomain(d string) error {
	if d == "" {
		return errors.New("empty domain")
	}
	if len(d) > MaxEntryLen {
		return fmt.Errorf("domain is %d bytes, at most %d", len(d), MaxEntryLen)
	}
	if strings.ContainsAny(d, ":/[]") {
		return errors.New("a rule's domain is a name or \"*.suffix\" only (no port, URL or IP)")
	}
	if _, err := netip.ParseAddr(d); err == nil {
		return errors.New("a rule's domain is a name or \"*.suffix\" only (no IP)")
	}
	name, wild, err := parsePattern(d)
	if err != nil {
		return err
	}
	if p.internet {
		return nil
	}
	covered := false
	if wild {
		// "*.a.example.com" is covered by "*.a.example.com" or "*.example.com".
		for s := name; !covered; {
			covered = len(p.wild[s]) > 0
			dot := strings.IndexByte(s, '.')
			if dot < 0 {
				break
			}
			s = s[dot+1:]
		}
	} else {
		p.nameMatch(name, func(*entry) bool { covered = true; return false })
	}
	if !covered {
		return errors.New("not covered by network.allow_out (nor internet)")
	}
	return nil
}

// checkHeaderName: an RFC 7230 token.
func checkHeaderName(k string) error {
	if k == "" {
		return errors.New("empty header name")
	}
	if len(k) > 256 {
		return fmt.Errorf("header name is %d bytes, at most 256", len(k))
	}
	for i := 0; i < len(k); i++ {
		if !isTchar(k[i]) {
			return fmt.Errorf("invalid character %q in header name", k[i])
		}
	}
	if forbiddenHeaders[strings.ToLower(k)] {
		return errors.New("this header frames or routes the request and may not be changed by a rule")
	}
	return nil
}

func isTchar(c byte) bool {
	switch {
	case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
		return true
	}
	return strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0
}

// checkHeaderValue refuses control characters (CR, LF, NUL and the other
// CTLs; HTAB is allowed) and values over MaxHeaderValue.
func checkHeaderValue(v string) error {
	if len(v) > MaxHeaderValue {
		return fmt.Errorf("is %d bytes, at most %d", len(v), MaxHeaderValue)
	}
	for i := 0; i < len(v); i++ {
		if c := v[i]; c < ' ' && c != '\t' || c == 0x7f {
			return fmt.Errorf("contains a control character at byte %d", i)
		}
	}
	return nil
}

// parseProxy parses "socks5://[user:pass@]host:port" (or socks5h://).
// Its errors never quote the input (it may carry a password).
func parseProxy(s string) (*Proxy, error) {
	if len(s) > MaxEgressProxy {
		return nil, fmt.Errorf("is %d bytes, at most %d", len(s), MaxEgressProxy)
	}
	scheme, _, ok := strings.Cut(s, "://")
	if !ok {
		return nil, errors.New(`must be "socks5://host:port" or "socks5h://host:port"`)
	}
	px := &Proxy{}
	switch strings.ToLower(scheme) {
	case "socks5":
	case "socks5h":
		px.RemoteDNS = true
	default:
		return nil, errors.New(`only "socks5://" and "socks5h://" proxies are supported`)
	}
	u, err := url.Parse(s)
	if err != nil {
		return nil, errors.New("not a valid URL") // url's error would quote the password
	}
	if u.Opaque != "" || u.Host == "" {
		return nil, errors.New(`must be "socks5://host:port"`)
	}
	if (u.Path != "" && u.Path != "/") || u.RawQuery != "" || u.ForceQuery || u.Fragment != "" {
		return nil, errors.New("a path, query or fragment is not allowed")
	}
	if u.User != nil {
		px.Username = u.User.Username()
		px.Password, _ = u.User.Password()
		// RFC 1929: each 1-255 bytes.
		if l := len(px.Username); l < 1 || l > maxSocksAuthPart {
			return nil, fmt.Errorf("username must be 1-%d bytes", maxSocksAuthPart)
		}
		if l := len(px.Password); l < 1 || l > maxSocksAuthPart {
			return nil, fmt.Errorf("password must be 1-%d bytes", maxSocksAuthPart)
		}
	}
	port := u.Port()
	if port == "" {
		return nil, errors.New("missing port (socks5://host:port)")
	}
	pn, err := parsePort(port)
	if err != nil {
		return nil, err
	}
	px.Port = pn
	host := u.Hostname()
	if ip, err := netip.ParseAddr(host); err == nil {
		if ip.Zone() != "" {
			return nil, errors.New("IPv6 zones are not allowed")
		}
		px.Host = ip.Unmap().String()
		return px, nil
	}
	if strings.Contains(u.Host, "[") {
		return nil, errors.New("not an IPv6 address inside '[…]'")
	}
	name, err := checkName(host)
	if err != nil {
		return nil, fmt.Errorf("host: %v", err)
	}
	px.Host = name
	return px, nil
}

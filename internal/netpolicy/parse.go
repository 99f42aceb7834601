package netpolicy

import (
	"errors"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
)

// Bounds of a policy (hostile input: the API takes it from any caller).
const (
	MaxAllowOut      = 1024
	MaxDenyOut       = 1024
	MaxAllowPrivate  = 256
	MaxEntryLen      = 300
	MaxRules         = 64
	MaxRuleHeaders   = 64
	MaxHeaderValue   = 8 << 10
	MaxEgressProxy   = 2048
	maxNameLen       = 253
	maxLabelLen      = 63
	maxSocksAuthPart = 255
)

type entryKind int

const (
	kindExact entryKind = iota
	kindWildcard
	kindPrefix
)

// entry is one parsed allow_out/deny_out entry.
type entry struct {
	kind   entryKind
	name   string       // kindExact: the name; kindWildcard: the suffix after "*."
	prefix netip.Prefix // kindPrefix
	port   uint16       // 0 = any port
	text   string       // as written, for verdict reasons
}

// parseEntry parses "host[:port]" where host is a name pattern (if names),
// an IP or a CIDR. Errors say what is wrong without the field name.
func parseEntry(s string, names bool) (entry, error) {
	e := entry{text: s}
	if s == "" {
		return e, errors.New("empty entry")
	}
	if len(s) > MaxEntryLen {
		return e, fmt.Errorf("entry is %d bytes, at most %d", len(s), MaxEntryLen)
	}
	if strings.Contains(s, "://") {
		return e, errors.New("a URL is not allowed: write host, IP or CIDR, optionally with :port")
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; c <= ' ' || c >= 0x7f {
			return e, errors.New("contains a space, control or non-ASCII character (write internationalised names in their xn-- form)")
		}
	}
	host, port, hasPort, bracketed := s, "", false, false
	switch {
	case s[0] == '[':
		end := strings.IndexByte(s, ']')
		if end < 0 {
			return e, errors.New("missing ']' after an IPv6 literal")
		}
		host, bracketed = s[1:end], true
		if rest := s[end+1:]; rest != "" {
			if rest[0] != ':' {
				return e, errors.New("unexpected text after ']' (want \":port\")")
			}
			port, hasPort = rest[1:], true
		}
	case strings.Count(s, ":") >= 2:
		// A bare IPv6 address or CIDR: it cannot carry a port without
		// brackets.
	default:
		if i := strings.LastIndexByte(s, ':'); i >= 0 {
			host, port, hasPort = s[:i], s[i+1:], true
		}
	}
	if hasPort {
		p, err := parsePort(port)
		if err != nil {
			return e, err
		}
		e.port = p
	}
	if host == "" {
		return e, errors.New("missing host")
	}
	if slash := strings.IndexByte(host, '/'); slash >= 0 {
		if _, err := netip.ParseAddr(host[:slash]); err != nil {
			if !bracketed && looksLikeName(host[:slash]) {
				return e, errors.New("a path is not allowed: write host, IP or CIDR, optionally with :port")
			}
			return e, fmt.Errorf("invalid CIDR: %q is not an IP address", host[:slash])
		}
		pfx, err := netip.ParsePrefix(host)
		if err != nil {
			return e, fmt.Errorf("invalid CIDR prefix length %q", host[slash+1:])
		}
		// Host bits set are refused rather than masked: "10.1.2.3/8" may
		// mean the one address or the whole /8, and guessing either way
		// on a security policy is worse than asking.
		if m := pfx.Masked(); m != pfx {
			return e, fmt.Errorf("CIDR has host bits set (did you mean %s?)", m)
		}
		if bracketed && !pfx.Addr().Is6() {
			return e, errors.New("brackets are for IPv6 literals only")
		}
		e.kind, e.prefix = kindPrefix, canonPrefix(pfx)
		return e, nil
	}
	if ip, err := netip.ParseAddr(host); err == nil {
		if ip.Zone() != "" {
			return e, errors.New("IPv6 zones are not allowed")
		}
		if bracketed && !ip.Is6() {
			return e, errors.New("brackets are for IPv6 literals only")
		}
		e.kind, e.prefix = kindPrefix, canonPrefix(netip.PrefixFrom(ip, ip.BitLen()))
		return e, nil
	}
	if bracketed {
		return e, errors.New("not an IPv6 address inside '[…]'")
	}
	if !names {
		if looksLikeName(host) || strings.HasPrefix(host, "*") {
			return e, errors.New("deny_out takes IPs and CIDRs only, not names (a name's addresses change; deny the addresses)")
		}
		return e, errors.New("not an IP address or CIDR")
	}
	name, wild, err := parsePattern(host)
	if err != nil {
		return e, err
	}
	e.name = name
	if wild {
		e.kind = kindWildcard
	}
	return e, nil
}

// parsePrivate parses an allow_private entry: an IP or a CIDR (IPv6
// optionally in brackets), no port, no name, that holds at least one
// special address (Classify). Errors say what is wrong without the field
// name.
func parsePrivate(s string) (netip.Prefix, error) {
	if s == "" {
		return netip.Prefix{}, errors.New("empty entry")
	}
	if len(s) > MaxEntryLen {
		return netip.Prefix{}, fmt.Errorf("entry is %d bytes, at most %d", len(s), MaxEntryLen)
	}
	e, err := parseEntry(s, true)
	if err == nil && e.kind != kindPrefix || strings.Contains(s, "*") {
		return netip.Prefix{}, errors.New("a name is not allowed: allow_private takes IPs and CIDRs (the ranges an allowed name may resolve into)")
	}
	if err != nil {
		return netip.Prefix{}, err
	}
	if e.port != 0 {
		return netip.Prefix{}, errors.New("a port is not allowed: allow_private opens addresses; ports are allow_out's")
	}
	if specialSet().intersect(allowFootprint(e.prefix)).empty() {
		return netip.Prefix{}, errors.New("holds no loopback, private, link-local or other special address: public addresses need no allow_private (allow_out allows them)")
	}
	return e.prefix, nil
}

// canonPrefix turns an IPv4-mapped IPv6 prefix (at least /96) into the
// IPv4 prefix it is, so it matches the unmapped addresses Check compares.
func canonPrefix(p netip.Prefix) netip.Prefix {
	if p.Addr().Is4In6() && p.Bits() >= 96 {
		return netip.PrefixFrom(p.Addr().Unmap(), p.Bits()-96)
	}
	return p
}

func parsePort(s string) (uint16, error) {
	if s == "" {
		return 0, errors.New("empty port after ':'")
	}
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return 0, fmt.Errorf("port %q is not a number", s)
		}
	}
	if len(s) > 1 && s[0] == '0' {
		return 0, fmt.Errorf("port %q has a leading zero", s)
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 1 || n > 65535 {
		return 0, fmt.Errorf("port %s out of range 1-65535", s)
	}
	return uint16(n), nil
}

// looksLikeName reports whether s is made of name characters (for choosing
// an error message, not for validation).
func looksLikeName(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		if !isNameByte(s[i]) && s[i] != '.' && s[i] != '*' && !(s[i] >= 'A' && s[i] <= 'Z') {
			return false
		}
	}
	return true
}

func isNameByte(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '_'
}

// parsePattern parses an exact name or a "*.suffix" wildcard, returning the
// lowercase name (the suffix for a wildcard) without a trailing dot.
func parsePattern(s string) (string, bool, error) {
	wild := false
	if s == "*" {
		return "", false, errors.New(`bare "*" is not allowed (set internet: true to allow every public destination)`)
	}
	if rest, ok := strings.CutPrefix(s, "*."); ok {
		wild, s = true, rest
		if s == "" || s == "." {
			return "", false, errors.New(`wildcard "*." needs a suffix ("*.example.com")`)
		}
	}
	if strings.Contains(s, "*") {
		return "", false, errors.New(`"*" is only allowed as the whole first label ("*.example.com")`)
	}
	name, err := checkName(s)
	if err != nil {
		return "", false, err
	}
	if wild && !strings.Contains(name, ".") {
		return "", false, fmt.Errorf(`wildcard over a single-label suffix ("*.%s") is too broad; name the domain ("*.example.%s")`, name, name)
	}
	return name, wild, nil
}

// checkName validates a DNS name (LDH labels plus '_', 1-63 bytes each,
// at most 253 in all, one optional trailing dot, not ending in a numeric
// label, which would make it an IPv4 address in disguise) and returns it
// lowercased without the trailing dot.
func checkName(s string) (string, error) {
	s = strings.TrimSuffix(s, ".")
	if s == "" {
		return "", errors.New("empty name")
	}
	if len(s) > maxNameLen {
		return "", fmt.Errorf("name is %d bytes, at most %d", len(s), maxNameLen)
	}
	var b []byte // lowercased copy, made only if needed
	start := 0
	for i := 0; i <= len(s); i++ {
		if i < len(s) && s[i] != '.' {
			c := s[i]
			if c >= 'A' && c <= 'Z' {
				if b == nil {
					b = []byte(s)
				}
				b[i] = c + 'a' - 'A'
				continue
			}
			if !isNameByte(c) {
				return "", fmt.Errorf("invalid character %q in name", c)
			}
			continue
		}
		label := s[start:i]
		switch {
		case label == "":
			return "", errors.New("empty label in name")
		case len(label) > maxLabelLen:
			return "", fmt.Errorf("label is %d bytes, at most %d", len(label), maxLabelLen)
		case label[0] == '-' || label[len(label)-1] == '-':
			return "", errors.New("label starts or ends with '-'")
		}
		if i == len(s) && numericLabel(label) {
			return "", errors.New("not a valid IP address, and not a name (the last label is numeric)")
		}
		start = i + 1
	}
	if b != nil {
		return string(b), nil
	}
	return s, nil
}

// numericLabel: all digits, or a 0x hex number (what inet_aton accepts).
func numericLabel(l string) bool {
	if len(l) > 2 && (l[:2] == "0x" || l[:2] == "0X") {
		l = l[2:]
		for i := 0; i < len(l); i++ {
			c := l[i]
			if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f' || c >= 'A' && c <= 'F') {
				return false
			}
		}
		return true
	}
	for i := 0; i < len(l); i++ {
		if l[i] < '0' || l[i] > '9' {
			return false
		}
	}
	return true
}

// CanonicalName returns name lowercased without its trailing dot if it is a
// valid DNS name as policies understand them (LDH labels and '_'), or ok
// false. The gateway uses it on names from DNS queries, SNI and Host.
func CanonicalName(name string) (string, bool) {
	n, err := checkName(name)
	return n, err == nil
}

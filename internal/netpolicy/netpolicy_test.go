package netpolicy

import (
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"testing"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

func TestValidateEntries(t *testing.T) {
	valid := []string{
		"pypi.org", "PyPI.org", "pypi.org.", "pypi.org:443", "*.example.com", "*.Example.COM.:8443",
		"_sip._tcp.example.com", "a-b.example.com", "localhost", "x1.io", "1.2.3.com",
		"8.8.8.8", "8.8.8.8:53", "10.0.0.0/8", "10.0.0.0/8:443", "2001:4860::8888",
		"[2001:4860::8888]", "[2001:4860::8888]:443", "2001:4860::/32", "[2001:4860::/32]:443",
		"::ffff:1.2.3.4", "0.0.0.0/0", "::/0", "a.b:65535", "a.b:1",
		strings.Repeat("a", 63) + ".com",
	}
	for _, s := range valid {
		if err := Validate(api.NetworkPolicy{AllowOut: []string{s}}); err != nil {
			t.Errorf("allow_out %q: %v", s, err)
		}
	}
	long := strings.Repeat("abcdefgh.", 28) + "com" // 255 bytes
	invalid := map[string]string{
		"":                               "empty entry",
		"*":                              `bare "*" is not allowed`,
		"*.":                             "needs a suffix",
		"*:443":                          `bare "*"`,
		"*.com":                          "single-label suffix",
		"*.com.":                         "single-label suffix",
		"a.*.b.com":                      `"*" is only allowed`,
		"**.x.com":                       `"*" is only allowed`,
		"*.*.x.com":                      `"*" is only allowed`,
		"*x.com":                         `"*" is only allowed`,
		"https://pypi.org":               "a URL is not allowed",
		"pypi.org/simple":                "a path is not allowed",
		"pypi .org":                      "space",
		" pypi.org":                      "space",
		"pypi.org\n":                     "control",
		"pypí.org":                       "non-ASCII",
		"pypi.org:":                      "empty port",
		"pypi.org:0":                     "out of range",
		"pypi.org:70000":                 "port 70000 out of range 1-65535",
		"pypi.org:044":                   "leading zero",
		"pypi.org:-1":                    "not a number",
		"pypi.org:http":                  "not a number",
		":443":                           "missing host",
		"-a.com":                         "starts or ends with '-'",
		"a-.com":                         "starts or ends with '-'",
		"a..com":                         "empty label",
		".a.com":                         "empty label",
		"a.com..":                        "empty label",
		"a!.com":                         "invalid character",
		strings.Repeat("a", 64) + ".com": "label is 64 bytes",
		long:                             "at most 253",
		"1.2.3":                          "numeric",
		"256.1.1.1":                      "numeric",
		"1.2.3.4.5":                      "numeric",
		"0x7f.1":                         "numeric",
		"a.0x7f":                         "numeric",
		"01.2.3.4":                       "numeric",
		"10.0.0.1/8":                     "host bits set (did you mean 10.0.0.0/8?)",
		"10.0.0.0/33":                    "prefix length",
		"10.0.0.0/":                      "prefix length",
		"[10.0.0.1]":                     "IPv6",
		"[10.0.0.0/8]:443":               "brackets are for IPv6",
		"[::1":                           "missing ']'",
		"[::1]443":                       "unexpected text",
		"[::1]:":                         "empty port",
		"[pypi.org]:443":                 "not an IPv6",
		"fe80::1%eth0":                   "zones",
		"2001:db8::/32:443":              "prefix length",
		"1.2.3.4:80:90":                  "invalid character",
		strings.Repeat("a", 301):         "at most 300",
	}
	for s, want := range invalid {
		err := Validate(api.NetworkPolicy{AllowOut: []string{"ok.com", s}})
		if err == nil {
			t.Errorf("allow_out %q: accepted", s)
			continue
		}
		if !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("allow_out %q: %v does not wrap ErrInvalidArgument", s, err)
		}
		if !strings.HasPrefix(err.Error(), "network.allow_out[1]: ") || !strings.Contains(err.Error(), want) {
			t.Errorf("allow_out %q: %v, want network.allow_out[1]: …%s…", s, err, want)
		}
	}
}

func TestValidateExactMessage(t *testing.T) {
	err := Validate(api.NetworkPolicy{AllowOut: []string{"a.com", "b.com", "c.com", "pypi.org:70000"}})
	want := `network.allow_out[3]: "pypi.org:70000": port 70000 out of range 1-65535: invalid argument`
	if err == nil || err.Error() != want {
		t.Fatalf("got %v, want %s", err, want)
	}
	err = Validate(api.NetworkPolicy{AllowOut: []string{"a.com", "b.com", "*"}})
	if err == nil || !strings.HasPrefix(err.Error(), `network.allow_out[2]: "*": bare "*" is not allowed`) {
		t.Fatalf("got %v", err)
	}
}

func TestValidateDeny(t *testing.T) {
	for _, s := range []string{"203.0.113.0/24", "1.2.3.4", "1.2.3.4:25", "[2001:db8::1]:25", "2001:db8::/32", "10.0.0.0/8:22"} {
		if err := Validate(api.NetworkPolicy{DenyOut: []string{s}}); err != nil {
			t.Errorf("deny_out %q: %v", s, err)
		}
	}
	for s, want := range map[string]string{
		"evil.com":       "IPs and CIDRs only",
		"evil.com:443":   "IPs and CIDRs only",
		"*.evil.com":     "IPs and CIDRs only",
		"":               "empty",
		"1.2.3.4:0":      "out of range",
		"10.1.0.0/8":     "host bits",
		"https://x.com/": "URL",
		"a b":            "space",
		"%%%":            "not an IP address or CIDR",
	} {
		err := Validate(api.NetworkPolicy{DenyOut: []string{s}})
		if err == nil || !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.HasPrefix(err.Error(), "network.deny_out[0]: ") || !strings.Contains(err.Error(), want) {
			t.Errorf("deny_out %q: %v, want …%s…", s, err, want)
		}
	}
}

func TestValidateBounds(t *testing.T) {
	many := func(n int) []string {
		out := make([]string, n)
		for i := range out {
			out[i] = fmt.Sprintf("h%d.example.com", i)
		}
		return out
	}
	if err := Validate(api.NetworkPolicy{AllowOut: many(MaxAllowOut)}); err != nil {
		t.Fatal(err)
	}
	if err := Validate(api.NetworkPolicy{AllowOut: many(MaxAllowOut + 1)}); err == nil || !strings.Contains(err.Error(), "network.allow_out: 1025 entries") {
		t.Fatalf("got %v", err)
	}
	deny := make([]string, MaxDenyOut+1)
	for i := range deny {
		deny[i] = "1.2.3.4"
	}
	if err := Validate(api.NetworkPolicy{DenyOut: deny}); err == nil || !strings.Contains(err.Error(), "network.deny_out: 1025 entries") {
		t.Fatalf("got %v", err)
	}
}

func TestValidateRules(t *testing.T) {
	base := []string{"api.example.com", "*.github.com", "pypi.org:443"}
	ok := []api.HeaderRule{
		{Domain: "api.example.com", SetHeaders: map[string]string{"Authorization": "Bearer x\ty"}},
		{Domain: "API.example.com.", RemoveHeaders: []string{"Cookie", "x-Trace_id!"}},
		{Domain: "*.github.com", SetHeaders: map[string]string{"X-A": ""}},
		{Domain: "*.api.github.com"},
		{Domain: "raw.github.com"},
		{Domain: "pypi.org"}, // the entry's port does not matter
	}
	for i, r := range ok {
		if err := Validate(api.NetworkPolicy{AllowOut: base, Rules: []api.HeaderRule{r}}); err != nil {
			t.Errorf("ok[%d]: %v", i, err)
		}
	}
	cases := []struct {
		r    api.HeaderRule
		want string
	}{
		{api.HeaderRule{Domain: "other.com"}, "network.rules[0].domain: \"other.com\": not covered"},
		{api.HeaderRule{Domain: "github.com"}, "not covered"}, // the apex is not under *.github.com
		{api.HeaderRule{Domain: "*.example.com"}, "not covered"},
		{api.HeaderRule{Domain: ""}, "empty domain"},
		{api.HeaderRule{Domain: "*"}, "bare"},
		{api.HeaderRule{Domain: "api.example.com:443"}, "no port"},
		{api.HeaderRule{Domain: "1.2.3.4"}, "no IP"},
		{api.HeaderRule{Domain: "https://api.example.com"}, "no port, URL"},
		{api.HeaderRule{Domain: "api.example.com", SetHeaders: map[string]string{"Bad Header": "x"}}, `network.rules[0].set_headers["Bad Header"]: invalid character ' '`},
		{api.HeaderRule{Domain: "api.example.com", SetHeaders: map[string]string{"": "x"}}, "empty header name"},
		{api.HeaderRule{Domain: "api.example.com", SetHeaders: map[string]string{"X-A": "a\r\nX-Evil: 1"}}, "control character"},
		{api.HeaderRule{Domain: "api.example.com", SetHeaders: map[string]string{"X-A": "a\x00"}}, "control character"},
		{api.HeaderRule{Domain: "api.example.com", SetHeaders: map[string]string{"X-A": strings.Repeat("v", MaxHeaderValue+1)}}, "at most 8192"},
		{api.HeaderRule{Domain: "api.example.com", SetHeaders: map[string]string{"X-A": "1", "x-a": "2"}}, "case-insensitive"},
		{api.HeaderRule{Domain: "api.example.com", SetHeaders: map[string]string{"X-A": "1"}, RemoveHeaders: []string{"x-A"}}, "already set or removed"},
		{api.HeaderRule{Domain: "api.example.com", SetHeaders: map[string]string{"Host": "evil.com"}}, "may not be changed"},
		{api.HeaderRule{Domain: "api.example.com", RemoveHeaders: []string{"Transfer-Encoding"}}, "may not be changed"},
		{api.HeaderRule{Domain: "api.example.com", RemoveHeaders: []string{"a:b"}}, `network.rules[0].remove_headers[0]: "a:b": invalid character ':'`},
	}
	for i, c := range cases {
		err := Validate(api.NetworkPolicy{AllowOut: base, Rules: []api.HeaderRule{c.r}})
		if err == nil || !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("case %d: %v, want …%s…", i, err, c.want)
		}
		if err != nil && strings.Contains(err.Error(), "Bearer") {
			t.Errorf("case %d: error echoes a header value: %v", i, err)
		}
	}
	// internet covers any domain.
	if err := Validate(api.NetworkPolicy{Internet: true, Rules: []api.HeaderRule{{Domain: "*.anything.io"}}}); err != nil {
		t.Error(err)
	}
	many := make([]api.HeaderRule, MaxRules+1)
	for i := range many {
		many[i] = api.HeaderRule{Domain: "api.example.com"}
	}
	if err := Validate(api.NetworkPolicy{AllowOut: base, Rules: many}); err == nil || !strings.Contains(err.Error(), "at most 64") {
		t.Errorf("65 rules: %v", err)
	}
	hs := map[string]string{}
	for i := 0; i <= MaxRuleHeaders; i++ {
		hs[fmt.Sprintf("X-%d", i)] = "v"
	}
	if err := Validate(api.NetworkPolicy{AllowOut: base, Rules: []api.HeaderRule{{Domain: "api.example.com", SetHeaders: hs}}}); err == nil || !strings.Contains(err.Error(), "65 headers") {
		t.Errorf("65 headers: %v", err)
	}
}

func TestValidateProxy(t *testing.T) {
	for _, s := range []string{"socks5://proxy.example.com:1080", "socks5h://1.2.3.4:1080", "SOCKS5://[2001:4860::1]:1080", "socks5://user:p%40ss@proxy.example.com:1080/"} {
		if err := Validate(api.NetworkPolicy{EgressProxy: s}); err != nil {
			t.Errorf("%q: %v", s, err)
		}
	}
	for s, want := range map[string]string{
		"http://proxy:8080":                 "only",
		"proxy:1080":                        "must be",
		"socks5://proxy.example.com":        "missing port",
		"socks5://proxy.example.com:0":      "out of range",
		"socks5://proxy.example.com:99999":  "out of range",
		"socks5://proxy.example.com:1080/x": "path",
		"socks5://proxy.example.com:1080?a": "query",
		"socks5://pro xy:1080":              "not a valid URL",
		"socks5://pr!xy:1080":               "invalid character",
		"socks5://:1080":                    "empty name",
		"socks5://user:secret@:1080":        "empty name",
		"socks5://user@proxy.com:1080":      "password",
		"socks5://[fe80::1%25eth0]:1080":    "zones",
	} {
		err := Validate(api.NetworkPolicy{EgressProxy: s})
		if err == nil || !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.HasPrefix(err.Error(), "network.egress_proxy: ") || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: %v, want …%s…", s, err, want)
		}
		if err != nil && strings.Contains(err.Error(), "secret") {
			t.Errorf("%q: error leaks the password: %v", s, err)
		}
	}
	pol, err := Compile(api.NetworkPolicy{EgressProxy: "socks5h://u:p@[2001:4860::1]:1080"}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	px := pol.Proxy()
	if px.Address() != "[2001:4860::1]:1080" || !px.RemoteDNS || px.Username != "u" || px.Password != "p" {
		t.Errorf("proxy %+v", px)
	}
	// A proxy at a private or protected address needs the operator's consent.
	if _, err := Compile(api.NetworkPolicy{EgressProxy: "socks5://127.0.0.1:1080"}, Options{}); err == nil || !strings.Contains(err.Error(), "loopback") {
		t.Errorf("loopback proxy: %v", err)
	}
	if _, err := Compile(api.NetworkPolicy{EgressProxy: "socks5://10.1.2.3:1080"}, Options{AllowPrivate: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}}); err != nil {
		t.Errorf("opened private proxy: %v", err)
	}
	if _, err := Compile(api.NetworkPolicy{EgressProxy: "socks5://8.8.8.8:1080"}, Options{Protected: []netip.AddrPort{netip.MustParseAddrPort("8.8.8.8:0")}}); err == nil || !strings.Contains(err.Error(), "protected") {
		t.Errorf("protected proxy: %v", err)
	}
}

func TestNameMatching(t *testing.T) {
	pol, err := Compile(api.NetworkPolicy{AllowOut: []string{"PyPI.org.", "*.example.com:443", "*.b.example.com", "*.corp.internal", "10.0.0.0/8"}}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name, rule, zone string
	}{
		{"pypi.org", "PyPI.org.", ""},
		{"PYPI.ORG.", "PyPI.org.", ""},
		{"files.pypi.org", "", ""}, // exact does not match subdomains
		{"example.com", "", ""},    // apex not under its wildcard
		{"a.example.com", "*.example.com:443", "*.example.com"},
		{"A.Example.Com.", "*.example.com:443", "*.example.com"},
		{"x.y.z.example.com", "*.example.com:443", "*.example.com"},
		{"x.b.example.com", "*.b.example.com", "*.example.com"}, // most specific rule, broadest zone
		{"b.example.com", "*.example.com:443", "*.example.com"},
		{"aexample.com", "", ""},
		{"a.example.com.evil.com", "", ""},
		{"x.corp.internal", "*.corp.internal", "*.corp.internal"},
		{"10.1.2.3", "", ""}, // IP entries are not names
		{"", "", ""},
		{".", "", ""},
		{"a..example.com", "", ""},
		{"a b.example.com", "", ""},
		{"a.example.com..", "", ""},
	}
	for _, c := range cases {
		rule, ok := pol.NameAllowed(c.name)
		if rule != c.rule || ok != (c.rule != "") {
			t.Errorf("NameAllowed(%q) = %q, %v; want %q", c.name, rule, ok, c.rule)
		}
		if z := pol.Zone(c.name); z != c.zone {
			t.Errorf("Zone(%q) = %q, want %q", c.name, z, c.zone)
		}
	}
	inet, _ := Compile(api.NetworkPolicy{Internet: true, AllowOut: []string{"*.example.com"}}, Options{})
	if r, ok := inet.NameAllowed("anything.net"); !ok || r != "internet" {
		t.Errorf("internet: %q %v", r, ok)
	}
	if r, ok := inet.NameAllowed("a.example.com"); !ok || r != "*.example.com" {
		t.Errorf("internet with entry: %q %v", r, ok)
	}
	if _, ok := inet.NameAllowed("bad name"); ok {
		t.Error("internet allowed an invalid name")
	}
	if z := inet.Zone("anything.net"); z != "" {
		t.Errorf("internet zone %q", z)
	}
}

func mustCompile(t *testing.T, p api.NetworkPolicy, o Options) *Policy {
	t.Helper()
	pol, err := Compile(p, o)
	if err != nil {
		t.Fatal(err)
	}
	return pol
}

func TestCheck(t *testing.T) {
	o := Options{
		AllowPrivate: []netip.Prefix{netip.MustParsePrefix("10.20.0.0/16"), netip.MustParsePrefix("fd00:1::/32")},
		Protected:    []netip.AddrPort{netip.MustParseAddrPort("10.20.0.1:0"), netip.MustParseAddrPort("93.184.216.1:8080")},
	}
	pol := mustCompile(t, api.NetworkPolicy{
		AllowOut: []string{
			"pypi.org", "ssh.example.com:22", "*.internal.example.com", "8.8.0.0/16", "1.1.1.1:53",
			"10.20.5.0/24:5432", "0.0.0.0/0:9999", "[fd00:1::5]", "93.184.216.0/24", "private.example.com",
		},
		DenyOut:      []string{"8.8.4.0/24", "151.101.0.0/16:80", "2600::/16"},
		AllowPrivate: []string{"10.20.0.0/16"},
	}, o)
	type want struct {
		allow, byName, opaque bool
		reason                string
	}
	cases := []struct {
		name, ip string
		port     uint16
		want
	}{
		// allow_out CIDR, with deny carving a hole
		{"", "8.8.8.8", 443, want{true, false, true, "8.8.0.0/16"}},
		{"", "8.8.4.4", 443, want{false, false, false, "deny_out 8.8.4.0/24"}},
		{"", "1.1.1.1", 53, want{true, false, true, "1.1.1.1:53"}},
		{"", "1.1.1.1", 443, want{false, false, false, "port not allowed"}},
		{"", "1.1.1.2", 53, want{false, false, false, "port not allowed"}}, // 0.0.0.0/0:9999 covers it
		// names
		{"pypi.org", "151.101.1.1", 443, want{true, true, false, "pypi.org"}},
		{"PyPI.org.", "151.101.1.1", 443, want{true, true, false, "pypi.org"}},
		{"pypi.org", "151.101.1.1", 80, want{false, false, false, "deny_out 151.101.0.0/16:80"}},
		{"ssh.example.com", "203.0.114.1", 22, want{true, true, true, "ssh.example.com:22"}},
		{"ssh.example.com", "203.0.114.1", 23, want{false, false, false, "port not allowed"}},
		{"a.b.internal.example.com", "203.0.114.1", 1234, want{true, true, false, "*.internal.example.com"}},
		{"internal.example.com", "203.0.114.1", 443, want{false, false, false, "port not allowed"}},
		{"evil.com", "203.0.114.1", 443, want{false, false, false, "port not allowed"}},
		{"", "2600::1", 443, want{false, false, false, "deny_out 2600::/16"}},
		// an allowed name resolving to a denied address
		{"pypi.org", "8.8.4.4", 443, want{false, false, false, "deny_out 8.8.4.0/24"}},
		// DNS rebinding: an allowed name resolving to special ranges
		{"pypi.org", "127.0.0.1", 443, want{false, false, false, "loopback address (127.0.0.0/8)"}},
		{"pypi.org", "10.1.1.1", 443, want{false, false, false, "private address (10.0.0.0/8)"}},
		{"pypi.org", "169.254.169.254", 80, want{false, false, false, "link-local address (169.254.0.0/16)"}},
		{"pypi.org", "198.18.0.1", 53, want{false, false, false, "benchmark address (198.18.0.0/15)"}},
		{"pypi.org", "::1", 443, want{false, false, false, "loopback address (::1/128)"}},
		{"pypi.org", "fe80::1", 443, want{false, false, false, "link-local address (fe80::/10)"}},
		// "0.0.0.0/0:9999" allows public addresses but never opens private ones
		{"", "9.9.9.9", 9999, want{true, false, true, "0.0.0.0/0:9999"}},
		{"", "10.20.9.9", 9999, want{false, false, false, "private address (10.0.0.0/8)"}},
		// AllowPrivate + explicit allow opens; either alone does not
		{"", "10.20.5.7", 5432, want{true, false, true, "10.20.5.0/24:5432"}},
		{"", "10.20.5.7", 5433, want{false, false, false, "private address (10.0.0.0/8)"}},
		{"", "10.20.6.7", 5432, want{false, false, false, "private address (10.0.0.0/8)"}},
		{"private.example.com", "10.20.6.7", 443, want{true, true, false, "private.example.com"}},
		{"private.example.com", "10.30.6.7", 443, want{false, false, false, "private address (10.0.0.0/8)"}},
		{"", "fd00:1::5", 80, want{true, false, true, "[fd00:1::5]"}},
		{"", "fd00:2::5", 80, want{false, false, false, "private address (fc00::/7)"}},
		// protected wins over everything
		{"private.example.com", "10.20.0.1", 443, want{false, false, false, "protected address"}},
		{"", "93.184.216.1", 8080, want{false, false, false, "protected address"}},
		{"", "93.184.216.1", 8081, want{true, false, true, "93.184.216.0/24"}},
		{"", "::ffff:93.184.216.1", 8080, want{false, false, false, "protected address"}},
		{"", "64:ff9b::5db8:d801", 8080, want{false, false, false, "protected address"}},
		// v4-mapped form of an allowed / denied address
		{"", "::ffff:8.8.8.8", 443, want{true, false, true, "8.8.0.0/16"}},
		{"", "::ffff:8.8.4.4", 443, want{false, false, false, "deny_out 8.8.4.0/24"}},
		{"", "64:ff9b::808:404", 443, want{false, false, false, "deny_out 8.8.4.0/24"}},
		// IPv6 forms embedding loopback / metadata
		{"pypi.org", "::ffff:127.0.0.1", 443, want{false, false, false, "loopback address (127.0.0.0/8, in ipv4-mapped form)"}},
		{"pypi.org", "::ffff:169.254.169.254", 80, want{false, false, false, "link-local address (169.254.0.0/16, in ipv4-mapped form)"}},
		{"pypi.org", "64:ff9b::7f00:1", 443, want{false, false, false, "loopback address (127.0.0.0/8, in nat64 form)"}},
		{"pypi.org", "64:ff9b::a9fe:a9fe", 80, want{false, false, false, "link-local address (169.254.0.0/16, in nat64 form)"}},
		{"pypi.org", "2002:7f00:1::", 443, want{false, false, false, "loopback address (127.0.0.0/8, in 6to4 form)"}},
		{"pypi.org", "2002:a9fe:a9fe::1", 80, want{false, false, false, "link-local address (169.254.0.0/16, in 6to4 form)"}},
		{"pypi.org", "::127.0.0.1", 443, want{false, false, false, "loopback address (127.0.0.0/8, in ipv4-compatible form)"}},
		{"pypi.org", "::a9fe:a9fe", 80, want{false, false, false, "link-local address (169.254.0.0/16, in ipv4-compatible form)"}},
		// port 0 and the zero Addr
		{"pypi.org", "151.101.1.1", 0, want{false, false, false, "port not allowed"}},
	}
	for _, c := range cases {
		v := pol.Check(c.name, netip.MustParseAddr(c.ip), c.port)
		got := want{v.Allow, v.ByName, v.OpaqueOK, v.Reason}
		if got != c.want {
			t.Errorf("Check(%q, %s, %d) = %+v, want %+v", c.name, c.ip, c.port, got, c.want)
		}
	}
	narrow := mustCompile(t, api.NetworkPolicy{AllowOut: []string{"pypi.org", "1.1.1.1:53"}}, o)
	for _, c := range []struct {
		name, ip string
		port     uint16
		reason   string
	}{
		{"evil.com", "203.0.114.1", 443, "not allowed"},
		{"", "1.1.1.2", 53, "not allowed"},
		{"", "1.1.1.1", 443, "port not allowed"},
		{"internal.example.com", "203.0.114.1", 443, "not allowed"},
	} {
		if v := narrow.Check(c.name, netip.MustParseAddr(c.ip), c.port); v.Allow || v.Reason != c.reason {
			t.Errorf("narrow Check(%q, %s, %d) = %+v, want %q", c.name, c.ip, c.port, v, c.reason)
		}
	}
	if v := pol.Check("pypi.org", netip.Addr{}, 443); v.Allow {
		t.Error("zero Addr allowed")
	}
}

func TestCheckInternet(t *testing.T) {
	o := Options{
		AllowPrivate: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")},
		Protected:    []netip.AddrPort{netip.MustParseAddrPort("198.51.100.7:0"), netip.MustParseAddrPort("9.9.9.9:443")},
	}
	pol := mustCompile(t, api.NetworkPolicy{Internet: true, AllowOut: []string{"pypi.org"}, DenyOut: []string{"1.2.3.0/24"}}, o)
	cases := []struct {
		name, ip string
		port     uint16
		allow    bool
		reason   string
	}{
		{"", "8.8.8.8", 443, true, "internet"},
		{"anything.net", "2606:4700::1111", 443, true, "internet"},
		{"", "1.2.3.4", 443, false, "deny_out 1.2.3.0/24"},
		{"", "10.1.1.1", 443, false, "private address (10.0.0.0/8)"}, // internet never opens private, even if the operator did
		{"", "127.0.0.1", 443, false, "loopback address (127.0.0.0/8)"},
		{"", "100.64.1.1", 443, false, "cgnat address (100.64.0.0/10)"},
		{"", "169.254.169.254", 80, false, "link-local address (169.254.0.0/16)"},
		{"", "::ffff:169.254.169.254", 80, false, "link-local address (169.254.0.0/16, in ipv4-mapped form)"},
		{"", "64:ff9b::a9fe:a9fe", 80, false, "link-local address (169.254.0.0/16, in nat64 form)"},
		{"", "224.0.0.1", 80, false, "multicast address (224.0.0.0/4)"},
		{"", "255.255.255.255", 80, false, "broadcast address (255.255.255.255/32)"},
		{"", "240.0.0.1", 80, false, "reserved address (240.0.0.0/4)"},
		{"", "9.9.9.9", 443, false, "protected address"},
		{"", "9.9.9.9", 53, true, "internet"},
		// a name entry + internet on a public address needs no proof
		{"pypi.org", "151.101.1.1", 443, true, "pypi.org"},
	}
	for _, c := range cases {
		v := pol.Check(c.name, netip.MustParseAddr(c.ip), c.port)
		if v.Allow != c.allow || v.Reason != c.reason || (v.Allow && (v.ByName || !v.OpaqueOK)) {
			t.Errorf("Check(%q, %s, %d) = %+v, want allow=%v %q", c.name, c.ip, c.port, v, c.allow, c.reason)
		}
	}
}

func TestClassify(t *testing.T) {
	cases := map[string]string{
		"8.8.8.8": "", "2606:4700::1111": "", "1.1.1.1": "", "::ffff:8.8.8.8": "", "64:ff9b::808:808": "", "2002:808:808::": "",
		"127.0.0.1": "loopback", "127.255.255.254": "loopback", "::1": "loopback", "::ffff:127.0.0.1": "loopback",
		"10.0.0.1": "private", "172.16.0.1": "private", "172.31.255.255": "private", "192.168.1.1": "private", "fc00::1": "private", "fd12::1": "private",
		"172.32.0.1": "", "100.64.0.1": "cgnat", "100.127.255.255": "cgnat", "100.128.0.1": "",
		"169.254.169.254": "link-local", "fe80::1": "link-local", "fe80::1%eth0": "link-local",
		"224.0.0.1": "multicast", "239.255.255.250": "multicast", "ff02::1": "multicast",
		"0.0.0.0": "unspecified", "0.1.2.3": "unspecified", "::": "unspecified",
		"255.255.255.255": "broadcast", "240.0.0.1": "reserved", "192.0.0.8": "reserved",
		"198.18.0.1": "benchmark", "198.19.255.255": "benchmark", "198.20.0.1": "",
		"192.0.2.1": "documentation", "198.51.100.1": "documentation", "203.0.113.1": "documentation", "2001:db8::1": "documentation", "3fff::1": "documentation",
		"100::1": "discard", "2001::1": "reserved", "::ffff:0:1.2.3.4": "reserved", "4000::1": "reserved",
		"64:ff9b::7f00:1": "loopback", "2002:c0a8:101::1": "private", "::10.0.0.1": "private",
	}
	for s, want := range cases {
		if got := Classify(netip.MustParseAddr(s)); got != want {
			t.Errorf("Classify(%s) = %q, want %q", s, got, want)
		}
	}
	if Classify(netip.Addr{}) != "invalid" {
		t.Error("zero Addr")
	}
}

func TestSourceIsACopy(t *testing.T) {
	in := api.NetworkPolicy{AllowOut: []string{"pypi.org"}, Rules: []api.HeaderRule{{Domain: "pypi.org", SetHeaders: map[string]string{"X-A": "1"}}}}
	pol := mustCompile(t, in, Options{})
	in.AllowOut[0] = "evil.com"
	in.Rules[0].SetHeaders["X-A"] = "2"
	s := pol.Source()
	if s.AllowOut[0] != "pypi.org" || s.Rules[0].SetHeaders["X-A"] != "1" {
		t.Fatalf("Source aliased its input: %+v", s)
	}
	if _, ok := pol.NameAllowed("evil.com"); ok {
		t.Fatal("policy changed with its input")
	}
}

func TestCompileOptions(t *testing.T) {
	if _, err := Compile(api.NetworkPolicy{}, Options{AllowPrivate: []netip.Prefix{{}}}); err == nil {
		t.Error("invalid AllowPrivate accepted")
	}
	if _, err := Compile(api.NetworkPolicy{}, Options{Protected: []netip.AddrPort{{}}}); err == nil {
		t.Error("invalid Protected accepted")
	}
	// Operator ranges written v4-mapped or with host bits still work.
	pol := mustCompile(t, api.NetworkPolicy{AllowOut: []string{"10.0.0.0/8"}}, Options{AllowPrivate: []netip.Prefix{netip.MustParsePrefix("::ffff:10.0.0.0/104")}})
	if v := pol.Check("", netip.MustParseAddr("10.1.2.3"), 80); !v.Allow {
		t.Errorf("%+v", v)
	}
	// The zero Policy, like the zero api.NetworkPolicy, reaches nothing.
	var zero Policy
	if v := zero.Check("pypi.org", netip.MustParseAddr("8.8.8.8"), 443); v.Allow {
		t.Errorf("zero Policy allowed %+v", v)
	}
	if _, ok := zero.NameAllowed("pypi.org"); ok {
		t.Error("zero Policy resolves names")
	}
	empty := mustCompile(t, api.NetworkPolicy{}, Options{})
	if v := empty.Check("", netip.MustParseAddr("8.8.8.8"), 443); v.Allow || v.Reason != "not allowed" {
		t.Errorf("empty policy: %+v", v)
	}
}

func BenchmarkCheck1024(b *testing.B) {
	var allow []string
	for i := 0; i < 512; i++ {
		allow = append(allow, fmt.Sprintf("h%d.example%d.com", i, i), fmt.Sprintf("*.zone%d.example.net:443", i))
	}
	var deny []string
	for i := 0; i < 1024; i++ {
		deny = append(deny, fmt.Sprintf("203.%d.%d.0/24", i/256, i%256))
	}
	pol, err := Compile(api.NetworkPolicy{AllowOut: allow, DenyOut: deny}, Options{})
	if err != nil {
		b.Fatal(err)
	}
	ip := netip.MustParseAddr("151.101.1.1")
	b.ResetTimer()
	for b.Loop() {
		if v := pol.Check("a.b.c.zone511.example.net", ip, 443); !v.Allow {
			b.Fatal(v)
		}
	}
}

func TestOptionsUnreachable(t *testing.T) {
	o := Options{
		AllowPrivate: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")},
		Protected:    []netip.AddrPort{netip.MustParseAddrPort("127.0.0.1:0"), netip.MustParseAddrPort("127.0.0.9:7070")},
	}
	for _, c := range []struct {
		ip   string
		port uint16
		want string
	}{
		{"127.0.0.2", 80, ""},
		{"::ffff:127.0.0.2", 80, ""},
		{"127.0.0.1", 80, "protected address"},
		{"127.0.0.1", 0, "protected address"},
		{"127.0.0.9", 7070, "protected address"},
		{"127.0.0.9", 80, ""},
		{"127.0.0.9", 0, "protected address"},
		{"10.1.2.3", 443, "private"},
		{"169.254.169.254", 80, "link-local"},
		{"151.101.1.1", 443, ""},
	} {
		if got := o.Unreachable(netip.MustParseAddr(c.ip), c.port); got != c.want {
			t.Errorf("Unreachable(%s, %d) = %q, want %q", c.ip, c.port, got, c.want)
		}
	}
}

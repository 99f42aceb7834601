package server

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/netpolicy"
)

func TestDefaultDNSUpstream(t *testing.T) {
	dir := t.TempDir()
	for content, want := range map[string]string{
		"# c\nsearch x\nnameserver 10.0.0.53\nnameserver 1.1.1.1\n": "10.0.0.53:53",
		"nameserver bogus\nnameserver 2001:db8::1\n":                "[2001:db8::1]:53",
		"options edns0\n": "",
	} {
		p := filepath.Join(dir, "resolv.conf")
		os.WriteFile(p, []byte(content), 0o644)
		got, err := DefaultDNSUpstream(p)
		if got != want || (want == "") != (err != nil) {
			t.Errorf("%q: %q %v, want %q", content, got, err, want)
		}
	}
	if _, err := DefaultDNSUpstream(filepath.Join(dir, "missing")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing file: %v", err)
	}
}

func TestNetworkOptionsCheck(t *testing.T) {
	o := NetworkOptions{DNSUpstream: "9.9.9.9:53", Default: api.NetworkPolicy{Internet: true}}
	if err := o.check(); err != nil {
		t.Fatal(err)
	}
	o.DNSUpstream = "9.9.9.9"
	if err := o.check(); err == nil {
		t.Fatal("a DNS upstream without a port was accepted")
	}
	bad := NetworkOptions{DNSUpstream: "9.9.9.9:53", Default: api.NetworkPolicy{AllowOut: []string{"*"}}}
	if netpolicy.Validate(bad.Default) != nil && bad.check() == nil {
		t.Fatal("an invalid default policy was accepted")
	}
}

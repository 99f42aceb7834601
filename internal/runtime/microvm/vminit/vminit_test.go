package vminit

import (
	"strings"
	"testing"
)

func TestConfigFromEnvChecksTheHost(t *testing.T) {
	for _, tc := range []struct {
		host, mem, pids string
		ok              bool
	}{
		{"sb-1", "128", "64", true},
		{"", "", "", true},
		{"a", "1", "1", true},
		{"Bad_Name", "128", "64", false},
		{"x y", "", "", false},
		{"-lead", "", "", false},
		{strings.Repeat("a", 64), "", "", false},
		{"ok", "0", "", false},
		{"ok", "-5", "", false},
		{"ok", "12x", "", false},
		{"ok", "99999999999", "", false},
		{"ok", "", "0", false},
		{"ok", "", "1e3", false},
	} {
		t.Setenv(EnvHostname, tc.host)
		t.Setenv(EnvMemoryMiB, tc.mem)
		t.Setenv(EnvPids, tc.pids)
		c, err := configFromEnv()
		if (err == nil) != tc.ok {
			t.Errorf("host %q mem %q pids %q: %+v, %v", tc.host, tc.mem, tc.pids, c, err)
		}
	}
	t.Setenv(EnvHostname, "sb")
	t.Setenv(EnvMemoryMiB, "128")
	t.Setenv(EnvPids, "64")
	if c, err := configFromEnv(); err != nil || c != (config{hostname: "sb", memoryMiB: 128, pids: 64}) {
		t.Errorf("config %+v, %v", c, err)
	}
}

func TestHostsWithName(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"", defaultHosts + "127.0.1.1\tsb\n"},
		{"127.0.0.1 localhost\n127.0.1.1 old old.example\n10.0.0.1 db", "127.0.0.1 localhost\n10.0.0.1 db\n127.0.1.1\tsb\n"},
		{"127.0.1.1\tsb\n127.0.1.1\tother\n", "127.0.1.1\tsb\n"},
	} {
		if got := string(hostsWithName([]byte(tc.in), "sb")); got != tc.want {
			t.Errorf("hostsWithName(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
}

func TestPhasesLine(t *testing.T) {
	var p phases
	p.mark("mounts")
	p.mark("port /dev/vport0p1")
	if s := p.String(); !strings.HasPrefix(s, "mounts ") || !strings.Contains(s, ", port /dev/vport0p1 ") {
		t.Errorf("phases line %q", s)
	}
}

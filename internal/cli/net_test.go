package cli

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
)

func TestNetworkFlagsOnCreateAndRun(t *testing.T) {
	f, url := newFakeServer(t)
	code, _, errOut := runCLI(t, url, "", "sandbox", "create", "-q", "--internet", "--allow-out", "pypi.org",
		"--allow-out", "*.github.com:443,1.2.3.0/24", "--deny-out", "10.0.0.0/8", "--egress-proxy", "socks5://127.0.0.1:1080")
	if code != 0 {
		t.Fatalf("create: %d %s", code, errOut)
	}
	want := api.NetworkPolicy{Internet: true, AllowOut: []string{"pypi.org", "*.github.com:443", "1.2.3.0/24"},
		DenyOut: []string{"10.0.0.0/8"}, EgressProxy: "socks5://127.0.0.1:1080"}
	if got := f.creates[0].Network; got == nil || !reflect.DeepEqual(*got, want) {
		t.Fatalf("create sent %+v", got)
	}
	// No policy flag: no policy sent (the template's or server's applies).
	if code, _, _ := runCLI(t, url, "", "create", "-q"); code != 0 || f.creates[1].Network != nil {
		t.Fatalf("plain create sent %+v", f.creates[1].Network)
	}
	if code, _, errOut := runCLI(t, url, "", "run", "--allow-out", "example.com", "--", "true"); code != 0 {
		t.Fatalf("run: %d %s", code, errOut)
	}
	if got := f.creates[2].Network; got == nil || !reflect.DeepEqual(got.AllowOut, []string{"example.com"}) {
		t.Fatalf("run sent %+v", got)
	}
	for _, args := range [][]string{
		{"create", "--allow-out", "a.com,,b.com"},
		{"create", "--egress-proxy", "http://proxy:3128"},
		{"net", "set", "sb-1"},
		{"net", "set", "sb-1", "--none", "--internet"},
		{"net", "get"},
	} {
		if code, _, errOut := runCLI(t, url, "", args...); code != ExitUsage {
			t.Errorf("%v: code %d %s", args, code, errOut)
		}
	}
}

func TestNetCommands(t *testing.T) {
	f, url := newFakeServer(t)
	code, out, errOut := runCLI(t, url, "", "net", "get", "sb-1")
	if code != 0 || !strings.Contains(out, "pypi.org") || !strings.Contains(out, "198.18.0.2") || !strings.Contains(out, "allow=2 deny=1") {
		t.Fatalf("get: %d %q %s", code, out, errOut)
	}
	code, out, _ = runCLI(t, url, "", "--json", "net", "get", "sb-1")
	var info api.NetworkInfo
	if code != 0 || json.Unmarshal([]byte(out), &info) != nil || !info.Attached {
		t.Fatalf("get --json: %d %q", code, out)
	}
	if code, _, _ := runCLI(t, url, "", "net", "get", "sb-nope"); code != ExitError {
		t.Fatalf("unknown sandbox: %d", code)
	}

	code, out, errOut = runCLI(t, url, "", "net", "set", "sb-1", "--internet", "--deny-out", "10.0.0.0/8")
	if code != 0 || !strings.Contains(out, "Internet:") || !strings.Contains(out, "yes") {
		t.Fatalf("set: %d %q %s", code, out, errOut)
	}
	if code, _, _ := runCLI(t, url, "", "net", "set", "sb-1", "--none"); code != 0 {
		t.Fatalf("set --none: %d", code)
	}
	if want := []string{`{"deny_out":["10.0.0.0/8"],"internet":true}`, `{}`}; !reflect.DeepEqual(f.netPuts, want) {
		t.Fatalf("PUT bodies %q", f.netPuts)
	}

	at := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	f.events = []api.NetworkEvent{
		{Seq: 1, Time: at, Protocol: "dns", Name: "evil.example", Verdict: api.VerdictDeny, Reason: "not in allow_out"},
		{Seq: 2, Time: at, Protocol: "tcp", Name: "pypi.org", IP: "151.101.0.223", Port: 443, Verdict: api.VerdictAllow, Reason: "allow_out[0]", BytesOut: 1500, BytesIn: 3 << 20},
	}
	code, out, _ = runCLI(t, url, "", "net", "log", "sb-1")
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if code != 0 || len(lines) != 2 || !strings.Contains(lines[0], "deny") || !strings.Contains(lines[0], "evil.example") ||
		!strings.Contains(lines[1], "151.101.0.223:443") || !strings.Contains(lines[1], "out=1.5KiB in=3.0MiB") {
		t.Fatalf("log: %d %q", code, out)
	}
	code, out, _ = runCLI(t, url, "", "--json", "net", "log", "sb-1")
	lines = strings.Split(strings.TrimSpace(out), "\n")
	var ev api.NetworkEvent
	if code != 0 || len(lines) != 2 || json.Unmarshal([]byte(lines[1]), &ev) != nil || ev.Port != 443 {
		t.Fatalf("log --json: %d %q", code, out)
	}
}

// TestAllowPrivateFlag: --allow-private (repeatable, comma lists) is the
// policy's allow_private on create, run and net set, and is shown.
func TestAllowPrivateFlag(t *testing.T) {
	f, url := newFakeServer(t)
	if code, _, errOut := runCLI(t, url, "", "sandbox", "create", "-q", "--allow-out", "db.internal.example",
		"--allow-private", "10.0.0.0/8", "--allow-private", "127.0.0.2,192.168.1.0/24"); code != 0 {
		t.Fatalf("create: %d %s", code, errOut)
	}
	want := api.NetworkPolicy{AllowOut: []string{"db.internal.example"}, AllowPrivate: []string{"10.0.0.0/8", "127.0.0.2", "192.168.1.0/24"}}
	if got := f.creates[0].Network; got == nil || !reflect.DeepEqual(*got, want) {
		t.Fatalf("create sent %+v", got)
	}
	if code, _, errOut := runCLI(t, url, "", "run", "--allow-private", "127.0.0.0/8", "--", "true"); code != 0 {
		t.Fatalf("run: %d %s", code, errOut)
	}
	if got := f.creates[1].Network; got == nil || !reflect.DeepEqual(got.AllowPrivate, []string{"127.0.0.0/8"}) {
		t.Fatalf("run sent %+v", got)
	}
	code, out, errOut := runCLI(t, url, "", "net", "set", "sb-1", "--allow-private", "10.1.0.0/16")
	if code != 0 {
		t.Fatalf("net set: %d %q %s", code, out, errOut)
	}
	if want := []string{`{"allow_private":["10.1.0.0/16"]}`}; !reflect.DeepEqual(f.netPuts, want) {
		t.Fatalf("PUT bodies %q", f.netPuts)
	}
	if code, _, _ := runCLI(t, url, "", "net", "set", "sb-1", "--none", "--allow-private", "10.1.0.0/16"); code != ExitUsage {
		t.Fatalf("--none with --allow-private: %d", code)
	}
	if code, _, _ := runCLI(t, url, "", "create", "--allow-private", "10.0.0.0/8,,"); code != ExitUsage {
		t.Fatalf("empty entry: %d", code)
	}
	if got := policySummary(want); !strings.Contains(got, "private 10.0.0.0/8,127.0.0.2,192.168.1.0/24") {
		t.Fatalf("summary %q", got)
	}
}

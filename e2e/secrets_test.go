package e2e

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/sandbox"
)

// secretRuntimes: every check of TestSecretNeverEntersSandbox runs on each.
var secretRuntimes = []string{"native", "gvisor"}

// newSecretValue is a fresh value no file, process or log can hold by
// chance.
func newSecretValue(t *testing.T) string {
	var b [16]byte
	rand.Read(b[:])
	return "sk-e2e-" + hex.EncodeToString(b[:])
}

// obfuscated is a grep -E pattern that matches value but does not contain
// it: a check inside the sandbox must not carry the value in.
func obfuscated(value string) string { return "s[k]" + value[2:] }

// TestSecretNeverEntersSandbox: a sandbox granted a secret sees only its
// placeholder, trusts its own CA, and the value is nowhere it can reach or
// the host keeps: not in any process's environment, ps, any file (from
// inside, and the sandbox's host-side directories and disk), the memory of
// every host process of the sandbox, a core dump, command output, the API's
// answers, or the store's raw file.
func TestSecretNeverEntersSandbox(t *testing.T) {
	e := setup(t)
	for _, rt := range secretRuntimes {
		t.Run(rt, func(t *testing.T) { testSecretNeverEnters(t, e, rt) })
	}
}

func testSecretNeverEnters(t *testing.T, e *env, runtime string) {
	ctx := ctxT(t, 5*time.Minute)
	value := newSecretValue(t)
	name := "E2E_TOKEN_" + strings.ToUpper(runtime)
	// Set through the CLI from stdin (no argument carries it).
	if out, errOut, code := e.spaceCLI(t, value+"\n", "secret", "set", name, "--hosts", "allowed.test", "--header", "Authorization: Bearer {}"); code != 0 || strings.Contains(out+errOut, value) {
		t.Fatalf("secret set: %d %q %q", code, out, errOut)
	}
	t.Cleanup(func() { e.client.DeleteSecret(context.Background(), name) })
	sb := newSandbox(t, e, api.CreateSandboxRequest{Runtime: runtime, Secrets: []string{name},
		Network: &api.NetworkPolicy{AllowOut: []string{"allowed.test"}, AllowPrivate: []string{"127.0.0.0/8"}}})
	gs, err := e.client.SandboxSecrets(ctx, sb.ID)
	if err != nil || len(gs) != 1 || gs[0].Name != name {
		t.Fatalf("grants: %v %+v", err, gs)
	}
	ph := gs[0].Placeholder
	var outputs []string
	run := func(script string) string {
		t.Helper()
		out, code := sh(t, e, sb.ID, script)
		if code != 0 {
			t.Fatalf("%q: exit %d: %s", script, code, out)
		}
		outputs = append(outputs, out)
		return out
	}
	if got := run("printf %s \"$" + name + "\""); got != ph {
		t.Fatalf("$%s = %q, want the placeholder %q", name, got, ph)
	}
	// Trust: the CA is in the sandbox's stores and the env points at it.
	run("test -s /etc/space/ca.crt && test -s /usr/local/share/ca-certificates/space-sandbox.crt && test -s /etc/space/ca-bundle.crt")
	for k, v := range sandbox.TrustEnv {
		if got := run("printf %s \"$" + k + "\""); got != v {
			t.Errorf("$%s = %q, want %q", k, got, v)
		}
	}
	ca := run("cat /etc/space/ca.crt")
	if !strings.Contains(ca, "BEGIN CERTIFICATE") || strings.Contains(ca, "PRIVATE") {
		t.Fatalf("/etc/space/ca.crt: %q", ca)
	}
	if sys := run("cat /etc/ssl/certs/ca-certificates.crt 2>/dev/null || true"); sys != "" && !strings.Contains(sys, strings.TrimSpace(ca)) {
		t.Error("the system bundle exists but does not hold the sandbox CA")
	}
	if b := run("cat /etc/space/ca-bundle.crt"); !strings.Contains(b, strings.TrimSpace(ca)) {
		t.Error("/etc/space/ca-bundle.crt does not hold the sandbox CA")
	}
	// A long-lived process with the placeholder in its env, for ps, environ
	// and the host-side memory scan.
	marker := "/tmp/space-secret-marker-" + runtime
	run("cp /bin/sleep " + marker + " && (" + marker + " 600 >/dev/null 2>&1 &)")
	// Inside: every process's env and argv, ps, and every file.
	pat := obfuscated(value)
	if out := run("cat /proc/[0-9]*/environ /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' '\\n'"); !strings.Contains(out, ph) {
		t.Errorf("no process env holds the placeholder:\n%s", out)
	}
	run("ps auxe 2>/dev/null || ps -ef")
	if out := run("grep -rlE '" + pat + "' / --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev 2>/dev/null || true"); out != "" {
		t.Errorf("files inside the sandbox hold the value:\n%s", out)
	}
	// A core dump of a sandbox process (where the runtime writes one).
	core := run(`cd /tmp && (ulimit -c unlimited 2>/dev/null; sh -c 'kill -SEGV $$') ; ls /tmp | grep -c '^core' || true`)
	if n, _ := strconv.Atoi(strings.TrimSpace(core)); n > 0 {
		if out := run("grep -lE '" + pat + "' /tmp/core* || true"); out != "" {
			t.Errorf("a core dump holds the value: %s", out)
		}
		t.Logf("%s: %d core dump(s) written and checked", runtime, n)
	} else {
		diag, _ := sh(t, e, sb.ID, "echo soft=$(ulimit -c) hard=$(ulimit -Hc) pattern=$(cat /proc/sys/kernel/core_pattern 2>&1); (ulimit -c unlimited; sh -c 'kill -SEGV $$'; echo status=$?) 2>&1")
		t.Logf("%s: no core dump was written in the sandbox (%s); the host-side memory scan stands in", runtime, strings.Join(strings.Fields(diag), " "))
	}
	// Host side: the memory of every host process of the sandbox.
	pids := sandboxPIDs(t, marker)
	for _, pid := range pids {
		if hit, err := memContains(pid, []byte(value)); err != nil {
			t.Logf("reading the memory of pid %d: %v", pid, err)
		} else if hit {
			t.Errorf("the memory of host pid %d of the sandbox holds the value", pid)
		}
	}
	if runtime == "native" {
		// The scan must see what is there: the marker's env holds the placeholder.
		if hit, err := memContains(pidOf(t, marker), []byte(ph)); err != nil || !hit {
			t.Errorf("the memory scan does not see the placeholder in the marker's env (%v): the scan is blind", err)
		}
	}
	// Host side: the sandbox's directories and disk, and the store.
	dir := filepath.Join(e.data, "runtimes", runtime, "sandboxes", sb.ID)
	if hits := treeContains(t, dir, []byte(value)); len(hits) > 0 {
		t.Errorf("host-side files of the sandbox hold the value: %v", hits)
	}
	for _, f := range []string{"space.db", "space.db-wal"} {
		if hit, _ := fileContains(filepath.Join(e.data, f), []byte(value)); hit {
			t.Errorf("the store's %s holds the value in clear", f)
		}
	}
	// Output and API answers.
	for _, o := range outputs {
		if strings.Contains(o, value) {
			t.Errorf("command output holds the value: %q", o)
		}
	}
	for _, path := range []string{"/v1/sandboxes/" + sb.ID, "/v1/secrets/" + name, "/v1/secrets", "/v1/sandboxes/" + sb.ID + "/secrets", "/v1/sandboxes/" + sb.ID + "/network"} {
		req, _ := http.NewRequestWithContext(ctx, "GET", e.url+path, nil)
		req.Header.Set("Authorization", "Bearer "+e.key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || bytes.Contains(b, []byte(value)) {
			t.Errorf("GET %s: %d, holds the value: %v", path, resp.StatusCode, bytes.Contains(b, []byte(value)))
		}
	}
	var got api.Secret
	if s, err := e.client.GetSecret(ctx, name); err != nil {
		t.Fatal(err)
	} else if got = *s; got.Version != 1 || got.Header != "Authorization: Bearer {}" || strings.Join(got.Hosts, ",") != "allowed.test" {
		t.Errorf("secret = %+v", got)
	}
	// Revoke: the next command has no env var; grant again: a new placeholder.
	if _, _, code := e.spaceCLI(t, "", "secret", "revoke", sb.ID, name); code != 0 {
		t.Fatal("revoke failed")
	}
	if got := run("printf %s \"${" + name + ":-unset}\""); got != "unset" {
		t.Fatalf("after revoke $%s = %q", name, got)
	}
	out, _, code := e.spaceCLI(t, "", "secret", "grant", sb.ID, name)
	if code != 0 || !strings.HasPrefix(out, name+"=space-ph-") || strings.Contains(out, ph) {
		t.Fatalf("grant again: %d %q", code, out)
	}
}

// pidOf is the host pid of the process whose argv[0] is marker.
func pidOf(t *testing.T, marker string) int {
	t.Helper()
	deadline := time.Now().Add(3 * time.Second)
	for time.Now().Before(deadline) {
		ents, _ := os.ReadDir("/proc")
		for _, d := range ents {
			pid, err := strconv.Atoi(d.Name())
			if err != nil {
				continue
			}
			b, _ := os.ReadFile(filepath.Join("/proc", d.Name(), "cmdline"))
			if bytes.HasPrefix(b, []byte(marker+"\x00")) {
				return pid
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
	return 0
}

// sandboxPIDs are the host processes of the sandbox that runs the marker
// process: those in its cgroup (memory controller, else the first line)
// — for gvisor the sentry and gofer, for native every sandbox process.
// Without a visible marker (gvisor hides sandbox processes from the host)
// it falls back to the runsc processes of the test's data dir.
func sandboxPIDs(t *testing.T, marker string) []int {
	t.Helper()
	pid := pidOf(t, marker)
	ents, _ := os.ReadDir("/proc")
	var out []int
	if pid != 0 {
		cg, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
		for _, d := range ents {
			p, err := strconv.Atoi(d.Name())
			if err != nil {
				continue
			}
			if b, _ := os.ReadFile(filepath.Join("/proc", d.Name(), "cgroup")); len(cg) > 0 && bytes.Equal(b, cg) {
				out = append(out, p)
			}
		}
		return out
	}
	for _, d := range ents {
		p, err := strconv.Atoi(d.Name())
		if err != nil {
			continue
		}
		b, _ := os.ReadFile(filepath.Join("/proc", d.Name(), "cmdline"))
		if bytes.Contains(b, []byte("runsc")) && bytes.Contains(b, []byte("space-e2e-")) {
			out = append(out, p)
		}
	}
	if len(out) == 0 {
		t.Error("found no host process of the sandbox to scan")
	}
	return out
}

// memContains scans the readable mappings of pid for needle.
func memContains(pid int, needle []byte) (bool, error) {
	maps, err := os.Open(fmt.Sprintf("/proc/%d/maps", pid))
	if err != nil {
		return false, err
	}
	defer maps.Close()
	mem, err := os.Open(fmt.Sprintf("/proc/%d/mem", pid))
	if err != nil {
		return false, err
	}
	defer mem.Close()
	pagemap, err := os.Open(fmt.Sprintf("/proc/%d/pagemap", pid))
	if err != nil {
		return false, err
	}
	defer pagemap.Close()
	sc := bufio.NewScanner(maps)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 2 || f[1][0] != 'r' || (len(f) >= 6 && (f[5] == "[vvar]" || f[5] == "[vsyscall]")) {
			continue
		}
		lo, hi, _ := strings.Cut(f[0], "-")
		a, _ := strconv.ParseUint(lo, 16, 64)
		b, _ := strconv.ParseUint(hi, 16, 64)
		// Only pages already present: reading others through /proc/PID/mem
		// would fault them in and charge them to the sandbox (a gvisor
		// sentry maps its whole memory file).
		var prev []byte
		for off := a; off < b; off += pageSize {
			var ent [8]byte
			if _, err := pagemap.ReadAt(ent[:], int64(off/pageSize*8)); err != nil {
				break
			}
			if ent[7]&0x80 == 0 { // bit 63: present
				prev = nil
				continue
			}
			buf := make([]byte, pageSize)
			if _, err := mem.ReadAt(buf, int64(off)); err != nil {
				prev = nil
				continue
			}
			if bytes.Contains(append(prev, buf...), needle) {
				return true, nil
			}
			prev = buf[pageSize-len(needle):]
		}
	}
	return false, sc.Err()
}

const pageSize = 4096

// treeContains lists the regular files under dir holding needle (sparse
// files read by their data extents only; symlinks not followed).
func treeContains(t *testing.T, dir string, needle []byte) []string {
	t.Helper()
	var hits []string
	n := 0
	filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return nil
		}
		n++
		if hit, _ := fileContains(p, needle); hit {
			hits = append(hits, p)
		}
		return nil
	})
	if n == 0 {
		t.Errorf("no host-side file of the sandbox under %s: the scan looked at nothing", dir)
	}
	return hits
}

// fileContains reads path's data extents (SEEK_DATA/SEEK_HOLE) looking
// for needle.
func fileContains(path string, needle []byte) (bool, error) {
	f, err := os.Open(path)
	if err != nil {
		return false, err
	}
	defer f.Close()
	fd := int(f.Fd())
	var off int64
	for {
		start, err := unix.Seek(fd, off, unix.SEEK_DATA)
		if err != nil {
			if errors.Is(err, unix.ENXIO) {
				return false, nil
			}
			return false, err
		}
		end, err := unix.Seek(fd, start, unix.SEEK_HOLE)
		if err != nil {
			return false, err
		}
		const chunk = 8 << 20
		var prev []byte
		for pos := start; pos < end; pos += chunk {
			buf := make([]byte, min(chunk, end-pos))
			if _, err := f.ReadAt(buf, pos); err != nil && err != io.EOF {
				return false, err
			}
			if bytes.Contains(append(prev, buf...), needle) {
				return true, nil
			}
			prev = buf[max(0, len(buf)-len(needle)):]
		}
		off = end
	}
}

// TestSecretsAPIRefusals: bad input to the secrets routes is a 4xx naming
// the problem, and never echoes a value.
func TestSecretsAPIRefusals(t *testing.T) {
	e := setup(t)
	ctx := ctxT(t, time.Minute)
	do := func(method, path, body string) (int, string) {
		req, _ := http.NewRequestWithContext(ctx, method, e.url+path, strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+e.key)
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	for _, tc := range []struct {
		method, path, body string
		status             int
		want               string
	}{
		{"PUT", "/v1/secrets/lower", `{"value":"v-secret-1"}`, 400, "must match"},
		{"PUT", "/v1/secrets/OK_NAME", `{}`, 400, "value or value_base64 is required"},
		{"PUT", "/v1/secrets/OK_NAME", `{"value":"v-secret-1","value_base64":"djE="}`, 400, "not both"},
		{"PUT", "/v1/secrets/OK_NAME", `{"value_base64":"v-secret-1!"}`, 400, "not standard base64"},
		{"PUT", "/v1/secrets/OK_NAME", `{"value":"v-secret-1","hosts":["*"]}`, 400, "hosts[0]"},
		{"PUT", "/v1/secrets/OK_NAME", `{"value":"v-secret-1","hosts":["a.test"],"header":"Host: {}"}`, 400, "frames or routes"},
		{"PUT", "/v1/secrets/OK_NAME", `{"value":"v-secret-1\n"}`, 400, "control character"},
		{"PUT", "/v1/secrets/OK_NAME", `{"value":"v-secret-1","extra":1}`, 400, "unknown field"},
		{"PUT", "/v1/secrets/OK_NAME", `{"value":"` + strings.Repeat("v", 70<<10) + `"}`, 413, "at most"},
		{"GET", "/v1/secrets/NOPE_NOT_THERE", ``, 404, "no secret"},
		{"DELETE", "/v1/secrets/NOPE_NOT_THERE", ``, 404, "no secret"},
		{"PUT", "/v1/sandboxes/sb-aaaaaaaaaaaaaaaa/secrets/NOPE", ``, 404, "not found"},
		{"POST", "/v1/sandboxes", `{"secrets":["NOPE_NOT_THERE"]}`, 404, "NOPE_NOT_THERE"},
		{"POST", "/v1/sandboxes", `{"secrets":["bad-name"]}`, 400, "secrets[0]"},
	} {
		status, body := do(tc.method, tc.path, tc.body)
		var eb api.Error
		json.Unmarshal([]byte(body), &eb)
		if status != tc.status || !strings.Contains(eb.Error.Message, tc.want) || strings.Contains(body, "v-secret-1") {
			t.Errorf("%s %s %.40s: %d %s; want %d %q", tc.method, tc.path, tc.body, status, body, tc.status, tc.want)
		}
	}
}

// TestSecretRunFlag: `space run --secret NAME` grants it to the run's
// sandbox: the command sees the placeholder, never the value.
func TestSecretRunFlag(t *testing.T) {
	e := setup(t)
	value := newSecretValue(t)
	if _, errOut, code := e.spaceCLI(t, value, "secret", "set", "E2E_RUN_TOKEN", "--hosts", "allowed.test"); code != 0 {
		t.Fatalf("secret set: %s", errOut)
	}
	t.Cleanup(func() { e.client.DeleteSecret(context.Background(), "E2E_RUN_TOKEN") })
	out, errOut, code := e.spaceCLI(t, "", "run", "--runtime", "native", "--secret", "E2E_RUN_TOKEN", "--", "sh", "-c", `printf %s "$E2E_RUN_TOKEN"`)
	if code != 0 || !strings.HasPrefix(out, "space-ph-") || len(out) != len("space-ph-")+32 || strings.Contains(out+errOut, value) {
		t.Fatalf("space run --secret: %d %q %q", code, out, errOut)
	}
	ls, _, code := e.spaceCLI(t, "", "secret", "ls")
	if code != 0 || !strings.Contains(ls, "E2E_RUN_TOKEN") || strings.Contains(ls, value) {
		t.Fatalf("secret ls: %d %q", code, ls)
	}
	if _, _, code := e.spaceCLI(t, "", "secret", "rm", "E2E_RUN_TOKEN"); code != 0 {
		t.Fatal("secret rm failed")
	}
}

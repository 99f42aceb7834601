package e2e

// Regression suite for issue 25 (the shared-CDN class of egress bypasses),
// run from real sandboxes on every runtime against fakes on loopback only.
//
// cdn-a.test (allowed) and cdn-b.test (denied) resolve to the same address,
// 127.0.0.9, where one deliberately lenient HTTP server (fakeCDN, below)
// routes by Host the way real shared upstreams do: it ignores bodies on
// GET, prefers Content-Length over Transfer-Encoding, takes the last item of
// a folded or listed Host, skips empty lines before a request line, accepts
// lowercase methods and bare LF, answers 200 (not 101) to an Upgrade it does
// not speak. Every attack tries to make it serve cdn-b.test through a
// connection the gateway allowed for cdn-a.test; the suite asserts the
// FIXED behaviour: it never does, and the attacking connection is closed or
// reset. Positive controls show the same paths work for cdn-a.test, so a
// refusal is not just a broken setup.

import (
	"bufio"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/gateway"
	"github.com/spacehq/space/internal/gateway/gatewaytest"
	"github.com/spacehq/space/internal/testenv"
)

// cdnIP is the address both names resolve to (sandboxes see 198.19.0.9).
const cdnIP = "127.0.0.9"

func TestEgressBypassNative(t *testing.T) { testEgressBypass(t, "native") }
func TestEgressBypassGVisor(t *testing.T) { testEgressBypass(t, "gvisor") }

// TestEgressBypassMicroVM runs a small subset (QEMU TCG is slow): one
// sandbox, one script.
func TestEgressBypassMicroVM(t *testing.T) { testEgressBypass(t, "microvm") }

// microvmAttacks is the microvm subset of ebScript's cases.
var microvmAttacks = []string{"P1", "P2", "P5", "1ws", "2connect", "3a", "3b", "6a", "6d", "9"}

func testEgressBypass(t *testing.T, rt string) {
	e := setup(t)
	requireEgressRuntime(t, e, rt)
	cdn := sharedCDN(t, e)
	cdn.reset()
	start := time.Now()
	t.Cleanup(func() { t.Logf("%s: %.1f s", rt, time.Since(start).Seconds()) })

	pol := cdn.policy()
	a := newSandbox(t, e, api.CreateSandboxRequest{Runtime: rt, Network: &pol})
	ctx := ctxT(t, 5*time.Minute)
	if _, err := e.client.WriteFile(ctx, a.ID, "/tmp/eb.py", strings.NewReader(ebScript), 0o644); err != nil {
		t.Fatal(err)
	}
	only, dnsN := "", 300
	if rt == "microvm" {
		only, dnsN = strings.Join(microvmAttacks, ","), 24
	}
	before := len(e.internet.dns.Queries())
	out, code := sh(t, e, a.ID, fmt.Sprintf("python3 /tmp/eb.py %d %d %s '%s' %d", cdn.p1, cdn.p2, rt, only, dnsN))
	// The names the fake upstream resolver was asked meanwhile, in the
	// letter case they came in.
	var upstream []string
	if q := e.internet.dns.Queries(); len(q) >= before {
		for _, m := range q[before:] {
			for _, qq := range m.Questions {
				upstream = append(upstream, strings.TrimSuffix(qq.Name.String(), "."))
			}
		}
	}
	results := map[string]ebResult{}
	var order []string
	for _, line := range strings.Split(out, "\n") {
		js, ok := strings.CutPrefix(line, "RESULT ")
		if !ok {
			continue
		}
		var r ebResult
		if err := json.Unmarshal([]byte(js), &r); err != nil {
			t.Fatalf("bad result line %q: %v", line, err)
		}
		results[r.Name] = r
		order = append(order, r.Name)
	}
	if code != 0 || len(results) == 0 {
		t.Fatalf("attack script: exit %d\n%s", code, out)
	}

	// Positive controls: without them a refusal proves nothing.
	for _, name := range order {
		r := results[name]
		if r.Kind != "control" {
			continue
		}
		ok, why := r.controlOK()
		t.Logf("control %-14s port %-5d %s: statuses %v end %s %q", name, r.Port, okWord(ok, "works", "BROKEN"), r.Statuses, r.End, r.Data)
		if !ok {
			t.Errorf("positive control %s (%s) failed: %s; %+v", name, r.What, why, r)
		}
	}
	// The attacks: the fake CDN never served cdn-b.test, the client never
	// saw its page, and the connection was closed or reset.
	served := cdn.records()
	for _, name := range order {
		r := results[name]
		if r.Kind != "attack" {
			continue
		}
		var hits []string
		for _, rec := range served {
			if rec.Path == "/"+rt+"/"+name && rec.denied() {
				hits = append(hits, rec.String())
			}
		}
		switch {
		case r.Reached || len(hits) > 0:
			t.Errorf("attack %s (%s) on port %d REACHED cdn-b.test: client got %q (end %s); cdn served %v", name, r.What, r.Port, r.Data, r.End, hits)
		case r.End == "timeout":
			t.Errorf("attack %s (%s) on port %d: cdn-b.test not reached, but the connection was neither closed nor reset (statuses %v, %q)", name, r.What, r.Port, r.Statuses, r.Data)
		default:
			t.Logf("attack  %-14s port %-5d refused (end %s, statuses %v): %s", name, r.Port, r.End, r.Statuses, r.What)
		}
	}
	for _, rec := range served {
		// Any other cdn-b.test the fake CDN saw (a TLS handshake, a
		// request no case sent as such) fails too.
		if _, isCase := results[strings.TrimPrefix(rec.Path, "/"+rt+"/")]; rec.denied() && !isCase {
			t.Errorf("the fake CDN served cdn-b.test: %s", rec)
		}
	}
	// The controls' requests really went to the fake CDN.
	for _, p := range []string{"/" + rt + "/P1", "/" + rt + "/P2"} {
		if !cdn.served(p, "cdn-a.test") {
			t.Errorf("the fake CDN never served %s for cdn-a.test: %v", p, served)
		}
	}

	// The gateway's events name cdn-b.test on both ports (on each, some
	// attack's refused request carries nothing but that name).
	evs := networkEvents(t, e, a.ID)
	named := map[int]int{}
	for _, ev := range evs {
		if ev.Verdict == api.VerdictAllow || ev.Protocol == "dns" {
			continue
		}
		t.Logf("event %s/%s %s %s:%d %s", ev.Protocol, ev.Verdict, ev.Name, ev.IP, ev.Port, ev.Reason)
		if strings.Contains(ev.Name+" "+ev.Reason, "cdn-b.test") {
			named[ev.Port]++
		}
	}
	for _, port := range []int{cdn.p1, cdn.p2} {
		if named[port] == 0 {
			t.Errorf("no refusal event names cdn-b.test on port %d", port)
		}
	}

	// DNS 0x20: case variants of an allowed name reach the upstream only
	// in one canonical (lowercase) form.
	if d, ok := results["dns0x20"]; !ok || d.Answered == 0 {
		t.Errorf("dns0x20: the sandbox's resolver answered none of its queries: %+v", d)
	} else {
		forms := map[string]int{}
		for _, n := range upstream {
			if strings.EqualFold(n, "cdn-a.test") {
				forms[n]++
			}
		}
		t.Logf("dns0x20: %d queries sent, %d answered (rcodes %v); the upstream got %d queries, %d letter-case forms of cdn-a.test",
			d.Sent, d.Answered, d.RCodes, len(upstream), len(forms))
		if len(forms) == 0 {
			t.Errorf("dns0x20: the upstream resolver got no query for cdn-a.test; got %v", upstream)
		}
		var cased []string
		for n, k := range forms {
			if n != "cdn-a.test" {
				cased = append(cased, fmt.Sprintf("%q×%d", n, k))
			}
		}
		if len(cased) > 0 {
			sort.Strings(cased)
			t.Errorf("dns0x20: letter case leaves the sandbox: the upstream was asked %d forms other than \"cdn-a.test\", e.g. %v",
				len(cased), cased[:min(len(cased), 8)])
		}
	}

	if rt == "microvm" {
		return
	}
	testConnCap(t, e, rt, cdn, a.ID)
}

// testConnCap: one sandbox opens 600 connections to cdn-a.test's address
// and sends nothing; the gateway must keep at most MaxConns of them open,
// while another sandbox (other) still fetches.
func testConnCap(t *testing.T, e *env, rt string, cdn *fakeCDN, other string) {
	capN := gateway.DefaultLimits.MaxConns
	pol := cdn.policy()
	b := newSandbox(t, e, api.CreateSandboxRequest{Runtime: rt, Network: &pol})
	ctx := ctxT(t, 3*time.Minute)
	if _, err := e.client.WriteFile(ctx, b.ID, "/tmp/cap.py", strings.NewReader(capScript), 0o644); err != nil {
		t.Fatal(err)
	}
	type res struct {
		out  string
		code int
		err  error
	}
	gwRSS := func() int64 {
		pb, _ := os.ReadFile(filepath.Join(e.data, "network", "gateway.pid"))
		pid, _ := strconv.Atoi(strings.Fields(string(pb) + " 0")[0])
		rss, _ := testenv.Rollup(pid)
		return rss
	}
	rssBefore := gwRSS()
	done := make(chan res, 1)
	go func() {
		r, err := e.client.Exec(ctx, b.ID, api.ExecRequest{Cmd: []string{"python3", "/tmp/cap.py", strconv.Itoa(cdn.p1), "600", "4"}})
		if err != nil {
			done <- res{err: err}
			return
		}
		done <- res{out: r.Stdout + r.Stderr, code: r.ExitCode}
	}()
	var fetched string
	var fcode int
	for deadline := time.Now().Add(90 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		if o, c := sh(t, e, b.ID, "cat /tmp/cap-holding 2>/dev/null"); c == 0 && o != "" {
			rssHeld := gwRSS()
			t.Logf("conn cap: gateway RSS %d KiB before, %d KiB while the connections are held (%+d KiB)", rssBefore, rssHeld, rssHeld-rssBefore)
			// The relay's bound for one sandbox's connections is 64 MiB
			// (docs/network.md); silent ones hold far less.
			if rssBefore > 0 && rssHeld-rssBefore > 64<<10 {
				t.Errorf("gateway RSS grew by %d KiB for one sandbox's held connections", rssHeld-rssBefore)
			}
			fetched, fcode = sh(t, e, other, fmt.Sprintf("curl -sS --max-time 5 http://cdn-a.test:%d/%s/cap-other", cdn.p1, rt))
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the connection-cap script never got to hold its connections")
		}
	}
	r := <-done
	if r.err != nil || r.code != 0 {
		t.Fatalf("cap script: %v exit %d\n%s", r.err, r.code, r.out)
	}
	var counts struct {
		Connected, Refused, Open, OpenLater int
		Errors                              map[string]int
		NoFile                              int
	}
	for _, line := range strings.Split(r.out, "\n") {
		if js, ok := strings.CutPrefix(line, "CAP "); ok {
			if err := json.Unmarshal([]byte(js), &counts); err != nil {
				t.Fatal(err)
			}
		}
	}
	t.Logf("conn cap: 600 opened, %d connected, %d refused (%v), %d open while held, %d open 4 s later (cap %d, fd limit %d)",
		counts.Connected, counts.Refused, counts.Errors, counts.Open, counts.OpenLater, capN, counts.NoFile)
	if counts.Connected == 0 {
		t.Fatalf("cap script connected nothing:\n%s", r.out)
	}
	if counts.Open > capN {
		t.Errorf("connection cap: the gateway kept %d silent connections of one sandbox open, more than its cap of %d", counts.Open, capN)
	}
	if counts.Open < capN/2 {
		t.Errorf("connection cap: only %d connections stayed open; the test cannot tell a cap from a broken setup", counts.Open)
	}
	if fcode != 0 || !strings.Contains(fetched, "host=cdn-a.test") {
		t.Errorf("while one sandbox held its connections, another could not fetch cdn-a.test: %d %q", fcode, fetched)
	} else {
		t.Logf("conn cap: the other sandbox fetched meanwhile: %q", fetched)
	}
	limited := 0
	for _, ev := range networkEvents(t, e, b.ID) {
		if ev.Verdict == api.VerdictLimit {
			if limited == 0 {
				t.Logf("conn cap: first limit event: %s:%d %s", ev.IP, ev.Port, ev.Reason)
			}
			limited++
		}
	}
	if counts.Refused > 0 && limited == 0 {
		t.Errorf("conn cap: %d connections refused, but no limit event", counts.Refused)
	}
}

// requireEgressRuntime skips (fails in CI) unless the server has rt.
func requireEgressRuntime(t *testing.T, e *env, rt string) {
	t.Helper()
	if rt == "microvm" {
		requireMicroVM(t, e)
		return
	}
	info, err := e.client.Info(ctxT(t, 2*time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range info.Runtimes {
		if r.Name == rt {
			testenv.Require(t, rt, r.Available, rt+" runtime: "+r.Reason)
			return
		}
	}
	testenv.Require(t, rt, false, "no "+rt+" runtime registered")
}

func okWord(ok bool, yes, no string) string {
	if ok {
		return yes
	}
	return no
}

// ebResult is one case of ebScript, as it reports it.
type ebResult struct {
	Name, Kind, What string
	Port             int
	End              string // eof, reset, timeout, refused, client, error
	Statuses         []int
	Reached          bool // the client saw "host=cdn-b.test"
	Echo             bool // the upgraded control got its bytes back
	Data, Err        string
	// dns0x20
	Sent, Answered int
	RCodes         map[string]int
}

func (r ebResult) controlOK() (bool, string) {
	want := map[string][]int{"P3": {200, 200}, "P5": {101}}[r.Name]
	if want == nil {
		want = []int{200}
	}
	if !reflect.DeepEqual(r.Statuses, want) {
		return false, fmt.Sprintf("statuses %v, want %v", r.Statuses, want)
	}
	switch {
	case r.Name == "P5" && !r.Echo:
		return false, "no echo after the 101"
	case r.Name == "P4" && !strings.Contains(r.Data, "host=cdn-a.test body=hello"):
		return false, "the body did not arrive"
	case r.Name != "P5" && !strings.Contains(r.Data, "host=cdn-a.test"):
		return false, "no cdn-a.test page"
	case r.Reached:
		return false, "saw cdn-b.test"
	}
	return true, ""
}

// The fake CDN.

type cdnRecord struct {
	Port                    int
	TLS                     bool
	SNI, Method, Path, Host string
	RawHost                 string
	Names                   []string // every name a lenient router might take from the request
}

func (r cdnRecord) denied() bool {
	return strings.Contains(r.Host, "cdn-b") || strings.Contains(r.SNI, "cdn-b") || slices.ContainsFunc(r.Names, func(n string) bool { return strings.Contains(n, "cdn-b") })
}

func (r cdnRecord) String() string {
	return fmt.Sprintf("%d tls=%v sni=%q %s %s host=%q (Host: %q)", r.Port, r.TLS, r.SNI, r.Method, r.Path, r.Host, r.RawHost)
}

// fakeCDN is one lenient HTTP(S) server for every name on cdnIP, on two
// ports; a connection whose first byte is a TLS handshake record is served
// over TLS (a certificate for both names).
type fakeCDN struct {
	p1, p2 int
	tls    *tls.Config
	mu     sync.Mutex
	recs   []cdnRecord
}

var (
	cdnOnce sync.Once
	cdnInst *fakeCDN
	cdnErr  error
)

// sharedCDN starts the fake CDN once per test binary (runtimes share it)
// and maps both names to its address in the shared fake DNS.
func sharedCDN(t *testing.T, e *env) *fakeCDN {
	t.Helper()
	cdnOnce.Do(func() {
		cdnInst, cdnErr = startFakeCDN()
		if cdnErr == nil {
			e.internet.dns.Set("cdn-a.test", []string{cdnIP})
			e.internet.dns.Set("cdn-b.test", []string{cdnIP})
		}
	})
	if cdnErr != nil {
		t.Fatalf("fake CDN: %v", cdnErr)
	}
	return cdnInst
}

func startFakeCDN() (*fakeCDN, error) {
	ca, err := gatewaytest.NewCA("fake CDN CA")
	if err != nil {
		return nil, err
	}
	cert, err := ca.Issue("cdn-a.test", "cdn-b.test")
	if err != nil {
		return nil, err
	}
	c := &fakeCDN{tls: &tls.Config{Certificates: []tls.Certificate{cert}}}
	for _, p := range []*int{&c.p1, &c.p2} {
		ln, err := net.Listen("tcp", cdnIP+":0")
		if err != nil {
			return nil, err
		}
		*p = ln.Addr().(*net.TCPAddr).Port
		go func(port int) {
			for {
				conn, err := ln.Accept()
				if err != nil {
					return
				}
				go c.serve(conn, port)
			}
		}(*p)
	}
	return c, nil
}

// policy is the sandboxes' policy: cdn-a.test on any port, and on p2 as an
// entry with an explicit port (which also allows protocols naming nothing);
// the name leads into the loopback range the server opened.
func (c *fakeCDN) policy() api.NetworkPolicy {
	return api.NetworkPolicy{AllowOut: []string{"cdn-a.test", fmt.Sprintf("cdn-a.test:%d", c.p2)},
		AllowPrivate: []string{"127.0.0.0/8"}}
}

func (c *fakeCDN) reset() {
	c.mu.Lock()
	c.recs = nil
	c.mu.Unlock()
}

func (c *fakeCDN) add(r cdnRecord) {
	c.mu.Lock()
	c.recs = append(c.recs, r)
	c.mu.Unlock()
}

func (c *fakeCDN) records() []cdnRecord {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]cdnRecord(nil), c.recs...)
}

func (c *fakeCDN) served(path, host string) bool {
	for _, r := range c.records() {
		if r.Path == path && r.Host == host {
			return true
		}
	}
	return false
}

type prefixedConn struct {
	net.Conn
	r io.Reader
}

func (p *prefixedConn) Read(b []byte) (int, error) { return p.r.Read(b) }

func (c *fakeCDN) serve(conn net.Conn, port int) {
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(20 * time.Second))
	br := bufio.NewReader(conn)
	var w io.Writer = conn
	isTLS, sni := false, ""
	first, err := br.Peek(1)
	if err != nil {
		return
	}
	if first[0] == 0x16 {
		tc := tls.Server(&prefixedConn{Conn: conn, r: br}, c.tls)
		if err := tc.Handshake(); err != nil {
			return
		}
		isTLS, sni = true, tc.ConnectionState().ServerName
		c.add(cdnRecord{Port: port, TLS: true, SNI: sni, Method: "(handshake)"})
		br, w = bufio.NewReader(tc), tc
	}
	for {
		req, err := gatewaytest.Lenient{LengthFirst: true}.Read(br)
		if err != nil {
			if errors.Is(err, gatewaytest.ErrLenientBad) {
				_, _ = io.WriteString(w, "HTTP/1.1 400 Bad Request\r\nContent-Length: 11\r\nConnection: close\r\n\r\nbad request")
			}
			return
		}
		c.add(cdnRecord{Port: port, TLS: isTLS, SNI: sni, Method: req.Method, Path: req.Target, Host: req.Route, RawHost: req.RawHost, Names: req.Names})
		switch {
		case req.Method == "CONNECT":
			_, _ = io.WriteString(w, "HTTP/1.1 405 Method Not Allowed\r\nContent-Length: 18\r\n\r\nmethod not allowed")
			continue
		case strings.HasSuffix(req.Target, "/ws") && strings.Contains(strings.ToLower(req.Upgrade), "websocket"):
			// A protocol this server speaks: switch, then echo.
			_, _ = io.WriteString(w, "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
			_, _ = io.Copy(w, br)
			return
		}
		status := "200 OK"
		if req.Route != "cdn-a.test" && req.Route != "cdn-b.test" {
			status = "404 Not Found"
		}
		body := "host=" + req.Route
		if len(req.Body) > 0 {
			body += " body=" + string(req.Body)
		}
		if req.Method == "HEAD" {
			body = ""
		}
		if _, err := fmt.Fprintf(w, "HTTP/1.1 %s\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n%s", status, len(body), body); err != nil {
			return
		}
		if req.Close {
			return
		}
	}
}

// ebScript runs in the sandbox: python3 eb.py P1 P2 TAG ONLY DNS_N. Every
// case runs on a connection of its own, all at once; each prints one
// "RESULT {json}" line. Requests whose Host is cdn-b.test use the path
// /TAG/NAME, so the fake CDN's record names the case.
const ebScript = `
import json, os, random, socket, ssl, struct, sys, time
from concurrent.futures import ThreadPoolExecutor

P1, P2, TAG = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
ONLY = [x for x in sys.argv[4].split(',') if x] if len(sys.argv) > 4 else []
DNSN = int(sys.argv[5]) if len(sys.argv) > 5 else 0
# EB_IP: aim the script at the fake CDN directly (debugging, no sandbox).
IP = os.environ.get('EB_IP') or socket.gethostbyname('cdn-a.test')

def path(n):
    return ('/%s/%s' % (TAG, n)).encode()

def get_b(n, method=b'GET', host=b'cdn-b.test', eol=b'\r\n'):
    return method + b' ' + path(n) + b' HTTP/1.1' + eol + b'Host: ' + host + eol + b'Connection: close' + eol + eol

def first(n, extra=b''):
    return b'GET ' + path(n + '-first') + b' HTTP/1.1\r\nHost: cdn-a.test\r\n' + extra + b'\r\n'

def responses(data):
    out, i = [], 0
    while True:
        j = data.find(b'\r\n\r\n', i)
        if j < 0:
            return out
        lines = data[i:j].decode('latin1').split('\r\n')
        try:
            status = int(lines[0].split()[1])
        except Exception:
            return out
        if status == 101:
            out.append((101, b''))
            return out
        cl = 0
        for l in lines[1:]:
            k, _, v = l.partition(':')
            if k.strip().lower() == 'content-length':
                cl = int(v.strip())
        if len(data) < j + 4 + cl:
            return out
        out.append((status, data[j + 4:j + 4 + cl]))
        i = j + 4 + cl

def talk(port, steps, wait=3.0):
    r = {'Port': port, 'End': '', 'Err': '', 'Echo': False}
    data = b''
    try:
        s = socket.create_connection((IP, port), timeout=5)
    except OSError as e:
        r['End'], r['Err'] = 'refused', repr(e)
        return r, data
    def recv(until, limit):
        nonlocal data
        deadline = time.time() + limit
        while not until():
            left = deadline - time.time()
            if left <= 0:
                return 'timeout'
            s.settimeout(left)
            b = s.recv(65536)
            if not b:
                return 'eof'
            data += b
        return ''
    try:
        for st in steps:
            if isinstance(st, float):
                time.sleep(st)
            elif isinstance(st, bytes):
                s.sendall(st)
            elif st[0] == 'TLS':
                ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
                s = ctx.wrap_socket(s, server_hostname=st[1])
            elif st[0] == 'R':  # wait for one more complete response
                have = len(responses(data))
                end = recv(lambda: len(responses(data)) > have, 3.0)
                if end:
                    r['End'] = end
                    break
            elif st[0] == 'ECHO':  # the upgraded stream sends it back
                s.sendall(st[1])
                recv(lambda: data.endswith(st[1]), 3.0)
                r['Echo'] = data.endswith(st[1])
                r['End'] = 'client'
                break
        if not r['End']:
            r['End'] = recv(lambda: False, wait) or 'timeout'
    except socket.timeout:
        r['End'] = 'timeout'
    except (ConnectionResetError, BrokenPipeError) as e:
        r['End'], r['Err'] = 'reset', repr(e)
    except ssl.SSLError as e:
        r['End'], r['Err'] = 'reset', repr(e)
    except OSError as e:
        r['End'], r['Err'] = 'error', repr(e)
    finally:
        s.close()
    return r, data

R = ('R',)
def smug(n):  # what the attacks try to slip to cdn-b.test
    return get_b(n)

CASES = [
    # Positive controls.
    ('P1', 'control', P1, 'GET Host cdn-a.test', [get_b('P1', host=b'cdn-a.test')]),
    ('P2', 'control', P2, 'GET Host cdn-a.test on the port-allowed entry', [get_b('P2', host=b'cdn-a.test')]),
    ('P3', 'control', P1, 'two kept-alive GETs', [first('P3'), R, get_b('P3', host=b'cdn-a.test')]),
    ('P4', 'control', P1, 'POST with a body', [b'POST ' + path('P4') + b' HTTP/1.1\r\nHost: cdn-a.test\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello']),
    ('P5', 'control', P1, 'WebSocket upgrade answered 101, then bytes both ways',
        [b'GET ' + path('ws') + b' HTTP/1.1\r\nHost: cdn-a.test\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n',
         R, ('ECHO', b'GET / HTTP/1.1\r\nHost: cdn-b.test\r\n\r\nping-123')]),
    ('P6', 'control', P1, 'TLS with SNI cdn-a.test', [('TLS', 'cdn-a.test'), get_b('P6', host=b'cdn-a.test')]),
    # 1: an Upgrade the server does not take (200, not 101), then another request.
    ('1ws', 'attack', P1, 'Upgrade: websocket answered 200, then POST Host cdn-b.test',
        [first('1ws', b'Upgrade: websocket\r\nConnection: Upgrade\r\n'), R,
         b'POST ' + path('1ws') + b' HTTP/1.1\r\nHost: cdn-b.test\r\nContent-Length: 3\r\nConnection: close\r\n\r\nabc']),
    ('1h2c', 'attack', P1, 'Upgrade: h2c answered 200, then GET Host cdn-b.test',
        [first('1h2c', b'Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\nConnection: Upgrade, HTTP2-Settings\r\n'), R, smug('1h2c')]),
    ('1foo', 'attack', P1, 'Upgrade: foo answered 200, then GET Host cdn-b.test',
        [first('1foo', b'Upgrade: foo\r\nConnection: Upgrade\r\n'), R, smug('1foo')]),
    ('1nowait', 'attack', P1, 'Upgrade: websocket and GET Host cdn-b.test in one write',
        [first('1nowait', b'Upgrade: websocket\r\nConnection: Upgrade\r\n') + smug('1nowait')]),
    # 2: CONNECT (answered 405), then another request.
    ('2connect', 'attack', P1, 'CONNECT cdn-a.test:P2 with Upgrade (405), then GET Host cdn-b.test',
        [b'CONNECT cdn-a.test:%d HTTP/1.1\r\nHost: cdn-a.test:%d\r\nUpgrade: x\r\n\r\n' % (P2, P2), R, smug('2connect')]),
    ('2connect-plain', 'attack', P1, 'CONNECT cdn-a.test:P2 (405), then GET Host cdn-b.test',
        [b'CONNECT cdn-a.test:%d HTTP/1.1\r\nHost: cdn-a.test:%d\r\n\r\n' % (P2, P2), R, smug('2connect-plain')]),
    # 3: body framing.
    ('3a', 'attack', P1, 'GET with Content-Length whose body is a request for cdn-b.test',
        [first('3a', b'Content-Length: %d\r\n' % len(smug('3a'))) + smug('3a')]),
    ('3b', 'attack', P1, 'POST with Transfer-Encoding: chunked and Content-Length (TE.CL)',
        [b'POST ' + path('3b-first') + b' HTTP/1.1\r\nHost: cdn-a.test\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n' +
         b'%x\r\n' % len(smug('3b')) + smug('3b') + b'\r\n0\r\n\r\n']),
    ('3b-get', 'attack', P1, 'GET with Transfer-Encoding: chunked and Content-Length, request after the last chunk',
        [first('3b-get', b'Content-Length: %d\r\nTransfer-Encoding: chunked\r\n' % (5 + len(smug('3b-get')))) + b'0\r\n\r\n' + smug('3b-get')]),
    ('3c', 'attack', P1, 'GET with Transfer-Encoding: chunked carrying a request for cdn-b.test',
        [first('3c', b'Transfer-Encoding: chunked\r\n') + b'%x\r\n' % len(smug('3c')) + smug('3c') + b'\r\n0\r\n\r\n']),
    ('3d', 'attack', P1, 'second request: obs-fold Host: cdn-a.test / cdn-b.test',
        [first('3d'), R, b'GET ' + path('3d') + b' HTTP/1.1\r\nHost: cdn-a.test\r\n cdn-b.test\r\nConnection: close\r\n\r\n']),
    ('3d-first', 'attack', P1, 'first request: obs-fold Host: cdn-a.test / cdn-b.test',
        [b'GET ' + path('3d-first') + b' HTTP/1.1\r\nHost: cdn-a.test\r\n\tcdn-b.test\r\nConnection: close\r\n\r\n']),
    ('3e', 'attack', P1, 'bare LF line ends, second request Host cdn-b.test',
        [b'GET ' + path('3e-first') + b' HTTP/1.1\nHost: cdn-a.test\n\n' + get_b('3e', eol=b'\n')]),
    ('3e-mixed', 'attack', P1, 'a bare LF inside a CRLF head hides a second Host: cdn-b.test',
        [b'GET ' + path('3e-mixed') + b' HTTP/1.1\r\nHost: cdn-a.test\r\nX-A: b\nHost: cdn-b.test\r\nConnection: close\r\n\r\n']),
    ('3f', 'attack', P1, 'POST with two different Content-Lengths',
        [b'POST ' + path('3f-first') + b' HTTP/1.1\r\nHost: cdn-a.test\r\nContent-Length: 3\r\nContent-Length: %d\r\n\r\nabc' % (3 + len(smug('3f'))) + smug('3f')]),
    ('3g', 'attack', P1, 'POST with Transfer-Encoding: xchunked',
        [b'POST ' + path('3g-first') + b' HTTP/1.1\r\nHost: cdn-a.test\r\nTransfer-Encoding: xchunked\r\n\r\n0\r\n\r\n' + smug('3g')]),
    ('3h', 'attack', P1, 'POST with Transfer-Encoding: chunked, identity',
        [b'POST ' + path('3h-first') + b' HTTP/1.1\r\nHost: cdn-a.test\r\nTransfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n' + smug('3h')]),
    # 6: the port-allowed entry, first bytes late or not recognised at once.
    ('6a', 'attack', P2, 'port-allowed entry: 0.5 s of silence, then GET Host cdn-b.test', [0.5, smug('6a')]),
    ('6b', 'attack', P2, 'port-allowed entry: CRLF, then GET Host cdn-b.test', [b'\r\n' + smug('6b')]),
    ('6b-late', 'attack', P2, 'port-allowed entry: 0.5 s, CRLF, then GET Host cdn-b.test', [0.5, b'\r\n' + smug('6b-late')]),
    ('6c', 'attack', P2, 'port-allowed entry: lowercase get, Host cdn-b.test', [get_b('6c', method=b'get')]),
    ('6d', 'attack', P2, 'port-allowed entry: 0.5 s, then TLS with SNI cdn-b.test', [0.5, ('TLS', 'cdn-b.test'), smug('6d')]),
    # 9: a Host the gateway splits as host:port.
    ('9', 'attack', P1, 'second request Host: cdn-a.test:,cdn-b.test',
        [b'GET ' + path('9-first') + b' HTTP/1.1\r\nHost: cdn-a.test\r\n\r\n' + get_b('9', host=b'cdn-a.test:,cdn-b.test')]),
]

def run(case):
    name, kind, port, what, steps = case
    r, data = talk(port, steps)
    r.update(Name=name, Kind=kind, What=what, Statuses=[st for st, _ in responses(data)],
             Reached=b'host=cdn-b.test' in data, Data=data[:300].decode('latin1'))
    return r

cases = [c for c in CASES if not ONLY or c[0] in ONLY]
with ThreadPoolExecutor(max_workers=len(cases)) as ex:
    for r in ex.map(run, cases):
        print('RESULT ' + json.dumps(r), flush=True)

def dns0x20(n):
    ns = [l.split()[1] for l in open('/etc/resolv.conf') if l.startswith('nameserver')][0]
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(2)
    name, rcodes, answered = 'cdn-a.test', {}, 0
    letters = [i for i, c in enumerate(name) if c.isalpha()]
    for i in range(n):
        v = list(name)
        for b, at in enumerate(letters):  # every letter-case form in turn
            if (i + 1) >> b & 1:
                v[at] = v[at].upper()
        v = ''.join(v)
        qid = random.randrange(65536)
        q = struct.pack('>HHHHHH', qid, 0x0100, 1, 0, 0, 0)
        q += b''.join(bytes([len(l)]) + l.encode() for l in v.split('.')) + b'\0' + struct.pack('>HH', 1, 1)
        s.sendto(q, (ns, 53))
        try:
            while True:
                resp = s.recv(1500)
                if struct.unpack('>H', resp[:2])[0] == qid:
                    break
            rc = str(resp[3] & 0xf)
            rcodes[rc] = rcodes.get(rc, 0) + 1
            answered += 1
        except socket.timeout:
            rcodes['timeout'] = rcodes.get('timeout', 0) + 1
    return {'Name': 'dns0x20', 'Kind': 'dns', 'Sent': n, 'Answered': answered, 'RCodes': rcodes}

if DNSN:
    print('RESULT ' + json.dumps(dns0x20(DNSN)), flush=True)
`

// capScript runs in the sandbox: python3 cap.py PORT N HOLD. It opens N
// connections to cdn-a.test:PORT that send nothing, counts those still open,
// writes /tmp/cap-holding, holds them HOLD seconds, counts again and prints
// "CAP {json}".
const capScript = `
import json, resource, select, socket, sys, time
port, n, hold = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
want = n + 100 if hard == resource.RLIM_INFINITY else min(hard, n + 100)
if soft != resource.RLIM_INFINITY and soft < want:
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
ip = socket.gethostbyname('cdn-a.test')
socks, errors = [], {}
for i in range(n):
    s = socket.socket()
    s.settimeout(3)
    try:
        s.connect((ip, port))
        socks.append(s)
    except OSError as e:
        k = type(e).__name__
        errors[k] = errors.get(k, 0) + 1
        s.close()
    time.sleep(0.004)  # under the new-connection rate limit (200/s, burst 400)

def still_open():
    p = select.poll()
    for s in socks:
        p.register(s, select.POLLIN | select.POLLERR | select.POLLHUP)
    gone = set(fd for fd, ev in p.poll(0))
    return sum(1 for s in socks if s.fileno() not in gone)

time.sleep(0.5)
c = {'Connected': len(socks), 'Refused': n - len(socks), 'Errors': errors, 'Open': still_open(),
     'NoFile': resource.getrlimit(resource.RLIMIT_NOFILE)[0]}
open('/tmp/cap-holding', 'w').write(json.dumps(c))
time.sleep(hold)
c['OpenLater'] = still_open()
print('CAP ' + json.dumps(c), flush=True)
`

package sandbox

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/fakeruntime"
	"github.com/spacehq/space/internal/runtime/gvisor"
	"github.com/spacehq/space/internal/runtime/microvm"
	"github.com/spacehq/space/internal/runtime/native"
	"github.com/spacehq/space/internal/store"
	"github.com/spacehq/space/internal/template"
	"github.com/spacehq/space/internal/testenv"
)

// poolHarness is a manager over one real runtime with the base template as
// "base:latest" and a variant with a start command as "started:latest".
type poolHarness struct {
	t      *testing.T
	m      *Manager
	db     *store.DB
	tmpl   *template.Store
	rts    map[string]runtime.Runtime
	net    *FakeNetwork
	rtName string
	mkRT   func() runtime.Runtime
}

// startedMarker is where the start command of "started:latest" writes
// the caller's GREETING.
const startedMarker = "/root/started"

// awaitStarted prints the marker once the start command wrote it (up to
// 30 s): a cold create returns once the start command is started, and a
// TCG guest may not have run its first line yet.
const awaitStarted = "for i in $(seq 300); do [ -s " + startedMarker + " ] && break; sleep 0.1; done; cat " + startedMarker

func newPoolHarness(t *testing.T, ctx context.Context, rtName string) *poolHarness {
	t.Helper()
	testenv.RequireRoot(t)
	base := testenv.BaseRootfs(t)
	dataDir, err := os.MkdirTemp("", "sp-") // short: socket paths must fit in sockaddr_un
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	h := &poolHarness{t: t, rtName: rtName, net: NewFakeNetwork()}
	h.mkRT = func() runtime.Runtime {
		cfg := runtime.Config{DataDir: filepath.Join(dataDir, rtName), AgentBinary: testenv.AgentBinary(t), Logger: log}
		var rt runtime.Runtime
		var err error
		switch rtName {
		case gvisor.Name:
			rt, err = gvisor.New(cfg)
		case microvm.Name:
			cfg.JailBinary = testenv.JailBinary(t)
			rt, err = runtime.New(microvm.Name, cfg)
		default:
			rt, err = native.New(cfg)
		}
		if err != nil {
			t.Fatal(err)
		}
		return rt
	}
	rt := h.mkRT()
	caps := rt.Probe(ctx)
	testenv.Require(t, rtName, caps.Available, caps.Reason)
	h.rts = map[string]runtime.Runtime{rtName: rt}
	dir := t.TempDir()
	if h.db, err = store.Open(filepath.Join(dir, "space.db")); err != nil {
		t.Fatal(err)
	}
	if h.tmpl, err = template.Open(h.db.SQL(), filepath.Join(dir, "templates"), filepath.Join(dir, "cache"), log); err != nil {
		t.Fatal(err)
	}
	if _, err := h.tmpl.ImportDir(ctx, base, template.ImportOptions{Tags: []string{"base:latest"}, Source: "dir"}); err != nil {
		t.Fatal(err)
	}
	if _, err := h.tmpl.ImportDir(ctx, base, template.ImportOptions{Tags: []string{"started:latest"}, Source: "dir",
		Config: api.TemplateConfig{Start: &api.StartCommand{Cmd: []string{"sh", "-c", `echo "$GREETING" > ` + startedMarker + `; exec sleep 100000`}}}}); err != nil {
		t.Fatal(err)
	}
	for _, t2 := range []string{"base:latest", "started:latest"} {
		tp, root, err := h.tmpl.Resolve(ctx, t2)
		if err != nil {
			t.Fatal(err)
		}
		if tp2, ok := rt.(runtime.TemplatePreparer); ok {
			if err := tp2.PrepareTemplate(ctx, tp.TreeDigest, root); err != nil {
				t.Fatal(err)
			}
		}
	}
	h.m = h.newManager()
	t.Cleanup(func() {
		h.cleanup()
		h.db.Close()
		if c, ok := h.rts[rtName].(io.Closer); ok {
			c.Close()
		}
		if err := os.RemoveAll(dataDir); err != nil {
			t.Errorf("runtime directory left behind: %v", err)
		}
	})
	return h
}

func (h *poolHarness) newManager() *Manager {
	m := New(Config{DB: h.db, Templates: h.tmpl, Runtimes: h.rts, Network: h.net,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), PoolMemFloor: 1})
	if err := m.recon.Reconcile(context.Background()); err != nil {
		h.t.Fatal(err)
	}
	m.recon.Run()
	return m
}

// cleanup deletes every pool and sandbox, members included.
func (h *poolHarness) cleanup() {
	ctx := context.Background()
	for _, p := range h.m.warm.Pools(ctx) {
		h.m.warm.DeletePool(ctx, p.ID)
	}
	h.m.Close()
	m := New(Config{DB: h.db, Templates: h.tmpl, Runtimes: h.rts, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	sbs, _ := h.db.ListSandboxes(ctx, store.SandboxFilter{})
	for _, sb := range sbs {
		e := m.entry(sb.ID)
		e.mu.Lock()
		m.verbs.doDelete(ctx, &phases{obs: nopObserver{}}, sb.ID)
		e.mu.Unlock()
	}
	m.Close()
}

func (h *poolHarness) create(ctx context.Context, req api.CreateSandboxRequest) (api.Sandbox, api.Operation) {
	h.t.Helper()
	req.Runtime = h.rtName
	sb, op, err := h.m.creates.Create(ctx, req)
	if err != nil {
		h.t.Fatal(err)
	}
	op, err = h.m.verbs.Wait(ctx, op.ID)
	if err != nil || op.State != api.OpSucceeded {
		h.t.Fatalf("create: %v %+v", err, op.Error)
	}
	return sb, op
}

func (h *poolHarness) sh(ctx context.Context, id, script string) string {
	h.t.Helper()
	res, err := h.m.cmds.Exec(ctx, id, api.ExecRequest{Cmd: []string{"sh", "-c", script}})
	if err != nil || res.ExitCode != 0 {
		h.t.Fatalf("exec %q in %s: %v %+v", script, id, err, res)
	}
	return strings.TrimSpace(res.Stdout)
}

// waitReady waits until pool id has n ready members.
func (h *poolHarness) waitReady(ctx context.Context, id string, n int) api.Pool {
	h.t.Helper()
	for {
		p, err := h.m.warm.GetPool(ctx, id)
		if err != nil {
			h.t.Fatal(err)
		}
		if p.Ready == n && p.Filling == 0 {
			return p
		}
		select {
		case <-ctx.Done():
			h.t.Fatalf("pool %s never had %d ready members: %+v", id, n, p)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// members returns the ids of the pool members recorded in the store.
func (h *poolHarness) members(ctx context.Context) []string {
	sbs, err := h.db.ListSandboxes(ctx, store.SandboxFilter{})
	if err != nil {
		h.t.Fatal(err)
	}
	var out []string
	for _, sb := range sbs {
		if isPoolMember(sb) {
			out = append(out, sb.ID)
		}
	}
	return out
}

// cpuWeight reads the CPU weight of sandbox id's host cgroup, whichever
// runtime made it (v1 cpu.shares or v2 cpu.weight).
func cpuWeight(t *testing.T, id string) string {
	t.Helper()
	for _, pat := range []string{"/sys/fs/cgroup/cpu/*/" + id + "/cpu.shares", "/sys/fs/cgroup/*/" + id + "/cpu.weight"} {
		if m, _ := filepath.Glob(pat); len(m) == 1 {
			b, err := os.ReadFile(m[0])
			if err != nil {
				t.Fatal(err)
			}
			return strings.TrimSpace(string(b))
		}
	}
	t.Fatalf("no cgroup with a CPU weight for %s", id)
	return ""
}

func phaseList(op api.Operation) []string {
	var out []string
	for _, p := range op.Phases {
		out = append(out, p.Name)
	}
	return out
}

func TestPoolNative(t *testing.T) { testPool(t, native.Name) }

func TestPoolGvisor(t *testing.T) {
	if testing.Short() {
		t.Skip("slow: real gVisor sandboxes")
	}
	testPool(t, gvisor.Name)
}

// TestPoolMicroVM runs the same checks on QEMU guests (TCG here), with a
// smaller burst: every member is a VM.
func TestPoolMicroVM(t *testing.T) {
	if testing.Short() {
		t.Skip("slow: real QEMU guests")
	}
	testPool(t, microvm.Name)
}

// testPool: a claimed sandbox is indistinguishable from a fresh one and
// has the caller's settings; members are invisible; 20 concurrent creates
// against a pool of 2 all succeed with distinct sandboxes and the pool
// refills; a broken member falls back to a cold create; a restart
// re-adopts members; a moved tag drains them; deleting the pool destroys
// them.
func testPool(t *testing.T, rtName string) {
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	h := newPoolHarness(t, ctx, rtName)
	req := func() api.CreateSandboxRequest {
		return api.CreateSandboxRequest{Template: "started:latest", Env: map[string]string{"GREETING": "hello-pool"},
			Labels: map[string]string{"team": "a"}, Workdir: "/tmp",
			Network: &api.NetworkPolicy{AllowOut: []string{"example.test"}}}
	}

	// A fresh sandbox, made before any pool exists.
	fresh, fop := h.create(ctx, req())
	if !slices.Contains(phaseList(fop), "start_runtime") {
		t.Fatalf("fresh create phases %v", phaseList(fop))
	}

	// Bad specs are refused naming the problem.
	for _, bad := range []struct {
		spec api.PoolSpec
		want string
		code error
	}{
		{api.PoolSpec{Template: "started:latest", Runtime: rtName, Min: 3, Max: 2}, "min (3) must not exceed max (2)", errdefs.ErrInvalidArgument},
		{api.PoolSpec{Template: "started:latest", Runtime: rtName, Min: -1, Max: 2}, "must not be negative", errdefs.ErrInvalidArgument},
		{api.PoolSpec{Template: "started:latest", Runtime: "nope", Min: 1, Max: 2}, "unknown runtime", errdefs.ErrInvalidArgument},
		{api.PoolSpec{Template: "missing:latest", Runtime: rtName, Min: 1, Max: 2}, "missing:latest", errdefs.ErrNotFound},
		{api.PoolSpec{Template: "started:latest", Runtime: rtName, Limits: api.Limits{CPUs: -1}, Min: 1, Max: 2}, "limits.cpus", errdefs.ErrInvalidArgument},
		{api.PoolSpec{Template: "", Runtime: rtName, Min: 1, Max: 2}, "template is required", errdefs.ErrInvalidArgument},
	} {
		if _, err := h.m.warm.SetPool(ctx, bad.spec); err == nil || !errors.Is(err, bad.code) || !strings.Contains(err.Error(), bad.want) {
			t.Errorf("SetPool(%+v) = %v, want %v naming %q", bad.spec, err, bad.code, bad.want)
		}
	}

	p, err := h.m.warm.SetPool(ctx, api.PoolSpec{Template: "started:latest", Runtime: rtName, Min: 2, Max: 3})
	if err != nil {
		t.Fatal(err)
	}
	again, err := h.m.warm.SetPool(ctx, api.PoolSpec{Template: "started:latest", Runtime: rtName, Min: 2, Max: 2})
	if err != nil || again.ID != p.ID || len(h.m.warm.Pools(ctx)) != 1 {
		t.Fatalf("a second PUT of the same key made another pool: %v %+v %+v", err, again, h.m.warm.Pools(ctx))
	}
	h.waitReady(ctx, p.ID, 2)

	// Members are nobody's sandboxes.
	mem := h.members(ctx)
	if len(mem) != 2 {
		t.Fatalf("members in the store: %v", mem)
	}
	if _, err := h.m.Get(ctx, mem[0]); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Get of a member: %v, want not found", err)
	}
	if l, _ := h.m.List(ctx, "", nil); len(l) != 1 || l[0].ID != fresh.ID {
		t.Errorf("List shows %d sandboxes, want only the fresh one", len(l))
	}
	if u, _ := h.m.tenancy.Usage(ctx, "default"); u.Sandboxes != 1 {
		t.Errorf("usage counts %d sandboxes, want 1", u.Sandboxes)
	}
	if _, err := h.m.cmds.Exec(ctx, mem[0], api.ExecRequest{Cmd: []string{"true"}}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("exec in a member: %v, want not found", err)
	}

	// Members are made at the lowest CPU weight.
	for _, id := range mem {
		if w := cpuWeight(t, id); w != "10" && w != "1" {
			t.Errorf("member %s has CPU weight %q, want the background one", id, w)
		}
	}

	// Claims: two of them, each a member, personalised.
	var claimed []api.Sandbox
	for range 2 {
		sb, op := h.create(ctx, req())
		if got := phaseList(op); !slices.Contains(got, "claim_pool") || slices.Contains(got, "start_runtime") || slices.Contains(got, "prepare") {
			t.Fatalf("claim phases %v", got)
		}
		if !slices.Contains(mem, sb.ID) {
			t.Fatalf("claimed %s is not one of the members %v", sb.ID, mem)
		}
		claimed = append(claimed, sb)
	}
	if claimed[0].ID == claimed[1].ID {
		t.Fatal("two creates got the same member")
	}
	for _, c := range append(claimed, fresh) {
		if w := cpuWeight(t, c.ID); w != "1024" && w != "100" {
			t.Errorf("sandbox %s has CPU weight %q, want the default", c.ID, w)
		}
	}
	got, _ := h.m.Get(ctx, claimed[0].ID)
	if got.Template != "started:latest" || got.Labels["team"] != "a" || got.Labels[PoolLabel] != "" || got.Env["GREETING"] != "hello-pool" || got.State != api.StateRunning {
		t.Errorf("claimed record: %+v", got)
	}
	if pol, ok := h.net.Policy(claimed[0].ID); !ok || len(pol.AllowOut) != 1 || pol.AllowOut[0] != "example.test" {
		t.Errorf("the gateway has policy %+v (%v) for the claimed sandbox, want the caller's", pol, ok)
	}

	// Indistinguishable from the fresh one, except for its own identity.
	norm := func(id, s string) string { return strings.ReplaceAll(s, id, "ID") }
	probes := []struct{ name, script string }{
		{"processes", `for p in /proc/[0-9]*; do tr '\0' ' ' < $p/cmdline 2>/dev/null; echo; done | grep -v -e '^$' -e 'for p in' -e '^tr ' -e '^sort' | sort`},
		{"env", `env | sort`},
		{"tmp", `ls -A /tmp`},
		{"root", `ls -A /`},
		{"root-home", `ls -A /root`},
		{"sockets", `for f in tcp tcp6 udp udp6 unix; do echo $f $(($(cat /proc/net/$f 2>/dev/null | wc -l))); done`},
		{"started", `cat ` + startedMarker},
		{"pwd", `pwd`},
	}
	for _, pr := range probes {
		want := norm(fresh.ID, h.sh(ctx, fresh.ID, pr.script))
		for _, c := range claimed {
			if g := norm(c.ID, h.sh(ctx, c.ID, pr.script)); g != want {
				t.Errorf("%s of claimed %s differs from a fresh sandbox's:\n got %q\nwant %q", pr.name, c.ID, g, want)
			}
		}
	}
	if s := h.sh(ctx, claimed[0].ID, "cat "+startedMarker); s != "hello-pool" {
		t.Errorf("start command saw GREETING=%q, want the caller's", s)
	}
	for _, c := range claimed {
		for _, f := range []string{"/etc/hostname", "/proc/sys/kernel/hostname"} {
			if s := h.sh(ctx, c.ID, "cat "+f); s != c.ID {
				t.Errorf("%s of %s = %q", f, c.ID, s)
			}
		}
		if s := h.sh(ctx, c.ID, "cat /etc/hosts"); !strings.Contains(s, c.ID) {
			t.Errorf("/etc/hosts of %s does not name it: %q", c.ID, s)
		}
	}
	if rtName == gvisor.Name || rtName == microvm.Name {
		b0 := h.sh(ctx, claimed[0].ID, "cat /proc/sys/kernel/random/boot_id")
		b1 := h.sh(ctx, claimed[1].ID, "cat /proc/sys/kernel/random/boot_id")
		if b0 == b1 || b0 == "" {
			t.Errorf("two claimed members share boot id %q", b0)
		}
	}
	h.waitReady(ctx, p.ID, 2)

	// A member whose agent connection is gone is a miss: the create falls
	// back to a cold boot under the same id and still succeeds.
	pb, _ := h.m.warm.GetPool(ctx, p.ID)
	h.m.pools.mu.Lock()
	broken := h.m.pools.byID[p.ID].ready[0].id
	h.m.pools.mu.Unlock()
	h.m.verbs.dropClient(h.m.entry(broken))
	sb, op := h.create(ctx, req())
	if sb.ID != broken || !slices.Contains(phaseList(op), "start_runtime") {
		t.Fatalf("fallback: got %s (broken member %s), phases %v", sb.ID, broken, phaseList(op))
	}
	if s := h.sh(ctx, sb.ID, awaitStarted); s != "hello-pool" {
		t.Errorf("fallback sandbox start command saw %q", s)
	}
	if pa, _ := h.m.warm.GetPool(ctx, p.ID); pa.Misses != pb.Misses+1 || pa.Hits != pb.Hits {
		t.Errorf("fallback counted hits %d→%d misses %d→%d, want one more miss", pb.Hits, pa.Hits, pb.Misses, pa.Misses)
	}
	h.waitReady(ctx, p.ID, 2)

	// 20 concurrent creates (4 VMs on microvm) against a pool of 2: all
	// succeed, no member is used twice, and the pool refills.
	burst := 20
	if rtName == microvm.Name {
		burst = 4
	}
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		ids  = map[string]bool{}
		errs []error
	)
	for range burst {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := req()
			r.Runtime = rtName
			sb, op, err := h.m.creates.Create(ctx, r)
			if err == nil {
				op, err = h.m.verbs.Wait(ctx, op.ID)
			}
			if err == nil && op.State != api.OpSucceeded {
				err = fmt.Errorf("%+v", op.Error)
			}
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs = append(errs, err)
			}
			if ids[sb.ID] {
				errs = append(errs, fmt.Errorf("sandbox %s created twice", sb.ID))
			}
			ids[sb.ID] = true
		}()
	}
	wg.Wait()
	if len(errs) > 0 {
		t.Fatalf("concurrent creates: %v", errs)
	}
	pc, _ := h.m.warm.GetPool(ctx, p.ID)
	if pc.Hits-pb.Hits < 2 || pc.Hits+pc.Misses-pb.Hits-pb.Misses != int64(burst)+1 {
		t.Errorf("after %d concurrent creates: %+v (before %+v)", burst, pc, pb)
	}
	for id := range ids {
		if s := h.sh(ctx, id, awaitStarted); s != "hello-pool" {
			t.Errorf("%s: start command saw %q", id, s)
		}
	}
	h.waitReady(ctx, p.ID, 2)
	for id := range ids {
		if op, err := h.m.verbs.Lifecycle(ctx, id, api.OpDelete, true); err == nil {
			h.m.verbs.Wait(ctx, op.ID)
		}
	}

	// A restart re-adopts the ready members.
	before := h.members(ctx)
	h.m.Close()
	if c, ok := h.rts[rtName].(io.Closer); ok {
		c.Close()
	}
	h.rts[rtName] = h.mkRT()
	h.m = h.newManager()
	pr, err := h.m.warm.GetPool(ctx, p.ID)
	if err != nil || pr.Ready != 2 {
		t.Fatalf("after restart: %v %+v", err, pr)
	}
	if after := h.members(ctx); !slices.Equal(after, before) {
		t.Fatalf("members after restart %v, before %v", after, before)
	}
	sb, op = h.create(ctx, req())
	if !slices.Contains(before, sb.ID) || !slices.Contains(phaseList(op), "claim_pool") {
		t.Fatalf("claim after restart: %s %v", sb.ID, phaseList(op))
	}
	h.waitReady(ctx, p.ID, 2)

	// A moved tag drains the old members and refills from the new digest.
	old := h.members(ctx)
	base, _ := h.tmpl.Get(ctx, "base:latest")
	if err := h.tmpl.Tag(ctx, base.Digest, "started:latest"); err != nil {
		t.Fatal(err)
	}
	h.m.pools.kick()
	for {
		now := h.members(ctx)
		pn, _ := h.m.warm.GetPool(ctx, p.ID)
		if pn.TemplateDigest == base.Digest && pn.Ready == 2 && !slices.ContainsFunc(now, func(id string) bool { return slices.Contains(old, id) }) {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("the pool did not move to the new digest: %+v, members %v (old %v)", pn, now, old)
		}
		time.Sleep(100 * time.Millisecond)
	}

	// Deleting the pool destroys its members.
	if err := h.m.warm.DeletePool(ctx, p.ID); err != nil {
		t.Fatal(err)
	}
	for len(h.members(ctx)) > 0 {
		if ctx.Err() != nil {
			t.Fatalf("members left after the pool was deleted: %v", h.members(ctx))
		}
		time.Sleep(100 * time.Millisecond)
	}
	if _, err := h.m.warm.GetPool(ctx, p.ID); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("deleted pool: %v", err)
	}
}

// What a cluster node does with a pool: a replica asks it to check the
// spec (nothing is made), then every node mirrors the checked spec.
func TestCheckAndMirrorPool(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	h := newPoolHarness(t, ctx, native.Name)
	if _, err := h.m.warm.CheckPool(ctx, api.PoolSpec{Template: "missing:latest", Runtime: native.Name, Max: 1}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("checking a pool of a missing template: %v", err)
	}
	checked, err := h.m.warm.CheckPool(ctx, api.PoolSpec{Template: "base:latest", Runtime: native.Name, Min: 1, Max: 2})
	if err != nil || checked.ID == "" || checked.Runtime != native.Name || checked.Spec.Limits.MemoryMiB == 0 {
		t.Fatalf("checked pool %+v %v", checked, err)
	}
	if ps := h.m.warm.Pools(ctx); len(ps) != 0 {
		t.Fatalf("CheckPool made a pool: %+v", ps)
	}
	if _, err := h.m.warm.MirrorPool(ctx, "pool-000000000000", checked.Spec); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("mirroring a spec under another pool's id: %v", err)
	}
	// The template need not be here for a mirror (it fills once it is).
	if changed, err := h.m.warm.MirrorPool(ctx, checked.ID, checked.Spec); err != nil || !changed {
		t.Fatalf("first mirror: %v %v", changed, err)
	}
	if changed, err := h.m.warm.MirrorPool(ctx, checked.ID, checked.Spec); err != nil || changed {
		t.Fatalf("mirroring the same spec again changed something: %v %v", changed, err)
	}
	p := h.waitReady(ctx, checked.ID, 1)
	if p.Spec != checked.Spec {
		t.Fatalf("mirrored pool %+v, checked %+v", p.Spec, checked.Spec)
	}
	if err := h.m.warm.DeletePool(ctx, checked.ID); err != nil {
		t.Fatal(err)
	}
	if id := h.m.warm.DefaultPoolID(ctx); !strings.HasPrefix(id, "pool-") {
		t.Fatalf("default pool id %q", id)
	}
}

// A second pool of the same members under other words — the template's
// digest or another tag, "auto" for the runtime it picks — is refused
// naming the first: a claim could not tell them apart (issue 26). The
// first stays writable; other limits make another pool.
func TestPoolTwinRefused(t *testing.T) {
	h := newHarness(t)
	ctx := h.ctx()
	if err := h.m.recon.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	first, err := h.m.warm.SetPool(ctx, api.PoolSpec{Template: "tiny:latest", Runtime: fakeruntime.Name, Max: 1})
	if err != nil {
		t.Fatal(err)
	}
	tmpl, err := h.tmpl.Get(ctx, "tiny:latest")
	if err != nil {
		t.Fatal(err)
	}
	if err := h.tmpl.Tag(ctx, "tiny:latest", "tiny:v2"); err != nil {
		t.Fatal(err)
	}
	for _, twin := range []api.PoolSpec{
		{Template: tmpl.Digest, Runtime: fakeruntime.Name, Max: 1},
		{Template: "tiny:v2", Runtime: fakeruntime.Name, Max: 2},
		{Template: "tiny:latest", Runtime: runtime.Auto, Max: 1},
		{Template: "tiny:latest", Max: 1},
	} {
		if _, err := h.m.warm.SetPool(ctx, twin); !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), first.ID) {
			t.Errorf("SetPool(%+v) = %v, want a conflict naming %s", twin, err, first.ID)
		}
	}
	if ps := h.m.warm.Pools(ctx); len(ps) != 1 {
		t.Fatalf("pools after the refused twins: %+v", ps)
	}
	if p, err := h.m.warm.SetPool(ctx, api.PoolSpec{Template: "tiny:latest", Runtime: fakeruntime.Name, Min: 1, Max: 2}); err != nil || p.ID != first.ID {
		t.Fatalf("updating the first pool: %+v %v", p, err)
	}
	other, err := h.m.warm.SetPool(ctx, api.PoolSpec{Template: "tiny:v2", Runtime: fakeruntime.Name, Limits: api.Limits{CPUs: 0.5}, Max: 1})
	if err != nil || other.ID == first.ID {
		t.Fatalf("a pool of other limits: %+v %v", other, err)
	}
	// The default pool (base template "tiny:latest" on auto) does not
	// duplicate the operator's: theirs stands.
	if err := h.m.warm.EnsureDefaultPool(ctx, 1); err != nil {
		t.Fatal(err)
	}
	if ps := h.m.warm.Pools(ctx); len(ps) != 2 {
		t.Fatalf("EnsureDefaultPool added a twin of the operator's pool: %+v", ps)
	}
	for _, p := range h.m.warm.Pools(ctx) {
		if err := h.m.warm.DeletePool(ctx, p.ID); err != nil {
			t.Fatal(err)
		}
	}
}

// A pool's hit and miss counters survive a restart (issue 26: they read 0
// after one).
func TestPoolCountersSurviveRestart(t *testing.T) {
	h := newHarness(t)
	ctx := h.ctx()
	if err := h.m.recon.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	h.m.recon.Run()
	// min 0: the first create misses (nothing ready) and raises the
	// target; the next one, once a member is ready, hits.
	p, err := h.m.warm.SetPool(ctx, api.PoolSpec{Template: "tiny:latest", Runtime: fakeruntime.Name, Min: 0, Max: 1})
	if err != nil {
		t.Fatal(err)
	}
	await := func(what string, ok func(api.Pool) bool) {
		t.Helper()
		for {
			got, err := h.m.warm.GetPool(ctx, p.ID)
			if err != nil {
				t.Fatal(err)
			}
			if ok(got) {
				return
			}
			select {
			case <-ctx.Done():
				t.Fatalf("the pool never %s: %+v", what, got)
			case <-time.After(20 * time.Millisecond):
			}
		}
	}
	// A claim matches a pool once the filler resolved its template.
	await("resolved its template", func(p api.Pool) bool { return p.TemplateDigest != "" })
	req := api.CreateSandboxRequest{Template: "tiny:latest", Runtime: fakeruntime.Name}
	h.create(req)
	await("refilled after its miss", func(p api.Pool) bool { return p.Ready == 1 })
	h.create(req)
	before, err := h.m.warm.GetPool(ctx, p.ID)
	if err != nil || before.Hits != 1 || before.Misses != 1 {
		t.Fatalf("before the restart: %+v %v, want 1 hit and 1 miss", before, err)
	}
	h.m.Close()
	h.m = h.manager()
	if err := h.m.recon.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	h.m.recon.Run()
	after, err := h.m.warm.GetPool(ctx, p.ID)
	if err != nil || after.Hits != before.Hits || after.Misses != before.Misses {
		t.Fatalf("after the restart: %+v %v, want %d hits and %d misses", after, err, before.Hits, before.Misses)
	}
	if err := h.m.warm.DeletePool(ctx, p.ID); err != nil {
		t.Fatal(err)
	}
}

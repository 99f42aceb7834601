package bench

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	mrand "math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/agentclient"
	"github.com/spacehq/space/internal/agentproto"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/gvisor"
	"github.com/spacehq/space/internal/testenv"
)

// The gvisor benchmarks drive the runtime directly (the layer that owns
// runsc) and, interleaved in the same run, raw runsc doing the same work:
//
//   - create→first output of `echo` vs `runsc run` of `echo` from the same
//     template;
//   - suspend (agent quiesce + Suspend) vs `runsc checkpoint`, and wake
//     (Restore until the agent answers) vs `runsc restore`, where the raw
//     container runs the very same process tree (ginit + agent, same
//     mounts) with its socket inside the sandbox so that it needs no
//     quiesce;
//   - fork of 10 children; host memory (PSS) of a running vs a suspended
//     sandbox and its host processes; 200 suspended sandboxes.
//
// SPACE_BENCH=1 runs them; SPACE_BENCH_GVISOR_N sets the iterations (10),
// SPACE_BENCH_GVISOR_SUSPENDED the suspended count (200).

type gvBench struct {
	rt      runtime.Runtime
	rootfs  string
	runsc   string
	rawRoot string // --root of the raw runsc calls
	// rawRootfs is a scratch copy of rootfs for raw runsc bundles.
	rawRootfs string
	dir       string
}

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

func newGVBench(t *testing.T) *gvBench {
	requireBench(t)
	testenv.RequireRoot(t)
	rootfs := testenv.BaseRootfs(t)
	agent := testenv.AgentBinary(t)
	dir, err := os.MkdirTemp("", "gvb-")
	if err != nil {
		t.Fatal(err)
	}
	rt, err := runtime.New(gvisor.Name, runtime.Config{DataDir: filepath.Join(dir, "rt"), AgentBinary: agent,
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: benchLogLevel()}))})
	if err != nil {
		t.Fatal(err)
	}
	rawRoot := filepath.Join(dir, "raw-state")
	var runscPath string
	t.Cleanup(func() {
		if out, err := exec.Command(runscPath, "--root", rawRoot, "list", "--quiet").Output(); err == nil {
			for _, id := range strings.Fields(string(out)) {
				exec.Command(runscPath, "--root", rawRoot, "delete", "--force", id).Run()
			}
		}
		rt.Sweep(context.Background(), func(string) bool { return false })
		rt.(io.Closer).Close()
		os.RemoveAll(dir)
	})
	c := rt.Probe(context.Background())
	// Through testenv: in CI a gVisor that lost its probe or its suspend
	// verb fails the benchmark instead of skipping it.
	testenv.Require(t, "gvisor", c.Available, c.Reason)
	testenv.Require(t, "suspend", c.Verbs[api.OpSuspend], "gvisor: "+c.VerbReasons[api.OpSuspend])
	runscPath = c.Details["runsc"]
	// Raw runsc creates its mount points inside the root it is given, even
	// a read-only one: give it a scratch copy, never the shared base cache.
	rawRootfs := filepath.Join(dir, "raw-rootfs")
	if out, err := exec.Command("cp", "-a", rootfs, rawRootfs).CombinedOutput(); err != nil {
		t.Fatalf("copy rootfs for raw runsc: %v %s", err, out)
	}
	b := &gvBench{rt: rt, rootfs: rootfs, rawRootfs: rawRootfs, runsc: runscPath, rawRoot: rawRoot, dir: dir}
	if err := os.MkdirAll(b.rawRoot, 0o700); err != nil {
		t.Fatal(err)
	}
	return b
}

func newSpecID(prefix string) string {
	b := make([]byte, 4)
	rand.Read(b)
	return prefix + hex.EncodeToString(b)
}

func (b *gvBench) spec(id string) runtime.Spec {
	return runtime.Spec{ID: id, RootFS: b.rootfs, TemplateDigest: "sha256:bench-base", Hostname: id,
		Limits: api.Limits{CPUs: 1, MemoryMiB: 256, Pids: 256, DiskMiB: 256}}
}

// start creates and starts a sandbox and returns a healthy client.
func (b *gvBench) start(ctx context.Context, id string) (runtime.Instance, *agentclient.Client, error) {
	inst, err := b.rt.Create(ctx, b.spec(id))
	if err != nil {
		return nil, nil, err
	}
	if err := inst.Start(ctx); err != nil {
		inst.Destroy(ctx)
		return nil, nil, err
	}
	c, err := dialHealthy(ctx, inst)
	if err != nil {
		inst.Destroy(ctx)
		return nil, nil, err
	}
	return inst, c, nil
}

func dialHealthy(ctx context.Context, inst runtime.Instance) (*agentclient.Client, error) {
	for {
		conn, err := inst.DialAgent(ctx)
		if err == nil {
			c, err := agentclient.New(conn)
			if err == nil {
				if _, err = c.Health(ctx); err == nil {
					return c, nil
				}
				c.Close()
			}
		}
		if ctx.Err() != nil {
			return nil, fmt.Errorf("agent not healthy: %v", err)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// runscFlags are the runtime's sandbox flags (docs/gvisor.md, "Flags").
var runscFlags = []string{"--platform=systrap", "--network=none", "--overlay2=none", "--host-uds=create",
	"--directfs=false", "--gofer-network-namespace=new", "--oci-seccomp"}

func (b *gvBench) raw(ctx context.Context, args ...string) ([]byte, error) {
	return b.rawFlags(ctx, runscFlags, args...)
}

func (b *gvBench) rawFlags(ctx context.Context, flags []string, args ...string) ([]byte, error) {
	full := append([]string{"--root", b.rawRoot}, flags...)
	cmd := exec.CommandContext(ctx, b.runsc, append(full, args...)...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	// Files, not pipes: a detached sandbox inherits them and would keep
	// a pipe open forever.
	outF, err := os.CreateTemp("", "gvb-out-")
	if err != nil {
		return nil, err
	}
	defer os.Remove(outF.Name())
	defer outF.Close()
	errF, err := os.CreateTemp("", "gvb-err-")
	if err != nil {
		return nil, err
	}
	defer os.Remove(errF.Name())
	defer errF.Close()
	cmd.Stdout, cmd.Stderr = outF, errF
	err = cmd.Run()
	out, _ := os.ReadFile(outF.Name())
	if err != nil {
		stderr, _ := os.ReadFile(errF.Name())
		err = fmt.Errorf("runsc %s: %v: %s", args[0], err, lastLine(string(stderr)))
	}
	return out, err
}

func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return lines[len(lines)-1]
}

// rawBundle writes a bundle for raw runsc from a sandbox's own config.json:
// the template itself as a read-only root, its own /run/space, its own
// cgroup; args replaces the process (nil: the agent, with its socket in
// the sandbox's /tmp so that a checkpoint needs no quiesce).
func (b *gvBench) rawBundle(t *testing.T, from runtime.Instance, id string, args []string) string {
	t.Helper()
	src := filepath.Join(b.dir, "rt", "sandboxes", from.ID(), "config.json")
	data, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	var spec map[string]any
	if err := json.Unmarshal(data, &spec); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(b.dir, "raw", id)
	agentDir := filepath.Join(dir, "agent")
	if err := os.MkdirAll(agentDir, 0o777); err != nil {
		t.Fatal(err)
	}
	os.Chown(agentDir, 100000000, 100000000)
	spec["root"] = map[string]any{"path": b.rawRootfs, "readonly": true}
	spec["hostname"] = id
	proc := spec["process"].(map[string]any)
	if args != nil {
		proc["args"] = args
		var env []any
		for _, e := range proc["env"].([]any) {
			if !strings.HasPrefix(e.(string), "SPACE_") {
				env = append(env, e)
			}
		}
		proc["env"] = env
	} else {
		proc["args"] = []any{"/run/space/space-agent", "--socket", "/tmp/agent.sock"}
	}
	for _, m := range spec["mounts"].([]any) {
		mm := m.(map[string]any)
		if mm["destination"] == "/run/space" {
			mm["source"] = agentDir
		}
	}
	spec["linux"].(map[string]any)["cgroupsPath"] = "/space-bench-raw/" + id
	out, _ := json.MarshalIndent(spec, "", "\t")
	if err := os.WriteFile(filepath.Join(dir, "config.json"), out, 0o600); err != nil {
		t.Fatal(err)
	}
	return dir
}

// hostProcs lists the host pids whose command line names id (runsc's
// sandbox and gofer processes name the container or its bundle).
func hostProcs(id string) []int {
	var out []int
	for pid := range testenv.ProcsNaming(id) {
		out = append(out, pid)
	}
	return out
}

func pssKiB(pids []int) (pss int64) {
	for _, p := range pids {
		_, v := testenv.Rollup(p)
		pss += v
	}
	return pss
}

func dirBytes(dir string) (apparent, allocated int64) {
	filepath.Walk(dir, func(_ string, fi os.FileInfo, err error) error {
		if err == nil && fi.Mode().IsRegular() {
			apparent += fi.Size()
			if st, ok := fi.Sys().(*syscall.Stat_t); ok {
				allocated += st.Blocks * 512
			}
		}
		return nil
	})
	return
}

func ratio(a, b samples) string {
	if b.pct(0.5) == 0 {
		return "n/a"
	}
	return fmt.Sprintf("%.2f×", float64(a.pct(0.5))/float64(b.pct(0.5)))
}

// TestGvisorCheckpointBench: create→first output, suspend, wake and fork,
// each next to raw runsc; host memory running vs suspended.
func TestGvisorCheckpointBench(t *testing.T) {
	b := newGVBench(t)
	n := envInt("SPACE_BENCH_GVISOR_N", 10)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()

	// Warm-up (page cache, the runtime's user namespace).
	inst, c, err := b.start(ctx, newSpecID("w-"))
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	echoBundle := b.rawBundle(t, inst, "raw-echo", []string{"/bin/echo", "hi"})
	agentBundle := b.rawBundle(t, inst, "raw-agent", nil)
	inst.Destroy(ctx)

	var ours, raw, suspend, rawCkpt, rawSafe, wake, rawRestore, wakeSocket samples
	var runPSS, memRunning, ckptBytes []int64
	var procsSuspended []int
	for i := 0; i < n; i++ {
		// create → first output
		id := newSpecID("b-")
		t0 := time.Now()
		inst, c, err := b.start(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		res, err := c.Exec(ctx, agentproto.ExecRequest{Cmd: []string{"echo", "hi"}})
		if err != nil || res.Stdout != "hi\n" {
			t.Fatalf("exec: %+v %v", res, err)
		}
		ours = append(ours, time.Since(t0))

		rid := newSpecID("r-")
		t0 = time.Now()
		out, err := b.raw(ctx, "run", "--bundle", echoBundle, rid)
		if err != nil || string(out) != "hi\n" {
			t.Fatalf("raw run: %q %v", out, err)
		}
		raw = append(raw, time.Since(t0))
		b.raw(ctx, "delete", "--force", rid)

		// A process holding some memory, as an idle agent session would.
		if _, err := c.StartProc(ctx, agentproto.ProcStart{ID: "mem", Cmd: []string{"sh", "-c", "x=$(head -c 1000000 /dev/urandom | od -An -tx1); sleep 3600"}}); err != nil {
			t.Fatal(err)
		}
		time.Sleep(300 * time.Millisecond)
		pids := hostProcs(id)
		runPSS = append(runPSS, pssKiB(pids))
		if st, err := inst.Stats(ctx); err == nil {
			memRunning = append(memRunning, st.MemoryBytes)
		}

		// suspend = quiesce + Suspend
		t0 = time.Now()
		if err := c.Quiesce(ctx); err != nil {
			t.Fatal(err)
		}
		c.Close()
		if err := inst.(runtime.Suspender).Suspend(ctx); err != nil {
			t.Fatal(err)
		}
		suspend = append(suspend, time.Since(t0))
		procsSuspended = append(procsSuspended, len(hostProcs(id)))
		a, _ := dirBytes(filepath.Join(b.dir, "rt", "sandboxes", id, "checkpoint"))
		ckptBytes = append(ckptBytes, a)

		// wake = Restore until the agent answers
		t0 = time.Now()
		if err := inst.(runtime.Suspender).Restore(ctx); err != nil {
			t.Fatal(err)
		}
		tRestored := time.Now()
		c, err = dialHealthy(ctx, inst)
		if err != nil {
			t.Fatal(err)
		}
		wake = append(wake, time.Since(t0))
		wakeSocket = append(wakeSocket, time.Since(tRestored))
		c.Close()
		inst.Destroy(ctx)

		// raw: the same process tree, checkpoint then restore
		rid = newSpecID("ra-")
		if _, err := b.raw(ctx, "run", "--detach", "--bundle", agentBundle, rid); err != nil {
			t.Fatal(err)
		}
		time.Sleep(500 * time.Millisecond) // the agent is up
		img := filepath.Join(b.dir, "raw-img-"+rid)
		t0 = time.Now()
		if _, err := b.raw(ctx, "checkpoint", "--image-path", img, rid); err != nil {
			t.Fatal(err)
		}
		rawCkpt = append(rawCkpt, time.Since(t0))
		b.raw(ctx, "delete", "--force", rid)
		t0 = time.Now()
		if _, err := b.raw(ctx, "restore", "--detach", "--image-path", img, "--bundle", agentBundle, rid); err != nil {
			t.Fatal(err)
		}
		rawRestore = append(rawRestore, time.Since(t0))
		// The safe sequence Suspend runs (a plain checkpoint kills the
		// sandbox even when the save fails), raw.
		img2 := img + "-safe"
		t0 = time.Now()
		if _, err := b.raw(ctx, "pause", rid); err != nil {
			t.Fatal(err)
		}
		if _, err := b.raw(ctx, "checkpoint", "--leave-running", "--image-path", img2, rid); err != nil {
			t.Fatal(err)
		}
		if _, err := b.raw(ctx, "delete", "--force", rid); err != nil {
			t.Fatal(err)
		}
		rawSafe = append(rawSafe, time.Since(t0))
		os.RemoveAll(img)
		os.RemoveAll(img2)
	}

	fmt.Printf("\n== gvisor runtime vs raw runsc (n=%d, interleaved) ==\n", n)
	printSamples("create→first output (runtime)", ours)
	printSamples("raw runsc run echo", raw)
	fmt.Printf("  ratio p50 %s (target ≤ 1.15×)\n", ratio(ours, raw))
	printSamples("suspend (quiesce+Suspend)", suspend)
	printSamples("raw runsc checkpoint", rawCkpt)
	fmt.Printf("  ratio p50 %s (target ≤ 1.3×)\n", ratio(suspend, rawCkpt))
	printSamples("raw pause+checkpoint -leave-running+delete", rawSafe)
	fmt.Printf("  ratio p50 %s (same safe sequence)\n", ratio(suspend, rawSafe))
	printSamples("wake (Restore→agent healthy)", wake)
	printSamples("  of which after Restore returned", wakeSocket)
	printSamples("raw runsc restore", rawRestore)
	fmt.Printf("  ratio p50 %s (target ≤ 1.3×)\n", ratio(wake, rawRestore))
	fmt.Printf("host PSS running (sentry+gofer): p50 %.1f MiB; sentry-reported usage p50 %.1f MiB\n",
		float64(median(runPSS))/1024, float64(median(memRunning))/(1<<20))
	fmt.Printf("suspended: host processes %v, checkpoint image p50 %.1f MiB\n", procsSuspended, float64(median(ckptBytes))/(1<<20))

	// fork of 10
	var forks samples
	for rep := 0; rep < 3; rep++ {
		pid := newSpecID("p-")
		parent, c, err := b.start(ctx, pid)
		if err != nil {
			t.Fatal(err)
		}
		var specs []runtime.Spec
		for k := 0; k < 10; k++ {
			specs = append(specs, b.spec(newSpecID("k-")))
		}
		t0 := time.Now()
		if err := c.Quiesce(ctx); err != nil {
			t.Fatal(err)
		}
		c.Close()
		kids, err := parent.(runtime.Forker).Fork(ctx, specs)
		if err != nil {
			t.Fatal(err)
		}
		for _, k := range kids {
			kc, err := dialHealthy(ctx, k)
			if err != nil {
				t.Fatal(err)
			}
			kc.Close()
		}
		forks = append(forks, time.Since(t0))
		for _, k := range kids {
			k.Destroy(ctx)
		}
		parent.Destroy(ctx)
	}
	printSamples("fork 10 children (all healthy)", forks)
}

func median(v []int64) int64 {
	if len(v) == 0 {
		return 0
	}
	c := append([]int64(nil), v...)
	for i := range c {
		for j := i + 1; j < len(c); j++ {
			if c[j] < c[i] {
				c[i], c[j] = c[j], c[i]
			}
		}
	}
	return c[len(c)/2]
}

// TestGvisorSuspendedDensity suspends SPACE_BENCH_GVISOR_SUSPENDED (200)
// sandboxes, counts their host processes and memory, and wakes a few.
func TestGvisorSuspendedDensity(t *testing.T) {
	b := newGVBench(t)
	n := envInt("SPACE_BENCH_GVISOR_SUSPENDED", 200)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Minute)
	defer cancel()
	before := testenv.MemInfo("MemAvailable")
	insts := make([]runtime.Instance, n)
	var mu sync.Mutex
	var firstErr error
	var suspendT samples
	sem := make(chan struct{}, 3)
	var wg sync.WaitGroup
	t0 := time.Now()
	for i := 0; i < n; i++ {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			inst, c, err := b.start(ctx, fmt.Sprintf("d-%04d", i))
			if err == nil {
				t1 := time.Now()
				if err = c.Quiesce(ctx); err == nil {
					c.Close()
					err = inst.(runtime.Suspender).Suspend(ctx)
				}
				mu.Lock()
				suspendT = append(suspendT, time.Since(t1))
				mu.Unlock()
			}
			mu.Lock()
			defer mu.Unlock()
			if err != nil && firstErr == nil {
				firstErr = err
			}
			insts[i] = inst
		}()
	}
	wg.Wait()
	elapsed := time.Since(t0)
	defer func() {
		for _, inst := range insts {
			if inst != nil {
				inst.Destroy(context.Background())
			}
		}
	}()
	if firstErr != nil {
		t.Fatal(firstErr)
	}
	after := testenv.MemInfo("MemAvailable")
	procs := 0
	for i := 0; i < n; i++ {
		procs += len(hostProcs(fmt.Sprintf("d-%04d", i)))
	}
	app, alloc := dirBytes(filepath.Join(b.dir, "rt", "sandboxes"))
	fmt.Printf("\n== %d suspended gvisor sandboxes ==\n", n)
	fmt.Printf("made (create+start+quiesce+suspend, 3 at a time) in %v\n", elapsed.Round(time.Second))
	printSamples("suspend under that load", suspendT)
	fmt.Printf("host processes of all of them: %d\n", procs)
	fmt.Printf("MemAvailable drop: %.1f MiB (%.2f MiB each; page cache of images included)\n",
		float64(before-after)/1024, float64(before-after)/1024/float64(n))
	fmt.Printf("disk: %.1f MiB allocated (%.0f MiB apparent, sparse disks) = %.1f MiB each\n",
		float64(alloc)/(1<<20), float64(app)/(1<<20), float64(alloc)/(1<<20)/float64(n))
	var wakes samples
	for _, k := range mrand.Perm(n)[:min(5, n)] {
		t0 := time.Now()
		if err := insts[k].(runtime.Suspender).Restore(ctx); err != nil {
			t.Fatal(err)
		}
		c, err := dialHealthy(ctx, insts[k])
		if err != nil {
			t.Fatal(err)
		}
		if res, err := c.Exec(ctx, agentproto.ExecRequest{Cmd: []string{"true"}}); err != nil || res.ExitCode != 0 {
			t.Fatalf("exec after wake: %+v %v", res, err)
		}
		wakes = append(wakes, time.Since(t0))
		c.Close()
	}
	printSamples("wake 5 of them (→ exec)", wakes)

}

// benchLogLevel: SPACE_BENCH_DEBUG=1 shows the runtime's phase timings.
func benchLogLevel() slog.Level {
	if os.Getenv("SPACE_BENCH_DEBUG") == "1" {
		return slog.LevelDebug
	}
	return slog.LevelWarn
}

package bench

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/agentclient"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/hostfs"
	"github.com/spacehq/space/internal/runtime/microvm"
	"github.com/spacehq/space/internal/testenv"
)

// The microvm benchmarks drive the runtime directly and, interleaved in the
// same run, raw QEMU doing the same work with the same kernel, initramfs,
// root image and a fresh disk (no jail):
//
//   - cold boot to the agent's health: raw QEMU vs space create with warm
//     templates off (a real cold boot through the jail) vs space create
//     from the warm template (the default path);
//   - suspend (agent quiesce + Suspend) vs raw QMP save (stop + migrate to a
//     file + fsync) and restore (Restore until the agent answers) vs raw
//     QEMU -incoming until the agent answers;
//   - host RSS/PSS per idle VM.
//
// SPACE_BENCH=1 runs it; SPACE_BENCH_MICROVM_N sets the iterations (5): a
// TCG boot takes seconds.

var mvLimits = api.Limits{CPUs: 1, MemoryMiB: 256, Pids: 256, DiskMiB: 256}

const mvDigest = "sha256:bench-microvm-base"

func TestMicroVMBench(t *testing.T) {
	phases := &phaseLog{}
	requireBench(t)
	testenv.RequireRoot(t)
	rootfs := testenv.BaseRootfs(t)
	agent := testenv.AgentBinary(t)
	n := envInt("SPACE_BENCH_MICROVM_N", 5)
	dir, err := os.MkdirTemp("", "mvb-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	rtI, err := runtime.New(microvm.Name, runtime.Config{DataDir: filepath.Join(dir, "rt"), AgentBinary: agent, JailBinary: testenv.JailBinary(t),
		Logger: slog.New(phases.wrap(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: benchLogLevel()})))})
	if err != nil {
		t.Fatal(err)
	}
	rt := rtI.(*microvm.Runtime)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	caps := rt.Probe(ctx)
	testenv.Require(t, "microvm", caps.Available, caps.Reason)
	accel := caps.Details["accel"]
	if err := rt.PrepareTemplate(ctx, mvDigest, rootfs); err != nil {
		t.Fatal(err)
	}
	defer rt.Sweep(context.Background(), func(string) bool { return false })

	k, initrd, rootImage := rawBootFiles(t, ctx, dir, agent, rootfs)
	rawVM := func(sub string) (microvm.VM, error) {
		d := filepath.Join(dir, sub)
		if err := os.MkdirAll(d, 0o700); err != nil {
			return microvm.VM{}, err
		}
		disk := filepath.Join(d, "disk.img")
		os.Remove(disk)
		if err := hostfs.FormatExt4(ctx, disk, mvLimits.DiskMiB, 100000000); err != nil {
			return microvm.VM{}, err
		}
		return microvm.VM{Kernel: k.Vmlinuz, Initrd: initrd, Accel: accel, CPUs: 1, MemoryMiB: int(mvLimits.MemoryMiB) + 96,
			TBSizeMiB: 128, AgentSocket: filepath.Join(d, "agent.sock"), ConsoleLog: filepath.Join(d, "console.log"),
			CtlSocket: filepath.Join(d, "ctl.sock"), QMPSocket: filepath.Join(d, "qmp.sock"), RootImage: rootImage, Disk: disk,
			Hostname: sub, SandboxMemoryMiB: mvLimits.MemoryMiB, Pids: mvLimits.Pids}, nil
	}
	rawBoot := func(sub string) (rawRun, error) {
		vm, err := rawVM(sub)
		if err != nil {
			return rawRun{}, err
		}
		t0 := time.Now()
		p, err := microvm.Start(vm)
		if err != nil {
			return rawRun{}, err
		}
		c, _, err := p.WaitHealthy(ctx)
		if err != nil {
			p.Kill()
			return rawRun{}, err
		}
		return rawRun{time.Since(t0), vm, p, c}, nil
	}
	create := func(id string) (time.Duration, runtime.Instance, *agentclient.Client, error) {
		spec := runtime.Spec{ID: id, RootFS: rootfs, TemplateDigest: mvDigest, Hostname: id, Limits: mvLimits}
		t0 := time.Now()
		inst, err := rt.Create(ctx, spec)
		if err != nil {
			return 0, nil, nil, err
		}
		if err := inst.Start(ctx); err != nil {
			inst.Destroy(ctx)
			return 0, nil, nil, err
		}
		c, err := dialHealthy(ctx, inst)
		if err != nil {
			inst.Destroy(ctx)
			return 0, nil, nil, err
		}
		return time.Since(t0), inst, c, nil
	}

	// Boot: raw vs cold vs warm, interleaved. The first create of the
	// kind boots cold and leaves the snapshot.
	d, inst, c, err := create(newSpecID("mvw"))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("first create of the kind (cold boot + taking the warm snapshot): %v", d.Round(time.Millisecond))
	c.Close()
	inst.Destroy(ctx)
	var raw, cold, warm samples
	var idle []runtime.Instance
	phases.reset() // the probe's restore
	for i := 0; i < n; i++ {
		rt.SetWarmTemplates(false)
		r, err := rawBoot(fmt.Sprintf("raw%d", i))
		if err != nil {
			t.Fatalf("raw boot: %v", err)
		}
		r.c.Close()
		r.p.Kill()
		raw = append(raw, r.d)

		d, inst, c, err := create(newSpecID("mvc"))
		if err != nil {
			t.Fatalf("cold create: %v", err)
		}
		c.Close()
		inst.Destroy(ctx)
		cold = append(cold, d)

		rt.SetWarmTemplates(true)
		d, inst, c, err = create(newSpecID("mvw"))
		if err != nil {
			t.Fatalf("warm create: %v", err)
		}
		c.Close()
		warm = append(warm, d)
		idle = append(idle, inst)
	}
	fmt.Printf("microvm (accel %s), %d iterations each, 1 vCPU, %d MiB sandbox memory:\n", accel, n, mvLimits.MemoryMiB)
	printSamples("raw QEMU boot→agent health", raw)
	printSamples("space create cold (jailed)", cold)
	printSamples("space create warm (default)", warm)
	for _, ph := range []string{"launch", "load", "reseed"} {
		printSamples("  warm phase "+ph, phases.get("guest restored", ph))
	}
	fmt.Printf("  cold/raw %s, cold/warm %s, p99 %.2f× (target warm ≥ 5× faster than cold)\n", ratio(cold, raw), ratio(cold, warm),
		float64(cold.pct(0.99))/float64(max(warm.pct(0.99), 1)))

	// Host memory of idle VMs (the warm ones, idle 5 s).
	time.Sleep(5 * time.Second)
	var rssSum, pssSum int64
	for _, inst := range idle {
		hp, ok := inst.(interface{ Pid() int })
		if !ok {
			t.Fatal("instance has no host pid")
		}
		rss, pss := testenv.Rollup(hp.Pid())
		rssSum += rss
		pssSum += pss
	}
	fmt.Printf("idle VM host memory (QEMU, %d VMs): RSS %.1f MiB, PSS %.1f MiB each\n", len(idle),
		float64(rssSum)/1024/float64(len(idle)), float64(pssSum)/1024/float64(len(idle)))

	// Suspend and restore vs raw QMP save / -incoming.
	var sus, res, rawSave, rawRestore samples
	for i, inst := range idle {
		c, err := dialHealthy(ctx, inst)
		if err != nil {
			t.Fatal(err)
		}
		t0 := time.Now()
		if err := c.Quiesce(ctx); err != nil {
			t.Fatal(err)
		}
		c.Close()
		if err := inst.(runtime.Suspender).Suspend(ctx); err != nil {
			t.Fatalf("suspend: %v", err)
		}
		sus = append(sus, time.Since(t0))
		t0 = time.Now()
		if err := inst.(runtime.Suspender).Restore(ctx); err != nil {
			t.Fatalf("restore: %v", err)
		}
		c, err = dialHealthy(ctx, inst)
		if err != nil {
			t.Fatal(err)
		}
		res = append(res, time.Since(t0))
		c.Close()
		inst.Destroy(ctx)

		s, r, err := rawSaveRestore(ctx, rawBoot, fmt.Sprintf("rs%d", i))
		if err != nil {
			t.Fatalf("raw save/restore: %v", err)
		}
		rawSave, rawRestore = append(rawSave, s), append(rawRestore, r)
	}
	printSamples("space suspend (quiesce+save)", sus)
	printSamples("raw QMP save (stop+migrate)", rawSave)
	printSamples("space restore→agent health", res)
	printSamples("raw -incoming→agent health", rawRestore)
	fmt.Printf("  suspend/raw %s, restore/raw %s\n", ratio(sus, rawSave), ratio(res, rawRestore))
}

// rawRun is one raw QEMU booted to its agent's health.
type rawRun struct {
	d  time.Duration
	vm microvm.VM
	p  *microvm.Process
	c  *agentclient.Client
}

// rawSaveRestore boots a raw VM, quiesces its agent, saves it through QMP
// into a file, kills it and restores it with -incoming until its agent
// answers; it returns the save and restore times.
func rawSaveRestore(ctx context.Context, boot func(string) (rawRun, error), sub string) (save, restore time.Duration, err error) {
	r, err := boot(sub)
	if err != nil {
		return 0, 0, err
	}
	p, c, vm := r.p, r.c, r.vm
	defer p.Kill()
	if err := c.Quiesce(ctx); err != nil {
		return 0, 0, err
	}
	c.Close()
	q, err := microvm.DialQMP(ctx, vm.QMPSocket)
	if err != nil {
		return 0, 0, err
	}
	if _, err := microvm.WaitAgentPortReleased(ctx, q, 5*time.Second); err != nil {
		q.Close()
		return 0, 0, err
	}
	statePath := filepath.Join(filepath.Dir(vm.AgentSocket), "vm.state")
	f, err := os.OpenFile(statePath, os.O_CREATE|os.O_TRUNC|os.O_RDWR, 0o600)
	if err != nil {
		q.Close()
		return 0, 0, err
	}
	t0 := time.Now()
	_, err = microvm.SaveState(ctx, q, f)
	save = time.Since(t0)
	f.Close()
	q.Close()
	if err != nil {
		return 0, 0, err
	}
	p.Kill()
	defer os.Remove(statePath)
	state, err := os.Open(statePath)
	if err != nil {
		return 0, 0, err
	}
	defer state.Close()
	vm.IncomingFD = 3
	t0 = time.Now()
	p2, err := microvm.Launch(vm, microvm.LaunchOptions{Incoming: state})
	if err != nil {
		return 0, 0, err
	}
	defer p2.Kill()
	q2, err := microvm.DialQMP(ctx, vm.QMPSocket)
	if err != nil {
		return 0, 0, err
	}
	defer q2.Close()
	if err := microvm.WaitIncoming(ctx, q2, p2.Done()); err != nil {
		return 0, 0, err
	}
	c2, _, err := p2.WaitHealthy(ctx)
	if err != nil {
		return 0, 0, err
	}
	restore = time.Since(t0)
	c2.Close()
	return save, restore, nil
}

// phaseLog keeps the durations the runtime logs at debug level (its phase
// timings, e.g. "guest restored" launch/load/reseed) whatever the level
// printed.
type phaseLog struct {
	mu sync.Mutex
	d  map[string]samples // "msg/attr"
}

func (p *phaseLog) get(msg, attr string) samples {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.d[msg+"/"+attr]
}

func (p *phaseLog) reset() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.d = nil
}

func (p *phaseLog) wrap(h slog.Handler) slog.Handler { return &phaseHandler{Handler: h, p: p} }

type phaseHandler struct {
	slog.Handler
	p *phaseLog
}

func (h *phaseHandler) Enabled(context.Context, slog.Level) bool { return true }

func (h *phaseHandler) Handle(ctx context.Context, r slog.Record) error {
	r.Attrs(func(a slog.Attr) bool {
		if a.Value.Kind() == slog.KindDuration {
			h.p.mu.Lock()
			if h.p.d == nil {
				h.p.d = map[string]samples{}
			}
			k := r.Message + "/" + a.Key
			h.p.d[k] = append(h.p.d[k], a.Value.Duration())
			h.p.mu.Unlock()
		}
		return true
	})
	if !h.Handler.Enabled(ctx, r.Level) {
		return nil
	}
	return h.Handler.Handle(ctx, r)
}

func (h *phaseHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return &phaseHandler{Handler: h.Handler.WithAttrs(as), p: h.p}
}

func (h *phaseHandler) WithGroup(name string) slog.Handler {
	return &phaseHandler{Handler: h.Handler.WithGroup(name), p: h.p}
}

// rawBootFiles makes what a raw QEMU of the microvm benches boots from
// under dir: the guest kernel, the initramfs with agent, and the root
// image of rootfs.
func rawBootFiles(t *testing.T, ctx context.Context, dir, agent, rootfs string) (k microvm.Kernel, initrd, rootImage string) {
	t.Helper()
	k, err := microvm.FindKernel(testenv.CacheDir())
	if err != nil {
		t.Fatal(err)
	}
	initrd, err = microvm.BuildInitramfs(k, agent, filepath.Join(dir, "boot"))
	if err != nil {
		t.Fatal(err)
	}
	images := &microvm.Images{Dir: filepath.Join(dir, "images"), AgentBinary: agent}
	rootImage, err = images.Prepare(ctx, mvDigest, rootfs)
	if err != nil {
		t.Fatal(err)
	}
	return k, initrd, rootImage
}

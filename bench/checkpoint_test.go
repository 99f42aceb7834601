package bench

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/internal/agentproto"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/runtime/hostfs"
	"github.com/spacehq/space/internal/runtime/microvm"
	"github.com/spacehq/space/internal/testenv"
)

// The raw tools' side of issue 27's checkpoint target ("pause seen by a
// sandbox with 256 MiB of touched memory during a checkpoint ≤ 2× what the
// raw tool alone costs"), measured before the feature exists:
//
//   - gvisor: raw runsc runs a program that fills 256 MiB with random bytes
//     and then watches its own clock in a tight loop, logging every gap
//     between two consecutive reads over 1 ms; `runsc checkpoint
//     --leave-running` to a fresh image directory, N times. Reported: the
//     command's duration, the largest gap the program saw during it (and,
//     for scale, in an equally long window without a checkpoint), the image
//     size. After each the sandbox must still be running and its program
//     still ticking.
//   - microvm: a raw QEMU (as rawSaveRestore boots one) whose guest runs the
//     same program, saved to a file by a live QMP `migrate` (no `stop`
//     first) and `cont` after; QEMU's own `downtime` is the guest's stop.
//     Then the same with `stop` first (microvm.SaveState), the way Suspend
//     saves today.
//
// SPACE_BENCH=1 runs them; SPACE_BENCH_CKPT_N sets the iterations (10
// gvisor, 5 microvm: each TCG migration of the guest takes seconds).

// pauseProbe is the program that fills 256 MiB and logs the gaps it sees,
// to the file named by argv[1]: "ready", then "G <end ns> <gap ns>" for a
// gap over 1 ms and "H <ns>" every 100 ms. The time of a write is not
// counted as a gap.
const pauseProbe = `
import os, sys, time
n = 256 << 20
b = bytearray(n)
for off in range(0, n, 1 << 20):
    b[off:off + (1 << 20)] = os.urandom(1 << 20)
f = open(sys.argv[1], "a", buffering=1)
f.write("ready\n")
prev = time.time_ns()
hb = prev
while True:
    now = time.time_ns()
    if now - prev > 1000000:
        f.write("G %d %d\n" % (now, now - prev))
        now = time.time_ns()
    if now - hb > 100000000:
        f.write("H %d\n" % now)
        hb = now
        now = time.time_ns()
    prev = now
`

// probeLog is what pauseProbe wrote after some offset.
type probeLog struct {
	ready   bool
	maxGap  time.Duration
	lastHB  time.Time
	lines   int
	nextOff int64
}

func parseProbeLog(r io.Reader, off int64) probeLog {
	l := probeLog{nextOff: off}
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		line := sc.Text()
		l.nextOff += int64(len(line)) + 1
		l.lines++
		f := strings.Fields(line)
		switch {
		case line == "ready":
			l.ready = true
		case len(f) == 3 && f[0] == "G":
			if g, err := strconv.ParseInt(f[2], 10, 64); err == nil && time.Duration(g) > l.maxGap {
				l.maxGap = time.Duration(g)
			}
		case len(f) == 2 && f[0] == "H":
			if ns, err := strconv.ParseInt(f[1], 10, 64); err == nil {
				l.lastHB = time.Unix(0, ns)
			}
		}
	}
	return l
}

func readProbeFile(path string, off int64) (probeLog, error) {
	f, err := os.Open(path)
	if err != nil {
		return probeLog{nextOff: off}, err
	}
	defer f.Close()
	if _, err := f.Seek(off, io.SeekStart); err != nil {
		return probeLog{nextOff: off}, err
	}
	return parseProbeLog(f, off), nil
}

func printMiB(name string, v []int64) {
	s := make(samples, len(v))
	for i, x := range v {
		s[i] = time.Duration(x)
	}
	fmt.Printf("%-34s n=%d p50=%.1fMiB p99=%.1fMiB\n", name, len(v), float64(s.pct(0.5))/(1<<20), float64(s.pct(0.99))/(1<<20))
}

// TestCheckpointPauseGvisor: raw `runsc checkpoint --leave-running` of a
// sandbox with 256 MiB touched, and the pause its program sees.
func TestCheckpointPauseGvisor(t *testing.T) {
	b := newGVBench(t)
	n := envInt("SPACE_BENCH_CKPT_N", 10)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()

	// The bundle comes from a sandbox's own config.json, with room for
	// the 256 MiB and the interpreter.
	spec := b.spec(newSpecID("cw-"))
	spec.Limits.MemoryMiB = 512
	inst, err := b.rt.Create(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	if err := inst.Start(ctx); err != nil {
		inst.Destroy(ctx)
		t.Fatal(err)
	}
	bundle := b.rawBundle(t, inst, "raw-pause", []string{"/usr/bin/python3", "-c", pauseProbe, "/run/space/gaps"})
	inst.Destroy(ctx)
	logPath := filepath.Join(bundle, "agent", "gaps")

	rid := newSpecID("rp-")
	if _, err := b.raw(ctx, "run", "--detach", "--bundle", bundle, rid); err != nil {
		t.Fatal(err)
	}
	defer b.raw(context.Background(), "delete", "--force", rid)
	var off int64
	deadline := time.Now().Add(2 * time.Minute)
	for {
		l, _ := readProbeFile(logPath, 0)
		if l.ready {
			off = l.nextOff
			break
		}
		if time.Now().After(deadline) {
			st, _ := b.raw(ctx, "state", rid)
			t.Fatalf("the probe did not fill its memory in time; state %s", st)
		}
		time.Sleep(50 * time.Millisecond)
	}
	time.Sleep(500 * time.Millisecond)
	if l, err := readProbeFile(logPath, off); err == nil {
		off = l.nextOff
	}

	var ckpt, pause, idle samples
	var imgBytes []int64
	for i := 0; i < n; i++ {
		// A window without a checkpoint, as long as the last one took
		// (300 ms at first): the loop's own noise.
		w := 300 * time.Millisecond
		if len(ckpt) > 0 {
			w = ckpt[len(ckpt)-1]
		}
		time.Sleep(w)
		l, err := readProbeFile(logPath, off)
		if err != nil {
			t.Fatal(err)
		}
		idle = append(idle, l.maxGap)
		off = l.nextOff

		img := filepath.Join(b.dir, fmt.Sprintf("pause-img-%d", i))
		t0 := time.Now()
		if _, err := b.raw(ctx, "checkpoint", "--leave-running", "--image-path", img, rid); err != nil {
			t.Fatal(err)
		}
		t1 := time.Now()
		ckpt = append(ckpt, t1.Sub(t0))
		// Still running, and the program ticks after the checkpoint.
		out, err := b.raw(ctx, "state", rid)
		if err != nil {
			t.Fatal(err)
		}
		var st struct{ Status string }
		if err := json.Unmarshal(out, &st); err != nil || st.Status != "running" {
			t.Fatalf("after checkpoint %d: state %s %v", i, out, err)
		}
		var after probeLog
		for wait := time.Now().Add(10 * time.Second); ; {
			l, err := readProbeFile(logPath, off)
			if err == nil && l.lastHB.After(t1) {
				after = l
				break
			}
			if time.Now().After(wait) {
				t.Fatalf("after checkpoint %d the program stopped ticking (last heartbeat %v, checkpoint ended %v)", i, l.lastHB, t1)
			}
			time.Sleep(20 * time.Millisecond)
		}
		pause = append(pause, after.maxGap)
		off = after.nextOff
		a, _ := dirBytes(img)
		imgBytes = append(imgBytes, a)
		os.RemoveAll(img)
	}

	fmt.Printf("\n== raw runsc checkpoint --leave-running, 256 MiB touched (random), n=%d ==\n", n)
	printSamples("runsc checkpoint --leave-running", ckpt)
	printSamples("largest gap seen inside", pause)
	printSamples("  same, window w/o checkpoint", idle)
	printMiB("image size", imgBytes)
	fmt.Printf("  pause/command p50 %s\n", ratio(pause, ckpt))
}

// TestCheckpointPauseMicroVM: a raw QEMU whose guest has 256 MiB touched,
// saved to a file by a live migration (then `cont`), and by stop+migrate.
func TestCheckpointPauseMicroVM(t *testing.T) {
	requireBench(t)
	testenv.RequireRoot(t)
	rootfs := testenv.BaseRootfs(t)
	agent := testenv.AgentBinary(t)
	n := envInt("SPACE_BENCH_CKPT_N", 5)
	dir, err := os.MkdirTemp("", "mvp-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	// The runtime only for its probe: whether QEMU runs here, and which
	// accelerator.
	rtI, err := runtime.New(microvm.Name, runtime.Config{DataDir: filepath.Join(dir, "rt"), AgentBinary: agent,
		JailBinary: testenv.JailBinary(t), Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: benchLogLevel()}))})
	if err != nil {
		t.Fatal(err)
	}
	caps := rtI.Probe(ctx)
	testenv.Require(t, "microvm", caps.Available, caps.Reason)
	accel := caps.Details["accel"]
	k, initrd, rootImage := rawBootFiles(t, ctx, dir, agent, rootfs)
	disk := filepath.Join(dir, "disk.img")
	if err := hostfs.FormatExt4(ctx, disk, mvLimits.DiskMiB, 100000000); err != nil {
		t.Fatal(err)
	}
	// Room for the 256 MiB and the interpreter inside the sandbox's cgroup.
	const sandboxMiB = 512
	vm := microvm.VM{Kernel: k.Vmlinuz, Initrd: initrd, Accel: accel, CPUs: 1, MemoryMiB: sandboxMiB + 96,
		TBSizeMiB: 128, AgentSocket: filepath.Join(dir, "agent.sock"), ConsoleLog: filepath.Join(dir, "console.log"),
		CtlSocket: filepath.Join(dir, "ctl.sock"), QMPSocket: filepath.Join(dir, "qmp.sock"), RootImage: rootImage, Disk: disk,
		Hostname: "ckpt", SandboxMemoryMiB: sandboxMiB, Pids: mvLimits.Pids}
	p, err := microvm.Start(vm)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Kill()
	c, _, err := p.WaitHealthy(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { c.Close() }()
	const logPath = "/tmp/gaps"
	if _, err := c.StartProc(ctx, agentproto.ProcStart{ID: "probe", Cmd: []string{"python3", "-c", pauseProbe, logPath}}); err != nil {
		t.Fatal(err)
	}
	guestLog := func(off int64) (probeLog, error) {
		res, err := c.Exec(ctx, agentproto.ExecRequest{Cmd: []string{"tail", "-c", "+" + strconv.FormatInt(off+1, 10), logPath}})
		if err != nil {
			return probeLog{nextOff: off}, err
		}
		if res.ExitCode != 0 {
			return probeLog{nextOff: off}, fmt.Errorf("tail: %d %s", res.ExitCode, res.Stderr)
		}
		return parseProbeLog(strings.NewReader(res.Stdout), off), nil
	}
	var off int64
	for deadline := time.Now().Add(5 * time.Minute); ; {
		l, _ := guestLog(0)
		if l.ready {
			off = l.nextOff
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the probe did not fill its memory in time; console:\n%s", p.ConsoleTail(2048))
		}
		time.Sleep(200 * time.Millisecond)
	}
	q, err := microvm.DialQMP(ctx, vm.QMPSocket)
	if err != nil {
		t.Fatal(err)
	}
	defer q.Close()
	if _, err := q.Execute(ctx, "migrate-set-parameters", map[string]any{"max-bandwidth": int64(1 << 40)}); err != nil {
		t.Fatal(err)
	}

	// The guest's clock stops with it under QEMU (the virtual clock does
	// not run while the VM is stopped), so the gap it logs understates the
	// pause; QEMU's downtime is the measure, the gap is printed for what
	// it is. The stream goes to a descriptor (getfd, fd:) rather than
	// exec:cat: the same bytes, and the way the runtime saves (its QEMU
	// runs with -sandbox spawn=deny).
	var live, liveQEMU, liveDown, liveSync, liveGap, liveIdle, stopSave, stopMigrate, stopSync, stopGap samples
	var liveBytes, stopBytes []int64
	for i := 0; i < n; i++ {
		time.Sleep(300 * time.Millisecond)
		l, err := guestLog(off)
		if err != nil {
			t.Fatal(err)
		}
		liveIdle = append(liveIdle, l.maxGap)
		off = l.nextOff

		// Live: migrate with the guest running; it ends in postmigrate.
		path := filepath.Join(dir, "live.state")
		f, err := os.OpenFile(path, os.O_CREATE|os.O_TRUNC|os.O_RDWR, 0o600)
		if err != nil {
			t.Fatal(err)
		}
		t0 := time.Now()
		if _, err := q.ExecuteWithFD(ctx, "getfd", map[string]any{"fdname": "ckpt"}, f); err != nil {
			t.Fatal(err)
		}
		if _, err := q.Execute(ctx, "migrate", map[string]any{"uri": "fd:ckpt"}); err != nil {
			t.Fatal(err)
		}
		var mig struct {
			Status   string `json:"status"`
			Downtime int64  `json:"downtime"`
			Error    string `json:"error-desc"`
		}
		for {
			raw, err := q.Execute(ctx, "query-migrate", nil)
			if err != nil {
				t.Fatal(err)
			}
			if err := json.Unmarshal(raw, &mig); err != nil {
				t.Fatal(err)
			}
			if mig.Status == "completed" {
				break
			}
			if mig.Status == "failed" || mig.Status == "cancelled" {
				t.Fatalf("live migration %s: %s", mig.Status, mig.Error)
			}
			time.Sleep(2 * time.Millisecond)
		}
		tDone := time.Now()
		status, err := q.Status(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if status != "running" {
			if err := microvm.ContinueAfterSave(ctx, q); err != nil {
				t.Fatal(err)
			}
		}
		live = append(live, time.Since(t0))
		// QEMU's downtime ends at completion; the guest stays stopped
		// until `cont` returns.
		liveQEMU = append(liveQEMU, time.Duration(mig.Downtime)*time.Millisecond)
		liveDown = append(liveDown, time.Duration(mig.Downtime)*time.Millisecond+time.Since(tDone))
		// SaveState syncs its file while the guest is stopped; here the
		// guest already runs again.
		t2 := time.Now()
		if err := f.Sync(); err != nil {
			t.Fatal(err)
		}
		liveSync = append(liveSync, time.Since(t2))
		st, _ := f.Stat()
		liveBytes = append(liveBytes, st.Size())
		f.Close()
		if i == 0 {
			t.Logf("live migration: status after completion %q", status)
		}
		time.Sleep(200 * time.Millisecond)
		l, err = guestLog(off)
		if err != nil {
			t.Fatalf("after live migration %d: %v", i, err)
		}
		liveGap = append(liveGap, l.maxGap)
		off = l.nextOff

		// Stop first, then migrate (SaveState, as Suspend does), cont.
		f, err = os.OpenFile(filepath.Join(dir, "stop.state"), os.O_CREATE|os.O_TRUNC|os.O_RDWR, 0o600)
		if err != nil {
			t.Fatal(err)
		}
		t0 = time.Now()
		info, err := microvm.SaveState(ctx, q, f)
		if err != nil {
			t.Fatal(err)
		}
		if err := microvm.ContinueAfterSave(ctx, q); err != nil {
			t.Fatal(err)
		}
		stopSave = append(stopSave, time.Since(t0))
		stopBytes = append(stopBytes, info.Bytes)
		stopMigrate, stopSync = append(stopMigrate, info.Migrate), append(stopSync, info.Sync)
		f.Close()
		time.Sleep(200 * time.Millisecond)
		l, err = guestLog(off)
		if err != nil {
			t.Fatalf("after stop+migrate %d: %v", i, err)
		}
		stopGap = append(stopGap, l.maxGap)
		off = l.nextOff
		if i == n-1 {
			// The guest's realtime falls behind the host's by the
			// time it spent stopped.
			t.Logf("guest clock behind the host's after %d saves: ~%v", 2*n, time.Since(l.lastHB).Round(time.Millisecond))
		}
	}
	if res, err := c.Exec(ctx, agentproto.ExecRequest{Cmd: []string{"true"}}); err != nil || res.ExitCode != 0 {
		t.Fatalf("exec after the migrations: %+v %v", res, err)
	}

	fmt.Printf("\n== raw QEMU migrate to file, guest with 256 MiB touched (random), accel %s, n=%d ==\n", accel, n)
	printSamples("live migrate+cont (total)", live)
	printSamples("  QEMU downtime", liveQEMU)
	printSamples("  guest stopped (downtime+cont)", liveDown)
	printSamples("  fsync after (guest running)", liveSync)
	printSamples("  largest gap seen in guest", liveGap)
	printSamples("  same, window w/o migration", liveIdle)
	printMiB("  state file", liveBytes)
	printSamples("stop+migrate+cont (guest stopped)", stopSave)
	printSamples("  of which migrate", stopMigrate)
	printSamples("  of which fsync", stopSync)
	printSamples("  largest gap seen in guest", stopGap)
	printMiB("  state file", stopBytes)
	fmt.Printf("  live downtime / stop+migrate p50 %s\n", ratio(liveDown, stopSave))
}

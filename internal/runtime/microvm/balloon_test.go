package microvm

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/spacehq/space/internal/runtime/runtimetest"
	"github.com/spacehq/space/internal/testenv"
)

// TestGuestGivesFreeMemoryBack: memory a sandbox used and freed goes back
// to the host (free page reporting through virtio-balloon), so an idle VM
// holds what its guest uses, not the most it ever touched.
func TestGuestGivesFreeMemoryBack(t *testing.T) {
	requireRuntime(t)
	sb := runtimetest.Start(t, harness(t), nil, runtimetest.DefaultLimits)
	pid := sb.Inst.(interface{ Pid() int }).Pid()
	rss := func() int64 { r, _ := testenv.Rollup(pid); return r }
	// 160 MiB touched in the guest, then freed when python exits. The
	// peak is sampled while the command runs: by the time the exec
	// returns the guest may already have reported part of it free.
	var peak atomic.Int64
	stop := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		for {
			if r := rss(); r > peak.Load() {
				peak.Store(r)
			}
			select {
			case <-stop:
				return
			case <-time.After(20 * time.Millisecond):
			}
		}
	}()
	res := sb.Exec(t, "python3", "-c", "b = bytearray(160 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\nprint('ok')")
	close(stop)
	<-sampled
	if res.Stdout != "ok\n" {
		t.Fatalf("allocating in the guest: %+v", res)
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		now := rss()
		if peak := peak.Load(); peak-now >= 100<<10 {
			t.Logf("QEMU RSS %d MiB at its peak, %d MiB once the guest reported it free", peak>>10, now>>10)
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("QEMU RSS %d MiB after the guest freed 160 MiB (peak %d MiB): free memory never went back", now>>10, peak.Load()>>10)
		}
		time.Sleep(500 * time.Millisecond)
	}
}

package microvm

import (
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
	// 160 MiB touched in the guest, then freed when python exits.
	res := sb.Exec(t, "python3", "-c", "b = bytearray(160 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\nprint('ok')")
	if res.Stdout != "ok\n" {
		t.Fatalf("allocating in the guest: %+v", res)
	}
	peak := rss()
	deadline := time.Now().Add(60 * time.Second)
	for {
		now := rss()
		if peak-now >= 100<<10 {
			t.Logf("QEMU RSS %d MiB after the allocation, %d MiB once the guest reported it free", peak>>10, now>>10)
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("QEMU RSS %d MiB after the guest freed 160 MiB (peak %d MiB): free memory never went back", now>>10, peak>>10)
		}
		time.Sleep(500 * time.Millisecond)
	}
}

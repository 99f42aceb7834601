package agent

import (
	"log/slog"
	"net"
	"net/http"
	"os"
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"sync"
	"time"
)

// An idle sandbox is its agent alone, so the agent's resident memory is
// what an idle sandbox costs its host. Two things keep it small: the Go
// runtime is sized for a small process (tuneRuntime), and whenever the
// agent has served nothing for a moment it collects garbage and gives the
// free pages back to the kernel (idleTrimmer); idle streams are shrunk and
// closed (yamux keeps a stream's receive buffer at its peak size). Without
// the trim, a burst of work leaves the heap's freed pages resident (an
// 8 MiB upload and a few large outputs left 8 MiB; trimmed, 3 MiB).

const (
	// runtimeProcs caps GOMAXPROCS: the agent mostly waits on pipes and
	// processes, and every P keeps its own cached spans (and, after the
	// first collection, a mark worker goroutine) on a host with many cores.
	runtimeProcs = 2
	// runtimeGCPercent halves the first collection target (4 MiB × 50%).
	runtimeGCPercent = 50
	// DefaultIdleTrim is how long the agent binary waits without a request
	// in flight before it returns free memory to the kernel.
	DefaultIdleTrim = time.Second
)

// tuneRuntime sizes the Go runtime of the agent binary, unless the
// environment sets GOMAXPROCS or GOGC explicitly.
func tuneRuntime() {
	if os.Getenv("GOMAXPROCS") == "" && runtime.GOMAXPROCS(0) > runtimeProcs {
		runtime.GOMAXPROCS(runtimeProcs)
	}
	if os.Getenv("GOGC") == "" {
		debug.SetGCPercent(runtimeGCPercent)
	}
	// Nothing reads heap profiles from the agent; sampling them costs a
	// stack-trace hash table.
	runtime.MemProfileRate = 0
}

// idleTrimmer calls debug.FreeOSMemory once no request has been in flight
// for a while. A live attach is a request in flight: nothing is trimmed
// while output streams.
type idleTrimmer struct {
	after time.Duration
	log   *slog.Logger

	mu     sync.Mutex
	active int
	freed  bool // a stream closed since the last trim
	timer  *time.Timer

	cycles uint64 // collections seen by the last fire (only fire uses it)
}

func newIdleTrimmer(after time.Duration, log *slog.Logger) *idleTrimmer {
	t := &idleTrimmer{after: after, log: log}
	t.timer = time.AfterFunc(after, t.fire) // also trims what startup left behind
	return t
}

// wrap counts h's requests as activity.
func (t *idleTrimmer) wrap(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		t.mu.Lock()
		t.active++
		t.timer.Stop()
		t.mu.Unlock()
		defer func() {
			t.mu.Lock()
			if t.active--; t.active == 0 {
				t.timer.Reset(t.after)
			}
			t.mu.Unlock()
		}()
		h.ServeHTTP(w, r)
	})
}

// trimAbove is how much reclaimable heap (garbage since the last
// collection plus free pages not yet returned) the agent may keep when
// idle. Below it a trim is skipped: the collection it forces would itself
// make the runtime allocate its collector's data structures (some hundreds
// of KiB that are never released), which an agent that has done little has
// not needed yet.
const trimAbove = 1 << 20

var trimMetrics = []metrics.Sample{
	{Name: "/gc/heap/live:bytes"},
	{Name: "/memory/classes/heap/objects:bytes"},
	{Name: "/memory/classes/heap/free:bytes"},
	{Name: "/gc/cycles/total:gc-cycles"},
}

// connState shrinks a stream that went idle (yamux keeps a stream's
// receive buffer at its peak size otherwise, up to its 256 KiB window) and
// counts a closed stream as a reason to trim: what it held became garbage
// that the reclaimable estimate below cannot see.
func (t *idleTrimmer) connState(c net.Conn, state http.ConnState) {
	switch state {
	case http.StateIdle:
		if s, ok := c.(interface{ Shrink() }); ok {
			s.Shrink()
		}
	case http.StateClosed:
		t.mu.Lock()
		t.freed = true
		if t.active == 0 {
			t.timer.Reset(t.after)
		}
		t.mu.Unlock()
	}
}

func (t *idleTrimmer) fire() {
	t.mu.Lock()
	busy, freed := t.active > 0, t.freed
	t.freed = false
	t.mu.Unlock()
	if busy {
		return
	}
	metrics.Read(trimMetrics)
	live, objects, free := trimMetrics[0].Value.Uint64(), trimMetrics[1].Value.Uint64(), trimMetrics[2].Value.Uint64()
	cycles := trimMetrics[3].Value.Uint64()
	reclaimable := objects - min(live, objects) + free
	// A collection since the last trim means the heap grew with work (and
	// the collector's structures exist already): what that left behind is
	// worth returning even when the estimate, which sees only garbage
	// made since the last collection, is small.
	trim := reclaimable > trimAbove || cycles > t.cycles || freed && cycles > 0
	if trim {
		debug.FreeOSMemory()
		metrics.Read(trimMetrics[3:])
		cycles = trimMetrics[3].Value.Uint64()
	}
	t.cycles = cycles
	t.log.Debug("idle", "reclaimable", reclaimable, "trimmed", trim, "goroutines", runtime.NumGoroutine())
}

func (t *idleTrimmer) stop() { t.timer.Stop() }

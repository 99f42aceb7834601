package agent

import (
	"os"
	"testing"
)

// TestSpareThreadsStayInThePool: the threads startSpareThreads makes exist
// afterwards (idle in the Go runtime's pool), so a goroutine that blocks in
// a system call later needs no new thread from the kernel.
func TestSpareThreadsStayInThePool(t *testing.T) {
	count := func() int {
		ents, err := os.ReadDir("/proc/self/task")
		if err != nil {
			t.Fatal(err)
		}
		return len(ents)
	}
	// More than the process has, so that idle threads it may already hold
	// cannot make up the number: each goroutine must hold its own.
	n := count() + 4
	startSpareThreads(n)
	if after := count(); after < n+1 {
		t.Fatalf("%d threads after starting %d spare ones (and the test's own)", after, n)
	}
}

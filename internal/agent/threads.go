package agent

import (
	"runtime"
	"sync"
)

// spareThreads is how many OS threads the agent starts with beyond what
// the Go runtime made by itself. The sandbox's task limit (RLIMIT_NPROC
// under gVisor, the pids cgroup elsewhere) counts the agent's threads with
// everything the sandbox runs, so a fork bomb can take every task the
// limit leaves. The Go runtime starts a thread whenever a goroutine
// blocks in a system call while others are runnable, and a thread it
// cannot start is fatal: the agent would die with the sandbox's processes
// at the limit. Threads made here stay idle in the runtime's pool and are
// reused before it asks the kernel for another.
const spareThreads = 8

// startSpareThreads makes n OS threads at once and leaves them idle in the
// Go runtime's pool: each goroutine holds its own thread (LockOSThread)
// until all n exist, then lets it go.
func startSpareThreads(n int) {
	var held, done sync.WaitGroup
	release := make(chan struct{})
	held.Add(n)
	done.Add(n)
	for i := 0; i < n; i++ {
		go func() {
			defer done.Done()
			runtime.LockOSThread()
			held.Done()
			<-release
			runtime.UnlockOSThread()
		}()
	}
	held.Wait()
	close(release)
	done.Wait()
}

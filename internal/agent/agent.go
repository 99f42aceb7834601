// Package agent is space-agent: it runs inside a sandbox and serves the
// protocol of internal/agentproto over the stream its runtime provides.
//
// Command line (Main):
//
//	--fd N        serve on an inherited listening socket (default
//	              $SPACE_AGENT_FD, for callers other than the runtimes,
//	              which pass --fd: the variable is scrubbed at start)
//	--socket PATH serve on a unix socket (tests, debugging)
//	--serial PATH serve one session at a time over a character device
//	              (a virtio-serial port), reopening it after each session
//	--root DIR    directory FILE operations are confined to (default "/")
//	-v            debug logging
//
// Every accepted connection carries one yamux server session; each yamux
// stream carries HTTP/1.1 (and WebSocket for attach). The host may
// reconnect any number of times; processes and their replay buffers
// outlive connections.
//
// Before a checkpoint the host asks the agent to quiesce (PathQuiesce): it
// drops every host connection and, on --socket, its listener and socket
// file, until a resume marker (socket path + ResumeSuffix) appears; after a
// restore or fork, PathRestored mixes host entropy into the kernel pool and
// takes a new hostname (see quiesce.go).
//
// The agent is its sandbox's PID 1 and reaps every process in it (see
// reaper.go). File operations resolve every path in the kernel with
// openat2(RESOLVE_IN_ROOT) against a descriptor of --root, so no path,
// symlink or concurrent rename can reach outside it (see fsroot.go).
//
// No other process of the sandbox can read the agent's memory, environment
// or descriptors or trace it: it is non-dumpable and its environment holds
// nothing of the runtime's (see harden.go).
package agent

import (
	"os"
	"sync/atomic"
)

// hardened is set once Main has made the process non-dumpable, so that
// runAs restores the flag after each credential switch (tests that embed
// the agent leave their own process as it is).
var hardened atomic.Bool

// Main parses the agent's flags and serves until the listener closes.
func Main(args []string) error {
	envFD := os.Getenv(EnvAgentFD)
	if err := harden(); err != nil {
		return err
	}
	hardened.Store(true)
	startSpareThreads(spareThreads)
	return serveMain(args, envFD)
}

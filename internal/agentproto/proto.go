// Package agentproto fixes the protocol between the host and space-agent.
//
// The runtime provides one byte stream (net.Conn) to the agent. The host runs
// a yamux client session over it and the agent a yamux server session; every
// yamux stream carries one HTTP/1.1 exchange (keep-alive allowed). Process
// attach is a WebSocket on such a stream using the frame format of package api.
//
// The agent is untrusted: code in the sandbox can kill or replace it. The host
// side (internal/agentclient) bounds every size and time it reads.
package agentproto

import "github.com/spacehq/space/api"

// HTTP paths served by the agent.
const (
	PathHealth = "/v1/health" // GET → Health

	PathExec = "/v1/exec" // POST ExecRequest → api.ExecResult (synchronous)

	PathProcs = "/v1/procs" // POST ProcStart → ProcInfo; GET → []ProcInfo
	// /v1/procs/{id}          GET → ProcInfo; DELETE → kill (if running) and forget
	// /v1/procs/{id}/attach   GET (WebSocket) ?stdout_offset=N&stderr_offset=M
	// /v1/procs/{id}/signal   POST api.SignalRequest

	// PathRestored: POST Restored → 204. The host calls it after every
	// restore or fork: the agent mixes the host's seed into the kernel
	// entropy pool, sets the hostname (fork) and the clock when it can.
	PathRestored = "/v1/restored"
	// PathQuiesce: POST → 204. Before a checkpoint: the agent closes its
	// listener and host connections (runtimes that cannot save host
	// sockets need this) until the runtime lets it listen again.
	PathQuiesce = "/v1/quiesce"

	PathFiles       = "/v1/files"        // GET ?path= → content; PUT ?path=&mode= (atomic replace) body=content; DELETE ?path=&recursive=1
	PathFilesStat   = "/v1/files/stat"   // GET ?path= → api.FileInfo
	PathFilesList   = "/v1/files/list"   // GET ?path= → api.FileList
	PathFilesMkdir  = "/v1/files/mkdir"  // POST api.MkdirRequest → api.FileInfo
	PathFilesRename = "/v1/files/rename" // POST api.RenameRequest
	PathFilesTar    = "/v1/files/tar"    // GET ?path= → tar stream of the dir/file; PUT ?path= body=tar → extracted below path
	// PathFilesWatch: GET ?path=&recursive=1 → NDJSON stream of
	// api.FileEvent, the first line {"type":"watching"} once armed; it
	// ends when the host goes away, or after a "remove"/"rename" event
	// of "." (the watched directory itself).
	PathFilesWatch = "/v1/files/watch"
	// PathFilesResolve: GET ?path=&leaf=follow|name → Resolved: the path
	// the sandbox's kernel reaches, every symlink on the way resolved
	// inside the root (the final component too with leaf=follow; with
	// leaf=name, the operation acts on the name itself, as write, remove,
	// rename and stat do). Missing components are kept as named.
	PathFilesResolve = "/v1/files/resolve"
)

// QueryExact, on any files route, makes the agent refuse every symlink on
// the way to the path (ELOOP → 400): the host sends a path it resolved
// with PathFilesResolve and had the policy decide, and a symlink planted
// since must fail the operation rather than move it elsewhere.
const QueryExact = "exact"

// Resolved is the answer to PathFilesResolve.
type Resolved struct {
	Path string `json:"path"`
}

// Every files route takes an optional user= query parameter ("name",
// "uid" or "uid:gid", resolved like ExecRequest.User): the agent performs
// the operation with that user's credentials, so the kernel's permission
// checks apply and new files belong to that user. Absent: root.
const QueryUser = "user"

// Limits the agent and host both enforce.
const (
	MaxPathLen       = 4096
	MaxJSONBody      = 1 << 20  // any JSON request or response body
	MaxArgs          = 4096     // argv + env entries
	DefaultRingBytes = 1 << 20  // replay buffer per output stream of a process
	DefaultSyncOut   = 1 << 20  // default cap per stream for synchronous exec
	MaxSyncOut       = 16 << 20 // max cap per stream for synchronous exec
	// MaxWatches caps the directories one recursive watch follows; past it
	// the stream reports "overflow" and new directories go unwatched.
	MaxWatches = 8192
	// MaxWatchLine caps one line of a watch stream (a 4096-byte name,
	// JSON-escaped, fits).
	MaxWatchLine = 32 << 10
)

// Health is the agent's answer to PathHealth.
type Health struct {
	Version string `json:"version"`
	Pid     int    `json:"pid"`
	// Watches is the number of open PathFilesWatch streams (tests check
	// that an abandoned watch is released).
	Watches int `json:"watches"`
}

// ExecRequest is a synchronous exec. Env is the complete environment
// ("K=V"); the host has already merged sandbox and request env.
type ExecRequest struct {
	Cmd     []string `json:"cmd"`
	Env     []string `json:"env"`
	Workdir string   `json:"workdir,omitempty"`
	User    string   `json:"user,omitempty"` // "name", "uid" or "uid:gid"; default root
	// Root, when set, is an absolute, clean directory of the sandbox the
	// process is chrooted into; Workdir, User (its /etc/passwd) and the
	// executable are resolved inside it.
	Root           string  `json:"root,omitempty"`
	Stdin          []byte  `json:"stdin,omitempty"`
	TimeoutSeconds float64 `json:"timeout_seconds,omitempty"`
	MaxOutputBytes int64   `json:"max_output_bytes,omitempty"`
}

// ProcStart starts a long-lived process whose output is kept in replay
// buffers until it is attached. ID is chosen by the host.
type ProcStart struct {
	ID      string   `json:"id"`
	Cmd     []string `json:"cmd"`
	Env     []string `json:"env"`
	Workdir string   `json:"workdir,omitempty"`
	User    string   `json:"user,omitempty"`
	Root    string   `json:"root,omitempty"` // as ExecRequest.Root
	TTY     bool     `json:"tty,omitempty"`
	Rows    uint16   `json:"rows,omitempty"`
	Cols    uint16   `json:"cols,omitempty"`
	// HoldForAttach keeps the output from the process's first byte for
	// the attach the caller makes next: until it arrives (or for the
	// agent's attach stall at most) the process waits on a full replay
	// buffer instead of overwriting output nobody has read yet.
	HoldForAttach bool `json:"hold_for_attach,omitempty"`
}

// ProcInfo describes a process the agent started.
type ProcInfo struct {
	ID      string          `json:"id"`
	Pid     int             `json:"pid"`
	Cmd     []string        `json:"cmd"`
	TTY     bool            `json:"tty"`
	Running bool            `json:"running"`
	Exit    *api.ExitStatus `json:"exit,omitempty"`
	// StdoutEnd and StderrEnd are the end offsets of the output so far
	// (bytes written to each stream since the start).
	StdoutEnd int64 `json:"stdout_end"`
	StderrEnd int64 `json:"stderr_end"`
}

// Restored is the body of PathRestored.
type Restored struct {
	// Seed is fresh host entropy (at least 32 bytes) to mix into the
	// kernel pool, so forked children never share random streams.
	Seed []byte `json:"seed"`
	// Hostname, when set, becomes the sandbox's hostname (a fork child
	// takes its own id).
	Hostname string `json:"hostname,omitempty"`
	// TimeUnixNano is the host's clock; the agent sets the sandbox clock
	// from it where it may (a microVM guest after a snapshot restore).
	TimeUnixNano int64 `json:"time_unix_nano"`
}

// Package api holds the wire types of the space REST API (/v1) and of the
// WebSocket attach protocol. The server, the Go SDK and the CLI all use these
// types, so the JSON shape is defined in exactly one place. The OpenAPI 3.1
// description of the same shapes is openapi.yaml beside this file.
package api

import "time"

// Error is the body of every non-2xx response: {"error":{"code","message"}}.
type Error struct {
	Error ErrorBody `json:"error"`
}

// ErrorBody names the problem. Code is stable: one of the Code… constants
// (errors.go), each with one HTTP status.
type ErrorBody struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

// Sandbox states.
const (
	StateCreating  = "creating"
	StateRunning   = "running"
	StatePaused    = "paused"
	StateStopping  = "stopping"
	StateStopped   = "stopped"
	StateStarting  = "starting"
	StateSuspended = "suspended"
	StateDeleting  = "deleting"
	StateDeleted   = "deleted"
	StateError     = "error"
)

// Operation kinds: one for each lifecycle verb, every verb run as a recorded
// Operation (docs/ARCHITECTURE.md, "How a request flows").
const (
	OpCreate  = "create"
	OpDelete  = "delete"
	OpStop    = "stop"
	OpStart   = "start"
	OpPause   = "pause"
	OpResume  = "resume"
	OpSuspend = "suspend"
	OpRestore = "restore"
	OpWake    = "wake"
	OpFork    = "fork"
)

// Operation states.
const (
	OpPending   = "pending"
	OpRunning   = "running"
	OpSucceeded = "succeeded"
	OpFailed    = "failed"
)

// Limits are the resource limits of a sandbox. Zero means "server default".
type Limits struct {
	CPUs      float64 `json:"cpus,omitempty"`       // CPU quota in cores (e.g. 0.5, 2)
	MemoryMiB int64   `json:"memory_mib,omitempty"` // memory+swap limit
	Pids      int64   `json:"pids,omitempty"`       // max tasks
	DiskMiB   int64   `json:"disk_mib,omitempty"`   // writable layer size
	OutputMiB int64   `json:"output_mib,omitempty"` // per-stream replay buffer of a command (reserved)
}

// IdlePolicy says what happens after a sandbox has seen no activity.
type IdlePolicy struct {
	AfterSeconds int64  `json:"after_seconds"`
	Action       string `json:"action"` // "pause" | "stop" | "suspend"
}

// Expiry actions (CreateSandboxRequest.OnExpiry).
const (
	ExpiryDelete  = "delete"
	ExpirySuspend = "suspend"
)

// CreateSandboxRequest is POST /v1/sandboxes.
type CreateSandboxRequest struct {
	Template   string            `json:"template,omitempty"` // "name:tag" or "sha256:…"; default "base:latest"
	Runtime    string            `json:"runtime,omitempty"`  // "auto" (default) or a registered runtime name
	Limits     Limits            `json:"limits,omitempty"`
	Env        map[string]string `json:"env,omitempty"`
	Workdir    string            `json:"workdir,omitempty"`
	User       string            `json:"user,omitempty"` // default user of execs and commands; overrides the template's
	Labels     map[string]string `json:"labels,omitempty"`
	TTLSeconds int64             `json:"ttl_seconds,omitempty"` // delete after this long; 0 = never
	// OnExpiry is what happens at the deadline TTLSeconds sets:
	// "delete" (default) or "suspend" (a runtime that cannot suspend stops
	// instead; either way the deadline is then cleared).
	OnExpiry string `json:"on_expiry,omitempty"`
	// AllPortsPublic makes every port of the sandbox reachable through the
	// server's ingress without its access token (E2B's allowPublicTraffic).
	AllPortsPublic bool        `json:"all_ports_public,omitempty"`
	Idle           *IdlePolicy `json:"idle,omitempty"`
	// Network is the egress policy; nil = the template's, else the server's
	// default (shipped default: no egress at all).
	Network *NetworkPolicy `json:"network,omitempty"`
	// Secrets names the tenant's secrets granted to the sandbox: each one's
	// env var holds a random placeholder the gateway replaces with the
	// value only on requests to the secret's hosts.
	Secrets []string `json:"secrets,omitempty"`
}

// Sandbox is the representation of one sandbox.
type Sandbox struct {
	ID             string            `json:"id"`
	Tenant         string            `json:"tenant,omitempty"` // the tenant of the key that created it ("" = default)
	State          string            `json:"state"`
	Runtime        string            `json:"runtime"`
	Isolation      string            `json:"isolation"` // what the runtime really provides, e.g. "namespaces+seccomp+landlock"
	Template       string            `json:"template"`  // as requested
	TemplateDigest string            `json:"template_digest"`
	Limits         Limits            `json:"limits"`
	Env            map[string]string `json:"env,omitempty"`
	Workdir        string            `json:"workdir,omitempty"`
	User           string            `json:"user,omitempty"` // default user of execs and commands ("" = root)
	Labels         map[string]string `json:"labels,omitempty"`
	TTLSeconds     int64             `json:"ttl_seconds,omitempty"`
	OnExpiry       string            `json:"on_expiry,omitempty"` // "delete" (default) | "suspend"
	AllPortsPublic bool              `json:"all_ports_public,omitempty"`
	Idle           *IdlePolicy       `json:"idle,omitempty"`
	Network        *NetworkPolicy    `json:"network,omitempty"` // the policy in force
	// PublicPorts are the ports reachable through the server without the
	// sandbox's access token (PUT /v1/sandboxes/{id}/ports/{port}).
	PublicPorts  []int      `json:"public_ports,omitempty"`
	Error        string     `json:"error,omitempty"`
	CreatedAt    time.Time  `json:"created_at"`
	UpdatedAt    time.Time  `json:"updated_at"`
	LastActiveAt time.Time  `json:"last_active_at"`
	ExpiresAt    *time.Time `json:"expires_at,omitempty"`
	OperationID  string     `json:"operation_id,omitempty"` // the operation that is acting on it now, if any
}

// SandboxList is GET /v1/sandboxes.
type SandboxList struct {
	Sandboxes []Sandbox `json:"sandboxes"`
}

// Phase is one timed step of an operation.
type Phase struct {
	Name       string  `json:"name"`
	DurationMS float64 `json:"duration_ms"`
}

// Operation is the persisted record of an asynchronous lifecycle request.
type Operation struct {
	ID         string     `json:"id"`
	Kind       string     `json:"kind"`
	SandboxID  string     `json:"sandbox_id"`
	State      string     `json:"state"`
	Error      *ErrorBody `json:"error,omitempty"`
	Phases     []Phase    `json:"phases"`
	CreatedAt  time.Time  `json:"created_at"`
	FinishedAt *time.Time `json:"finished_at,omitempty"`
	// Children are the ids of the sandboxes a fork creates (their records
	// exist from the moment the fork is accepted).
	Children []string `json:"children,omitempty"`
}

// Done reports whether the operation has finished (either way).
func (o *Operation) Done() bool { return o.State == OpSucceeded || o.State == OpFailed }

// ExecRequest is POST /v1/sandboxes/{id}/exec (synchronous) and the process
// part of POST /v1/sandboxes/{id}/commands.
type ExecRequest struct {
	Cmd     []string          `json:"cmd"`
	Env     map[string]string `json:"env,omitempty"`
	Workdir string            `json:"workdir,omitempty"`
	User    string            `json:"user,omitempty"` // "uid[:gid]" or names; default the sandbox's user, else root
	// Root, when set, is an absolute, clean path of a directory in the
	// sandbox that the process is chrooted into (a container image's tree:
	// the containerd shim runs each container so). Workdir, User (from
	// Root's /etc/passwd) and cmd[0] are then resolved inside it, and the
	// sandbox's default workdir and user do not apply.
	Root           string  `json:"root,omitempty"`
	Stdin          string  `json:"stdin,omitempty"` // sync exec only
	TimeoutSeconds float64 `json:"timeout_seconds,omitempty"`
	MaxOutputBytes int64   `json:"max_output_bytes,omitempty"` // sync exec only; per stream
	TTY            bool    `json:"tty,omitempty"`              // sessions only
	Rows           uint16  `json:"rows,omitempty"`
	Cols           uint16  `json:"cols,omitempty"`
}

// ExecResult is the synchronous exec response.
type ExecResult struct {
	ExitCode        int     `json:"exit_code"`
	Signal          string  `json:"signal,omitempty"`
	OOMKilled       bool    `json:"oom_killed,omitempty"`
	TimedOut        bool    `json:"timed_out,omitempty"`
	Stdout          string  `json:"stdout"`
	Stderr          string  `json:"stderr"`
	StdoutTruncated bool    `json:"stdout_truncated,omitempty"`
	StderrTruncated bool    `json:"stderr_truncated,omitempty"`
	DurationMS      float64 `json:"duration_ms"`
}

// Command session states.
const (
	CommandCreated = "created" // not yet attached, process not started
	CommandRunning = "running"
	CommandExited  = "exited"
)

// Command is a command session (POST /v1/sandboxes/{id}/commands).
type Command struct {
	ID          string      `json:"id"`
	SandboxID   string      `json:"sandbox_id"`
	Cmd         []string    `json:"cmd"`
	TTY         bool        `json:"tty"`
	State       string      `json:"state"`
	Pid         int         `json:"pid,omitempty"` // pid inside the sandbox
	Exit        *ExitStatus `json:"exit,omitempty"`
	AttachURL   string      `json:"attach_url,omitempty"`   // only in the create response
	AttachToken string      `json:"attach_token,omitempty"` // only in the create response / token refresh
	CreatedAt   time.Time   `json:"created_at"`
	// StartedAt is when the process started (first attach, or create for
	// a detached command); nil while created.
	StartedAt *time.Time `json:"started_at,omitempty"`
	// StdoutBytes and StderrBytes are how much the process has written to
	// each stream so far (the end offsets of its output; the replay buffer
	// keeps the last part), as the agent counted them when this answer was
	// made. Only while running: a reader of "the output so far" attaches
	// and stops at these offsets instead of following.
	StdoutBytes int64 `json:"stdout_bytes,omitempty"`
	StderrBytes int64 `json:"stderr_bytes,omitempty"`
}

// CommandList is GET /v1/sandboxes/{id}/commands.
type CommandList struct {
	Commands []Command `json:"commands"`
}

// ExitStatus is how a process ended.
type ExitStatus struct {
	ExitCode  int    `json:"exit_code"`
	Signal    string `json:"signal,omitempty"`
	OOMKilled bool   `json:"oom_killed,omitempty"`
	Reason    string `json:"reason,omitempty"` // human words, e.g. "killed by the OOM killer (memory limit 256 MiB)"
}

// SignalRequest is POST /v1/sandboxes/{id}/commands/{cid}/signal.
type SignalRequest struct {
	Signal string `json:"signal"` // "TERM", "KILL", "INT", "HUP", … or a number
}

// FileInfo describes one file inside a sandbox.
type FileInfo struct {
	Name    string    `json:"name"`
	Path    string    `json:"path"`
	Type    string    `json:"type"` // "file" | "dir" | "symlink" | "other"
	Size    int64     `json:"size"`
	Mode    uint32    `json:"mode"` // permission bits
	ModTime time.Time `json:"mod_time"`
	Target  string    `json:"target,omitempty"` // symlink target
	UID     uint32    `json:"uid"`              // owner
	GID     uint32    `json:"gid"`              // group
}

// FileList is GET /v1/sandboxes/{id}/files/list.
type FileList struct {
	Entries []FileInfo `json:"entries"`
}

// RenameRequest is POST /v1/sandboxes/{id}/files/rename.
type RenameRequest struct {
	From string `json:"from"`
	To   string `json:"to"`
	// User performs the rename as this sandbox user; empty means root.
	User string `json:"user,omitempty"`
}

// MkdirRequest is POST /v1/sandboxes/{id}/files/mkdir (always -p).
type MkdirRequest struct {
	Path string `json:"path"`
	Mode uint32 `json:"mode,omitempty"`
	// User performs the operation as this sandbox user ("name", "uid" or
	// "uid:gid", like ExecRequest.User); empty means root.
	User string `json:"user,omitempty"`
}

// WatchRequest is GET /v1/sandboxes/{id}/files/watch.
type WatchRequest struct {
	Path      string `json:"path"`
	Recursive bool   `json:"recursive,omitempty"`
	// User watches as this sandbox user: the directories must be readable
	// by it. Empty means root.
	User string `json:"user,omitempty"`
}

// FileEvent is one change under a watched directory, a line of the NDJSON
// stream of GET /v1/sandboxes/{id}/files/watch. The stream's first line is
// {"type":"watching"} once the watch is armed: every change after it is
// reported.
type FileEvent struct {
	Name string    `json:"name"` // path relative to the watched directory ("a/b.txt"; "." is the directory itself)
	Type string    `json:"type"` // one of the FileEvent* constants
	Time time.Time `json:"time"`
}

// FileEvent types. They follow fsnotify (and so E2B): the old name of a
// move is "rename", the new name "create"; writes are reported as they
// happen ("write" may repeat for one write call).
const (
	FileEventWatching = "watching" // the first line: the watch is armed (no name)
	FileEventCreate   = "create"
	FileEventWrite    = "write"
	FileEventRemove   = "remove"
	FileEventRename   = "rename"
	FileEventChmod    = "chmod"    // mode, owner, times or other attributes changed
	FileEventOverflow = "overflow" // events were lost (kernel queue full, or the watch cap reached); no name
)

// FileEventTypes are the types a change event may have (not "watching").
var FileEventTypes = []string{FileEventCreate, FileEventWrite, FileEventRemove, FileEventRename, FileEventChmod, FileEventOverflow}

// Template is an immutable root filesystem plus runtime defaults, addressed
// by digest and by tags. Digest covers the tree and Config: two templates
// with the same files but different defaults have different digests and
// share one stored tree (TreeDigest).
type Template struct {
	Digest     string         `json:"digest"`
	TreeDigest string         `json:"tree_digest"`
	Tags       []string       `json:"tags"`
	SizeBytes  int64          `json:"size_bytes"` // bytes of file content in the tree
	Source     string         `json:"source"`     // "debootstrap:bookworm", "dir", "tar", "oci:…", "build", "archive"
	Parent     string         `json:"parent,omitempty"`
	Config     TemplateConfig `json:"config"`
	// Layers is the provenance: the OCI layers an image was made of, or the
	// build steps that made it (each with the template it produced).
	Layers    []TemplateLayer `json:"layers,omitempty"`
	CreatedAt time.Time       `json:"created_at"`
	// UsedBy lists the sandboxes created from this template that still
	// exist (filled by inspect only).
	UsedBy []string `json:"used_by,omitempty"`
}

// TemplateConfig are the defaults a sandbox created from a template gets.
// Request values win over them (env merges key by key).
type TemplateConfig struct {
	Env     map[string]string `json:"env,omitempty"`
	Workdir string            `json:"workdir,omitempty"`
	User    string            `json:"user,omitempty"` // "uid[:gid]" or a name from the template's /etc/passwd
	Start   *StartCommand     `json:"start,omitempty"`
	// Network is the default egress policy of sandboxes created from the
	// template (a request's own policy replaces it whole).
	Network *NetworkPolicy `json:"network,omitempty"`
}

// StartCommand is started in the background when a sandbox is created from
// the template; creation completes only when Ready (if set) exits 0.
type StartCommand struct {
	Cmd []string `json:"cmd"`
	// Ready is run repeatedly (every ReadyIntervalMS) until it exits 0 or
	// ReadyTimeoutSeconds pass; then creation fails with its last output.
	Ready               []string `json:"ready,omitempty"`
	ReadyTimeoutSeconds float64  `json:"ready_timeout_seconds,omitempty"` // default 60
	ReadyIntervalMS     int64    `json:"ready_interval_ms,omitempty"`     // default 100
}

// TemplateLayer is one OCI layer or one build step of a template.
type TemplateLayer struct {
	// Digest is the OCI blob digest, or the template a build step produced.
	Digest    string `json:"digest"`
	SizeBytes int64  `json:"size_bytes,omitempty"`
	CreatedBy string `json:"created_by,omitempty"` // the step's instruction, e.g. "RUN make" (line 4)
	Cached    bool   `json:"cached,omitempty"`     // build steps: reused from the build cache
}

// TemplateList is GET /v1/templates.
type TemplateList struct {
	Templates []Template `json:"templates"`
}

// TagRequest is POST /v1/templates/{ref}/tags: point Tag at ref (moving it).
type TagRequest struct {
	Tag string `json:"tag"`
}

// PullRequest is POST /v1/templates/pull: import an image from a registry.
type PullRequest struct {
	Image    string   `json:"image"`              // e.g. "registry.local:5000/app:1.2"
	Tags     []string `json:"tags,omitempty"`     // space tags to apply
	Insecure bool     `json:"insecure,omitempty"` // plain HTTP registry (loopback always allowed)
}

// GCResult is POST /v1/templates/gc.
type GCResult struct {
	Removed    []string `json:"removed"` // template digests forgotten
	Trees      int      `json:"trees"`   // stored trees deleted
	BytesFreed int64    `json:"bytes_freed"`
}

// BuildEvent is one NDJSON line of POST /v1/templates/build. Exactly one of
// the groups is set: a step starting/finishing, output of a RUN step, or the
// final result (Template or Error).
type BuildEvent struct {
	Step      int        `json:"step,omitempty"` // 1-based
	Steps     int        `json:"steps,omitempty"`
	Line      int        `json:"line,omitempty"` // line in the build file
	Instr     string     `json:"instruction,omitempty"`
	Status    string     `json:"status,omitempty"` // "running" | "cached" | "done" | "failed"
	Output    string     `json:"output,omitempty"` // RUN output chunk (stdout+stderr interleaved)
	ExitCode  *int       `json:"exit_code,omitempty"`
	Digest    string     `json:"digest,omitempty"` // template produced by the step
	ElapsedMS float64    `json:"elapsed_ms,omitempty"`
	Template  *Template  `json:"template,omitempty"`
	Error     *ErrorBody `json:"error,omitempty"`
}

// RuntimeInfo is one entry of GET /v1/info.
type RuntimeInfo struct {
	Name        string            `json:"name"`
	Available   bool              `json:"available"`
	Reason      string            `json:"reason,omitempty"` // why not available
	Isolation   string            `json:"isolation"`
	Verbs       map[string]bool   `json:"verbs"`                  // lifecycle verb -> supported here
	VerbReasons map[string]string `json:"verb_reasons,omitempty"` // verb -> why not
	Details     map[string]string `json:"details,omitempty"`      // e.g. landlock_abi, cgroup_version
}

// Info is GET /v1/info.
type Info struct {
	Version     string        `json:"version"`
	AutoRuntime string        `json:"auto_runtime"`
	Runtimes    []RuntimeInfo `json:"runtimes"`
}

// CreateSandboxResponse is the 202 body of POST /v1/sandboxes.
type CreateSandboxResponse struct {
	Sandbox   Sandbox   `json:"sandbox"`
	Operation Operation `json:"operation"`
}

// CreateCommandRequest is POST /v1/sandboxes/{id}/commands. The process
// starts on the first attach, or at once when Detached is set (a background
// process that nobody needs to attach to; its output is still buffered).
type CreateCommandRequest struct {
	ExecRequest
	Detached bool `json:"detached,omitempty"`
}

// ForkRequest is POST /v1/sandboxes/{id}/fork.
type ForkRequest struct {
	Count int `json:"count,omitempty"` // 1 to MaxForkCount; 0 means 1
}

// Fork limits and the label that ties a fork child to its parent.
const (
	// MaxForkCount is the most children one fork request may ask for.
	MaxForkCount = 16
	// LabelForkOf is set on every fork child to its parent's id.
	LabelForkOf = "space.fork_of"
)

// SandboxStats is GET /v1/sandboxes/{id}/stats: one sample of a sandbox's resource use.
type SandboxStats struct {
	SandboxID      string    `json:"sandbox_id"`
	State          string    `json:"state"`
	Timestamp      time.Time `json:"timestamp"`
	CPUCount       float64   `json:"cpu_count"`    // cores the sandbox may use (its limit, else the host's cores)
	CPUUsedPct     float64   `json:"cpu_used_pct"` // of CPUCount, over the last ~1 s (0 when not running)
	CPUSeconds     float64   `json:"cpu_seconds"`  // cumulative
	MemUsedBytes   int64     `json:"mem_used_bytes"`
	MemTotalBytes  int64     `json:"mem_total_bytes"` // the memory limit, else host total
	MemCacheBytes  int64     `json:"mem_cache_bytes"` // page cache part of MemUsed where the runtime can tell, else 0
	Pids           int64     `json:"pids"`
	PidsMax        int64     `json:"pids_max,omitempty"`
	DiskUsedBytes  int64     `json:"disk_used_bytes"`  // writable layer in use
	DiskTotalBytes int64     `json:"disk_total_bytes"` // the disk limit, else 0 = unbounded
	NetRxBytes     int64     `json:"net_rx_bytes"`     // into the sandbox, from the gateway's counters
	NetTxBytes     int64     `json:"net_tx_bytes"`
}

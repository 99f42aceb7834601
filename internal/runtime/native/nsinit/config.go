package nsinit

// The host (package native) and the sandbox init (this package) agree on the
// file descriptors and the JSON configuration below. They are the only
// contract between the two halves of the native runtime.

// File descriptors of the init process as started by the host.
const (
	// FDAgentListener is the listening unix socket the agent serves on. The
	// host creates it so a restarted server can re-dial a live sandbox.
	FDAgentListener = 3
	// FDConfig is the read end of a pipe carrying one JSON Config. The init
	// blocks on it until the host has moved it into the sandbox's cgroups:
	// that read is the synchronisation point between host and child.
	FDConfig = 4
	// FDStatus is the write end of a pipe on which the init reports a setup
	// failure as text before exiting. It is close-on-exec in the final agent,
	// so the host sees EOF without data once setup succeeded.
	FDStatus = 5
)

// Environment values of EnvMarker.
const (
	// StageSetup: build the sandbox around this process, then re-exec.
	StageSetup = "1"
	// StageProbe: try an overlay mount inside a user namespace and exit; the
	// host uses it to measure what works before it offers the runtime.
	StageProbe = "probe"
	// stageServe marks the re-executed agent: the sandbox is complete.
	stageServe = "serve"
)

// EnvAgentFD is read by the agent: the fd of its listening socket.
const EnvAgentFD = "SPACE_AGENT_FD"

// Config is what the host sends the init on FDConfig. Paths are host paths,
// valid in the init's mount namespace before pivot_root.
type Config struct {
	// Lower is the uid-shifted template directory (overlay lowerdir).
	Lower string `json:"lower"`
	// Upper and Work live on the sandbox's writable disk.
	Upper string `json:"upper"`
	Work  string `json:"work"`
	// Root is an empty directory where the overlay is assembled.
	Root     string `json:"root"`
	Hostname string `json:"hostname"`
	// NoFile is RLIMIT_NOFILE (soft and hard) inside the sandbox.
	NoFile uint64 `json:"nofile"`
}

// ProbeConfig is what the host sends in StageProbe: directories for a test
// overlay mount.
type ProbeConfig struct {
	Lower  string `json:"lower"`
	Upper  string `json:"upper"`
	Work   string `json:"work"`
	Merged string `json:"merged"`
}

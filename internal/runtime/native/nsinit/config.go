package nsinit

// The host (package native) and the sandbox init (this package) agree on the
// file descriptors and the JSON configuration below. They are the only
// contract between the two halves of the native runtime.

// File descriptors of the init process as started by the host.
const (
	// FDAgentListener is the listening unix socket the agent serves on. The
	// host creates it so a restarted server can re-dial a live sandbox.
	FDAgentListener = 3
	// FDConfig is a unix socket on which the host sends one message: the
	// JSON Config with the layer descriptors attached (SCM_RIGHTS). The
	// init blocks on it until the host has moved it into the sandbox's
	// cgroups: that read is the synchronisation point between host and
	// child.
	FDConfig = 4
	// FDStatus is the write end of a pipe on which the init reports a setup
	// failure as text before exiting. It is close-on-exec in the final agent,
	// so the host sees EOF without data once setup succeeded.
	FDStatus = 5
	// FDAgentBinary is the binary the host execs as the init
	// (/proc/self/fd/6): space-nsinit, or space-agent itself in its
	// init-native role.
	FDAgentBinary = 6
	// FDLower, FDUpper, FDWork and FDRoot are where the init places the
	// O_PATH descriptors it received with its config: the overlay's layers
	// and the directory it is attached to. The host opens them through
	// /proc/<init>/root, so they name mounts of the init's own mount
	// namespace (overlayfs refuses layers from another namespace), and the
	// init, an unprivileged host uid, can use directories below the
	// server's private (0700) data directory it could not look up by path.
	FDLower = 7
	FDUpper = 8
	FDWork  = 9
	FDRoot  = 10
	// FDAgentExe is the space-agent binary the init execs once the
	// sandbox is built. Absent (closed), the init execs its own binary.
	FDAgentExe = 11
)

// LayerFDs is the number of descriptors sent with the config, placed at
// FDLower, FDUpper, FDWork, FDRoot.
const LayerFDs = 4

// Config is what the host sends the init on FDConfig.
type Config struct {
	Hostname string `json:"hostname"`
	// NoFile is RLIMIT_NOFILE (soft and hard) inside the sandbox.
	NoFile uint64 `json:"nofile"`
	// SpawnedUnixNano is when the host started the init, so init.log can
	// say how the start-up time divides (diagnostics only).
	SpawnedUnixNano int64 `json:"spawned,omitempty"`
	// ResolvConf is the content of the sandbox's /etc/resolv.conf
	// (hostnet.ResolvConf: the gateway is the only resolver); empty leaves
	// the file as the template has it.
	ResolvConf string `json:"resolv_conf,omitempty"`
}

// Package nsinit runs inside space-agent when the native runtime starts it as
// a sandbox's init: it finishes the sandbox (mounts, pivot_root, the
// confinement of package confine) before the agent serves.
//
// The host starts `space-agent init-native` (RoleSetup) in the sandbox's
// new namespaces; Setup builds the sandbox and execs the plain agent. The
// runtime's probe starts `space-agent probe-native` (RoleProbe).
package nsinit

// Roles: the first argument of space-agent that selects this package.
const (
	// RoleSetup: build the sandbox around this process, then exec the
	// agent (Setup).
	RoleSetup = "init-native"
	// RoleProbe: try an overlay mount inside a user namespace and exit; the
	// host uses it to measure what works before it offers the runtime.
	RoleProbe = "probe-native"
)

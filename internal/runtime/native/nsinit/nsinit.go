// Package nsinit runs inside space-agent when the native runtime starts it as
// a sandbox's init: it finishes the sandbox (mounts, pivot_root, security)
// before the agent serves.
package nsinit

import "os"

// EnvMarker is set by the native runtime on the init process it starts.
const EnvMarker = "SPACE_NSINIT"

// Enter does nothing unless the process was started as a native sandbox init.
func Enter() error {
	if os.Getenv(EnvMarker) == "" {
		return nil
	}
	return setup()
}

package nsinit

import (
	"fmt"

	ll "github.com/landlock-lsm/go-landlock/landlock/syscall"
	"golang.org/x/sys/unix"
)

// LandlockABI returns the Landlock ABI version of the running kernel, or 0
// when Landlock is unavailable.
func LandlockABI() int {
	v, err := ll.LandlockGetABIVersion()
	if err != nil {
		return 0
	}
	return v
}

// handledFS is every filesystem right the given ABI knows, so that rights
// newer kernels add are handled (and thereby restricted) too.
func handledFS(abi int) uint64 {
	rights := uint64(ll.AccessFSRefer - 1) // ABI 1: execute … make_sym
	if abi >= 2 {
		rights |= ll.AccessFSRefer
	}
	if abi >= 3 {
		rights |= ll.AccessFSTruncate
	}
	if abi >= 5 {
		rights |= ll.AccessFSIoctlDev
	}
	return rights
}

// fileRights are the rights that may be granted on a regular file.
const fileRights = ll.AccessFSExecute | ll.AccessFSWriteFile | ll.AccessFSReadFile | ll.AccessFSTruncate | ll.AccessFSIoctlDev

// restrictLandlock confines the calling thread (and, after execve, the
// agent and all its descendants) to the sandbox's own root: full access
// below "/", nothing outside it (descriptors and magic links that lead to
// host files), plus execute/read of the agent binary through exe. With ABI
// ≥ 6 it also scopes abstract unix sockets and signals to the sandbox.
// Best effort: a kernel without Landlock yields ABI 0 and no error, and the
// caller reports the ABI.
func restrictLandlock(exe int) (int, error) {
	abi := LandlockABI()
	if abi <= 0 {
		return 0, nil
	}
	attr := ll.RulesetAttr{HandledAccessFS: handledFS(abi)}
	if abi >= 6 {
		attr.Scoped = ll.ScopeAbstractUnixSocket | ll.ScopeSignal
	}
	ruleset, err := ll.LandlockCreateRuleset(&attr, 0)
	if err != nil {
		return abi, fmt.Errorf("landlock create ruleset (ABI %d): %w", abi, err)
	}
	defer unix.Close(ruleset)

	root, err := unix.Open("/", unix.O_PATH|unix.O_CLOEXEC|unix.O_DIRECTORY, 0)
	if err != nil {
		return abi, err
	}
	defer unix.Close(root)
	if err := ll.LandlockAddPathBeneathRule(ruleset, &ll.PathBeneathAttr{ParentFd: root, AllowedAccess: attr.HandledAccessFS}, 0); err != nil {
		return abi, fmt.Errorf("landlock rule for /: %w", err)
	}
	exeRights := uint64(ll.AccessFSExecute|ll.AccessFSReadFile) & attr.HandledAccessFS & fileRights
	if err := ll.LandlockAddPathBeneathRule(ruleset, &ll.PathBeneathAttr{ParentFd: exe, AllowedAccess: exeRights}, 0); err != nil {
		return abi, fmt.Errorf("landlock rule for the agent binary: %w", err)
	}
	if err := ll.LandlockRestrictSelf(ruleset, 0); err != nil {
		return abi, fmt.Errorf("landlock restrict self: %w", err)
	}
	return abi, nil
}

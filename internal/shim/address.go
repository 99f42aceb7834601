package shim

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
)

// SocketDir holds the shims' sockets: short, so every path stays far
// below the 108-byte limit of a unix socket address.
const SocketDir = "/run/space-shim"

// SocketDirEnv, set in containerd's environment (which its shims inherit),
// replaces SocketDir: a test's containerd keeps its shims' sockets in its
// own directory.
const SocketDirEnv = "SPACE_SHIM_SOCKET_DIR"

// socketDir is SocketDir or $SPACE_SHIM_SOCKET_DIR.
func socketDir() string {
	if d := os.Getenv(SocketDirEnv); d != "" {
		return d
	}
	return SocketDir
}

// maxSocketPath is the longest socket path containerd accepts (106 bytes:
// sun_path less the NUL and some room containerd keeps).
const maxSocketPath = 106

// SocketPath is the socket of the shim daemon that serves group (the CRI
// pod sandbox id, or the task id outside Kubernetes) in namespace ns:
// dir + a hash of both, so any id length gives a short path.
func SocketPath(dir, ns, group string) (string, error) {
	sum := sha256.Sum256([]byte(ns + "/" + group))
	p := filepath.Join(dir, hex.EncodeToString(sum[:16])+".sock")
	if len(p) > maxSocketPath {
		return "", fmt.Errorf("shim socket path %q is %d bytes, longer than %d", p, len(p), maxSocketPath)
	}
	return p, nil
}

// Address is what `start` prints: a plain unix:// URL (containerd 1.6
// through 2.x accept it; without the scheme 1.6 takes an abstract socket).
func Address(socket string) string { return "unix://" + socket }

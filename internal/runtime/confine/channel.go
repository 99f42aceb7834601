package confine

import (
	"fmt"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// HideChannel takes the agent's channel to the host out of every path of
// the agent's mount namespace, which all the sandbox's processes share,
// and returns agentArgs naming it through a descriptor only the agent
// holds instead. It runs in Self while the agent still has CAP_SYS_ADMIN
// in its own user namespace, after /proc of its pid namespace is mounted.
//
//   - --socket PATH (gvisor): the directory of PATH is a host directory
//     (runsc --host-uds=create turns a bind there into a socket on the
//     host, which the server dials). Any sandbox process could connect to
//     the agent there, or remove the socket and bind its own for the host
//     to dial. The agent keeps an O_PATH descriptor of the directory, and
//     an empty read-only tmpfs covers it; the agent binds, unlinks and
//     polls for its resume marker at /proc/self/fd/N/NAME, which resolves
//     through the agent's own descriptor table and so names nothing in any
//     other process (and the agent is non-dumpable: no other process can
//     follow /proc/<agent>/fd/N).
//   - --serial PATH (microvm): the virtio-serial port is a device node
//     only sandbox root may open, and sandbox root is every command run as
//     root. The agent keeps an O_PATH descriptor of the node and /dev/null
//     is bound over its path; the agent reopens the port (after each host
//     session) through /proc/self/fd/N.
//
// Other arguments are returned unchanged.
func HideChannel(agentArgs []string) ([]string, error) {
	out := append([]string(nil), agentArgs...)
	for i := 0; i < len(out); i++ {
		name, val, inline := strings.Cut(strings.TrimLeft(out[i], "-"), "=")
		if !strings.HasPrefix(out[i], "-") || (name != "socket" && name != "serial") {
			continue
		}
		vi := i
		if !inline {
			vi = i + 1
			if vi >= len(out) {
				return nil, fmt.Errorf("hide agent channel: %s without a value", out[i])
			}
			val = out[vi]
		}
		var hidden string
		var err error
		if name == "socket" {
			hidden, err = hideDir(val)
		} else {
			hidden, err = hideNode(val)
		}
		if err != nil {
			return nil, fmt.Errorf("hide agent channel %s: %w", val, err)
		}
		if inline {
			out[i] = "--" + name + "=" + hidden
		} else {
			out[vi] = hidden
			i++
		}
	}
	return out, nil
}

// hideDir covers the directory of sock and returns sock's name below a
// descriptor of the directory.
func hideDir(sock string) (string, error) {
	dir, base := filepath.Split(filepath.Clean(sock))
	fd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", err
	}
	if err := unix.Mount("tmpfs", dir, "tmpfs", unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "size=0,mode=555"); err != nil {
		unix.Close(fd)
		return "", fmt.Errorf("cover %s: %w", dir, err)
	}
	return "/proc/self/fd/" + strconv.Itoa(fd) + "/" + base, nil
}

// hideNode covers the device node path and returns a name of it through a
// descriptor.
func hideNode(path string) (string, error) {
	fd, err := unix.Open(path, unix.O_PATH|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", err
	}
	if err := unix.Mount("/dev/null", path, "", unix.MS_BIND, ""); err != nil {
		unix.Close(fd)
		return "", fmt.Errorf("cover %s: %w", path, err)
	}
	return "/proc/self/fd/" + strconv.Itoa(fd), nil
}

// channelFDs returns the descriptors HideChannel named in args.
func channelFDs(args []string) []int {
	var fds []int
	for _, a := range args {
		_, rest, ok := strings.Cut(a, "/proc/self/fd/")
		if !ok {
			continue
		}
		n, _, _ := strings.Cut(rest, "/")
		if fd, err := strconv.Atoi(n); err == nil {
			fds = append(fds, fd)
		}
	}
	return fds
}

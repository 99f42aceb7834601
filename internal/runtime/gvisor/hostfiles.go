package gvisor

import (
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/runtime/confine"
	"github.com/spacehq/space/internal/runtime/hostnet"
)

// writeHostFiles makes the hostname resolve inside the sandbox, as native
// does: /etc/hostname, and /etc/hosts gains the name. The sandbox owns
// /etc, so every path resolves inside root (openat2 RESOLVE_IN_ROOT): a
// symlink the sandbox planted cannot make the host write outside it.
// Best effort, like native's.
func writeHostFiles(root, hostname string) {
	dir, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return
	}
	defer unix.Close(dir)
	_ = writeInRoot(dir, "etc/hostname", []byte(hostname+"\n"))
	writeResolvConf(dir)
	hosts, err := readInRoot(dir, "etc/hosts", 1<<20)
	if err != nil && !os.IsNotExist(err) {
		return
	}
	for _, line := range strings.Split(string(hosts), "\n") {
		if f := strings.Fields(line); len(f) > 1 && slices.Contains(f[1:], hostname) {
			return
		}
	}
	if !strings.Contains(string(hosts), "localhost") {
		hosts = append(hosts, "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"...)
	}
	hosts = append(hosts, fmt.Sprintf("127.0.1.1\t%s\n", hostname)...)
	_ = writeInRoot(dir, "etc/hosts", hosts)
}

// writeResolvConf makes etc/resolv.conf in the root at dir name the
// gateway as the only resolver (hostnet.ResolvConf). A symlink in its place
// (systemd-resolved's stub, say) is removed, not followed; a file that
// already says the right thing is left alone, so the writable layer gets
// no copy of it.
func writeResolvConf(dir int) {
	const path = "etc/resolv.conf"
	if b, err := readInRoot(dir, path, 4096); err == nil && string(b) == hostnet.ResolvConf {
		return
	}
	err := writeInRoot(dir, path, []byte(hostnet.ResolvConf))
	if !errors.Is(err, unix.ELOOP) {
		return
	}
	etc, err := openInRoot(dir, "etc", unix.O_PATH|unix.O_DIRECTORY, 0)
	if err != nil {
		return
	}
	defer etc.Close()
	if unix.Unlinkat(int(etc.Fd()), "resolv.conf", 0) == nil {
		_ = writeInRoot(dir, path, []byte(hostnet.ResolvConf))
	}
}

func openInRoot(dir int, path string, flags uint64, mode uint64) (*os.File, error) {
	fd, err := unix.Openat2(dir, path, &unix.OpenHow{
		// O_NONBLOCK: a FIFO planted by the sandbox must not block the host.
		Flags:   flags | unix.O_CLOEXEC | unix.O_NOFOLLOW | unix.O_NONBLOCK,
		Mode:    mode,
		Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV,
	})
	if err != nil {
		return nil, &os.PathError{Op: "openat2", Path: path, Err: err}
	}
	return os.NewFile(uintptr(fd), path), nil
}

func readInRoot(dir int, path string, max int64) ([]byte, error) {
	f, err := openInRoot(dir, path, unix.O_RDONLY, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if fi, err := f.Stat(); err != nil || !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("%s is not a regular file", path)
	}
	b, err := io.ReadAll(io.LimitReader(f, max+1))
	if int64(len(b)) > max {
		return nil, fmt.Errorf("%s is larger than %d bytes", path, max)
	}
	return b, err
}

func writeInRoot(dir int, path string, data []byte) error {
	f, err := openInRoot(dir, path, unix.O_WRONLY|unix.O_CREAT|unix.O_TRUNC, 0o644)
	if err != nil {
		return err
	}
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG {
		return fmt.Errorf("%s is not a regular file", path)
	}
	// A file the host just created belongs to the host's root, who is
	// nobody inside: give it to sandbox root.
	if st.Uid == 0 {
		if err := f.Chown(confine.IDBase, confine.IDBase); err != nil {
			return err
		}
	}
	_, err = f.Write(data)
	return err
}

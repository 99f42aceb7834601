package agent

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/agentproto"
	"github.com/spacehq/space/internal/errdefs"
)

// defaultPath is added to a process environment that has no PATH.
const defaultPath = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// launch is a validated, resolved process description ready for ForkExec.
type launch struct {
	argv0 string
	argv  []string
	env   []string
	dir   string
	cred  *syscall.Credential
	// chroot, when set, is the directory (as the agent sees it) the child
	// chroots into before it changes to dir and execs argv0; dir and argv0
	// are then paths inside it.
	chroot string
}

// identity is a resolved "user" field.
type identity struct {
	uid, gid uint32
	groups   []uint32
	home     string
}

// prepare validates a process request and resolves its user, environment,
// working directory and executable. root, when set, is an absolute, clean
// directory of the sandbox the process is chrooted into (a container's
// image tree): user, workdir and executable are then resolved inside it.
func (a *Agent) prepare(cmd, env []string, workdir, user, root string, tty bool) (*launch, error) {
	if len(cmd) == 0 || cmd[0] == "" {
		return nil, fmt.Errorf("cmd is empty: %w", errdefs.ErrInvalidArgument)
	}
	if len(cmd)+len(env) > agentproto.MaxArgs {
		return nil, fmt.Errorf("%d argv+env entries exceed the limit of %d: %w", len(cmd)+len(env), agentproto.MaxArgs, errdefs.ErrInvalidArgument)
	}
	for _, s := range cmd {
		if strings.IndexByte(s, 0) >= 0 {
			return nil, fmt.Errorf("argument contains a NUL byte: %w", errdefs.ErrInvalidArgument)
		}
	}
	fsys, chroot, err := a.processRoot(root)
	if err != nil {
		return nil, err
	}
	if fsys != a.root {
		defer fsys.close()
	}
	id, err := a.resolveUserIn(fsys, user)
	if err != nil {
		return nil, err
	}
	stat := os.Stat
	if fsys != a.root {
		stat = fsys.statPath
	}

	l := &launch{argv: cmd, chroot: chroot}
	seen := map[string]bool{}
	for _, kv := range env {
		k, _, ok := strings.Cut(kv, "=")
		if !ok || k == "" || strings.IndexByte(kv, 0) >= 0 {
			return nil, fmt.Errorf("environment entry %q is not KEY=VALUE: %w", truncate(kv, 64), errdefs.ErrInvalidArgument)
		}
		seen[k] = true
		l.env = append(l.env, kv)
	}
	if !seen["PATH"] {
		l.env = append(l.env, defaultPath)
	}
	if !seen["HOME"] {
		l.env = append(l.env, "HOME="+id.home)
	}
	if tty && !seen["TERM"] {
		l.env = append(l.env, "TERM=xterm-256color")
	}

	switch {
	case workdir == "":
		l.dir = "/"
		if fi, err := stat(id.home); err == nil && fi.IsDir() {
			l.dir = id.home
		}
	default:
		if strings.IndexByte(workdir, 0) >= 0 || len(workdir) > agentproto.MaxPathLen {
			return nil, fmt.Errorf("invalid workdir: %w", errdefs.ErrInvalidArgument)
		}
		l.dir = filepath.Join("/", workdir)
		fi, err := stat(l.dir)
		if err != nil {
			return nil, fmt.Errorf("workdir %q does not exist: %w", l.dir, errdefs.ErrInvalidArgument)
		}
		if !fi.IsDir() {
			return nil, fmt.Errorf("workdir %q is not a directory: %w", l.dir, errdefs.ErrInvalidArgument)
		}
	}

	if user != "" {
		l.cred = &syscall.Credential{Uid: id.uid, Gid: id.gid, Groups: id.groups}
	}

	pathEnv := ""
	for _, kv := range l.env {
		if v, ok := strings.CutPrefix(kv, "PATH="); ok {
			pathEnv = v
		}
	}
	l.argv0, err = lookPath(stat, cmd[0], pathEnv, l.dir)
	if err != nil {
		return nil, err
	}
	return l, nil
}

// lookPath finds the executable for name like execvp would.
func lookPath(stat func(string) (os.FileInfo, error), name, pathEnv, dir string) (string, error) {
	if strings.Contains(name, "/") {
		p := name
		if !filepath.IsAbs(p) {
			p = filepath.Join(dir, p)
		}
		if err := checkExecutable(stat, p); err != nil {
			return "", fmt.Errorf("%s: %w", name, err)
		}
		return p, nil
	}
	for _, d := range filepath.SplitList(pathEnv) {
		if d == "" {
			d = "."
		}
		if !filepath.IsAbs(d) {
			d = filepath.Join(dir, d)
		}
		p := filepath.Join(d, name)
		if checkExecutable(stat, p) == nil {
			return p, nil
		}
	}
	return "", fmt.Errorf("executable %q not found in PATH: %w", truncate(name, 256), errdefs.ErrNotFound)
}

func checkExecutable(stat func(string) (os.FileInfo, error), p string) error {
	fi, err := stat(p)
	if err != nil {
		return fmt.Errorf("no such file: %w", errdefs.ErrNotFound)
	}
	if !fi.Mode().IsRegular() || fi.Mode().Perm()&0o111 == 0 {
		return fmt.Errorf("not an executable file: %w", errdefs.ErrUnprocessable)
	}
	return nil
}

// spawnError maps a ForkExec failure to a sentinel.
func spawnError(argv0 string, err error) error {
	switch {
	case errors.Is(err, unix.ENOENT):
		return fmt.Errorf("exec %s: %w: %w", argv0, err, errdefs.ErrNotFound)
	case errors.Is(err, unix.EACCES), errors.Is(err, unix.EPERM), errors.Is(err, unix.ENOEXEC),
		errors.Is(err, unix.ENOTDIR), errors.Is(err, unix.ELOOP), errors.Is(err, unix.ETXTBSY):
		return fmt.Errorf("exec %s: %w: %w", argv0, err, errdefs.ErrUnprocessable)
	case errors.Is(err, unix.EAGAIN), errors.Is(err, unix.ENOMEM):
		return fmt.Errorf("exec %s: %v (process or memory limit): %w", argv0, err, errdefs.ErrUnavailable)
	case errors.Is(err, unix.E2BIG), errors.Is(err, unix.EINVAL):
		return fmt.Errorf("exec %s: %w: %w", argv0, err, errdefs.ErrInvalidArgument)
	}
	return fmt.Errorf("exec %s: %w", argv0, err)
}

// resolveUser resolves "", "name", "uid", "name:group" or "uid:gid" against
// <root>/etc/passwd and <root>/etc/group. Unknown names are an error; unknown
// numeric ids are allowed (gid defaults to the uid, never to root's group).
func (a *Agent) resolveUser(spec string) (*identity, error) {
	return a.resolveUserIn(a.root, spec)
}

// resolveUserIn is resolveUser against the databases of the tree r.
func (a *Agent) resolveUserIn(r *fsRoot, spec string) (*identity, error) {
	passwd := readDB(r, "etc/passwd")
	if spec == "" {
		home := "/root"
		if e, ok := lookupPasswd(passwd, "0"); ok && e[5] != "" {
			home = e[5]
		}
		return &identity{home: home}, nil
	}
	if len(spec) > 256 || strings.IndexByte(spec, 0) >= 0 {
		return nil, fmt.Errorf("invalid user: %w", errdefs.ErrInvalidArgument)
	}
	groupDB := readDB(r, "etc/group")
	userPart, groupPart, hasGroup := strings.Cut(spec, ":")

	id := &identity{home: "/"}
	name := ""
	entry, found := lookupPasswd(passwd, userPart)
	if uid, err := parseID(userPart); err == nil {
		id.uid, id.gid = uid, uid
	} else if !found {
		return nil, fmt.Errorf("unknown user %q (not in /etc/passwd): %w", truncate(userPart, 64), errdefs.ErrInvalidArgument)
	}
	if found {
		uid, err1 := parseID(entry[2])
		gid, err2 := parseID(entry[3])
		if err1 != nil || err2 != nil {
			return nil, fmt.Errorf("malformed /etc/passwd entry for %q: %w", truncate(userPart, 64), errdefs.ErrUnprocessable)
		}
		id.uid, id.gid, name = uid, gid, entry[0]
		if entry[5] != "" {
			id.home = entry[5]
		}
	}
	if hasGroup {
		gid, err := parseID(groupPart)
		if err != nil {
			g, ok := lookupGroup(groupDB, groupPart)
			if !ok {
				return nil, fmt.Errorf("unknown group %q (not in /etc/group): %w", truncate(groupPart, 64), errdefs.ErrInvalidArgument)
			}
			if gid, err = parseID(g[2]); err != nil {
				return nil, fmt.Errorf("malformed /etc/group entry for %q: %w", truncate(groupPart, 64), errdefs.ErrUnprocessable)
			}
		}
		id.gid = gid
	}
	id.groups = []uint32{}
	if name != "" {
		for _, g := range groupDB {
			for _, m := range strings.Split(g[3], ",") {
				if m == name {
					if gid, err := parseID(g[2]); err == nil && gid != id.gid {
						id.groups = append(id.groups, gid)
					}
				}
			}
		}
	}
	return id, nil
}

// parseID parses a uid/gid, refusing -1 (which means "unchanged" to the kernel).
func parseID(s string) (uint32, error) {
	n, err := strconv.ParseUint(s, 10, 32)
	if err != nil || n == 1<<32-1 {
		return 0, fmt.Errorf("invalid id %q", s)
	}
	return uint32(n), nil
}

// readDB reads a colon-separated database (passwd, group) through the root;
// a missing or unreadable file reads as empty.
func readDB(r *fsRoot, rel string) [][]string {
	b, err := r.readSmall(rel, 4<<20)
	if err != nil {
		return nil
	}
	var out [][]string
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(make([]byte, 4096), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		f := strings.Split(line, ":")
		for len(f) < 7 {
			f = append(f, "")
		}
		out = append(out, f)
	}
	return out
}

// lookupPasswd finds a passwd entry by name, or by uid if key is numeric.
func lookupPasswd(db [][]string, key string) ([]string, bool) {
	for _, e := range db {
		if e[0] == key {
			return e, true
		}
	}
	if _, err := parseID(key); err == nil {
		for _, e := range db {
			if e[2] == key {
				return e, true
			}
		}
	}
	return nil, false
}

func lookupGroup(db [][]string, name string) ([]string, bool) {
	for _, e := range db {
		if e[0] == name {
			return e, true
		}
	}
	return nil, false
}

// processRoot validates a process's root ("" = the sandbox's own) and
// opens it as the tree its user, workdir and executable are resolved in.
// It returns a.root itself for "", else a new fsRoot the caller closes and
// the path to chroot into. The path is resolved inside the sandbox root
// (RESOLVE_IN_ROOT), so a symlink in it cannot lead elsewhere.
func (a *Agent) processRoot(root string) (*fsRoot, string, error) {
	if root == "" {
		return a.root, "", nil
	}
	switch {
	case len(root) > agentproto.MaxPathLen || strings.IndexByte(root, 0) >= 0:
		return nil, "", fmt.Errorf("root is not a valid path: %w", errdefs.ErrInvalidArgument)
	case !path.IsAbs(root):
		return nil, "", fmt.Errorf("root %q is not an absolute path: %w", truncate(root, 256), errdefs.ErrInvalidArgument)
	case path.Clean(root) != root:
		return nil, "", fmt.Errorf("root %q is not a clean path (no \"..\", \".\", \"//\" or trailing \"/\"): %w", truncate(root, 256), errdefs.ErrInvalidArgument)
	case root == "/":
		return a.root, "", nil
	}
	fd, err := a.root.open(root[1:], unix.O_PATH|unix.O_DIRECTORY)
	if err != nil {
		if errors.Is(err, unix.ENOTDIR) {
			return nil, "", fmt.Errorf("root %q is not a directory: %w", truncate(root, 256), errdefs.ErrInvalidArgument)
		}
		if errors.Is(err, unix.ENOENT) {
			return nil, "", fmt.Errorf("root %q does not exist: %w", truncate(root, 256), errdefs.ErrInvalidArgument)
		}
		return nil, "", fsError("open root", root, err)
	}
	return &fsRoot{fd: fd}, filepath.Join(a.cfg.Root, root), nil
}

// statPath stats the absolute path p of the tree r, following symlinks
// inside it.
func (r *fsRoot) statPath(p string) (os.FileInfo, error) {
	rel, err := cleanPath(p)
	if err != nil {
		return nil, err
	}
	fd, err := r.open(rel, unix.O_PATH)
	if err != nil {
		return nil, &os.PathError{Op: "stat", Path: p, Err: err}
	}
	f := os.NewFile(uintptr(fd), p)
	defer f.Close()
	return f.Stat()
}

// truncate shortens s for error messages.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

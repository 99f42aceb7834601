package template

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
)

// The base template's unprivileged account, the one E2B's SDKs and the
// code written against them assume ("user", uid and gid 1000, home
// /home/user). Its password is locked ("!"): it is reached with the user
// field of an exec or a file operation, never by logging in.
const (
	baseUserName  = "user"
	baseUserID    = 1000
	baseUserHome  = "home/user"
	baseUserShell = "/bin/bash"
)

// baseUserLines are the account's entries, one per database. The shadow
// entry leaves the date of the last change empty (aging disabled) so that
// every host builds the same bytes, hence the same template digest.
var baseUserLines = []struct{ file, line string }{
	{"etc/passwd", fmt.Sprintf("%s:x:%d:%d::/%s:%s", baseUserName, baseUserID, baseUserID, baseUserHome, baseUserShell)},
	{"etc/group", fmt.Sprintf("%s:x:%d:", baseUserName, baseUserID)},
	{"etc/shadow", baseUserName + ":!::0:99999:7:::"},
	{"etc/gshadow", baseUserName + ":!::"},
}

// ensureBaseUser makes the base account exist in the root filesystem at
// root: its passwd, group, shadow and gshadow entries (an entry of that
// name that differs is replaced; other entries are kept), and its home,
// owned by it, mode 0755, with the files of /etc/skel. With apply false it
// changes nothing and only reports whether everything is already so. It is
// idempotent, and each database is replaced by rename, so a concurrent
// reader sees the old file or the new one.
func ensureBaseUser(root string, apply bool) (ok bool, err error) {
	ok = true
	for _, e := range baseUserLines {
		p := filepath.Join(root, e.file)
		b, err := os.ReadFile(p)
		if errors.Is(err, fs.ErrNotExist) && (e.file == "etc/gshadow") {
			continue // optional database
		}
		if err != nil {
			return false, err
		}
		lines := strings.Split(strings.TrimSuffix(string(b), "\n"), "\n")
		if len(b) == 0 {
			lines = nil
		}
		idx := -1
		for i, l := range lines {
			name, rest, _ := strings.Cut(l, ":")
			if name == baseUserName {
				idx = i
			} else if e.file == "etc/passwd" || e.file == "etc/group" {
				// The id must be free for another name to keep its own.
				if f := strings.Split(rest, ":"); len(f) >= 2 && f[1] == fmt.Sprint(baseUserID) {
					return false, fmt.Errorf("%s: id %d belongs to %q, not %q", e.file, baseUserID, name, baseUserName)
				}
			}
		}
		if idx >= 0 && lines[idx] == e.line {
			continue
		}
		ok = false
		if !apply {
			continue
		}
		if idx >= 0 {
			lines[idx] = e.line
		} else {
			lines = append(lines, e.line)
		}
		if err := replaceFile(p, []byte(strings.Join(lines, "\n")+"\n")); err != nil {
			return false, err
		}
	}
	home := filepath.Join(root, baseUserHome)
	fi, err := os.Lstat(home)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		ok = false
		if !apply {
			return false, nil
		}
		if err := os.MkdirAll(filepath.Dir(home), 0o755); err != nil {
			return false, err
		}
		if err := os.Mkdir(home, 0o755); err != nil {
			return false, err
		}
		if err := copySkel(filepath.Join(root, "etc", "skel"), home); err != nil {
			return false, err
		}
	case err != nil:
		return false, err
	case !fi.IsDir():
		return false, fmt.Errorf("/%s exists and is not a directory", baseUserHome)
	default:
		st := fi.Sys().(*syscall.Stat_t)
		if st.Uid == baseUserID && st.Gid == baseUserID && fi.Mode().Perm() == 0o755 {
			return ok, nil
		}
		ok = false
		if !apply {
			return false, nil
		}
	}
	if err := os.Chmod(home, 0o755); err != nil {
		return false, err
	}
	return ok, os.Lchown(home, baseUserID, baseUserID)
}

// copySkel copies the regular files of skel (a missing skel is empty) into
// home, owned by the account.
func copySkel(skel, home string) error {
	ents, err := os.ReadDir(skel)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	for _, e := range ents {
		if !e.Type().IsRegular() {
			continue
		}
		b, err := os.ReadFile(filepath.Join(skel, e.Name()))
		if err != nil {
			return err
		}
		dst := filepath.Join(home, e.Name())
		if err := os.WriteFile(dst, b, 0o644); err != nil {
			return err
		}
		if err := os.Lchown(dst, baseUserID, baseUserID); err != nil {
			return err
		}
	}
	return nil
}

// replaceFile replaces p with data by rename, keeping p's mode and owner.
func replaceFile(p string, data []byte) error {
	fi, err := os.Stat(p)
	if err != nil {
		return err
	}
	st := fi.Sys().(*syscall.Stat_t)
	tmp := p + ".space-new"
	err = writeFileSync(tmp, data, fi.Mode().Perm())
	if err == nil {
		err = os.Chown(tmp, int(st.Uid), int(st.Gid))
	}
	if err == nil {
		err = os.Chmod(tmp, fi.Mode().Perm()) // exact, whatever the umask
	}
	if err == nil {
		err = os.Rename(tmp, p)
	}
	if err != nil {
		os.Remove(tmp)
	}
	return err
}

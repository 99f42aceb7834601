package native

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime"
)

var _ runtime.TemplatePreparer = (*Runtime)(nil)

// PrepareTemplate implements runtime.TemplatePreparer: it builds the
// uid-shifted copy of a template tree that sandboxes use as their lower
// layer, so the first create from it does not pay for the copy.
func (r *Runtime) PrepareTemplate(ctx context.Context, treeDigest, rootfs string) error {
	if _, err := r.ensureShiftedRootfs(ctx, rootfs, treeDigest); err != nil {
		return fmt.Errorf("native: prepare template %s: %w", treeDigest, err)
	}
	return nil
}

// ForgetTemplate implements runtime.TemplatePreparer: it removes the
// shifted copy of a tree. It refuses with errdefs.ErrConflict while a
// sandbox of this runtime records the copy as its lower layer (every
// sandbox from Create until Destroy), and a sandbox that is starting holds
// the copy (acquireRootfs) until its overlay is mounted, so a running
// overlay never loses its lower layer.
func (r *Runtime) ForgetTemplate(ctx context.Context, treeDigest string) error {
	name, err := rootfsName(treeDigest)
	if err != nil {
		return err
	}
	unlock, err := r.lockRootfs(ctx, name, unix.LOCK_EX)
	if err != nil {
		return err
	}
	defer unlock()
	if users := r.templateUsers(name); len(users) > 0 {
		return fmt.Errorf("native: template %s is the root of sandbox(es) %s: %w", treeDigest, strings.Join(users, ", "), errdefs.ErrConflict)
	}
	base := r.rootfsBase()
	dst := filepath.Join(base, name)
	if _, err := os.Lstat(dst); err == nil {
		// Move it out of the way first so that nothing finds a half-removed
		// copy; a crash leaves a .tmp- directory that Sweep removes.
		tmp, err := os.MkdirTemp(base, ".tmp-"+name+"-")
		if err != nil {
			return err
		}
		// unix.Rename: os.Rename refuses to replace a directory, even an
		// empty one.
		if err := unix.Rename(dst, tmp); err != nil {
			os.Remove(tmp)
			return fmt.Errorf("native: forget template %s: %w", treeDigest, err)
		}
		if err := os.RemoveAll(tmp); err != nil {
			return fmt.Errorf("native: forget template %s: %w", treeDigest, err)
		}
	} else if !errors.Is(err, os.ErrNotExist) {
		return err
	}
	if err := os.Remove(srcRecord(base, name)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	// Waiters on the old lock file notice it is gone (lockRootfs).
	if err := os.Remove(filepath.Join(base, "."+name+".lock")); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// templateUsers lists the sandboxes whose recorded lower layer is the
// shifted copy name.
func (r *Runtime) templateUsers(name string) []string {
	ents, _ := os.ReadDir(r.sandboxesDir())
	var out []string
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join(r.sandboxesDir(), e.Name(), "template"))
		if err == nil && strings.TrimSpace(string(b)) == name {
			out = append(out, e.Name())
		}
	}
	sort.Strings(out)
	return out
}

// recordTemplate writes the name of the sandbox's shifted template copy
// into its directory, before the copy is used, for ForgetTemplate.
func (i *instance) recordTemplate() error {
	name, err := rootfsName(i.spec.TemplateDigest)
	if err != nil {
		return err
	}
	if b, err := os.ReadFile(i.templateRef()); err == nil && string(b) == name+"\n" {
		return nil
	}
	tmp := i.templateRef() + ".tmp"
	if err := os.WriteFile(tmp, []byte(name+"\n"), 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, i.templateRef())
}

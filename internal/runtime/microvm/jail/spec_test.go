package jail

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spacehq/space/internal/errdefs"
)

func TestUID(t *testing.T) {
	a, b := UID("sb-one"), UID("sb-two")
	if a != UID("sb-one") {
		t.Fatal("UID is not deterministic")
	}
	if a == b {
		t.Errorf("two ids share uid %d (possible, but not for these)", a)
	}
	for _, u := range []uint32{a, b, UID(""), UID(strings.Repeat("x", 100))} {
		if u < UIDBase || u >= UIDBase+UIDRange {
			t.Errorf("uid %d outside [%d, %d)", u, UIDBase, UIDBase+UIDRange)
		}
	}
}

// TestSpecValidation: every malformed spec is refused before anything is
// created, with an error that names the problem and wraps the right
// sentinel.
func TestSpecValidation(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "kernel")
	if err := os.WriteFile(file, []byte("k"), 0o644); err != nil {
		t.Fatal(err)
	}
	secret := filepath.Join(dir, "secret")
	if err := os.WriteFile(secret, []byte("s"), 0o600); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(dir, "link")
	if err := os.Symlink(dir, link); err != nil {
		t.Fatal(err)
	}
	comma := filepath.Join(dir, "a,b")
	if err := os.Mkdir(comma, 0o755); err != nil {
		t.Fatal(err)
	}
	qemu := "/usr/bin/true" // any program under /usr
	good := func() Spec {
		return Spec{ID: "sb-1", Argv: []string{qemu}, ReadOnly: []string{"/usr", file}, Writable: []string{dir + "/w"},
			Limits: Limits{MemoryBytes: 1 << 30, CPUs: 1}}
	}
	if err := os.Mkdir(dir+"/w", 0o755); err != nil {
		t.Fatal(err)
	}
	s := good()
	if err := s.normalize(); err != nil {
		t.Fatalf("good spec refused: %v", err)
	}
	if s.UID != UID("sb-1") || s.GID != s.UID || s.Limits.Pids != DefaultPids {
		t.Errorf("defaults: uid %d gid %d pids %d", s.UID, s.GID, s.Limits.Pids)
	}
	cases := []struct {
		name string
		edit func(*Spec)
		want string
		is   error
	}{
		{"bad id", func(s *Spec) { s.ID = "../x" }, `id "../x"`, errdefs.ErrInvalidArgument},
		{"empty id", func(s *Spec) { s.ID = "" }, `id ""`, errdefs.ErrInvalidArgument},
		{"relative read-only", func(s *Spec) { s.ReadOnly = append(s.ReadOnly, "usr/lib") }, `read-only path "usr/lib" is relative`, errdefs.ErrInvalidArgument},
		{"relative writable", func(s *Spec) { s.Writable = []string{"w"} }, `writable path "w" is relative`, errdefs.ErrInvalidArgument},
		{"unclean", func(s *Spec) { s.ReadOnly = append(s.ReadOnly, "/usr/../etc") }, "not clean", errdefs.ErrInvalidArgument},
		{"comma", func(s *Spec) { s.Writable = []string{comma} }, "has a comma", errdefs.ErrInvalidArgument},
		{"missing", func(s *Spec) { s.ReadOnly = append(s.ReadOnly, dir+"/initrd") }, dir + `/initrd`, errdefs.ErrNotFound},
		{"root", func(s *Spec) { s.ReadOnly = append(s.ReadOnly, "/") }, "host's root", errdefs.ErrInvalidArgument},
		{"proc", func(s *Spec) { s.ReadOnly = append(s.ReadOnly, "/proc/1") }, "under /proc", errdefs.ErrInvalidArgument},
		{"dev as a bind", func(s *Spec) { s.Writable = []string{"/dev/shm"} }, "under /dev", errdefs.ErrInvalidArgument},
		{"unreadable", func(s *Spec) { s.ReadOnly = append(s.ReadOnly, secret) }, "not readable by the jail's uid", errdefs.ErrInvalidArgument},
		{"writable symlink", func(s *Spec) { s.Writable = []string{link} }, "is a symlink", errdefs.ErrInvalidArgument},
		{"twice", func(s *Spec) { s.Writable = []string{file} }, "both read-only and writable", errdefs.ErrInvalidArgument},
		{"device not char", func(s *Spec) { s.Devices = []string{"/dev/shm"} }, "not a character device", errdefs.ErrInvalidArgument},
		{"device outside dev", func(s *Spec) { s.Devices = []string{secret} }, "not under /dev", errdefs.ErrInvalidArgument},
		{"base device listed", func(s *Spec) { s.Devices = []string{"/dev/null"} }, "always there", errdefs.ErrInvalidArgument},
		{"missing device", func(s *Spec) { s.Devices = []string{"/dev/no-such-dev"} }, "/dev/no-such-dev", errdefs.ErrNotFound},
		{"no argv", func(s *Spec) { s.Argv = nil }, "empty argv", errdefs.ErrInvalidArgument},
		{"relative program", func(s *Spec) { s.Argv = []string{"qemu"} }, `program path "qemu" is relative`, errdefs.ErrInvalidArgument},
		{"program outside", func(s *Spec) { s.Argv = []string{file}; s.ReadOnly = []string{"/usr"} }, "under none of the read-only paths", errdefs.ErrInvalidArgument},
		{"no memory", func(s *Spec) { s.Limits.MemoryBytes = 0 }, "memory limit", errdefs.ErrInvalidArgument},
		{"no cpu", func(s *Spec) { s.Limits.CPUs = 0 }, "cpu limit", errdefs.ErrInvalidArgument},
		{"negative pids", func(s *Spec) { s.Limits.Pids = -1 }, "pids limit", errdefs.ErrInvalidArgument},
		{"too few pids", func(s *Spec) { s.Limits.Pids = 4 }, "at least 16", errdefs.ErrInvalidArgument},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s := good()
			c.edit(&s)
			// Start validates before it creates anything; the agent
			// binary does not even exist.
			_, err := Start("/nonexistent-agent", s)
			if err == nil {
				t.Fatal("accepted")
			}
			if !strings.Contains(err.Error(), c.want) || !errors.Is(err, c.is) {
				t.Errorf("error %q: want it to contain %q and wrap %v", err, c.want, c.is)
			}
		})
	}
	if ids := CgroupIDs(); contains(ids, "sb-1") {
		t.Errorf("a refused spec left a cgroup: %v", ids)
	}
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

func TestPlanMergedUsr(t *testing.T) {
	paths, err := QEMUPaths("/usr/bin/true")
	if err != nil {
		t.Fatal(err)
	}
	s := Spec{ID: "plan", Argv: []string{"/usr/bin/true"}, ReadOnly: paths, Limits: Limits{MemoryBytes: 1 << 20, CPUs: 1}}
	if err := s.normalize(); err != nil {
		t.Fatal(err)
	}
	p, err := makePlan(&s)
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range []string{"/lib", "/lib64"} {
		if target, err := os.Readlink(l); err == nil {
			found := false
			for _, pl := range p.Links {
				found = found || (pl.Path == l && pl.Target == target)
			}
			if !found {
				t.Errorf("host link %s → %s is not recreated: %+v", l, target, p.Links)
			}
		}
	}
	if len(p.Devices) != len(baseDevices) {
		t.Errorf("devices %+v", p.Devices)
	}
	for i := 1; i < len(p.Binds); i++ {
		if p.Binds[i-1].Path >= p.Binds[i].Path {
			t.Errorf("binds not sorted parents first: %+v", p.Binds)
		}
	}
}

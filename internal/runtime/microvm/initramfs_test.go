package microvm

import (
	"compress/gzip"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime/microvm/vminit"
)

type cpioEntry struct {
	name string
	mode uint32
	rdev [2]uint32
	data []byte
}

// readNewc parses a newc archive the way the kernel does (8-hex fields,
// name and data padded to 4 bytes) up to the trailer.
func readNewc(t *testing.T, r io.Reader) []cpioEntry {
	t.Helper()
	b, err := io.ReadAll(r)
	if err != nil {
		t.Fatal(err)
	}
	field := func(hdr []byte, i int) uint32 {
		v, err := strconv.ParseUint(string(hdr[6+8*i:6+8*i+8]), 16, 32)
		if err != nil {
			t.Fatalf("header field %d: %v", i, err)
		}
		return uint32(v)
	}
	align := func(n int) int { return (n + 3) &^ 3 }
	var out []cpioEntry
	off := 0
	for {
		if off+110 > len(b) || string(b[off:off+6]) != "070701" {
			t.Fatalf("bad header at %d", off)
		}
		hdr := b[off : off+110]
		size, nameLen := int(field(hdr, 6)), int(field(hdr, 11))
		name := string(b[off+110 : off+110+nameLen-1])
		off = align(off + 110 + nameLen)
		if name == "TRAILER!!!" {
			return out
		}
		out = append(out, cpioEntry{name: name, mode: field(hdr, 1), rdev: [2]uint32{field(hdr, 9), field(hdr, 10)}, data: b[off : off+size]})
		off = align(off + size)
	}
}

// fakeKernel builds a kernel tree with each GuestModules module as a small
// .ko file (content = its name), in nested directories as Debian lays them
// out; compressed lists modules to store as .ko.xz instead.
func fakeKernel(t *testing.T, compressed ...string) Kernel {
	dir := t.TempDir()
	k := Kernel{Release: "test", Dir: dir, ModulesDir: filepath.Join(dir, "lib/modules/test")}
	for i, m := range GuestModules {
		ext := ".ko"
		for _, c := range compressed {
			if c == m {
				ext = ".ko.xz"
			}
		}
		// Debian names some files with '-' and loads them as '_' (and
		// the reverse): store every other one with the other separator.
		file := m
		if i%2 == 1 {
			file = strings.ReplaceAll(strings.ReplaceAll(m, "_", "#"), "-", "_")
			file = strings.ReplaceAll(file, "#", "-")
		}
		d := filepath.Join(k.ModulesDir, "kernel", "sub"+strconv.Itoa(i))
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(d, file+ext), []byte("module "+m), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return k
}

func TestBuildInitramfsLayoutAndCache(t *testing.T) {
	k := fakeKernel(t)
	agent := filepath.Join(t.TempDir(), "space-agent")
	if err := os.WriteFile(agent, []byte("agent v1"), 0o755); err != nil {
		t.Fatal(err)
	}
	cache := t.TempDir()
	p1, err := BuildInitramfs(k, agent, cache)
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(p1)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	zr, err := gzip.NewReader(f)
	if err != nil {
		t.Fatal(err)
	}
	ents := readNewc(t, zr)
	byName := map[string]cpioEntry{}
	var mods []string
	for _, e := range ents {
		byName[e.name] = e
		if strings.HasPrefix(e.name, strings.TrimPrefix(vminit.ModulesDir, "/")+"/") {
			mods = append(mods, e.name)
		}
	}
	if e := byName["init"]; string(e.data) != "agent v1" || e.mode != cpioReg|0o755 {
		t.Errorf("/init = %q mode %o", e.data, e.mode)
	}
	if e := byName["dev/console"]; e.mode != cpioChar|0o600 || e.rdev != [2]uint32{5, 1} {
		t.Errorf("/dev/console mode %o rdev %v", e.mode, e.rdev)
	}
	if len(mods) != len(GuestModules) {
		t.Fatalf("modules %v, want %d", mods, len(GuestModules))
	}
	// In archive order and in lexical order, each module's file is the one
	// named in GuestModules at that position.
	for i, name := range mods {
		if i > 0 && mods[i-1] >= name {
			t.Errorf("module %s does not sort after %s", name, mods[i-1])
		}
		if got, want := string(byName[name].data), "module "+GuestModules[i]; got != want {
			t.Errorf("%s holds %q, want %q", name, got, want)
		}
	}

	// Same inputs: the cached image, untouched.
	st1, _ := os.Stat(p1)
	p2, err := BuildInitramfs(k, agent, cache)
	if err != nil || p2 != p1 {
		t.Fatalf("rebuild: %s %v, want %s", p2, err, p1)
	}
	if st2, _ := os.Stat(p2); !st2.ModTime().Equal(st1.ModTime()) {
		t.Errorf("cached image was rewritten")
	}
	// A different agent binary: a different image.
	if err := os.WriteFile(agent, []byte("agent v2"), 0o755); err != nil {
		t.Fatal(err)
	}
	p3, err := BuildInitramfs(k, agent, cache)
	if err != nil || p3 == p1 {
		t.Fatalf("after agent change: %s %v (old %s)", p3, err, p1)
	}
	left, _ := filepath.Glob(filepath.Join(cache, ".initramfs-*"))
	if len(left) != 0 {
		t.Errorf("temporary files left: %v", left)
	}
}

func TestBuildInitramfsRefusesMissingAndCompressedModules(t *testing.T) {
	agent := filepath.Join(t.TempDir(), "space-agent")
	if err := os.WriteFile(agent, []byte("agent"), 0o755); err != nil {
		t.Fatal(err)
	}
	k := fakeKernel(t, "erofs")
	if _, err := BuildInitramfs(k, agent, t.TempDir()); !errors.Is(err, errdefs.ErrNotSupported) {
		t.Errorf("compressed module: %v, want ErrNotSupported", err)
	}
	k = fakeKernel(t)
	if err := os.RemoveAll(filepath.Join(k.ModulesDir, "kernel", "sub0")); err != nil {
		t.Fatal(err)
	}
	if _, err := BuildInitramfs(k, agent, t.TempDir()); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("missing module: %v, want ErrNotFound", err)
	}
}

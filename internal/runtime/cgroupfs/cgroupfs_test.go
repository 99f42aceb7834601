package cgroupfs

import (
	"os"
	"path/filepath"
	"testing"
)

func TestReadIntAndKey(t *testing.T) {
	dir := t.TempDir()
	write := func(name, body string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	if n, err := ReadInt(write("memory.current", "4096\n")); err != nil || n != 4096 {
		t.Fatalf("ReadInt: %d %v", n, err)
	}
	if _, err := ReadInt(write("bad", "max\n")); err == nil {
		t.Fatal("ReadInt of a non-number succeeded")
	}
	events := write("memory.events", "low 0\nhigh 0\nmax 7\noom 2\noom_kill 3\n")
	if n, found, err := LookupKey(events, "oom_kill"); err != nil || !found || n != 3 {
		t.Fatalf("ReadKey oom_kill: %d %v %v", n, found, err)
	}
	if n, found, err := LookupKey(events, "oom"); err != nil || !found || n != 2 {
		t.Fatalf("ReadKey must match whole keys: %d %v %v", n, found, err)
	}
	if n, found, err := LookupKey(events, "oom_group_kill"); err != nil || found || n != 0 {
		t.Fatalf("missing key: %d %v %v", n, found, err)
	}
	if n, err := ReadKey(events, "oom_group_kill"); err != nil || n != 0 {
		t.Fatalf("ReadKey of a missing key: %d %v", n, err)
	}
	if _, _, err := LookupKey(filepath.Join(dir, "absent"), "x"); !os.IsNotExist(err) {
		t.Fatalf("missing file: %v", err)
	}
	if _, _, err := LookupKey(write("garbled", "oom_kill many\n"), "oom_kill"); err == nil {
		t.Fatal("a non-number value was accepted")
	}
}

package agent_test

import (
	"archive/tar"
	"bytes"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"

	"github.com/spacehq/space/internal/agent"
	"github.com/spacehq/space/internal/agentclient"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/testenv"
)

func owner(t *testing.T, p string) (uint32, uint32) {
	t.Helper()
	fi, err := os.Lstat(p)
	if err != nil {
		t.Fatal(err)
	}
	st := fi.Sys().(*syscall.Stat_t)
	return st.Uid, st.Gid
}

// TestFilesAsUser: every file operation with user= runs with that user's
// credentials (the kernel says no where the user may not, new files are
// its own), resolved from the root's /etc/passwd, and the agent's own
// threads stay root.
func TestFilesAsUser(t *testing.T) {
	testenv.RequireRoot(t)
	e := newEnv(t, agent.Config{})
	ctx := ctxT(t)
	c := e.c
	writeRootFile(t, e.root, "etc/passwd", "root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/bash\n")
	writeRootFile(t, e.root, "etc/group", "root:x:0:\nuser:x:1000:\nshared:x:2000:user\n")
	for _, d := range []string{"home/user", "root", "shared"} {
		os.MkdirAll(filepath.Join(e.root, d), 0o755)
	}
	os.Chown(filepath.Join(e.root, "home/user"), 1000, 1000)
	os.Chmod(filepath.Join(e.root, "root"), 0o700)
	// Group-writable by a supplementary group of user's only.
	os.Chown(filepath.Join(e.root, "shared"), 0, 2000)
	os.Chmod(filepath.Join(e.root, "shared"), 0o770)
	writeRootFile(t, e.root, "root/secret", "s")
	os.Chmod(filepath.Join(e.root, "root/secret"), 0o600)
	writeRootFile(t, e.root, "home/user/root-owned", "r")

	as := agentclient.AsUser("user")
	fi, err := c.WriteFile(ctx, "/home/user/f", 0, strings.NewReader("hi"), as)
	if err != nil || fi.Size != 2 {
		t.Fatalf("write as user: %v %+v", err, fi)
	}
	if u, g := owner(t, filepath.Join(e.root, "home/user/f")); u != 1000 || g != 1000 {
		t.Fatalf("file written as user is owned by %d:%d", u, g)
	}
	if _, err := c.Mkdir(ctx, "/home/user/a/b", 0, as); err != nil {
		t.Fatal(err)
	}
	if u, _ := owner(t, filepath.Join(e.root, "home/user/a/b")); u != 1000 {
		t.Fatalf("dir made as user is owned by %d", u)
	}
	if _, err := c.WriteFile(ctx, "/shared/g", 0, strings.NewReader("x"), as); err != nil {
		t.Fatalf("write through a supplementary group: %v", err)
	}
	var tb bytes.Buffer
	tw := tar.NewWriter(&tb)
	tw.WriteHeader(&tar.Header{Name: "t.txt", Mode: 0o644, Size: 1, Typeflag: tar.TypeReg})
	tw.Write([]byte("t"))
	tw.Close()
	if err := c.TarPut(ctx, "/home/user/tar", &tb, as); err != nil {
		t.Fatal(err)
	}
	if u, _ := owner(t, filepath.Join(e.root, "home/user/tar/t.txt")); u != 1000 {
		t.Fatalf("tar entry extracted as user is owned by %d", u)
	}
	if err := c.Rename(ctx, "/home/user/f", "/home/user/a/f", as); err != nil {
		t.Fatal(err)
	}
	if err := c.Remove(ctx, "/home/user/a", true, as); err != nil {
		t.Fatal(err)
	}

	// Refused by the kernel, as 422 naming the cause, like any other
	// permission error of the files API.
	denied := map[string]error{}
	_, denied["write into /root"] = c.WriteFile(ctx, "/root/f", 0, strings.NewReader("x"), as)
	_, denied["read a 0600 root file"] = c.ReadFile(ctx, "/root/secret", as)
	_, denied["stat below a 0700 dir"] = c.Stat(ctx, "/root/secret", as)
	_, denied["list a 0700 dir"] = c.List(ctx, "/root", as)
	_, denied["mkdir in /"] = c.Mkdir(ctx, "/newdir", 0, as)
	denied["remove from /"] = c.Remove(ctx, "/etc/passwd", false, as)
	denied["rename in /"] = c.Rename(ctx, "/etc/passwd", "/etc/p2", as)
	_, denied["tar get of /root"] = c.TarGet(ctx, "/root", as)
	denied["tar put into /root"] = c.TarPut(ctx, "/root/x", bytes.NewReader(tb.Bytes()), as)
	for what, err := range denied {
		if !strings.Contains(errString(err), "permission denied") || !isErr(err, errdefs.ErrUnprocessable) {
			t.Errorf("%s as user: %v", what, err)
		}
	}
	// A numeric uid:gid works too; an unknown name is the caller's error.
	if _, err := c.WriteFile(ctx, "/home/user/n", 0, strings.NewReader("x"), agentclient.AsUser("1000:2000")); err != nil {
		t.Fatal(err)
	}
	if u, g := owner(t, filepath.Join(e.root, "home/user/n")); u != 1000 || g != 2000 {
		t.Fatalf("written as 1000:2000, owned by %d:%d", u, g)
	}
	_, err = c.Stat(ctx, "/", agentclient.AsUser("nobody-here"))
	wantErr(t, err, errdefs.ErrInvalidArgument)

	// Root still can, and "root" is the agent itself.
	if _, err := c.ReadFile(ctx, "/root/secret", agentclient.AsUser("root")); err != nil {
		t.Fatal(err)
	}
	// Many user operations at once with root ones in between: every
	// root write stays root's (no thread kept a user's credentials).
	var wg sync.WaitGroup
	for i := 0; i < 64; i++ {
		wg.Add(2)
		go func() {
			defer wg.Done()
			c.WriteFile(ctx, "/home/user/c", 0, strings.NewReader("u"), as)
		}()
		go func() {
			defer wg.Done()
			if _, err := c.WriteFile(ctx, "/root/r", 0, strings.NewReader("r")); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	if u, g := owner(t, filepath.Join(e.root, "root/r")); u != 0 || g != 0 {
		t.Fatalf("root write after user writes is owned by %d:%d", u, g)
	}
	r, err := c.ReadFile(ctx, "/home/user/c", as)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(r)
	r.Close()
	if string(b) != "u" {
		t.Fatalf("read as user: %q", b)
	}
}

func errString(err error) string {
	if err == nil {
		return "<nil>"
	}
	return err.Error()
}

func isErr(err, target error) bool {
	return err != nil && errdefs.Code(err) == errdefs.Code(target)
}

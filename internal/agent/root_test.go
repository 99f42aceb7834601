package agent_test

import (
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spacehq/space/internal/agent"
	"github.com/spacehq/space/internal/agentproto"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/testenv"
)

// busyboxTree makes a container-like tree at dir: a static busybox with
// applet symlinks (absolute ones, resolved inside the tree), an
// /etc/passwd with a user of its own and a marker file.
func busyboxTree(t *testing.T, dir string) {
	t.Helper()
	const bb = "/bin/busybox"
	_, err := os.Stat(bb)
	testenv.Require(t, "busybox-static", err == nil, "apt-get install busybox-static (scripts/setup-test.sh)")
	for _, d := range []string{"bin", "etc", "work", "tmp"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	src, err := os.Open(bb)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	dst, err := os.OpenFile(filepath.Join(dir, "bin", "busybox"), os.O_CREATE|os.O_WRONLY, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(dst, src); err != nil {
		t.Fatal(err)
	}
	dst.Close()
	for _, a := range []string{"sh", "ls", "cat", "id", "pwd"} {
		if err := os.Symlink("/bin/busybox", filepath.Join(dir, "bin", a)); err != nil {
			t.Fatal(err)
		}
	}
	os.WriteFile(filepath.Join(dir, "etc", "passwd"), []byte("root:x:0:0:root:/root:/bin/sh\nimg:x:4242:4343:img:/work:/bin/sh\n"), 0o644)
	os.WriteFile(filepath.Join(dir, "etc", "group"), []byte("root:x:0:\nimg:x:4343:\n"), 0o644)
	os.WriteFile(filepath.Join(dir, "etc", "marker"), []byte("inside\n"), 0o644)
}

// TestProcessRoot runs processes chrooted into a tree below the agent's
// root: they see only that tree, resolve their user, workdir and
// executable in it, and a bad root is refused naming the problem.
func TestProcessRoot(t *testing.T) {
	testenv.RequireRoot(t) // chroot needs CAP_SYS_CHROOT
	e := newEnv(t, agent.Config{})
	ctx := ctxT(t)
	busyboxTree(t, filepath.Join(e.root, "ctr", "rootfs"))
	os.WriteFile(filepath.Join(e.root, "outside"), []byte("secret"), 0o644)
	os.WriteFile(filepath.Join(e.root, "ctr", "afile"), nil, 0o644)
	const root = "/ctr/rootfs"

	res, err := e.c.Exec(ctx, agentproto.ExecRequest{Root: root, Cmd: []string{"sh", "-c", "cat /etc/marker; ls /; ls /..; pwd; cat /outside ../outside 2>&1; true"}, Env: []string{"PATH=/bin"}})
	if err != nil {
		t.Fatal(err)
	}
	if res.ExitCode != 0 || !strings.HasPrefix(res.Stdout, "inside\n") {
		t.Fatalf("chrooted exec: %+v", res)
	}
	if strings.Contains(res.Stdout, "secret") || strings.Contains(res.Stdout, "ctr") || strings.Contains(res.Stdout, "\noutside") {
		t.Fatalf("the process saw outside its root:\n%s", res.Stdout)
	}
	if strings.Count(res.Stdout, "bin\netc\ntmp\nwork\n") != 2 {
		t.Fatalf("ls / and ls /.. should both list the tree:\n%s", res.Stdout)
	}

	// User and workdir come from the tree.
	res, err = e.c.Exec(ctx, agentproto.ExecRequest{Root: root, Cmd: []string{"sh", "-c", "id -u; id -g; pwd"}, User: "img", Workdir: "/work"})
	if err != nil {
		t.Fatal(err)
	}
	if res.Stdout != "4242\n4343\n/work\n" {
		t.Fatalf("user/workdir in root: %+v", res)
	}
	// A session process (the containerd shim's path) too.
	info, err := e.c.StartProc(ctx, agentproto.ProcStart{ID: "rooted", Root: root, Cmd: []string{"/bin/cat", "/etc/marker"}})
	if err != nil || info.Pid == 0 {
		t.Fatalf("start in root: %+v %v", info, err)
	}

	for _, c := range []struct {
		root, want string
	}{
		{"ctr/rootfs", "not an absolute path"},
		{"/ctr/../ctr/rootfs", "not a clean path"},
		{"/ctr/rootfs/", "not a clean path"},
		{"/nope", "does not exist"},
		{"/ctr/afile", "not a directory"},
	} {
		_, err := e.c.Exec(ctx, agentproto.ExecRequest{Root: c.root, Cmd: []string{"true"}})
		wantErr(t, err, errdefs.ErrInvalidArgument)
		if !strings.Contains(err.Error(), c.want) {
			t.Errorf("root %q: error %q does not say %q", c.root, err, c.want)
		}
	}
	// An executable outside the tree is not found from inside it.
	_, err = e.c.Exec(ctx, agentproto.ExecRequest{Root: root, Cmd: []string{"/outside"}})
	wantErr(t, err, errdefs.ErrNotFound)
}

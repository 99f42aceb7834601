package e2e

import (
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/testenv"
)

// TestExecInteractivePTY drives `space exec -it ID bash` inside tmux: a real
// terminal, so raw mode, resize, Ctrl-C and job control are what a user gets.
func TestExecInteractivePTY(t *testing.T) {
	e := setup(t)
	_, err := exec.LookPath("tmux")
	testenv.Require(t, "tmux", err == nil, "tmux is not installed")
	bin := buildSpace(t)
	sb := newSandbox(t, e, api.CreateSandboxRequest{})
	sess := "space-pty-" + sb.ID
	tmux := func(args ...string) string {
		t.Helper()
		out, err := exec.Command("tmux", args...).CombinedOutput()
		if err != nil {
			t.Fatalf("tmux %v: %v %s", args, err, out)
		}
		return string(out)
	}
	cmd := exec.Command("tmux", "new-session", "-d", "-s", sess, "-x", "100", "-y", "30",
		bin+" --url "+e.url+" --api-key "+e.key+" exec -it "+sb.ID+" bash; echo EXITED-$?; sleep 30")
	cmd.Env = append(os.Environ(), "TERM=xterm")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("tmux new-session: %v %s", err, out)
	}
	defer exec.Command("tmux", "kill-session", "-t", sess).Run()
	screen := func() string { return tmux("capture-pane", "-p", "-t", sess) }
	waitFor := func(want string) {
		t.Helper()
		deadline := time.Now().Add(20 * time.Second)
		for time.Now().Before(deadline) {
			if strings.Contains(screen(), want) {
				return
			}
			time.Sleep(100 * time.Millisecond)
		}
		t.Fatalf("screen never showed %q:\n%s", want, screen())
	}
	send := func(keys ...string) { tmux(append([]string{"send-keys", "-t", sess}, keys...)...) }

	send("export PS1='$ '; stty size", "Enter")
	waitFor("30 100")
	tmux("resize-window", "-t", sess, "-x", "120", "-y", "40")
	time.Sleep(300 * time.Millisecond)
	send("clear; stty size", "Enter")
	waitFor("40 120")
	send("sleep 100", "Enter")
	time.Sleep(500 * time.Millisecond)
	send("C-c")
	send("echo after-$?", "Enter")
	waitFor("after-130")
	send("sleep 50 &", "Enter")
	send("jobs", "Enter")
	waitFor("Running")
	send("tty", "Enter")
	waitFor("/dev/pts/")
	send("exit 5", "Enter")
	waitFor("EXITED-5")
}

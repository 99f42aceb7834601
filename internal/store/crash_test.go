package store

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
)

// TestCrashHelper is the child of TestKillDuringWrites: it writes sandboxes
// as fast as it can and prints the id of each one after Put returned.
func TestCrashHelper(t *testing.T) {
	path := os.Getenv("SPACE_STORE_CRASH_DB")
	if path == "" {
		t.Skip("helper process only")
	}
	d, err := Open(path)
	if err != nil {
		fmt.Println("error", err)
		os.Exit(2)
	}
	ctx := context.Background()
	for i := 0; ; i++ {
		id := fmt.Sprintf("sb-%06d", i)
		s := sandbox(id, i, api.StateRunning, map[string]string{"n": fmt.Sprint(i % 7)})
		if err := d.PutSandbox(ctx, s); err != nil {
			fmt.Println("error", err)
			os.Exit(2)
		}
		if err := d.PutCommand(ctx, CommandRecord{Command: api.Command{ID: "c", SandboxID: id}}); err != nil {
			fmt.Println("error", err)
			os.Exit(2)
		}
		fmt.Println("acked", id)
	}
}

// TestKillDuringWrites SIGKILLs a writer mid-stream and checks that the
// database is intact and holds every write that was acknowledged.
func TestKillDuringWrites(t *testing.T) {
	path := filepath.Join(t.TempDir(), "space.db")
	cmd := exec.Command(os.Args[0], "-test.run=^TestCrashHelper$", "-test.count=1")
	cmd.Env = append(os.Environ(), "SPACE_STORE_CRASH_DB="+path)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var acked []string
	sc := bufio.NewScanner(out)
	deadline := time.Now().Add(20 * time.Second)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "error") {
			t.Fatalf("helper: %s", line)
		}
		if id, ok := strings.CutPrefix(line, "acked "); ok {
			acked = append(acked, id)
		}
		if len(acked) >= 200 || time.Now().After(deadline) {
			cmd.Process.Kill()
			break
		}
	}
	cmd.Wait()
	if len(acked) == 0 {
		t.Fatal("helper acknowledged nothing")
	}

	d, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	var check string
	if err := d.SQL().QueryRow("PRAGMA integrity_check").Scan(&check); err != nil || check != "ok" {
		t.Fatalf("integrity_check = %q, %v", check, err)
	}
	ctx := context.Background()
	for _, id := range acked {
		if _, err := d.GetSandbox(ctx, id); err != nil {
			t.Fatalf("acknowledged sandbox lost after kill -9: %v", err)
		}
	}
	// Writes the helper made after its last line we read (still in the pipe
	// when it died) may be there too; every row that is there is whole.
	all, err := d.ListSandboxes(ctx, SandboxFilter{})
	if err != nil {
		t.Fatal(err)
	}
	if len(all) < len(acked) {
		t.Fatalf("%d sandboxes after kill, %d acknowledged", len(all), len(acked))
	}
	t.Logf("%d writes acknowledged before SIGKILL; %d present after reopen", len(acked), len(all))
}

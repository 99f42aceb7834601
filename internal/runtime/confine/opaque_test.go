package confine

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// TestOpaque runs Opaque in a child process started with SPACE_* variables
// and checks what the kernel shows of it: no SPACE_ bytes in
// /proc/self/environ (os.Unsetenv alone leaves them there), the other
// variables intact, and the process non-dumpable.
func TestOpaque(t *testing.T) {
	if os.Getenv("CONFINE_OPAQUE_CHILD") == "1" {
		if err := Opaque(); err != nil {
			fmt.Println("ERR", err)
			os.Exit(1)
		}
		env, err := os.ReadFile("/proc/self/environ")
		if err != nil {
			fmt.Println("ERR", err)
			os.Exit(1)
		}
		d, _ := unix.PrctlRetInt(unix.PR_GET_DUMPABLE, 0, 0, 0, 0)
		fmt.Printf("dumpable=%d getenv=%q environ=%q\n", d, os.Getenv("SPACE_AGENT_FD"), env)
		os.Exit(0)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestOpaque$")
	cmd.Env = []string{"CONFINE_OPAQUE_CHILD=1", "SPACE_AGENT_FD=3", "KEEP=kept", "SPACE_GINIT_MEMORY=268435456"}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
	s := string(out)
	for _, want := range []string{"dumpable=0 ", `getenv=""`, "KEEP=kept", "CONFINE_OPAQUE_CHILD=1"} {
		if !strings.Contains(s, want) {
			t.Errorf("child output lacks %q: %s", want, s)
		}
	}
	if strings.Contains(s, "SPACE_") || strings.Contains(s, "268435456") {
		t.Errorf("SPACE_ variables still visible: %s", s)
	}
}

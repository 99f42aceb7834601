package agent

import (
	"context"
	"syscall"
	"testing"

	"github.com/spacehq/space/internal/agentproto"
)

// BenchmarkSpawnTrue is the floor under any exec: fork/exec of /bin/true
// and its reaping, with nothing else.
func BenchmarkSpawnTrue(b *testing.B) {
	a, err := New(Config{Root: b.TempDir()})
	if err != nil {
		b.Fatal(err)
	}
	defer a.Close()
	for i := 0; i < b.N; i++ {
		_, done, err := a.reaper.start("/bin/true", []string{"true"}, &syscall.ProcAttr{Sys: &syscall.SysProcAttr{Setsid: true}})
		if err != nil {
			b.Fatal(err)
		}
		<-done
	}
}

// BenchmarkExecTrue is a synchronous exec without the transport.
func BenchmarkExecTrue(b *testing.B) {
	a, err := New(Config{Root: b.TempDir()})
	if err != nil {
		b.Fatal(err)
	}
	defer a.Close()
	req := &agentproto.ExecRequest{Cmd: []string{"/bin/true"}}
	for i := 0; i < b.N; i++ {
		if _, err := a.Exec(context.Background(), req); err != nil {
			b.Fatal(err)
		}
	}
}

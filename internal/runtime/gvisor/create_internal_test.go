package gvisor

import (
	"context"
	"log/slog"
	"maps"
	"os"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/agentclient"
	"github.com/spacehq/space/internal/agentproto"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/testenv"
)

// TestOneRunscPerCreate: a cold create — Create, Start, the first exec and
// the manager's OOM count around it — runs exactly one runsc process
// (`runsc run --detach`), and the agent answers as soon as Start returns.
func TestOneRunscPerCreate(t *testing.T) {
	testenv.RequireRoot(t)
	if _, err := findRunsc(); err != nil {
		testenv.Require(t, "runsc", false, err.Error())
	}
	dir, err := os.MkdirTemp("", "gvi-")
	if err != nil {
		t.Fatal(err)
	}
	rtI, err := New(runtime.Config{DataDir: dir, AgentBinary: testenv.AgentBinary(t), Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	rt := rtI.(*Runtime)
	t.Cleanup(func() {
		rt.Close()
		os.RemoveAll(dir)
	})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	spec := runtime.Spec{ID: "one-runsc", RootFS: testenv.BaseRootfs(t), TemplateDigest: "sha256:test", Hostname: "one-runsc",
		Limits: api.Limits{CPUs: 1, MemoryMiB: 128, Pids: 64, DiskMiB: 64}}
	inst, err := rt.Create(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { inst.Destroy(context.Background()) })
	rs, err := rt.runsc()
	if err != nil {
		t.Fatal(err)
	}
	before := rs.callCounts()
	if err := inst.Start(ctx); err != nil {
		t.Fatal(err)
	}
	// No retry: Start returned, so the agent's socket is there.
	conn, err := inst.DialAgent(ctx)
	if err != nil {
		t.Fatal(err)
	}
	c, err := agentclient.New(conn)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	oc := inst.(runtime.OOMCounter)
	if n, err := oc.OOMKills(); err != nil || n != 0 {
		t.Fatalf("OOMKills of a fresh sandbox: %d, %v", n, err)
	}
	res, err := c.Exec(ctx, agentproto.ExecRequest{Cmd: []string{"true"}})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("exec true: %+v %v", res, err)
	}
	if _, err := oc.OOMKills(); err != nil {
		t.Fatal(err)
	}
	after := rs.callCounts()
	for k, v := range before {
		after[k] -= v
		if after[k] == 0 {
			delete(after, k)
		}
	}
	if want := map[string]int64{"run": 1}; !maps.Equal(after, want) {
		t.Fatalf("runsc invocations for a create and its first exec: %v, want %v", after, want)
	}
}

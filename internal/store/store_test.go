package store

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"sync"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

func openTemp(t *testing.T) (*DB, string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "state", "space.db")
	d, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	return d, path
}

var t0 = time.Date(2026, 1, 2, 3, 4, 5, 6000, time.UTC)

func sandbox(id string, n int, state string, labels map[string]string) api.Sandbox {
	created := t0.Add(time.Duration(n) * time.Second)
	exp := created.Add(time.Hour)
	return api.Sandbox{
		ID: id, State: state, Runtime: "native", Isolation: "namespaces+seccomp+landlock",
		Template: "base:latest", TemplateDigest: "sha256:abc",
		Limits: api.Limits{CPUs: 0.5, MemoryMiB: 256, Pids: 100},
		Env:    map[string]string{"A": "b"}, Workdir: "/root", Labels: labels,
		TTLSeconds: 3600, Idle: &api.IdlePolicy{AfterSeconds: 60, Action: "pause"},
		Network: &api.NetworkPolicy{AllowOut: []string{"pypi.org:443"}, DenyOut: []string{"10.0.0.0/8"},
			Rules: []api.HeaderRule{{Domain: "*.example.com", SetHeaders: map[string]string{"X-Key": "placeholder"}}}},
		CreatedAt: created, UpdatedAt: created, LastActiveAt: created, ExpiresAt: &exp,
		OperationID: "op-" + id,
	}
}

func TestSandboxRoundTrip(t *testing.T) {
	ctx := context.Background()
	d, _ := openTemp(t)
	want := sandbox("sb1", 0, api.StateRunning, map[string]string{"team": "a", "env": "dev"})
	if err := d.PutSandbox(ctx, want); err != nil {
		t.Fatal(err)
	}
	got, err := d.GetSandbox(ctx, "sb1")
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("round trip:\n got %+v\nwant %+v", got, want)
	}

	// Upsert replaces the record and its label index.
	want.State = api.StateStopped
	want.Labels = map[string]string{"team": "b"}
	if err := d.PutSandbox(ctx, want); err != nil {
		t.Fatal(err)
	}
	got, _ = d.GetSandbox(ctx, "sb1")
	if got.State != api.StateStopped || !reflect.DeepEqual(got.Labels, want.Labels) {
		t.Fatalf("after upsert: %+v", got)
	}
	if l, _ := d.ListSandboxes(ctx, SandboxFilter{Labels: map[string]string{"env": "dev"}}); len(l) != 0 {
		t.Fatalf("stale label still indexed: %v", l)
	}

	if _, err := d.GetSandbox(ctx, "nope"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("missing sandbox: %v", err)
	}
	if err := d.PutSandbox(ctx, api.Sandbox{}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("empty id: %v", err)
	}
}

func TestListSandboxesFilters(t *testing.T) {
	ctx := context.Background()
	d, _ := openTemp(t)
	// Inserted out of creation order to prove ORDER BY created_at.
	put := []api.Sandbox{
		sandbox("c", 3, api.StateRunning, map[string]string{"team": "a", "env": "prod"}),
		sandbox("a", 1, api.StateRunning, map[string]string{"team": "a", "env": "dev"}),
		sandbox("b", 2, api.StateStopped, map[string]string{"team": "b"}),
		sandbox("d", 4, api.StatePaused, nil),
	}
	for _, s := range put {
		if err := d.PutSandbox(ctx, s); err != nil {
			t.Fatal(err)
		}
	}
	ids := func(f SandboxFilter) []string {
		t.Helper()
		l, err := d.ListSandboxes(ctx, f)
		if err != nil {
			t.Fatal(err)
		}
		out := []string{}
		for _, s := range l {
			out = append(out, s.ID)
		}
		return out
	}
	for _, tc := range []struct {
		f    SandboxFilter
		want []string
	}{
		{SandboxFilter{}, []string{"a", "b", "c", "d"}},
		{SandboxFilter{State: api.StateRunning}, []string{"a", "c"}},
		{SandboxFilter{Labels: map[string]string{"team": "a"}}, []string{"a", "c"}},
		{SandboxFilter{Labels: map[string]string{"team": "a", "env": "prod"}}, []string{"c"}},
		{SandboxFilter{State: api.StateStopped, Labels: map[string]string{"team": "a"}}, []string{}},
		{SandboxFilter{Labels: map[string]string{"team": "zzz"}}, []string{}},
		// A label value that looks like SQL is just a value.
		{SandboxFilter{Labels: map[string]string{"team": "a' OR '1'='1"}}, []string{}},
	} {
		if got := ids(tc.f); !reflect.DeepEqual(got, tc.want) {
			t.Errorf("ListSandboxes(%+v) = %v, want %v", tc.f, got, tc.want)
		}
	}
}

func TestDeleteSandboxCascadesCommandsKeepsOperations(t *testing.T) {
	ctx := context.Background()
	d, _ := openTemp(t)
	if err := d.PutSandbox(ctx, sandbox("sb", 0, api.StateRunning, map[string]string{"k": "v"})); err != nil {
		t.Fatal(err)
	}
	if err := d.PutCommand(ctx, CommandRecord{Command: api.Command{ID: "c1", SandboxID: "sb", State: api.CommandRunning}}); err != nil {
		t.Fatal(err)
	}
	if err := d.PutOperation(ctx, api.Operation{ID: "op1", SandboxID: "sb", Kind: api.OpDelete, State: api.OpRunning}); err != nil {
		t.Fatal(err)
	}
	if err := d.DeleteSandbox(ctx, "sb"); err != nil {
		t.Fatal(err)
	}
	if _, err := d.GetSandbox(ctx, "sb"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("sandbox still there: %v", err)
	}
	if _, err := d.GetCommand(ctx, "sb", "c1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("command survived its sandbox: %v", err)
	}
	var n int
	if err := d.SQL().QueryRow(`SELECT count(*) FROM sandbox_labels`).Scan(&n); err != nil || n != 0 {
		t.Fatalf("labels left: %d %v", n, err)
	}
	if _, err := d.GetOperation(ctx, "op1"); err != nil {
		t.Fatalf("operation must outlive its sandbox: %v", err)
	}
	if err := d.DeleteSandbox(ctx, "sb"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("second delete: %v", err)
	}
}

func TestOperations(t *testing.T) {
	ctx := context.Background()
	d, _ := openTemp(t)
	fin := t0.Add(time.Minute)
	ops := []api.Operation{
		{ID: "o3", Kind: api.OpStop, SandboxID: "s1", State: api.OpPending, Phases: []api.Phase{}, CreatedAt: t0.Add(3 * time.Second)},
		{ID: "o1", Kind: api.OpCreate, SandboxID: "s1", State: api.OpSucceeded, CreatedAt: t0.Add(1 * time.Second), FinishedAt: &fin,
			Phases: []api.Phase{{Name: "rootfs", DurationMS: 12.5}, {Name: "start", DurationMS: 40}}},
		{ID: "o2", Kind: api.OpCreate, SandboxID: "s2", State: api.OpFailed, CreatedAt: t0.Add(2 * time.Second), FinishedAt: &fin,
			Error: &api.ErrorBody{Code: "internal", Message: "boom"}, Phases: []api.Phase{}},
		{ID: "o4", Kind: api.OpStart, SandboxID: "s2", State: api.OpRunning, CreatedAt: t0.Add(4 * time.Second), Phases: []api.Phase{}},
	}
	for _, o := range ops {
		if err := d.PutOperation(ctx, o); err != nil {
			t.Fatal(err)
		}
	}
	got, err := d.GetOperation(ctx, "o1")
	if err != nil || !reflect.DeepEqual(got, ops[1]) {
		t.Fatalf("round trip: %+v %v", got, err)
	}
	if _, err := d.GetOperation(ctx, "zz"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("missing op: %v", err)
	}
	list := func(f OperationFilter) []string {
		l, err := d.ListOperations(ctx, f)
		if err != nil {
			t.Fatal(err)
		}
		out := []string{}
		for _, o := range l {
			out = append(out, o.ID)
		}
		return out
	}
	for _, tc := range []struct {
		f    OperationFilter
		want []string
	}{
		{OperationFilter{}, []string{"o1", "o2", "o3", "o4"}},
		{OperationFilter{SandboxID: "s1"}, []string{"o1", "o3"}},
		{OperationFilter{Unfinished: true}, []string{"o3", "o4"}},
		{OperationFilter{SandboxID: "s2", Unfinished: true}, []string{"o4"}},
	} {
		if got := list(tc.f); !reflect.DeepEqual(got, tc.want) {
			t.Errorf("ListOperations(%+v) = %v, want %v", tc.f, got, tc.want)
		}
	}
	// Finishing an operation moves it out of the unfinished set.
	ops[3].State = api.OpSucceeded
	ops[3].FinishedAt = &fin
	if err := d.PutOperation(ctx, ops[3]); err != nil {
		t.Fatal(err)
	}
	if got := list(OperationFilter{Unfinished: true}); !reflect.DeepEqual(got, []string{"o3"}) {
		t.Errorf("unfinished after finishing o4 = %v", got)
	}
	n, err := d.DeleteOperationsBefore(ctx, t0.Add(10*time.Second))
	if err != nil || n != 3 {
		t.Fatalf("prune = %d, %v; want 3 finished ops", n, err)
	}
	if got := list(OperationFilter{}); !reflect.DeepEqual(got, []string{"o3"}) {
		t.Errorf("after prune = %v (unfinished ops must stay)", got)
	}
}

func TestCommands(t *testing.T) {
	ctx := context.Background()
	d, _ := openTemp(t)
	if err := d.PutSandbox(ctx, sandbox("sb", 0, api.StateRunning, nil)); err != nil {
		t.Fatal(err)
	}
	exp := t0.Add(5 * time.Minute)
	c := CommandRecord{
		Command: api.Command{ID: "c2", SandboxID: "sb", Cmd: []string{"bash", "-lc", "echo hi"}, TTY: true,
			State: api.CommandCreated, CreatedAt: t0.Add(2 * time.Second), AttachURL: "/v1/x", AttachToken: "secret-token"},
		Spec: api.ExecRequest{Cmd: []string{"bash", "-lc", "echo hi"}, Env: map[string]string{"X": "1"}, TTY: true, Rows: 24, Cols: 80,
			TimeoutSeconds: 1.5},
		TokenHash: "sha256:deadbeef", TokenExpiry: exp, Detached: true,
	}
	if err := d.PutCommand(ctx, c); err != nil {
		t.Fatal(err)
	}
	got, err := d.GetCommand(ctx, "sb", "c2")
	if err != nil {
		t.Fatal(err)
	}
	want := c
	want.AttachToken = "" // never persisted
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("round trip:\n got %+v\nwant %+v", got, want)
	}
	c1 := CommandRecord{Command: api.Command{ID: "c1", SandboxID: "sb", State: api.CommandExited, CreatedAt: t0.Add(time.Second),
		Exit: &api.ExitStatus{ExitCode: 137, Signal: "KILL", OOMKilled: true, Reason: "oom"}}}
	if err := d.PutCommand(ctx, c1); err != nil {
		t.Fatal(err)
	}
	// Update in place.
	c.State, c.Pid = api.CommandRunning, 42
	if err := d.PutCommand(ctx, c); err != nil {
		t.Fatal(err)
	}
	l, err := d.ListCommands(ctx, "sb")
	if err != nil {
		t.Fatal(err)
	}
	if len(l) != 2 || l[0].ID != "c1" || l[1].ID != "c2" || l[1].Pid != 42 || l[0].Exit == nil || !l[0].Exit.OOMKilled {
		t.Fatalf("ListCommands = %+v", l)
	}
	if l, err := d.ListCommands(ctx, "other"); err != nil || len(l) != 0 {
		t.Fatalf("ListCommands(other) = %v, %v", l, err)
	}
	if _, err := d.GetCommand(ctx, "sb", "nope"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("missing command: %v", err)
	}
	// Same command id in another sandbox is a different record; a missing
	// sandbox cannot own commands.
	err = d.PutCommand(ctx, CommandRecord{Command: api.Command{ID: "c1", SandboxID: "ghost"}})
	if !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("command for missing sandbox: %v", err)
	}
	if err := d.PutCommand(ctx, CommandRecord{Command: api.Command{SandboxID: "sb"}}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("empty command id: %v", err)
	}
}

func TestReopenKeepsData(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "space.db")
	d, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	s := sandbox("keep", 0, api.StateRunning, map[string]string{"a": "b"})
	if err := d.PutSandbox(ctx, s); err != nil {
		t.Fatal(err)
	}
	if err := d.PutOperation(ctx, api.Operation{ID: "op", SandboxID: "keep", State: api.OpPending}); err != nil {
		t.Fatal(err)
	}
	if err := d.PutCommand(ctx, CommandRecord{Command: api.Command{ID: "c", SandboxID: "keep"}, TokenHash: "h"}); err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Errorf("db mode = %v, want 0600", fi.Mode().Perm())
	}

	d, err = Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	got, err := d.GetSandbox(ctx, "keep")
	if err != nil || !reflect.DeepEqual(got, s) {
		t.Fatalf("after reopen: %+v %v", got, err)
	}
	if ops, err := d.ListOperations(ctx, OperationFilter{Unfinished: true}); err != nil || len(ops) != 1 {
		t.Fatalf("ops after reopen: %v %v", ops, err)
	}
	if c, err := d.GetCommand(ctx, "keep", "c"); err != nil || c.TokenHash != "h" {
		t.Fatalf("command after reopen: %+v %v", c, err)
	}
	var v int
	if err := d.SQL().QueryRow("PRAGMA user_version").Scan(&v); err != nil || v != SchemaVersion {
		t.Fatalf("user_version = %d, %v", v, err)
	}
	var mode string
	if err := d.SQL().QueryRow("PRAGMA journal_mode").Scan(&mode); err != nil || mode != "wal" {
		t.Fatalf("journal_mode = %q, %v", mode, err)
	}
	var fk int
	if err := d.SQL().QueryRow("PRAGMA foreign_keys").Scan(&fk); err != nil || fk != 1 {
		t.Fatalf("foreign_keys = %d, %v", fk, err)
	}
}

func TestOpenRefusesNewerSchema(t *testing.T) {
	path := filepath.Join(t.TempDir(), "space.db")
	d, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := d.SQL().Exec(fmt.Sprintf("PRAGMA user_version = %d", SchemaVersion+1)); err != nil {
		t.Fatal(err)
	}
	d.Close()
	if _, err := Open(path); err == nil {
		t.Fatal("opened a database from a newer build")
	}
	if _, err := Open(filepath.Join(t.TempDir(), "a?b.db")); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("path with '?': %v", err)
	}
}

// TestConcurrentWriters hammers one database from many goroutines through
// one DB and through a second DB handle on the same file (as a second
// process would): none may see SQLITE_BUSY.
func TestConcurrentWriters(t *testing.T) {
	ctx := context.Background()
	d1, path := openTemp(t)
	d2, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer d2.Close()
	const workers, each = 16, 40
	var wg sync.WaitGroup
	errs := make(chan error, workers*each*3)
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			d := d1
			if w%2 == 1 {
				d = d2
			}
			for i := 0; i < each; i++ {
				id := fmt.Sprintf("w%d-%d", w, i)
				if err := d.PutSandbox(ctx, sandbox(id, i, api.StateRunning, map[string]string{"w": fmt.Sprint(w)})); err != nil {
					errs <- err
					continue
				}
				if err := d.PutCommand(ctx, CommandRecord{Command: api.Command{ID: "c", SandboxID: id}}); err != nil {
					errs <- err
				}
				if err := d.PutOperation(ctx, api.Operation{ID: "op-" + id, SandboxID: id, State: api.OpPending}); err != nil {
					errs <- err
				}
				if _, err := d.ListSandboxes(ctx, SandboxFilter{Labels: map[string]string{"w": fmt.Sprint(w)}}); err != nil {
					errs <- err
				}
			}
		}(w)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	l, err := d1.ListSandboxes(ctx, SandboxFilter{})
	if err != nil || len(l) != workers*each {
		t.Fatalf("got %d sandboxes, %v; want %d", len(l), err, workers*each)
	}
}

func TestNetworkSummaries(t *testing.T) {
	d, _ := openTemp(t)
	ctx := context.Background()
	if err := d.AddNetworkSummary(ctx, "nope", api.NetworkSummary{}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("summary of a missing sandbox: %v", err)
	}
	sb := api.Sandbox{ID: "sb1", State: api.StateRunning, Runtime: "native", CreatedAt: time.Now()}
	if err := d.PutSandbox(ctx, sb); err != nil {
		t.Fatal(err)
	}
	base := time.Now().UTC()
	for i := 0; i < maxNetworkSummaries+5; i++ {
		if err := d.AddNetworkSummary(ctx, "sb1", api.NetworkSummary{EndedAt: base.Add(time.Duration(i) * time.Second), During: "stop",
			Stats: api.NetworkStats{BytesIn: int64(i)}}); err != nil {
			t.Fatal(err)
		}
	}
	got, err := d.NetworkSummaries(ctx, "sb1", 1000)
	if err != nil || len(got) != maxNetworkSummaries || got[0].Stats.BytesIn != maxNetworkSummaries+4 {
		t.Fatalf("summaries: %d %v (newest %+v)", len(got), err, got[0])
	}
	if err := d.DeleteSandbox(ctx, "sb1"); err != nil {
		t.Fatal(err)
	}
	if got, _ := d.NetworkSummaries(ctx, "sb1", 10); len(got) != 0 {
		t.Fatalf("summaries outlived their sandbox: %d", len(got))
	}
}

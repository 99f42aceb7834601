package sandbox

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/audit"
	"github.com/spacehq/space/internal/principal"
)

// TestAuditorWithoutTheManager: the Auditor part on an in-memory sink and
// fake records — an operation's record names the caller noted at its start
// (not whoever finishes it) and the sandbox's tenant; without a noted
// caller the tenant comes from the record; a failure carries its error and
// code; a file change and a command start are recorded with a capped argv;
// the Nop sink records nothing and a nil Auditor is safe.
func TestAuditorWithoutTheManager(t *testing.T) {
	ctx := context.Background()
	recs := &fakeRecords{sbs: []api.Sandbox{{ID: "sb-1", Tenant: "acme"}}}
	sink := &audit.Memory{}
	a := newAuditor(sink, recordsGetter{recs})

	caller := principal.With(ctx, principal.Principal{KeyName: "k", KeyID: "key-1", Tenant: "acme"})
	a.noteCaller(caller, "op-1", "acme")
	fin := time.Now().UTC()
	op := api.Operation{ID: "op-1", Kind: api.OpCreate, SandboxID: "sb-1", State: api.OpSucceeded, CreatedAt: fin.Add(-time.Second), FinishedAt: &fin}
	a.auditOp(ctx, op, nil) // finished in the background: no caller in ctx
	op2 := api.Operation{ID: "op-2", Kind: api.OpDelete, SandboxID: "sb-1", State: api.OpFailed,
		Error: &api.ErrorBody{Code: "unavailable", Message: "agent gone"}}
	a.auditOp(ctx, op2, errors.New("agent gone"))
	a.AuditFiles(caller, "sb-1", "write", "/tmp/x", "", nil)
	long := []string{"sh", "-c", strings.Repeat("a", 10000)}
	a.auditCommandStart(caller, api.Sandbox{ID: "sb-1", Tenant: "acme"}, "cmd-1", "detached", long, "root", "/", nil)

	evs := sink.Events()
	if len(evs) != 4 {
		t.Fatalf("%d events, want 4: %+v", len(evs), evs)
	}
	if e := evs[0]; e.Kind != audit.KindLifecycle || e.Action != api.OpCreate || e.KeyID != "key-1" || e.Tenant != "acme" || e.Detail["duration_ms"] == nil {
		t.Errorf("create's record: %+v", e)
	}
	if e := evs[1]; e.Tenant != "acme" || e.KeyID != "" || e.Detail["code"] != "unavailable" || e.Detail["error"] != "agent gone" {
		t.Errorf("failed delete's record (tenant from the sandbox's record): %+v", e)
	}
	if e := evs[2]; e.Action != "write" || e.Target != "/tmp/x" || e.KeyID != "key-1" {
		t.Errorf("file write's record: %+v", e)
	}
	if e := evs[3]; !strings.Contains(strings.Join(anyStrings(e.Detail["argv"]), " "), "sh -c") || len(strings.Join(anyStrings(e.Detail["argv"]), "")) >= 10000 || e.Detail["argv_truncated"] != true {
		t.Errorf("command start's record does not hold a capped argv: %+v", e)
	}

	off := newAuditor(audit.Nop{}, recordsGetter{recs})
	off.noteCaller(caller, "op-3", "acme")
	off.auditOp(ctx, api.Operation{ID: "op-3"}, nil)
	var none *Auditor
	none.AuditFiles(ctx, "sb-1", "write", "/x", "", nil)
}

// recordsGetter gives fakeRecords the store's GetSandbox.
type recordsGetter struct{ *fakeRecords }

func (r recordsGetter) GetSandbox(ctx context.Context, id string) (api.Sandbox, error) {
	return r.get(ctx, id)
}

func anyStrings(v any) []string {
	switch x := v.(type) {
	case []string:
		return x
	case []any:
		out := make([]string, 0, len(x))
		for _, s := range x {
			out = append(out, s.(string))
		}
		return out
	}
	return nil
}

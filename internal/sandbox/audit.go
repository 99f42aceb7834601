package sandbox

import (
	"context"
	"strconv"
	"strings"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/audit"
	"github.com/spacehq/space/internal/principal"
	"github.com/spacehq/space/internal/store"
)

// What the manager records in the audit log (Config.Audit):
//
//   - the end of every lifecycle operation (kind lifecycle, action = the
//     operation's kind, target = its id, result = its state), by whoever
//     asked for it (noteCaller keeps the request's principal until the
//     operation, which runs in the background, ends);
//   - every command start (argv capped, user, cwd; never env) and exit
//     (exit code or signal), of sync execs, sessions and start commands;
//   - every files API change (AuditFiles: write, tar_put, remove, mkdir,
//     rename), attempted or done;
//   - every network verdict of the gateway (netaudit.go).

// Bounds on the argv an audit record carries: it is not secret, but it is
// the caller's and may be huge.
const (
	auditLookupTimeout = 5 * time.Second
	auditMaxArgs       = 64
	auditMaxArg        = 1024
	auditMaxArgvLen    = 8192
)

// opCaller is who asked for an operation, kept from the request until the
// operation ends.
type opCaller struct {
	p      principal.Principal
	tenant string // the sandbox's tenant
}

// sandboxGetter is what the Auditor part reads of the store: a sandbox's
// tenant, for an operation record without a caller.
type sandboxGetter interface {
	GetSandbox(ctx context.Context, id string) (api.Sandbox, error)
}

var _ sandboxGetter = (*store.DB)(nil)

// newAuditor makes the Auditor part from the audit sink and the sandbox
// records, not the Manager.
func newAuditor(sink audit.Sink, records sandboxGetter) *Auditor {
	return &Auditor{sink: sink, records: records}
}

// noteCaller remembers ctx's principal (and the sandbox's tenant) for
// operation opID's audit record.
func (part *Auditor) noteCaller(ctx context.Context, opID, tenant string) {
	if part.auditOff() {
		return
	}
	p, _ := principal.From(ctx)
	part.callers.Store(opID, opCaller{p: p, tenant: tenant})
}

func (part *Auditor) auditOff() bool {
	_, nop := part.sink.(audit.Nop)
	return nop
}

// auditOp records the end of op (err: how it failed).
func (part *Auditor) auditOp(ctx context.Context, op api.Operation, err error) {
	if part.auditOff() {
		return
	}
	ev := audit.Event{Kind: audit.KindLifecycle, Action: op.Kind, Sandbox: op.SandboxID, Target: op.ID, Result: op.State}
	if c, ok := part.callers.LoadAndDelete(op.ID); ok {
		oc := c.(opCaller)
		ev.KeyID, ev.Tenant = oc.p.KeyID, oc.tenant
	} else if p, ok := principal.From(ctx); ok {
		ev.KeyID = p.KeyID
	}
	if ev.Tenant == "" {
		ev.Tenant = part.tenantOf(op.SandboxID)
	}
	d := map[string]any{"operation": op.ID}
	if op.FinishedAt != nil {
		d["duration_ms"] = op.FinishedAt.Sub(op.CreatedAt).Milliseconds()
	}
	if err != nil {
		d["error"] = truncate(err.Error(), 1024)
		if op.Error != nil {
			d["code"] = op.Error.Code
		}
	}
	ev.Detail = d
	part.sink.Record(ctx, ev)
}

// tenantOf is the tenant of sandbox id ("" when unknown: the log makes it
// the caller's or the default).
func (part *Auditor) tenantOf(id string) string {
	ctx, cancel := context.WithTimeout(context.Background(), auditLookupTimeout)
	defer cancel()
	if sb, err := part.records.GetSandbox(ctx, id); err == nil {
		return sb.Tenant
	}
	return ""
}

// cappedArgv is argv bounded for a record, and whether it was cut.
func cappedArgv(argv []string) ([]string, bool) {
	out := make([]string, 0, min(len(argv), auditMaxArgs))
	total, cut := 0, false
	for i, a := range argv {
		if i == auditMaxArgs || total >= auditMaxArgvLen {
			cut = true
			break
		}
		if len(a) > auditMaxArg {
			a, cut = a[:auditMaxArg], true
		}
		total += len(a)
		out = append(out, a)
	}
	return out, cut
}

// auditCommandStart records that command cmdID of sb started (err nil) or
// failed to.
func (part *Auditor) auditCommandStart(ctx context.Context, sb api.Sandbox, cmdID, how string, argv []string, user, cwd string, err error) {
	if part.auditOff() {
		return
	}
	a, cut := cappedArgv(argv)
	d := map[string]any{"argv": a, "user": user, "cwd": cwd, "how": how}
	if cut {
		d["argv_truncated"] = true
	}
	res := "started"
	if err != nil {
		res = "failed"
		d["error"] = truncate(err.Error(), 1024)
	}
	part.sink.Record(ctx, audit.Event{Kind: audit.KindCommand, Action: "start", Sandbox: sb.ID, Target: cmdID, Result: res, Tenant: sb.Tenant, Detail: d})
}

// auditCommandExit records how command cmdID of sandbox id ended.
func (part *Auditor) auditCommandExit(ctx context.Context, id, tenant, cmdID string, st api.ExitStatus) {
	if part.auditOff() {
		return
	}
	if tenant == "" {
		tenant = part.tenantOf(id)
	}
	d := map[string]any{"exit_code": st.ExitCode}
	if st.Signal != "" {
		d["signal"] = st.Signal
	}
	if st.OOMKilled {
		d["oom_killed"] = true
	}
	if st.Reason != "" {
		d["reason"] = truncate(st.Reason, 256)
	}
	part.sink.Record(ctx, audit.Event{Kind: audit.KindCommand, Action: "exit", Sandbox: id, Target: cmdID, Result: strconv.Itoa(st.ExitCode), Tenant: tenant, Detail: d})
}

// AuditFiles records a files API change of sandbox id: action is write,
// tar_put, remove, mkdir or rename (to: the new path), err how it failed.
// Callers are the server's and the E2B API's files handlers, which reach
// the agent directly.
func (part *Auditor) AuditFiles(ctx context.Context, id, action, path, to string, err error) {
	if part == nil || part.auditOff() {
		return
	}
	res := "ok"
	d := map[string]any{}
	if err != nil {
		res = "failed"
		d["error"] = truncate(err.Error(), 1024)
	}
	if to != "" {
		d["to"] = truncate(to, 4096)
	}
	ev := audit.Event{Kind: audit.KindFiles, Action: action, Sandbox: id, Target: truncate(path, 4096), Result: res, Tenant: part.tenantOf(id)}
	if len(d) > 0 {
		ev.Detail = d
	}
	part.sink.Record(ctx, ev)
}

// commandHow says what kind of command rec is, for its start record.
func commandHow(rec *store.CommandRecord) string {
	if strings.HasPrefix(rec.ID, StartCommandIDPrefix) {
		return "start_command"
	}
	return "session"
}

// auditExecExit records how a synchronous exec ended.
func (part *Auditor) auditExecExit(ctx context.Context, sb api.Sandbox, res api.ExecResult) {
	st := api.ExitStatus{ExitCode: res.ExitCode, Signal: res.Signal, OOMKilled: res.OOMKilled}
	if res.TimedOut {
		st.Reason = "timed out"
	}
	part.auditCommandExit(ctx, sb.ID, sb.Tenant, "exec", st)
}

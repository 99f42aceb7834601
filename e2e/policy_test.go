package e2e

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/sdk"
)

// pendingApproval waits for the one pending approval of sandbox id.
func pendingApproval(t *testing.T, e *env, id string) api.Approval {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		list, err := e.client.Approvals(ctxT(t, time.Minute), sdk.ApprovalsOptions{State: api.ApprovalPending, Sandbox: id})
		if err != nil {
			t.Fatal(err)
		}
		if len(list.Approvals) == 1 {
			return list.Approvals[0]
		}
	}
	t.Fatal("no pending approval")
	return api.Approval{}
}

func policyDenied(t *testing.T, err error, want string) {
	t.Helper()
	var ae *sdk.APIError
	if !errors.Is(err, sdk.ErrPolicyDenied) || !errors.As(err, &ae) || ae.Status != 403 || ae.Code != api.CodePolicyDenied || !strings.Contains(ae.Message, want) {
		t.Fatalf("got %v, want 403 policy_denied saying %q", err, want)
	}
}

// TestPolicyOnANativeSandbox: rules attached to one sandbox decide its
// execs, files API calls and lifecycle verbs; an "ask" holds the exec
// until it is approved (it then runs) or denied (403 with the reason);
// rules change live; a rule reads the history the hooks recorded.
func TestPolicyOnANativeSandbox(t *testing.T) {
	e := setup(t)
	ctx := ctxT(t, 5*time.Minute)
	sb := newSandbox(t, e, api.CreateSandboxRequest{Runtime: "native"})
	sh(t, e, sb.ID, "mkdir -p /data/secret /data/pii")
	scope := "sandbox:" + sb.ID
	t.Cleanup(func() { e.client.DeletePolicyRuleSet(context.Background(), scope) })
	set := func(rules ...api.PolicyRule) {
		t.Helper()
		if _, err := e.client.SetPolicyRuleSet(ctx, scope, api.PolicyRuleSet{Rules: rules}); err != nil {
			t.Fatal(err)
		}
	}
	curlAsk := api.PolicyRule{Name: "curl-ask", Match: `action.kind == "exec" && action.argv[0].matches("(^|/)(curl|wget)$")`, Verdict: "ask", Reason: "network tools need a human"}
	secretRead := api.PolicyRule{Name: "no-secret-reads", Match: `action.kind == "file.read" && under(action.path, "/data/secret")`, Verdict: "deny", Reason: "secrets stay put"}
	set(curlAsk, secretRead)

	// A rule that does not compile is a 400 with CEL's position.
	_, err := e.client.SetPolicyRuleSet(ctx, scope, api.PolicyRuleSet{Rules: []api.PolicyRule{{Name: "bad", Match: `action.pth == "/x"`, Verdict: "deny"}}})
	if !errors.Is(err, sdk.ErrInvalidArgument) || !strings.Contains(err.Error(), "1:7") || !strings.Contains(err.Error(), "pth") {
		t.Fatalf("bad rule: %v", err)
	}

	// ask → the exec waits; approve → it runs.
	type res struct {
		r   *api.ExecResult
		err error
	}
	done := make(chan res, 1)
	go func() {
		r, err := e.client.Exec(ctx, sb.ID, api.ExecRequest{Cmd: []string{"curl", "--version"}})
		done <- res{r, err}
	}()
	ap := pendingApproval(t, e, sb.ID)
	if ap.Rule != scope+"/curl-ask" || ap.Reason != "network tools need a human" || !slices.Equal(ap.Action.Argv, []string{"curl", "--version"}) || ap.Action.Kind != "exec" {
		t.Fatalf("approval %+v", ap)
	}
	select {
	case r := <-done:
		t.Fatalf("exec finished before an answer: %+v %v", r.r, r.err)
	case <-time.After(300 * time.Millisecond):
	}
	if _, err := e.client.Approve(ctx, ap.ID, ""); err != nil {
		t.Fatal(err)
	}
	r := <-done
	if r.err != nil || r.r.ExitCode != 0 || !strings.Contains(r.r.Stdout, "curl") {
		t.Fatalf("approved exec: %+v %v", r.r, r.err)
	}
	if _, err := e.client.Approve(ctx, ap.ID, ""); !errors.Is(err, sdk.ErrConflict) {
		t.Fatalf("second answer: %v", err)
	}

	// ask → deny: 403 policy_denied with the approver's reason; nothing ran.
	go func() {
		r, err := e.client.Exec(ctx, sb.ID, api.ExecRequest{Cmd: []string{"sh", "-c", "touch /tmp/ran"}})
		done <- res{r, err}
	}()
	// (sh is not curl: that one runs; now the one that asks.)
	if r := <-done; r.err != nil {
		t.Fatal(r.err)
	}
	go func() {
		r, err := e.client.Exec(ctx, sb.ID, api.ExecRequest{Cmd: []string{"wget", "-O", "/tmp/got", "http://x/"}})
		done <- res{r, err}
	}()
	ap = pendingApproval(t, e, sb.ID)
	if _, err := e.client.Deny(ctx, ap.ID, "not during the audit"); err != nil {
		t.Fatal(err)
	}
	policyDenied(t, (<-done).err, "not during the audit")

	// Files: reads under /data/secret are refused; writes and other reads are not.
	if _, err := e.client.WriteFile(ctx, sb.ID, "/data/secret/key", strings.NewReader("k"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err = e.client.ReadFile(ctx, sb.ID, "/data/secret/key")
	policyDenied(t, err, "secrets stay put")
	if rc, err := e.client.ReadFile(ctx, sb.ID, "/etc/hostname"); err != nil {
		t.Fatal(err)
	} else {
		io.Copy(io.Discard, rc)
		rc.Close()
	}

	// Live update: the next action sees the new rules.
	set(api.PolicyRule{Name: "after-pii-no-curl", Match: `action.kind == "exec" && seen("file.read", "/data/pii") && action.argv[0] == "curl"`, Verdict: "deny", Reason: "PII was read"},
		api.PolicyRule{Name: "no-pause", Match: `action.kind == "lifecycle" && action.verb == "pause"`, Verdict: "deny", Reason: "stay awake"},
		api.PolicyRule{Name: "no-public-8080", Match: `action.kind == "port" && action.port == 8080`, Verdict: "deny", Reason: "8080 stays private"})
	rc, err := e.client.ReadFile(ctx, sb.ID, "/data/secret/key")
	if err != nil {
		t.Fatalf("read after the rule went: %v", err)
	}
	rc.Close()
	if _, err := e.client.Exec(ctx, sb.ID, api.ExecRequest{Cmd: []string{"curl", "--version"}}); err != nil {
		t.Fatalf("curl before any PII read: %v", err)
	}
	if _, err := e.client.WriteFile(ctx, sb.ID, "/data/pii/users.csv", strings.NewReader("a,b"), 0o600); err != nil {
		t.Fatal(err)
	}
	rc, err = e.client.ReadFile(ctx, sb.ID, "/data/pii/users.csv")
	if err != nil {
		t.Fatal(err)
	}
	rc.Close()
	_, err = e.client.Exec(ctx, sb.ID, api.ExecRequest{Cmd: []string{"curl", "--version"}})
	policyDenied(t, err, "PII was read")
	_, err = e.client.Lifecycle(ctx, sb.ID, api.OpPause)
	policyDenied(t, err, "stay awake")
	_, err = e.client.SetPortPublic(ctx, sb.ID, 8080, true)
	policyDenied(t, err, "8080 stays private")
	if _, err := e.client.SetPortPublic(ctx, sb.ID, 8081, true); err != nil {
		t.Fatalf("another port: %v", err)
	}

	// The CLI shows the rule set and the answered approvals.
	out, errOut, code := e.spaceCLI(t, "", "policy", "get", scope)
	if code != 0 || !strings.Contains(out, "after-pii-no-curl") {
		t.Fatalf("policy get: %d %s %s", code, out, errOut)
	}
	out, errOut, code = e.spaceCLI(t, "", "approvals", "ls", "--sandbox", sb.ID)
	if code != 0 || !strings.Contains(out, "approved") || !strings.Contains(out, "denied") {
		t.Fatalf("approvals ls: %d %s %s", code, out, errOut)
	}
}

// TestPolicyProposal: a name the network policy refused is listed with
// its count and, approved, joins the sandbox's allow_out.
func TestPolicyProposal(t *testing.T) {
	e := setup(t)
	ctx := ctxT(t, 5*time.Minute)
	sb := newSandbox(t, e, api.CreateSandboxRequest{Runtime: "native", Network: &api.NetworkPolicy{AllowOut: []string{"allowed.test"}, AllowPrivate: []string{"127.0.0.0/8"}}})
	for range 2 {
		sh(t, e, sb.ID, "getent hosts other.test || true")
	}
	id := "prop:" + sb.ID + ":other.test"
	var found *api.Proposal
	for deadline := time.Now().Add(20 * time.Second); found == nil && time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		list, err := e.client.Approvals(ctx, sdk.ApprovalsOptions{Sandbox: sb.ID})
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range list.Proposals {
			if p.ID == id && p.Count >= 2 {
				found = &p
			}
		}
	}
	if found == nil {
		t.Fatalf("no proposal %s; events %+v", id, networkEvents(t, e, sb.ID))
	}
	out, _, code := e.spaceCLI(t, "", "approvals", "ls")
	if code != 0 || !strings.Contains(out, id) {
		t.Fatalf("approvals ls: %s", out)
	}
	if _, err := e.client.Deny(ctx, id, ""); !errors.Is(err, sdk.ErrInvalidArgument) {
		t.Fatalf("deny of a proposal: %v", err)
	}
	if _, _, code := e.spaceCLI(t, "", "approve", id); code != 0 {
		t.Fatalf("approve exited %d", code)
	}
	info, err := e.client.SandboxNetwork(ctx, sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(info.Policy.AllowOut, []string{"allowed.test", "other.test"}) {
		t.Fatalf("allow_out %v", info.Policy.AllowOut)
	}
	if out, code := sh(t, e, sb.ID, "getent hosts other.test"); code != 0 || !strings.Contains(out, "other.test") {
		t.Fatalf("other.test after approval: %d %s", code, out)
	}
	if _, err := e.client.Approve(ctx, id, ""); !errors.Is(err, sdk.ErrNotFound) {
		t.Fatalf("approving an allowed name again: %v", err)
	}
}

// TestPolicyTenants: rule sets and approvals stay inside their tenant —
// another tenant's scopes and approvals answer 404, server-wide rules need
// admin, and the approval records the key that answered.
func TestPolicyTenants(t *testing.T) {
	e := setup(t)
	ctx := ctxT(t, 5*time.Minute)
	newClient := func(tenant, scopes string) (*sdk.Client, string) {
		k, err := e.client.CreateKey(ctx, api.CreateKeyRequest{Name: "pol-" + tenant, Tenant: tenant, Scopes: strings.Split(scopes, ",")})
		if err != nil {
			t.Fatal(err)
		}
		c, _ := sdk.New(e.url, k.Key)
		return c, k.ID
	}
	ca, kaID := newClient("pol-a", "sandbox:write,exec:write,policy:write")
	cb, _ := newClient("pol-b", "sandbox:write,exec:write,policy:write")
	ro, _ := newClient("pol-a", "sandbox:read,policy:read")
	sb, err := ca.CreateSandboxAndWait(ctx, api.CreateSandboxRequest{Runtime: "native"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if op, err := e.client.DeleteSandbox(context.Background(), sb.ID, true); err == nil {
			e.client.WaitOperation(context.Background(), op.ID)
		}
	})
	scope := "sandbox:" + sb.ID
	rules := api.PolicyRuleSet{Rules: []api.PolicyRule{{Name: "ask-all-execs", Match: `action.kind == "exec"`, Verdict: "ask"}}}
	if _, err := ca.SetPolicyRuleSet(ctx, scope, rules); err != nil {
		t.Fatal(err)
	}
	if _, err := ro.SetPolicyRuleSet(ctx, scope, rules); !errors.Is(err, sdk.ErrPermissionDenied) {
		t.Fatalf("policy:read key setting rules: %v", err)
	}
	for _, sc := range []string{scope, "tenant:pol-a"} {
		if _, err := cb.SetPolicyRuleSet(ctx, sc, rules); !errors.Is(err, sdk.ErrNotFound) {
			t.Fatalf("other tenant setting %s: %v", sc, err)
		}
	}
	if _, err := cb.PolicyRuleSet(ctx, scope); !errors.Is(err, sdk.ErrNotFound) {
		t.Fatalf("other tenant reading %s: %v", scope, err)
	}
	if _, err := ca.SetPolicyRuleSet(ctx, "server", rules); !errors.Is(err, sdk.ErrPermissionDenied) {
		t.Fatalf("non-admin setting server rules: %v", err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := ca.Exec(ctx, sb.ID, api.ExecRequest{Cmd: []string{"true"}})
		done <- err
	}()
	ap := pendingApproval(t, e, sb.ID)
	if ap.Tenant != "pol-a" {
		t.Fatalf("approval tenant %q", ap.Tenant)
	}
	if list, err := cb.Approvals(ctx, sdk.ApprovalsOptions{}); err != nil || slices.ContainsFunc(list.Approvals, func(a api.Approval) bool { return a.ID == ap.ID }) {
		t.Fatalf("other tenant lists %+v %v", list, err)
	}
	if _, err := cb.Approve(ctx, ap.ID, ""); !errors.Is(err, sdk.ErrNotFound) {
		t.Fatalf("other tenant approving: %v", err)
	}
	got, err := ca.Approve(ctx, ap.ID, "")
	if err != nil || got.AnsweredBy != kaID {
		t.Fatalf("approve: %+v %v", got, err)
	}
	if err := <-done; err != nil {
		t.Fatalf("approved exec: %v", err)
	}
}

// TestPolicyGatesConnections: the policy engine, not a test fake, decides
// a native sandbox's connections through the real gateway process: an
// "ask" holds curl's connection until it is approved (with the executable
// the host saw opening it), a "deny" resets it with the rule's reason in
// the network events, and removing the rules lets it through unasked.
func TestPolicyGatesConnections(t *testing.T) {
	e := setup(t)
	ctx := ctxT(t, 5*time.Minute)
	sb := newSandbox(t, e, api.CreateSandboxRequest{Runtime: "native", Network: &api.NetworkPolicy{AllowOut: []string{"allowed.test"}, AllowPrivate: []string{"127.0.0.0/8"}}})
	scope := "sandbox:" + sb.ID
	t.Cleanup(func() { e.client.DeletePolicyRuleSet(context.Background(), scope) })
	url := fmt.Sprintf("http://allowed.test:%d/", e.internet.httpPort)
	curl := "curl -sS --max-time 60 " + url

	if _, err := e.client.SetPolicyRuleSet(ctx, scope, api.PolicyRuleSet{Rules: []api.PolicyRule{{Name: "egress-ask",
		Match: `action.kind == "connect" && action.name == "allowed.test"`, Verdict: "ask", Reason: "egress needs a human"}}}); err != nil {
		t.Fatal(err)
	}
	type res struct {
		out  string
		code int
	}
	done := make(chan res, 1)
	go func() { out, code := sh(t, e, sb.ID, curl); done <- res{out, code} }()
	ap := pendingApproval(t, e, sb.ID)
	if ap.Action.Kind != "connect" || ap.Action.Name != "allowed.test" || !strings.HasSuffix(ap.Action.Exe, "curl") {
		t.Fatalf("approval %+v", ap.Action)
	}
	select {
	case r := <-done:
		t.Fatalf("curl finished before the approval: %+v", r)
	case <-time.After(300 * time.Millisecond):
	}
	if _, err := e.client.Approve(ctx, ap.ID, "ok"); err != nil {
		t.Fatal(err)
	}
	if r := <-done; r.code != 0 || !strings.Contains(r.out, "127.0.0.2:") {
		t.Fatalf("curl after approval: %+v", r)
	}

	if _, err := e.client.SetPolicyRuleSet(ctx, scope, api.PolicyRuleSet{Rules: []api.PolicyRule{{Name: "egress-deny",
		Match: `action.kind == "connect"`, Verdict: "deny", Reason: "no egress today"}}}); err != nil {
		t.Fatal(err)
	}
	if out, code := sh(t, e, sb.ID, curl); code == 0 {
		t.Fatalf("curl under a deny rule: %q", out)
	}
	found := false
	for _, ev := range networkEvents(t, e, sb.ID) {
		if ev.Verdict == api.VerdictDeny && strings.Contains(ev.Reason, "no egress today") {
			found = true
		}
	}
	if !found {
		t.Errorf("no deny event with the rule's reason: %+v", networkEvents(t, e, sb.ID))
	}
	if err := e.client.DeletePolicyRuleSet(ctx, scope); err != nil {
		t.Fatal(err)
	}
	if out, code := sh(t, e, sb.ID, curl); code != 0 {
		t.Fatalf("curl without rules: %d %q", code, out)
	}
}

package e2e

import (
	"context"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/sdk"
)

// TestTenantKeysWithRealSandboxes drives keys and tenants as an operator
// would, through the CLI, against real native sandboxes: a tenant's key
// runs its own sandbox; another tenant's key finds nothing (404, on the
// native and the E2B API alike); a key without a scope is refused; a
// quota stops the next create with 429; a revoked key stops at once.
func TestTenantKeysWithRealSandboxes(t *testing.T) {
	e := setup(t)
	ctx := ctxT(t, 5*time.Minute)
	newKey := func(tenant, scopes string) string {
		out, errOut, code := e.spaceCLI(t, "", "key", "create", "--name", "e2e-"+tenant, "--tenant", tenant, "--scope", scopes)
		if code != 0 || !strings.HasPrefix(out, "sk_") || !strings.Contains(errOut, "not shown again") {
			t.Fatalf("key create: %d %q %q", code, out, errOut)
		}
		return strings.TrimSpace(out)
	}
	ka := newKey("e2e-a", "sandbox:write,exec:write")
	kb := newKey("e2e-b", "sandbox:write,exec:write,files:write")
	ca, _ := sdk.New(e.url, ka)
	cb, _ := sdk.New(e.url, kb)

	sb, err := ca.CreateSandboxAndWait(ctx, api.CreateSandboxRequest{Runtime: "native"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if op, err := e.client.DeleteSandbox(context.Background(), sb.ID, true); err == nil {
			e.client.WaitOperation(context.Background(), op.ID)
		}
	})
	if sb.Tenant != "e2e-a" {
		t.Errorf("sandbox tenant %q", sb.Tenant)
	}
	out, _, code := e.spaceCLI(t, "", "--api-key", ka, "exec", sb.ID, "--", "sh", "-c", "echo hi from $(hostname)")
	if code != 0 || !strings.Contains(out, "hi from") {
		t.Fatalf("exec with the owner's key: %d %q", code, out)
	}
	// The other tenant: not found, everywhere, exactly like a missing id.
	if _, err := cb.Exec(ctx, sb.ID, api.ExecRequest{Cmd: []string{"true"}}); !errors.Is(err, sdk.ErrNotFound) {
		t.Errorf("team-b exec: %v, want not found", err)
	}
	if _, err := cb.GetSandbox(ctx, sb.ID); !errors.Is(err, sdk.ErrNotFound) {
		t.Errorf("team-b get: %v", err)
	}
	if _, _, code := e.spaceCLI(t, "", "--api-key", kb, "exec", sb.ID, "--", "true"); code == 0 {
		t.Error("team-b's CLI exec into team-a's sandbox succeeded")
	}
	if out, _, _ := e.spaceCLI(t, "", "--api-key", kb, "ls"); strings.Contains(out, sb.ID) {
		t.Errorf("team-b's ls shows team-a's sandbox:\n%s", out)
	}
	for _, path := range []string{"/e2b/sandboxes/" + sb.ID, "/e2b/sandboxes/" + sb.ID + "/metrics"} {
		req, _ := http.NewRequestWithContext(ctx, "GET", e.url+path, nil)
		req.Header.Set("X-API-KEY", kb)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 404 {
			t.Errorf("E2B %s as team-b: %d %s", path, resp.StatusCode, b)
		}
	}
	// Own sandbox, scope it lacks.
	if _, err := ca.ReadFile(ctx, sb.ID, "/etc/hostname"); !errors.Is(err, sdk.ErrPermissionDenied) {
		t.Errorf("files read without files:read: %v", err)
	}
	// Quota: one sandbox at most; the second create is refused saying so.
	if _, errOut, code := e.spaceCLI(t, "", "tenant", "set", "e2e-a", "--sandboxes", "1"); code != 0 {
		t.Fatalf("tenant set: %s", errOut)
	}
	_, err = ca.CreateSandbox(ctx, api.CreateSandboxRequest{Runtime: "native"})
	if !errors.Is(err, sdk.ErrQuotaExceeded) || !strings.Contains(err.Error(), "1 used") {
		t.Errorf("create over quota: %v", err)
	}
	out, _, _ = e.spaceCLI(t, "", "tenant", "get", "e2e-a")
	if !strings.Contains(out, "1 / 1") {
		t.Errorf("tenant get:\n%s", out)
	}
	// Keys are listed without their secrets; revoking one ends it.
	out, _, _ = e.spaceCLI(t, "", "key", "ls")
	if strings.Contains(out, ka) || !strings.Contains(out, "e2e-e2e-a") {
		t.Errorf("key ls:\n%s", out)
	}
	keys, err := e.client.ListKeys(ctx, "e2e-a")
	if err != nil || len(keys) != 1 {
		t.Fatalf("list keys: %v %v", keys, err)
	}
	if _, _, code := e.spaceCLI(t, "", "key", "revoke", keys[0].ID); code != 0 {
		t.Fatal("revoke failed")
	}
	if _, err := ca.GetSandbox(ctx, sb.ID); !errors.Is(err, sdk.ErrUnauthorized) {
		t.Errorf("revoked key: %v, want unauthorized", err)
	}
}

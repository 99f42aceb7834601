package e2e

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/sdk"
)

// TestPoolAPIBadInputs: every bad pool spec is a 4xx naming the problem.
func TestPoolAPIBadInputs(t *testing.T) {
	e := setup(t)
	ctx := ctxT(t, time.Minute)
	cases := []struct {
		name, method, path, body string
		status                   int
		contains                 string
	}{
		{"min over max", "PUT", "/v1/pools", `{"template":"base:latest","min":3,"max":2}`, 400, "min (3) must not exceed max (2)"},
		{"negative", "PUT", "/v1/pools", `{"template":"base:latest","min":-1,"max":2}`, 400, "negative"},
		{"too big", "PUT", "/v1/pools", `{"template":"base:latest","min":1,"max":1000}`, 400, "max must be at most"},
		{"unknown runtime", "PUT", "/v1/pools", `{"template":"base:latest","runtime":"xen","min":1,"max":1}`, 400, "unknown runtime"},
		{"unknown template", "PUT", "/v1/pools", `{"template":"nope:latest","min":1,"max":1}`, 404, "nope:latest"},
		{"malformed template", "PUT", "/v1/pools", `{"template":"../etc","min":1,"max":1}`, 400, "template"},
		{"no template", "PUT", "/v1/pools", `{"min":1,"max":1}`, 400, "template is required"},
		{"bad shape", "PUT", "/v1/pools", `{"template":"base:latest","limits":{"memory_mib":-5},"min":1,"max":1}`, 400, "memory_mib"},
		{"unknown field", "PUT", "/v1/pools", `{"template":"base:latest","size":3}`, 400, "unknown field"},
		{"unknown pool", "GET", "/v1/pools/pool-000000000000", "", 404, "not found"},
		{"delete unknown pool", "DELETE", "/v1/pools/pool-000000000000", "", 404, "not found"},
	}
	for _, c := range cases {
		req, _ := http.NewRequestWithContext(ctx, c.method, e.url+c.path, strings.NewReader(c.body))
		req.Header.Set("Authorization", "Bearer "+e.key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != c.status || !strings.Contains(string(b), c.contains) || !strings.Contains(string(b), `"error"`) {
			t.Errorf("%s: %d %s, want %d naming %q", c.name, resp.StatusCode, b, c.status, c.contains)
		}
	}
}

// TestPoolClaimsThroughTheCLI: `space pool set` makes a pool of a shape;
// creates of that shape claim its members (phase claim_pool) with the
// caller's network policy in force (a claimed sandbox allowed a fake host
// reaches it, one without a policy does not); `space pool ls` counts the
// hits; `space pool rm` drains it. The server's default pool is listed.
func TestPoolClaimsThroughTheCLI(t *testing.T) {
	e := setup(t)
	ctx := ctxT(t, 5*time.Minute)
	e.ensureBase(t, ctx)
	out, errOut, code := e.spaceCLI(t, "", "pool", "set", "base:latest", "--runtime", "gvisor", "--memory", "384m", "--min", "1", "--max", "2", "--json")
	if code != 0 {
		t.Fatalf("pool set: %d %s %s", code, out, errOut)
	}
	var p api.Pool
	if err := json.Unmarshal([]byte(out), &p); err != nil || !strings.HasPrefix(p.ID, "pool-") || p.Spec.Limits.MemoryMiB != 384 {
		t.Fatalf("pool set answer %q: %v", out, err)
	}
	defer e.spaceCLI(t, "", "pool", "rm", p.ID)
	waitPool := func(ready int) api.Pool {
		t.Helper()
		for {
			got, err := e.client.Pool(ctx, p.ID)
			if err != nil {
				t.Fatal(err)
			}
			if got.Ready >= ready {
				return *got
			}
			if ctx.Err() != nil {
				t.Fatalf("pool never got %d ready: %+v", ready, got)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	waitPool(1)
	claim := func(pol *api.NetworkPolicy) *api.Sandbox {
		t.Helper()
		resp, err := e.client.CreateSandbox(ctx, api.CreateSandboxRequest{Runtime: "gvisor", Limits: api.Limits{MemoryMiB: 384}, Network: pol})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if op, err := e.client.DeleteSandbox(ctx, resp.Sandbox.ID, true); err == nil {
				e.client.WaitOperation(ctx, op.ID)
			}
		})
		op, err := e.client.WaitOperation(ctx, resp.Operation.ID)
		if err != nil || op.State != api.OpSucceeded {
			t.Fatalf("create: %v %+v", err, op)
		}
		var names []string
		for _, ph := range op.Phases {
			names = append(names, ph.Name)
		}
		if !slices.Contains(names, "claim_pool") {
			t.Fatalf("create did not claim from the pool: phases %v", names)
		}
		return &resp.Sandbox
	}
	allowed := claim(&api.NetworkPolicy{AllowOut: []string{"allowed.test"}, AllowPrivate: []string{"127.0.0.0/8"}})
	url := fmt.Sprintf("http://allowed.test:%d/", e.internet.httpPort)
	if out, code := sh(t, e, allowed.ID, "curl -sS --max-time 10 "+url); code != 0 || !strings.Contains(out, "127.0.0.2:") {
		t.Fatalf("claimed sandbox with a policy allowing allowed.test: %d %q", code, out)
	}
	waitPool(1)
	closed := claim(nil)
	if out, code := sh(t, e, closed.ID, "curl -sS --max-time 10 "+url); code == 0 {
		t.Fatalf("claimed sandbox without a policy reached allowed.test: %q", out)
	}
	if host, _ := sh(t, e, closed.ID, "cat /etc/hostname; hostname"); strings.TrimSpace(host) != closed.ID+"\n"+closed.ID {
		t.Errorf("hostname of claimed %s: %q", closed.ID, host)
	}
	out, _, code = e.spaceCLI(t, "", "pool", "ls")
	if code != 0 || !strings.Contains(out, p.ID) || !strings.Contains(out, "HITS") {
		t.Fatalf("pool ls: %d %q", code, out)
	}
	got, _ := e.client.Pool(ctx, p.ID)
	if got.Hits < 2 {
		t.Errorf("pool counted %d hits, want 2", got.Hits)
	}
	pools, err := e.client.ListPools(ctx)
	if err != nil {
		t.Fatal(err)
	}
	def := ""
	for _, q := range pools {
		if q.Spec.Template == "base:latest" && q.Spec.Runtime == "auto" {
			def = q.ID
		}
	}
	if def == "" {
		t.Errorf("the server's default pool is not listed: %+v", pools)
	} else if info, err := e.client.Info(ctx); err != nil {
		t.Fatal(err)
	} else {
		// The runtime auto picks, by name, with the default limits: the
		// default pool's members; refused with 409 naming it.
		_, err := e.client.SetPool(ctx, api.PoolSpec{Template: "base:latest", Runtime: info.AutoRuntime, Max: 1})
		if !errors.Is(err, sdk.ErrConflict) || !strings.Contains(err.Error(), def) {
			t.Errorf("a twin of the default pool on %s: %v, want a conflict naming %s", info.AutoRuntime, err, def)
		}
	}
	if _, _, code := e.spaceCLI(t, "", "pool", "rm", p.ID); code != 0 {
		t.Fatalf("pool rm: %d", code)
	}
	if _, err := e.client.Pool(ctx, p.ID); err == nil {
		t.Fatal("pool still there after rm")
	}
}

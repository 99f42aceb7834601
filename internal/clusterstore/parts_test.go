package clusterstore

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/spacehq/space/api"
)

// TestPartsShareOnePool: each part works on its own, over the Store's one
// pool, and sees what another part wrote.
func TestPartsShareOnePool(t *testing.T) {
	s, _ := open(t)
	ctx := context.Background()
	for name, p := range map[string]*pgxpool.Pool{
		"Nodes": s.Nodes().pool, "Sandboxes": s.Sandboxes().pool, "Keys": s.Keys().pool,
		"Settings": s.Settings().pool, "Secrets": s.Secrets().pool, "AuditHeads": s.AuditHeads().pool,
	} {
		if p != s.pool {
			t.Errorf("%s has a pool of its own", name)
		}
	}
	nodes, rows := s.Nodes(), s.Sandboxes()
	if err := nodes.Heartbeat(ctx, NodeStatus{ID: "n1", Address: "https://n1:7443", MemFree: 1 << 30, CPUs: 2}); err != nil {
		t.Fatal(err)
	}
	if err := rows.AddSandbox(ctx, "sb1", "n1", "acme", api.CreateSandboxRequest{}); err != nil {
		t.Fatal(err)
	}
	if sb, err := rows.GetSandbox(ctx, "sb1"); err != nil || sb.Node != "n1" {
		t.Fatalf("GetSandbox = %+v, %v", sb, err)
	}
	if n, err := rows.CountSandboxes(ctx, "acme"); err != nil || n != 1 {
		t.Fatalf("CountSandboxes = %d, %v", n, err)
	}
}

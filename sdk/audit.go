package sdk

import (
	"context"
	"io"
	"net/http"
	"net/url"
	"strconv"

	"github.com/spacehq/space/api"
)

// maxAuditLine bounds one streamed audit record.
const maxAuditLine = 1 << 20

// AuditFilter selects audit records (GET /v1/audit).
type AuditFilter struct {
	Sandbox string
	Kind    string
	After   uint64
	Limit   int
	// Node is the node whose log to read, through a cluster replica
	// (each node keeps its own chain); empty on a single server.
	Node string
}

func (f AuditFilter) query() url.Values {
	q := url.Values{}
	if f.Sandbox != "" {
		q.Set("sandbox", f.Sandbox)
	}
	if f.Kind != "" {
		q.Set("kind", f.Kind)
	}
	if f.After > 0 {
		q.Set("after", strconv.FormatUint(f.After, 10))
	}
	if f.Limit > 0 {
		q.Set("limit", strconv.Itoa(f.Limit))
	}
	if f.Node != "" {
		q.Set("node", f.Node)
	}
	return q
}

// AuditRecords lists audit records, oldest first.
func (c *Client) AuditRecords(ctx context.Context, f AuditFilter) ([]api.AuditRecord, error) {
	var out api.AuditRecordList
	if err := c.do(ctx, request{method: http.MethodGet, path: "/v1/audit", query: f.query()}, &out); err != nil {
		return nil, err
	}
	return out.Records, nil
}

// FollowAudit calls fn for each matching record, then for new ones as the
// server commits them, until ctx ends or fn fails.
func (c *Client) FollowAudit(ctx context.Context, f AuditFilter, fn func(api.AuditRecord) error) error {
	q := f.query()
	q.Del("limit")
	q.Set("follow", "true")
	resp, err := c.send(ctx, request{method: http.MethodGet, path: "/v1/audit", query: q})
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	return readNDJSON(ctx, resp.Body, ndjsonStream{what: "audit stream", item: "record", maxLine: maxAuditLine}, fn)
}

// ExportAudit copies GET /v1/audit/export to w: JSON Lines from the
// checkpoint at or before since ("" = the whole log; RFC 3339 or a
// duration such as "24h") in format "jsonl" (the chain's records, which `space
// audit verify` checks) or "ocsf".
func (c *Client) ExportAudit(ctx context.Context, since, format string, w io.Writer) (int64, error) {
	return c.ExportNodeAudit(ctx, "", since, format, w)
}

// ExportNodeAudit is ExportAudit of one node's log through a cluster
// replica ("" = the server's own log).
func (c *Client) ExportNodeAudit(ctx context.Context, node, since, format string, w io.Writer) (int64, error) {
	q := url.Values{}
	if since != "" {
		q.Set("since", since)
	}
	if format != "" {
		q.Set("format", format)
	}
	if node != "" {
		q.Set("node", node)
	}
	resp, err := c.send(ctx, request{method: http.MethodGet, path: "/v1/audit/export", query: q})
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	return io.Copy(w, resp.Body)
}

// AuditKeys returns the public keys the audit log's checkpoints are
// signed with.
func (c *Client) AuditKeys(ctx context.Context) ([]api.AuditKey, error) {
	return c.NodeAuditKeys(ctx, "")
}

// NodeAuditKeys is AuditKeys of one node's log through a cluster replica
// ("" = the server's own log).
func (c *Client) NodeAuditKeys(ctx context.Context, node string) ([]api.AuditKey, error) {
	var q url.Values
	if node != "" {
		q = url.Values{"node": {node}}
	}
	var out api.AuditKeyList
	if err := c.do(ctx, request{method: http.MethodGet, path: "/v1/audit/key", query: q}, &out); err != nil {
		return nil, err
	}
	return out.Keys, nil
}

// AuditHeads lists every node's audit chain head as the cluster anchors it
// (cluster replicas only; admin).
func (c *Client) AuditHeads(ctx context.Context) ([]api.AuditHead, error) {
	var out api.AuditHeadList
	if err := c.do(ctx, request{method: http.MethodGet, path: "/v1/audit/heads"}, &out); err != nil {
		return nil, err
	}
	return out.Heads, nil
}

// ForgetAuditHead drops a node's anchored head and its problem, so the
// node anchors afresh (cluster replicas only; admin).
func (c *Client) ForgetAuditHead(ctx context.Context, node string) error {
	return c.do(ctx, request{method: http.MethodDelete, path: "/v1/audit/heads/" + url.PathEscape(node)}, nil)
}

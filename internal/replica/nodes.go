package replica

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/clusterstore"
	"github.com/spacehq/space/internal/clustertls"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/principal"
	"github.com/spacehq/space/internal/server"
)

// nodeStore is what reaching nodes reads of the cluster's nodes.
type nodeStore interface {
	Nodes(ctx context.Context) ([]clusterstore.Node, error)
	PlaceExcept(ctx context.Context, digest string, mem int64, window time.Duration, exclude []string) (clusterstore.Node, error)
}

var _ nodeStore = (*clusterstore.NodeStore)(nil)

// rowStore is how reaching nodes finds the node a sandbox's row names.
type rowStore interface {
	GetSandbox(ctx context.Context, id string) (clusterstore.Sandbox, error)
}

var _ rowStore = (*clusterstore.SandboxStore)(nil)

// nodeClient reaches the cluster's nodes: it finds the node of a sandbox
// (or by name, or by placement), and calls it over mutual TLS from the
// cluster CA as the caller the replica vouches for — proxying a request
// whole, making one call, or asking every ready node.
type nodeClient struct {
	store       nodeStore
	rows        rowStore
	id          *clustertls.Identity
	log         *slog.Logger
	nodeTimeout time.Duration

	mu         sync.Mutex
	transports map[string]*http.Transport // node id + address → its mutual-TLS transport

	placements *prometheus.CounterVec   // creates placed, by node
	nodeErrors *prometheus.CounterVec   // calls a node did not answer, by node
	forwarded  *prometheus.HistogramVec // time to a node's answer headers, by node
}

func newNodeClient(st nodeStore, rows rowStore, id *clustertls.Identity, log *slog.Logger, nodeTimeout time.Duration) *nodeClient {
	return &nodeClient{store: st, rows: rows, id: id, log: log, nodeTimeout: nodeTimeout, transports: map[string]*http.Transport{},
		placements: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "space_replica_placements_total", Help: "Creates a cluster replica placed, by node."}, []string{"node"}),
		nodeErrors: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "space_replica_node_errors_total", Help: "Calls to a node that got no answer, by node."}, []string{"node"}),
		forwarded: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "space_replica_node_seconds", Help: "Time from a proxied call to the node's answer headers, by node.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16)}, []string{"node"}),
	}
}

// closeIdle closes idle connections to nodes.
func (c *nodeClient) closeIdle() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, t := range c.transports {
		t.CloseIdleConnections()
	}
}

// countingTransport times a node's answers and counts the calls it left
// unanswered.
type countingTransport struct {
	next http.RoundTripper
	node string
	c    *nodeClient
}

func (t countingTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	t0 := time.Now()
	resp, err := t.next.RoundTrip(req)
	if err != nil {
		if req.Context().Err() == nil {
			t.c.nodeErrors.WithLabelValues(t.node).Inc()
		}
		return nil, err
	}
	t.c.forwarded.WithLabelValues(t.node).Observe(time.Since(t0).Seconds())
	return resp, nil
}

// sandboxRow is the row of a sandbox the caller may see (404 otherwise,
// exactly as for a sandbox that does not exist).
func (c *nodeClient) sandboxRow(ctx context.Context, id string, p *principal.Principal) (clusterstore.Sandbox, error) {
	row, err := c.rows.GetSandbox(ctx, id)
	if err != nil {
		return row, err
	}
	if p != nil && !p.Sees(row.Tenant) {
		return clusterstore.Sandbox{}, fmt.Errorf("sandbox %q: %w", id, errdefs.ErrNotFound)
	}
	return row, nil
}

// node returns the row of node id.
func (c *nodeClient) node(ctx context.Context, id string) (clusterstore.Node, error) {
	nodes, err := c.store.Nodes(ctx)
	if err != nil {
		return clusterstore.Node{}, err
	}
	for _, n := range nodes {
		if n.ID == id {
			return n, nil
		}
	}
	return clusterstore.Node{}, fmt.Errorf("node %q: %w", id, errdefs.ErrNotFound)
}

// sandboxNode is the node of sandbox id, for caller p (nil: any caller,
// when the node checks the call's own token).
func (c *nodeClient) sandboxNode(ctx context.Context, id string, p *principal.Principal) (clusterstore.Node, error) {
	row, err := c.sandboxRow(ctx, id, p)
	if err != nil {
		return clusterstore.Node{}, err
	}
	return c.node(ctx, row.Node)
}

// transport is the mutual-TLS transport to node n (HTTP/1.1: attach and
// port streams upgrade the connection).
func (c *nodeClient) transport(n clusterstore.Node) (http.RoundTripper, error) {
	key := n.ID + "\x00" + n.Address
	c.mu.Lock()
	defer c.mu.Unlock()
	if t, ok := c.transports[key]; ok {
		return countingTransport{next: t, node: n.ID, c: c}, nil
	}
	cfg, err := c.id.ClientConfig(n.ID)
	if err != nil {
		return nil, err
	}
	t := &http.Transport{
		TLSClientConfig:     cfg,
		DialContext:         (&net.Dialer{Timeout: 3 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		TLSHandshakeTimeout: 5 * time.Second,
		MaxIdleConnsPerHost: 64,
		IdleConnTimeout:     90 * time.Second,
	}
	c.transports[key] = t
	return countingTransport{next: t, node: n.ID, c: c}, nil
}

// nodeURL is the base URL of a node's cluster listener.
func nodeURL(n clusterstore.Node) (*url.URL, error) {
	u, err := url.Parse(n.Address)
	if err != nil || u.Scheme != "https" || u.Host == "" {
		return nil, fmt.Errorf("node %s advertises %q, not an https:// cluster listener: %w", n.ID, n.Address, errdefs.ErrUnavailable)
	}
	return u, nil
}

// errNodeDown is a node the replica could not reach (or that is lost).
func errNodeDown(n clusterstore.Node, err error) error {
	if n.State == clusterstore.NodeLost {
		return fmt.Errorf("node %s is lost (%s): %w", n.ID, n.StateReason, errdefs.ErrUnavailable)
	}
	return fmt.Errorf("node %s did not answer: %v: %w", n.ID, err, errdefs.ErrUnavailable)
}

// proxy forwards req to node n as caller p (nil: as nobody, for routes a
// token authorises), streaming both ways.
func (c *nodeClient) proxy(w http.ResponseWriter, req *http.Request, n clusterstore.Node, p *principal.Principal) {
	if n.State == clusterstore.NodeLost {
		server.WriteError(w, req, errNodeDown(n, nil))
		return
	}
	target, err := nodeURL(n)
	if err != nil {
		server.WriteError(w, req, err)
		return
	}
	t, err := c.transport(n)
	if err != nil {
		server.WriteError(w, req, err)
		return
	}
	var who []byte
	if p != nil {
		who, _ = json.Marshal(p)
	}
	rp := &httputil.ReverseProxy{
		Transport:     t,
		FlushInterval: -1,
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(target)
			// The Host and scheme the caller used: the node makes the
			// URLs it answers with (ports, MCP) from them, and routes
			// <port>-<id>.<domain> by the Host. The connection still
			// goes to, and verifies, the node.
			pr.Out.Host = req.Host
			pr.Out.Header.Set(server.ForwardedProtoHeader, server.RequestScheme(req))
			// The caller's API key stays here: the node trusts the
			// replica's certificate and the principal it vouches for. A
			// token route's Authorization is the node's own token.
			pr.Out.Header.Del(server.PrincipalHeader)
			if who != nil {
				pr.Out.Header.Del("Authorization")
				pr.Out.Header.Set(server.PrincipalHeader, string(who))
			}
		},
		ModifyResponse: func(resp *http.Response) error {
			resp.Header.Set("Space-Node", n.ID)
			return nil
		},
		ErrorHandler: func(w http.ResponseWriter, req *http.Request, err error) {
			if req.Context().Err() != nil {
				return // the caller went away
			}
			server.WriteError(w, req, errNodeDown(n, err))
		},
		ErrorLog: slog.NewLogLogger(c.log.Handler(), slog.LevelDebug),
	}
	// A node may answer before it has read the whole request (a Connect
	// stream flushes its headers after the first message): the caller's
	// body must stay readable after the replica starts answering, or the
	// copy to the node fails and cuts the answer. (Over HTTP/1.1 a server
	// otherwise stops reading a request once its response has begun.)
	_ = http.NewResponseController(w).EnableFullDuplex()
	rp.ServeHTTP(w, req)
}

// forward makes one call to node n as p.
func (c *nodeClient) forward(ctx context.Context, n clusterstore.Node, method, path string, body []byte, p *principal.Principal, idem string) (*http.Response, error) {
	return c.forwardFor(ctx, nil, n, method, path, body, p, idem)
}

// forwardFor is forward on behalf of the caller's request in (nil: the
// replica's own call): the node sees in's Host and scheme, as proxy gives
// them, so the URLs it answers with are the replica's.
func (c *nodeClient) forwardFor(ctx context.Context, in *http.Request, n clusterstore.Node, method, path string, body []byte, p *principal.Principal, idem string) (*http.Response, error) {
	u, err := nodeURL(n)
	if err != nil {
		return nil, err
	}
	t, err := c.transport(n)
	if err != nil {
		return nil, err
	}
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, strings.TrimSuffix(u.String(), "/")+path, rd)
	if err != nil {
		return nil, err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if p != nil {
		who, _ := json.Marshal(p)
		req.Header.Set(server.PrincipalHeader, string(who))
	}
	if idem != "" {
		req.Header.Set(api.IdempotencyKeyHeader, idem)
	}
	if in != nil {
		req.Host = in.Host
		req.Header.Set(server.ForwardedProtoHeader, server.RequestScheme(in))
	}
	return t.RoundTrip(req)
}

func copyResponse(w http.ResponseWriter, resp *http.Response, node string) {
	for k, vs := range resp.Header {
		for _, v := range vs {
			w.Header().Add(k, v)
		}
	}
	w.Header().Set("Space-Node", node)
	w.WriteHeader(resp.StatusCode)
	io.Copy(w, resp.Body)
}

// place picks a node for a create of template tmpl needing mem bytes (not
// one of tried) and makes sure the node has the template.
func (c *nodeClient) place(ctx context.Context, tmpl string, mem int64, tried []string, p principal.Principal) (clusterstore.Node, error) {
	n, err := c.store.PlaceExcept(ctx, tmpl, mem, c.nodeTimeout, tried)
	if err != nil {
		return n, err
	}
	c.placements.WithLabelValues(n.ID).Inc()
	if err := c.ensureTemplate(ctx, n, tmpl, p); err != nil {
		c.log.Warn("cluster: copying a template to its node", "node", n.ID, "template", tmpl, "err", err)
	}
	return n, nil
}

// ensureTemplate copies template ref to node n from a node that has it,
// by export and import (the import verifies every digest), when n has not
// got it and another node has. The base template is built by each node
// itself.
func (c *nodeClient) ensureTemplate(ctx context.Context, n clusterstore.Node, ref string, p principal.Principal) error {
	if slices.Contains(n.Templates, ref) || ref == "base:latest" {
		return nil
	}
	nodes, err := c.store.Nodes(ctx)
	if err != nil {
		return err
	}
	var src *clusterstore.Node
	for i := range nodes {
		// A draining node still serves its templates.
		if nodes[i].ID != n.ID && nodes[i].State != clusterstore.NodeLost && slices.Contains(nodes[i].Templates, ref) {
			src = &nodes[i]
			break
		}
	}
	if src == nil {
		return nil // nowhere to copy from: the node's own create says what is missing
	}
	// The copy is made for the caller's tenant: what it may use on one
	// node it may use on another.
	cp := principal.Principal{KeyID: p.KeyID, KeyName: p.KeyName, Tenant: p.Tenant, Scopes: []string{principal.ScopeTemplatesRead, principal.ScopeTemplatesWrite}}
	exp, err := c.forward(ctx, *src, http.MethodGet, "/v1/templates/"+url.PathEscape(ref)+"/export", nil, &cp, "")
	if err != nil {
		return err
	}
	defer exp.Body.Close()
	if exp.StatusCode != http.StatusOK {
		return fmt.Errorf("export from %s: %s", src.ID, exp.Status)
	}
	u, err := nodeURL(n)
	if err != nil {
		return err
	}
	t, err := c.transport(n)
	if err != nil {
		return err
	}
	q := url.Values{"format": {"archive"}}
	if !strings.HasPrefix(ref, "sha256:") {
		q.Set("tag", ref)
	}
	imp, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimSuffix(u.String(), "/")+"/v1/templates?"+q.Encode(), exp.Body)
	if err != nil {
		return err
	}
	who, _ := json.Marshal(cp)
	imp.Header.Set(server.PrincipalHeader, string(who))
	imp.Header.Set("Content-Type", "application/x-tar")
	resp, err := t.RoundTrip(imp)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusCreated && resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return fmt.Errorf("import on %s: %s: %s", n.ID, resp.Status, b)
	}
	c.log.Info("cluster: template copied", "template", ref, "from", src.ID, "to", n.ID)
	return nil
}

// askReadyNodes GETs path from every ready node as p (on behalf of req)
// and hands each node's answer to each, in node order. A node that does
// not answer fails the call with ErrUnavailable naming it; a node's error
// answer (the caller's bad filter, say) is passed on as the node gave it.
// It has answered w when it returns false.
func (c *nodeClient) askReadyNodes(w http.ResponseWriter, req *http.Request, path string, p *principal.Principal,
	writeErr func(http.ResponseWriter, *http.Request, error), each func(n clusterstore.Node, body io.Reader) error) bool {
	nodes, err := c.store.Nodes(req.Context())
	if err != nil {
		writeErr(w, req, err)
		return false
	}
	for _, n := range nodes {
		if n.State != clusterstore.NodeReady {
			continue
		}
		resp, err := c.forwardFor(req.Context(), req, n, http.MethodGet, path, nil, p, "")
		if err != nil {
			writeErr(w, req, errNodeDown(n, err))
			return false
		}
		if resp.StatusCode != http.StatusOK {
			copyResponse(w, resp, n.ID)
			resp.Body.Close()
			return false
		}
		err = each(n, io.LimitReader(resp.Body, 16<<20))
		resp.Body.Close()
		if err != nil {
			writeErr(w, req, fmt.Errorf("node %s's answer does not parse: %v: %w", n.ID, err, errdefs.ErrUnavailable))
			return false
		}
	}
	return true
}

// readyHolder is the first ready node holding template ref.
func readyHolder(nodes []clusterstore.Node, ref string) (clusterstore.Node, bool) {
	for _, n := range nodes {
		if n.State == clusterstore.NodeReady && slices.Contains(n.Templates, ref) {
			return n, true
		}
	}
	return clusterstore.Node{}, false
}

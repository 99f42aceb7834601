package replica

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"

	"github.com/spacehq/space/internal/clusterstore"
	"github.com/spacehq/space/internal/e2b"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/principal"
	"github.com/spacehq/space/internal/sandbox"
	"github.com/spacehq/space/internal/server"
)

// A replica serves E2B's API (internal/e2b) by routing: each call naming a
// sandbox goes to the node its row names, where the node's own E2B layer
// answers it as it would on a single box; a create is placed like any
// create; a listing merges the nodes'. The caller's key is checked here
// and vouched for, never passed on.

// e2bAPI serves E2B's API (control plane and envd) through a replica.
type e2bAPI struct {
	nodes         *nodeClient
	keys          *keyring
	quota         sandboxQuota
	defaultMemMiB int64
}

// maxE2BCreateBody bounds a create's JSON.
const maxE2BCreateBody = 1 << 20

func (e *e2bAPI) serve(w http.ResponseWriter, req *http.Request) {
	path := req.URL.Path
	if strings.HasPrefix(path, e2b.EnvdPrefix+"/") || path == e2b.SignedFilesPath {
		e.envd(w, req)
		return
	}
	key := req.Header.Get("X-API-KEY")
	if key == "" {
		key, _ = strings.CutPrefix(req.Header.Get("Authorization"), "Bearer ")
	}
	if key == "" {
		e2b.WriteError(w, req, fmt.Errorf("missing API key (X-API-KEY header, E2B_API_KEY in the SDK): %w", errdefs.ErrUnauthorized))
		return
	}
	p, err := e.keys.authenticateKey(req.Context(), key)
	if err != nil {
		e2b.WriteError(w, req, err)
		return
	}
	rest := strings.TrimPrefix(path, e2b.Prefix)
	switch {
	case (rest == "/sandboxes" || rest == "/v2/sandboxes") && req.Method == http.MethodPost:
		e.create(w, req, p)
	case (rest == "/sandboxes" || rest == "/v2/sandboxes") && req.Method == http.MethodGet:
		e.list(w, req, p)
	case strings.HasPrefix(rest, "/sandboxes/") || strings.HasPrefix(rest, "/v2/sandboxes/"):
		id, _, _ := strings.Cut(strings.TrimPrefix(strings.TrimPrefix(rest, "/v2"), "/sandboxes/"), "/")
		e.toSandbox(w, req, id, &p)
	default:
		e2b.WriteError(w, req, fmt.Errorf("%s %s is not served by a cluster replica (it serves E2B's sandboxes: create, list, get, kill, timeout, pause, resume, connect, fork, metrics, network, and envd); snapshots and templates are each node's: %w",
			req.Method, path, errdefs.ErrNotSupported))
	}
}

// toSandbox proxies a call about sandbox id to its node, as caller p
// (nil: the node checks the call's own token).
func (e *e2bAPI) toSandbox(w http.ResponseWriter, req *http.Request, id string, p *principal.Principal) {
	if sandbox.ValidID(id) != nil {
		e2b.WriteError(w, req, fmt.Errorf("sandbox %q not found: %w", server.TruncateQuery(id), errdefs.ErrNotFound))
		return
	}
	n, err := e.nodes.sandboxNode(req.Context(), id, p)
	if err == nil && n.State == clusterstore.NodeLost {
		err = errNodeDown(n, nil)
	}
	if err != nil {
		e2b.WriteError(w, req, err)
		return
	}
	e.nodes.proxy(w, req, n, p)
}

// envd routes an envd call by its E2b-Sandbox-Id (or sandbox_id). Its
// access token is the node's to check; an API key is checked here and
// vouched for.
func (e *e2bAPI) envd(w http.ResponseWriter, req *http.Request) {
	id := req.Header.Get("E2b-Sandbox-Id")
	if id == "" {
		id = req.URL.Query().Get("sandbox_id")
	}
	if id == "" {
		e2b.WriteError(w, req, fmt.Errorf("through a cluster replica, envd calls must name their sandbox (E2b-Sandbox-Id header or sandbox_id parameter): a signed file URL without one cannot be routed to its node: %w", errdefs.ErrInvalidArgument))
		return
	}
	var p *principal.Principal
	if key := req.Header.Get("X-API-KEY"); key != "" {
		pp, err := e.keys.authenticateKey(req.Context(), key)
		if err != nil {
			e2b.WriteError(w, req, err)
			return
		}
		p = &pp
		req.Header.Del("X-API-KEY")
	}
	e.toSandbox(w, req, id, p)
}

// create places an E2B create like a native one (the tenant's sandbox
// quota across the cluster, template locality, one retry elsewhere when a
// node does not answer) and lets the chosen node's E2B layer make it.
func (e *e2bAPI) create(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	if !p.Can(principal.ScopeSandboxWrite) {
		e2b.WriteError(w, req, fmt.Errorf("this API key (%s) lacks the %s scope: %w", p.KeyName, principal.ScopeSandboxWrite, errdefs.ErrPermissionDenied))
		return
	}
	raw, err := io.ReadAll(io.LimitReader(req.Body, maxE2BCreateBody+1))
	if err != nil || len(raw) > maxE2BCreateBody {
		e2b.WriteError(w, req, fmt.Errorf("the create's body must be JSON of at most %d bytes: %w", maxE2BCreateBody, errdefs.ErrInvalidArgument))
		return
	}
	var body struct {
		TemplateID string `json:"templateID"`
	}
	if err := json.Unmarshal(raw, &body); err != nil {
		e2b.WriteError(w, req, fmt.Errorf("the create's body is not JSON: %v: %w", err, errdefs.ErrInvalidArgument))
		return
	}
	if err := e.quota.check(req.Context(), p); err != nil {
		e2b.WriteError(w, req, err)
		return
	}
	// E2B's template id is a template name (a tag's default is latest)
	// or a digest, as on a node.
	tmpl := body.TemplateID
	if tmpl == "" {
		tmpl = "base"
	}
	if !strings.Contains(tmpl, ":") {
		tmpl += ":latest"
	}
	var tried []string
	for attempt := 0; attempt < 2; attempt++ {
		n, err := e.nodes.place(req.Context(), tmpl, e.defaultMemMiB<<20, tried, p)
		if err != nil {
			e2b.WriteError(w, req, err)
			return
		}
		tried = append(tried, n.ID)
		resp, err := e.nodes.forwardFor(req.Context(), req, n, http.MethodPost, req.URL.RequestURI(), raw, &p, "")
		if err != nil {
			e.nodes.log.Warn("cluster: E2B create not answered", "node", n.ID, "err", err)
			continue
		}
		defer resp.Body.Close()
		copyResponse(w, resp, n.ID)
		return
	}
	e2b.WriteError(w, req, fmt.Errorf("no node answered the create (tried %s): %w", strings.Join(tried, ", "), errdefs.ErrUnavailable))
}

// list asks every ready node for its whole listing (as the caller) and
// cuts the page the caller asked for from their union.
func (e *e2bAPI) list(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	q := req.URL.Query()
	nq := req.URL.Query()
	nq.Del("nextToken")
	nq.Set("limit", strconv.Itoa(e2b.MaxListLimit))
	// Only ready nodes: a lost node's sandboxes are not listed, as E2B
	// lists only live ones.
	var bodies []io.Reader
	ok := e.nodes.askReadyNodes(w, req, req.URL.Path+"?"+nq.Encode(), &p, e2b.WriteError, func(_ clusterstore.Node, body io.Reader) error {
		b, err := io.ReadAll(body)
		bodies = append(bodies, bytes.NewReader(b))
		return err
	})
	if !ok {
		return
	}
	page, next, err := e2b.MergeList(bodies, q)
	if err != nil {
		e2b.WriteError(w, req, err)
		return
	}
	if next != "" {
		w.Header().Set("X-Next-Token", next)
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusOK)
	w.Write(page)
}

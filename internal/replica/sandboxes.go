package replica

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"strings"
	"sync"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/clusterstore"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/principal"
	"github.com/spacehq/space/internal/server"
)

// sandboxStore is what the sandbox routes read and write of the cluster's
// sandbox rows beyond finding nodes.
type sandboxStore interface {
	Sandboxes(ctx context.Context, tenant string) ([]clusterstore.Sandbox, error)
	SandboxByKey(ctx context.Context, tenant, key string) (clusterstore.Sandbox, error)
	SetDesired(ctx context.Context, id, desired string) error
	GetSandbox(ctx context.Context, id string) (clusterstore.Sandbox, error)
	ClaimMove(ctx context.Context, id, from, to string) error
	EndMove(ctx context.Context, id, from, to string, failure error) error
}

var _ sandboxStore = (*clusterstore.SandboxStore)(nil)

// sandboxes serves the sandbox routes: creates placed and forwarded, lists
// from the rows, every call naming a sandbox proxied to its node (a lost
// node's sandboxes answered from their rows, a wake of one suspended
// there moved to another node), operations found on whichever node has
// them.
type sandboxes struct {
	store         sandboxStore
	quota         sandboxQuota
	nodes         *nodeClient
	keys          *keyring
	defaultMemMiB int64
	log           *slog.Logger
}

// toNode is a ForwardToNode route of the table: proxied to the node of
// the path's sandbox, as the caller (keyChecked) or, for a route its own
// token authorises, as nobody. The node checks the scope and the tenant as
// it always does.
func (s *sandboxes) toNode(keyChecked bool) http.HandlerFunc {
	return func(w http.ResponseWriter, req *http.Request) {
		s.forward(w, req, keyChecked)
	}
}

// anyCall is a call under a sandbox that no route of the table names: to
// its node, which answers it as it would (a 404 or 405 in its words). Attach
// and port routes carry their own tokens, which the node checks: they pass
// without a key.
func (s *sandboxes) anyCall(w http.ResponseWriter, req *http.Request) {
	s.forward(w, req, !tokenRoute(req.Method, req.PathValue("rest")))
}

func (s *sandboxes) forward(w http.ResponseWriter, req *http.Request, keyChecked bool) {
	var p *principal.Principal
	if keyChecked {
		pp, err := s.keys.authenticate(req)
		if err != nil {
			server.WriteError(w, req, err)
			return
		}
		p = &pp
	}
	n, err := s.nodes.sandboxNode(req.Context(), req.PathValue("id"), p)
	if err != nil {
		server.WriteError(w, req, err)
		return
	}
	s.nodes.proxy(w, req, n, p)
}

// tokenRoute reports whether a sandbox sub-route is authorised by a token
// the node checks (attach, ports) rather than by an API key.
func tokenRoute(method, rest string) bool {
	parts := strings.Split(rest, "/")
	switch {
	case len(parts) == 3 && parts[0] == "commands" && parts[2] == "attach" && method == http.MethodGet:
		return true
	case len(parts) >= 3 && parts[0] == "ports":
		return true
	}
	return false
}

// hostCall proxies host-routed port traffic to the sandbox's node. A
// bearer that is a cluster key is vouched for (and not passed on); any
// other credential (a port token, the service's own Authorization) is the
// node's to check.
func (s *sandboxes) hostCall(w http.ResponseWriter, req *http.Request, id string) {
	var p *principal.Principal
	if strings.HasPrefix(req.Header.Get("Authorization"), "Bearer ") {
		if pp, err := s.keys.authenticate(req); err == nil {
			p = &pp
		}
	}
	n, err := s.nodes.sandboxNode(req.Context(), id, nil)
	if err != nil {
		server.WriteError(w, req, err)
		return
	}
	s.nodes.proxy(w, req, n, p)
}

// get answers from the node, or from the row when the node is lost or
// down (its last report, with the state the cluster knows).
func (s *sandboxes) get(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	row, err := s.nodes.sandboxRow(req.Context(), req.PathValue("id"), &p)
	if err != nil {
		server.WriteError(w, req, err)
		return
	}
	n, err := s.nodes.node(req.Context(), row.Node)
	if err != nil {
		server.WriteError(w, req, err)
		return
	}
	if n.State == clusterstore.NodeLost || row.State == clusterstore.StateLost {
		w.Header().Set("Space-Node", n.ID)
		server.WriteJSON(w, http.StatusOK, rowSandbox(row))
		return
	}
	s.nodes.proxy(w, req, n, &p)
}

// rowSandbox is a sandbox as its row has it: the node's last report with
// the cluster's state (lost) and reason.
func rowSandbox(row clusterstore.Sandbox) api.Sandbox {
	sb := api.Sandbox{ID: row.ID, Tenant: row.Tenant, Template: row.Request.Template, CreatedAt: row.Created}
	if row.Status != nil {
		sb = *row.Status
	}
	sb.State = row.State
	if row.StateReason != "" {
		sb.Error = row.StateReason
	}
	if sb.Tenant == principal.DefaultTenant {
		sb.Tenant = ""
	}
	return sb
}

// list answers from the rows: one query, whatever the nodes are doing.
func (s *sandboxes) list(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	tenant := p.Tenant
	if p.Admin() {
		tenant = ""
	}
	rows, err := s.store.Sandboxes(req.Context(), tenant)
	if err != nil {
		server.WriteError(w, req, err)
		return
	}
	labels, err := server.LabelFilter(req.URL.Query())
	if err != nil {
		server.WriteError(w, req, err)
		return
	}
	state := req.URL.Query().Get("state")
	out := []api.Sandbox{}
	for _, row := range rows {
		sb := rowSandbox(row)
		if (state == "" || sb.State == state) && hasLabels(sb.Labels, labels) {
			out = append(out, sb)
		}
	}
	server.WriteJSON(w, http.StatusOK, api.SandboxList{Sandboxes: out})
}

// hasLabels reports whether have carries every one of want.
func hasLabels(have, want map[string]string) bool {
	for k, v := range want {
		if got, ok := have[k]; !ok || got != v {
			return false
		}
	}
	return true
}

// delete records the desire first (so a node that is down deletes the
// sandbox when it is back), then asks the node now.
func (s *sandboxes) delete(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	row, err := s.nodes.sandboxRow(req.Context(), req.PathValue("id"), &p)
	if err != nil {
		server.WriteError(w, req, err)
		return
	}
	if err := s.store.SetDesired(req.Context(), row.ID, clusterstore.DesiredDeleted); err != nil {
		server.WriteError(w, req, err)
		return
	}
	n, err := s.nodes.node(req.Context(), row.Node)
	if err != nil {
		server.WriteError(w, req, err)
		return
	}
	if n.State == clusterstore.NodeLost {
		server.WriteJSON(w, http.StatusAccepted, map[string]string{"id": row.ID, "state": clusterstore.DesiredDeleted,
			"message": fmt.Sprintf("node %s is lost; the deletion is recorded and applied if it comes back", n.ID)})
		return
	}
	s.nodes.proxy(w, req, n, &p)
}

// maxIdempotencyKey bounds an Idempotency-Key header.
const maxIdempotencyKey = 128

func checkIdempotencyKey(k string) error {
	if len(k) > maxIdempotencyKey {
		return fmt.Errorf("%s is %d bytes; at most %d: %w", api.IdempotencyKeyHeader, len(k), maxIdempotencyKey, errdefs.ErrInvalidArgument)
	}
	for _, c := range []byte(k) {
		if c < 0x21 || c > 0x7e {
			return fmt.Errorf("%s must be printable ASCII without spaces: %w", api.IdempotencyKeyHeader, errdefs.ErrInvalidArgument)
		}
	}
	return nil
}

// create places the sandbox, makes sure its node has the template, and
// forwards the create; the node writes the row before it answers. With an
// Idempotency-Key, a create the tenant already made answers with that
// sandbox.
func (s *sandboxes) create(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	var body api.CreateSandboxRequest
	if err := server.DecodeJSON(w, req, &body); err != nil {
		server.WriteError(w, req, err)
		return
	}
	if _, err := server.WaitParam(req); err != nil {
		server.WriteError(w, req, err)
		return
	}
	idem := req.Header.Get(api.IdempotencyKeyHeader)
	if err := checkIdempotencyKey(idem); err != nil {
		server.WriteError(w, req, err)
		return
	}
	if idem != "" && s.answerExisting(w, req, p, idem) {
		return
	}
	if err := s.quota.check(req.Context(), p); err != nil {
		server.WriteError(w, req, err)
		return
	}
	raw, _ := json.Marshal(body)
	tmpl := body.Template
	if tmpl == "" {
		tmpl = "base:latest"
	}
	mem := body.Limits.MemoryMiB
	if mem <= 0 {
		mem = s.defaultMemMiB
	}
	var tried []string
	for attempt := 0; attempt < 2; attempt++ {
		n, err := s.nodes.place(req.Context(), tmpl, mem<<20, tried, p)
		if err != nil {
			server.WriteError(w, req, err)
			return
		}
		tried = append(tried, n.ID)
		resp, err := s.nodes.forwardFor(req.Context(), req, n, http.MethodPost, "/v1/sandboxes?"+req.URL.RawQuery, raw, &p, idem)
		if err != nil {
			// Not answered: try once more elsewhere. A create the node
			// did make without answering has its row, and the key (if
			// any) finds it.
			s.log.Warn("cluster: create not answered", "node", n.ID, "err", err)
			if idem != "" && s.answerExisting(w, req, p, idem) {
				return
			}
			continue
		}
		defer resp.Body.Close()
		if resp.StatusCode == http.StatusConflict && idem != "" && s.answerExisting(w, req, p, idem) {
			return
		}
		copyResponse(w, resp, n.ID)
		return
	}
	server.WriteError(w, req, fmt.Errorf("no node answered the create (tried %s): %w", strings.Join(tried, ", "), errdefs.ErrUnavailable))
}

// tenantStore is where the cluster-wide sandbox quota reads a tenant's
// quota: the cluster's settings.
type tenantStore interface {
	Tenant(ctx context.Context, name string) (api.Tenant, error)
}

var _ tenantStore = (*clusterstore.SettingsStore)(nil)

// sandboxCounter is where the cluster-wide sandbox quota counts a tenant's
// sandboxes: the sandbox rows.
type sandboxCounter interface {
	CountSandboxes(ctx context.Context, tenant string) (int, error)
}

var _ sandboxCounter = (*clusterstore.SandboxStore)(nil)

// sandboxQuota is the cluster-wide sandbox quota: the tenant's quota from
// the settings, its sandboxes counted in the rows.
type sandboxQuota struct {
	tenants tenantStore
	rows    sandboxCounter
}

// check refuses a create over the tenant's sandbox quota, which holds
// across the cluster; its other quotas each node enforces on its own
// sandboxes.
func (q sandboxQuota) check(ctx context.Context, p principal.Principal) error {
	t, err := q.tenants.Tenant(ctx, tenantName(p.Tenant))
	if err != nil || t.Quotas.Sandboxes <= 0 {
		return err
	}
	n, err := q.rows.CountSandboxes(ctx, tenantName(p.Tenant))
	if err != nil {
		return err
	}
	if n >= t.Quotas.Sandboxes {
		return fmt.Errorf("tenant %s has %d sandboxes in the cluster, its quota is %d: %w", tenantName(p.Tenant), n, t.Quotas.Sandboxes, errdefs.ErrQuotaExceeded)
	}
	return nil
}

func tenantName(t string) string {
	if t == "" {
		return principal.DefaultTenant
	}
	return t
}

// answerExisting answers with the tenant's sandbox made under idem, if
// there is one: as its node has it now (or as its row does), with its
// create operation, still running or done.
func (s *sandboxes) answerExisting(w http.ResponseWriter, req *http.Request, p principal.Principal, idem string) bool {
	row, err := s.store.SandboxByKey(req.Context(), p.Tenant, idem)
	if err != nil {
		return false
	}
	sb := rowSandbox(row)
	if n, err := s.nodes.node(req.Context(), row.Node); err == nil && n.State != clusterstore.NodeLost {
		if resp, err := s.nodes.forward(req.Context(), n, http.MethodGet, "/v1/sandboxes/"+url.PathEscape(row.ID), nil, &p, ""); err == nil {
			var now api.Sandbox
			if resp.StatusCode == http.StatusOK && json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&now) == nil {
				sb = now
			}
			resp.Body.Close()
		}
	}
	op := api.Operation{ID: row.CreateOperation, Kind: "create", SandboxID: sb.ID, State: api.OpSucceeded, CreatedAt: sb.CreatedAt}
	switch sb.State {
	case api.StateCreating, "":
		op.State = api.OpRunning
	case api.StateError, clusterstore.StateLost:
		op.State = api.OpFailed
		op.Error = &api.ErrorBody{Code: api.CodeUnavailable, Message: sb.Error}
	}
	w.Header().Set("Space-Node", row.Node)
	server.WriteJSON(w, http.StatusOK, api.CreateSandboxResponse{Sandbox: sb, Operation: op})
	return true
}

// operation finds an operation on whichever node has it (operation ids do
// not say where they run).
func (s *sandboxes) operation(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	nodes, err := s.nodes.store.Nodes(req.Context())
	if err != nil {
		server.WriteError(w, req, err)
		return
	}
	path := "/v1/operations/" + url.PathEscape(req.PathValue("id"))
	if req.URL.RawQuery != "" {
		path += "?" + req.URL.RawQuery
	}
	type answer struct {
		resp *http.Response
		node string
	}
	ctx, cancel := context.WithCancel(req.Context())
	defer cancel()
	found := make(chan answer, len(nodes))
	var wg sync.WaitGroup
	for _, n := range nodes {
		if n.State == clusterstore.NodeLost {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := s.nodes.forward(ctx, n, http.MethodGet, path, nil, &p, "")
			if err != nil {
				return
			}
			if resp.StatusCode == http.StatusNotFound {
				resp.Body.Close()
				return
			}
			found <- answer{resp, n.ID}
		}()
	}
	go func() { wg.Wait(); close(found) }()
	a, ok := <-found
	if !ok {
		server.WriteError(w, req, fmt.Errorf("operation %q: %w", req.PathValue("id"), errdefs.ErrNotFound))
		return
	}
	defer a.resp.Body.Close()
	copyResponse(w, a.resp, a.node)
	go func() {
		for other := range found {
			other.resp.Body.Close()
		}
	}()
}

// wake proxies a wake to the sandbox's node — and when that node is lost
// and the sandbox was suspended there, first moves it to another node
// through the suspend share (the node exported it when it suspended).
func (s *sandboxes) wake(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	row, err := s.nodes.sandboxRow(req.Context(), req.PathValue("id"), &p)
	if err != nil {
		server.WriteError(w, req, err)
		return
	}
	if row.State == clusterstore.StateLost && row.Status != nil && row.Status.State == api.StateSuspended {
		n, err := s.move(req.Context(), row, p)
		if err != nil {
			server.WriteError(w, req, err)
			return
		}
		s.nodes.proxy(w, req, n, &p)
		return
	}
	n, err := s.nodes.node(req.Context(), row.Node)
	if err != nil {
		server.WriteError(w, req, err)
		return
	}
	s.nodes.proxy(w, req, n, &p)
}

// move continues a lost node's suspended sandbox on another node: claim
// the row (one replica wins), make sure the template is there (by
// digest), have the node import the export from the suspend share, settle
// the row. It returns the node the sandbox is on afterwards.
func (s *sandboxes) move(ctx context.Context, row clusterstore.Sandbox, p principal.Principal) (clusterstore.Node, error) {
	mem := row.Request.Limits.MemoryMiB
	if mem <= 0 {
		mem = s.defaultMemMiB
	}
	digest := row.Status.TemplateDigest
	target, err := s.nodes.store.PlaceExcept(ctx, digest, mem<<20, s.nodes.nodeTimeout, []string{row.Node})
	if err != nil {
		return clusterstore.Node{}, fmt.Errorf("sandbox %s was suspended on lost node %s and no other node can take it: %w", row.ID, row.Node, err)
	}
	if err := s.store.ClaimMove(ctx, row.ID, row.Node, target.ID); err != nil {
		// Another replica moved it (or the node came back): follow the row.
		now, gerr := s.store.GetSandbox(ctx, row.ID)
		if gerr != nil {
			return clusterstore.Node{}, gerr
		}
		return s.nodes.node(ctx, now.Node)
	}
	s.log.Info("cluster: moving a lost node's suspended sandbox", "sandbox", row.ID, "from", row.Node, "to", target.ID)
	if err := s.nodes.ensureTemplate(ctx, target, digest, p); err != nil {
		s.log.Warn("cluster: copying a template for a move", "node", target.ID, "template", digest, "err", err)
	}
	resp, err := s.nodes.forward(ctx, target, http.MethodPost, "/v1/cluster/adopt/"+url.PathEscape(row.ID), nil, &p, "")
	if err == nil {
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			var e api.Error
			json.NewDecoder(io.LimitReader(resp.Body, 1<<16)).Decode(&e)
			err = fmt.Errorf("node %s refused to take it: %s: %w", target.ID, e.Error.Message, errdefs.FromCode(e.Error.Code))
		}
	}
	if serr := s.store.EndMove(context.WithoutCancel(ctx), row.ID, row.Node, target.ID, err); serr != nil {
		return clusterstore.Node{}, errors.Join(err, serr)
	}
	if err != nil {
		return clusterstore.Node{}, fmt.Errorf("moving sandbox %s off lost node %s: %w", row.ID, row.Node, err)
	}
	return target, nil
}

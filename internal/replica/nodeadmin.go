package replica

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/clusterstore"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/principal"
	"github.com/spacehq/space/internal/server"
)

// nodeAdminStore is what the node routes change of the cluster's nodes.
type nodeAdminStore interface {
	Drain(ctx context.Context, id, reason string) error
	Undrain(ctx context.Context, id string) error
}

var _ nodeAdminStore = (*clusterstore.NodeStore)(nil)

// auditHeadStore is what the node routes read and forget of the nodes'
// audit chain heads.
type auditHeadStore interface {
	AuditHeads(ctx context.Context) ([]clusterstore.AuditHead, error)
	ForgetAuditHead(ctx context.Context, node string) error
}

var _ auditHeadStore = (*clusterstore.AuditHeadStore)(nil)

// nodeAdmin serves the routes about the nodes themselves: GET /v1/nodes
// and drain/undrain (`space nodes`), each node's audit log (?node=) and
// the heads anchored in PostgreSQL, and /v1/info from a ready node.
type nodeAdmin struct {
	store nodeAdminStore
	heads auditHeadStore
	nodes *nodeClient
}

func apiNode(n clusterstore.Node) api.ClusterNode {
	return api.ClusterNode{ID: n.ID, Address: n.Address, State: n.State, StateReason: n.StateReason,
		MemFree: n.MemFree, CPUs: n.CPUs, Sandboxes: n.Sandboxes, Templates: n.Templates, HeartbeatAt: n.Heartbeat}
}

func (a *nodeAdmin) list(w http.ResponseWriter, req *http.Request, _ principal.Principal) {
	nodes, err := a.nodes.store.Nodes(req.Context())
	if err != nil {
		server.WriteError(w, req, err)
		return
	}
	out := make([]api.ClusterNode, 0, len(nodes))
	for _, n := range nodes {
		out = append(out, apiNode(n))
	}
	server.WriteJSON(w, http.StatusOK, out)
}

// drain is POST /v1/nodes/{node}/drain (no new sandboxes are placed
// there; its own keep running and answering) and …/undrain.
func (a *nodeAdmin) drain(w http.ResponseWriter, req *http.Request, _ principal.Principal) {
	id := req.PathValue("node")
	var err error
	if strings.HasSuffix(req.URL.Path, "/undrain") {
		err = a.store.Undrain(req.Context(), id)
	} else {
		var body api.DrainRequest
		if req.ContentLength != 0 {
			if err := server.DecodeJSON(w, req, &body); err != nil {
				server.WriteError(w, req, err)
				return
			}
		}
		if len(body.Reason) > 256 {
			server.WriteError(w, req, fmt.Errorf("a drain's reason is at most 256 bytes: %w", errdefs.ErrInvalidArgument))
			return
		}
		if body.Reason == "" {
			body.Reason = "drained by an admin"
		}
		err = a.store.Drain(req.Context(), id, body.Reason)
	}
	if err != nil {
		server.WriteError(w, req, err)
		return
	}
	n, err := a.nodes.node(req.Context(), id)
	if err != nil {
		server.WriteError(w, req, err)
		return
	}
	server.WriteJSON(w, http.StatusOK, apiNode(n))
}

// info is a ready node's answer (the version and runtimes a create gets,
// for clusters of like nodes).
func (a *nodeAdmin) info(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	nodes, err := a.nodes.store.Nodes(req.Context())
	if err != nil {
		server.WriteError(w, req, err)
		return
	}
	for _, n := range nodes {
		if n.State == clusterstore.NodeReady {
			a.nodes.proxy(w, req, n, &p)
			return
		}
	}
	server.WriteError(w, req, fmt.Errorf("the cluster has no ready node: %w", errdefs.ErrUnavailable))
}

// auditHeads lists every node's audit chain head as anchored in the
// cluster.
func (a *nodeAdmin) auditHeads(w http.ResponseWriter, req *http.Request, _ principal.Principal) {
	heads, err := a.heads.AuditHeads(req.Context())
	if err != nil {
		server.WriteError(w, req, err)
		return
	}
	out := api.AuditHeadList{Heads: make([]api.AuditHead, 0, len(heads))}
	for _, h := range heads {
		var cp api.AuditRecord
		if err := json.Unmarshal([]byte(h.Checkpoint), &cp); err != nil {
			server.WriteError(w, req, fmt.Errorf("audit head of %s does not parse: %w", h.Node, err))
			return
		}
		out.Heads = append(out.Heads, api.AuditHead{Node: h.Node, Seq: h.Seq, Hash: h.Hash, KeyID: h.KeyID, PublicKey: h.PublicKey,
			SignedAt: h.SignedAt, AnchoredAt: h.AnchoredAt, Checkpoint: cp, Problem: h.Problem, ProblemAt: h.ProblemAt})
	}
	server.WriteJSON(w, http.StatusOK, out)
}

// forgetAuditHead drops a node's head and its problem: the node anchors
// afresh from its newest checkpoint.
func (a *nodeAdmin) forgetAuditHead(w http.ResponseWriter, req *http.Request, _ principal.Principal) {
	if err := a.heads.ForgetAuditHead(req.Context(), req.PathValue("node")); err != nil {
		server.WriteError(w, req, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// nodeAudit proxies a read of one node's audit log (?node=NAME): each node
// keeps its own chain, signed with its own key.
func (a *nodeAdmin) nodeAudit(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	name := req.URL.Query().Get("node")
	if name == "" {
		server.WriteError(w, req, fmt.Errorf("each node keeps its own audit log: name it with ?node=NAME (GET /v1/nodes lists them): %w", errdefs.ErrInvalidArgument))
		return
	}
	n, err := a.nodes.node(req.Context(), name)
	if err != nil {
		server.WriteError(w, req, err)
		return
	}
	a.nodes.proxy(w, req, n, &p)
}

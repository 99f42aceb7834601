package replica

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/clusterstore"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/principal"
	"github.com/spacehq/space/internal/server"
)

// templates serves templates through a replica: each node keeps its own,
// so a listing merges the nodes', a read goes to a node that holds the
// template, and an import, pull or build to the node placement picks (the
// template reaches other nodes when a create needs it there).
type templates struct {
	nodes *nodeClient
}

// list merges the templates of every node that answers (one entry per
// digest).
func (t *templates) list(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	nodes, err := t.nodes.store.Nodes(req.Context())
	if err != nil {
		server.WriteError(w, req, err)
		return
	}
	seen := map[string]bool{}
	out := []api.Template{}
	for _, n := range nodes {
		if n.State != clusterstore.NodeReady {
			continue
		}
		resp, err := t.nodes.forward(req.Context(), n, http.MethodGet, "/v1/templates", nil, &p, "")
		if err != nil {
			continue
		}
		var ts api.TemplateList
		if resp.StatusCode == http.StatusOK {
			json.NewDecoder(io.LimitReader(resp.Body, 16<<20)).Decode(&ts)
		}
		resp.Body.Close()
		for _, tm := range ts.Templates {
			if !seen[tm.Digest] {
				seen[tm.Digest] = true
				out = append(out, tm)
			}
		}
	}
	server.WriteJSON(w, http.StatusOK, api.TemplateList{Templates: out})
}

// read proxies a read of one template to a node that has it.
func (t *templates) read(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	nodes, err := t.nodes.store.Nodes(req.Context())
	if err != nil {
		server.WriteError(w, req, err)
		return
	}
	ref := req.PathValue("ref")
	if n, ok := readyHolder(nodes, ref); ok {
		t.nodes.proxy(w, req, n, &p)
		return
	}
	server.WriteError(w, req, fmt.Errorf("template %q is on no ready node: %w", ref, errdefs.ErrNotFound))
}

// write sends an import, pull or build to the node placement picks.
func (t *templates) write(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	n, err := t.nodes.store.PlaceExcept(req.Context(), "", 0, t.nodes.nodeTimeout, nil)
	if err != nil {
		server.WriteError(w, req, err)
		return
	}
	t.nodes.proxy(w, req, n, &p)
}

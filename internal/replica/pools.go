package replica

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/clusterstore"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/principal"
	"github.com/spacehq/space/internal/server"
)

// Warm pools through a replica. A pool is the cluster's: its spec lives in
// PostgreSQL and every node keeps its own members of it (the server's mirrorSettings),
// so a create placed anywhere can be a claim. A PUT asks a ready node
// that holds the template to check and normalise the spec (the node makes
// nothing), then stores it; a listing sums every ready node's members,
// with each node's part.

// poolStore is what warm pools keep in the cluster store.
type poolStore interface {
	PutPool(ctx context.Context, id string, spec api.PoolSpec) error
	DeletePool(ctx context.Context, id string) error
}

var _ poolStore = (*clusterstore.SettingsStore)(nil)

// pools serves the cluster's warm pools.
type pools struct {
	store poolStore
	nodes *nodeClient
}

// put checks the spec on a node, stores it for every node, and
// answers the pool as checked (no member is ready yet).
func (pl *pools) put(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	var spec api.PoolSpec
	if err := server.DecodeJSON(w, req, &spec); err != nil {
		server.WriteError(w, req, err)
		return
	}
	n, err := pl.checkerFor(req, spec.Template)
	if err != nil {
		server.WriteError(w, req, err)
		return
	}
	raw, _ := json.Marshal(spec)
	resp, err := pl.nodes.forwardFor(req.Context(), req, n, http.MethodPut, "/v1/pools", raw, &p, "")
	if err != nil {
		server.WriteError(w, req, errNodeDown(n, err))
		return
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		copyResponse(w, resp, n.ID) // the spec's problem, as the node names it
		return
	}
	var checked api.Pool
	if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&checked); err != nil || !strings.HasPrefix(checked.ID, "pool-") {
		server.WriteError(w, req, fmt.Errorf("node %s's check of the pool does not parse: %v: %w", n.ID, err, errdefs.ErrUnavailable))
		return
	}
	if err := pl.store.PutPool(req.Context(), checked.ID, checked.Spec); err != nil {
		server.WriteError(w, req, err)
		return
	}
	server.WriteJSON(w, http.StatusOK, checked)
}

// checkerFor picks the ready node to check a pool of template ref: one
// that holds it, else any (which then names the template as missing).
func (pl *pools) checkerFor(req *http.Request, ref string) (clusterstore.Node, error) {
	nodes, err := pl.nodes.store.Nodes(req.Context())
	if err != nil {
		return clusterstore.Node{}, err
	}
	if n, ok := readyHolder(nodes, ref); ok {
		return n, nil
	}
	for _, n := range nodes {
		if n.State == clusterstore.NodeReady {
			return n, nil
		}
	}
	return clusterstore.Node{}, fmt.Errorf("no ready node to check the pool: %w", errdefs.ErrUnavailable)
}

// deletePool removes the cluster's pool; every node destroys its members.
func (pl *pools) delete(w http.ResponseWriter, req *http.Request, _ principal.Principal) {
	if err := pl.store.DeletePool(req.Context(), req.PathValue("id")); err != nil {
		server.WriteError(w, req, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// list sums every ready node's pools (a node's own --pool-default
// included), each with its nodes' parts.
func (pl *pools) list(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	if pools, ok := pl.clusterPools(w, req, p); ok {
		server.WriteJSON(w, http.StatusOK, api.PoolList{Pools: pools})
	}
}

func (pl *pools) get(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	pools, ok := pl.clusterPools(w, req, p)
	if !ok {
		return
	}
	id := req.PathValue("id")
	for _, one := range pools {
		if one.ID == id {
			server.WriteJSON(w, http.StatusOK, one)
			return
		}
	}
	server.WriteError(w, req, fmt.Errorf("pool %s is on no ready node: %w", server.TruncateQuery(id), errdefs.ErrNotFound))
}

// clusterPools merges the ready nodes' pools by id; it has answered w
// when it returns false.
func (pl *pools) clusterPools(w http.ResponseWriter, req *http.Request, p principal.Principal) ([]api.Pool, bool) {
	byID := map[string]*api.Pool{}
	var order []string
	ok := pl.nodes.askReadyNodes(w, req, "/v1/pools", &p, server.WriteError, func(n clusterstore.Node, body io.Reader) error {
		var part api.PoolList
		if err := json.NewDecoder(body).Decode(&part); err != nil {
			return err
		}
		for _, pool := range part.Pools {
			sum := byID[pool.ID]
			if sum == nil {
				c := pool
				c.Ready, c.Filling, c.Target, c.Hits, c.Misses, c.LastError = 0, 0, 0, 0, 0, ""
				sum = &c
				byID[pool.ID] = sum
				order = append(order, pool.ID)
			}
			sum.Ready += pool.Ready
			sum.Filling += pool.Filling
			sum.Target += pool.Target
			sum.Hits += pool.Hits
			sum.Misses += pool.Misses
			sum.LastRefillMS = max(sum.LastRefillMS, pool.LastRefillMS)
			if pool.LastError != "" {
				sum.LastError = strings.TrimPrefix(sum.LastError+"; ", "; ") + n.ID + ": " + pool.LastError
			}
			sum.Nodes = append(sum.Nodes, api.PoolOnNode{Node: n.ID, Ready: pool.Ready, Filling: pool.Filling, Target: pool.Target,
				Hits: pool.Hits, Misses: pool.Misses, LastError: pool.LastError})
		}
		return nil
	})
	if !ok {
		return nil, false
	}
	slices.Sort(order)
	out := make([]api.Pool, 0, len(order))
	for _, id := range order {
		out = append(out, *byID[id])
	}
	return out, true
}

package server

import (
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
)

// Warm pools through a replica. A pool is the cluster's: its spec lives in
// PostgreSQL and every node keeps its own members of it (mirrorSettings),
// so a create placed anywhere can be a claim. A PUT asks a ready node
// that holds the template to check and normalise the spec (the node makes
// nothing), then stores it; a listing sums every ready node's members,
// with each node's part.

// putPool checks the spec on a node, stores it for every node, and
// answers the pool as checked (no member is ready yet).
func (r *Replica) putPool(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	var spec api.PoolSpec
	if err := decodeJSON(w, req, &spec); err != nil {
		writeError(w, req, err)
		return
	}
	n, err := r.checkerFor(req, spec.Template)
	if err != nil {
		writeError(w, req, err)
		return
	}
	raw, _ := json.Marshal(spec)
	resp, err := r.forwardFor(req.Context(), req, n, http.MethodPut, "/v1/pools", raw, &p, "")
	if err != nil {
		writeError(w, req, errNodeDown(n, err))
		return
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		copyResponse(w, resp, n.ID) // the spec's problem, as the node names it
		return
	}
	var checked api.Pool
	if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&checked); err != nil || !strings.HasPrefix(checked.ID, "pool-") {
		writeError(w, req, fmt.Errorf("node %s's check of the pool does not parse: %v: %w", n.ID, err, errdefs.ErrUnavailable))
		return
	}
	if err := r.store.PutPool(req.Context(), checked.ID, checked.Spec); err != nil {
		writeError(w, req, err)
		return
	}
	writeJSON(w, http.StatusOK, checked)
}

// checkerFor picks the ready node to check a pool of template ref: one
// that holds it, else any (which then names the template as missing).
func (r *Replica) checkerFor(req *http.Request, ref string) (clusterstore.Node, error) {
	nodes, err := r.store.Nodes(req.Context())
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
func (r *Replica) deletePool(w http.ResponseWriter, req *http.Request, _ principal.Principal) {
	if err := r.store.DeletePool(req.Context(), req.PathValue("id")); err != nil {
		writeError(w, req, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// listPools sums every ready node's pools (a node's own --pool-default
// included), each with its nodes' parts.
func (r *Replica) listPools(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	if pools, ok := r.clusterPools(w, req, p); ok {
		writeJSON(w, http.StatusOK, api.PoolList{Pools: pools})
	}
}

func (r *Replica) getPool(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	pools, ok := r.clusterPools(w, req, p)
	if !ok {
		return
	}
	id := req.PathValue("id")
	for _, pl := range pools {
		if pl.ID == id {
			writeJSON(w, http.StatusOK, pl)
			return
		}
	}
	writeError(w, req, fmt.Errorf("pool %s is on no ready node: %w", truncateQuery(id), errdefs.ErrNotFound))
}

// clusterPools merges the ready nodes' pools by id; it has answered w
// when it returns false.
func (r *Replica) clusterPools(w http.ResponseWriter, req *http.Request, p principal.Principal) ([]api.Pool, bool) {
	byID := map[string]*api.Pool{}
	var order []string
	ok := r.askReadyNodes(w, req, "/v1/pools", &p, writeError, func(n clusterstore.Node, body io.Reader) error {
		var part api.PoolList
		if err := json.NewDecoder(body).Decode(&part); err != nil {
			return err
		}
		for _, pl := range part.Pools {
			sum := byID[pl.ID]
			if sum == nil {
				c := pl
				c.Ready, c.Filling, c.Target, c.Hits, c.Misses, c.LastError = 0, 0, 0, 0, 0, ""
				sum = &c
				byID[pl.ID] = sum
				order = append(order, pl.ID)
			}
			sum.Ready += pl.Ready
			sum.Filling += pl.Filling
			sum.Target += pl.Target
			sum.Hits += pl.Hits
			sum.Misses += pl.Misses
			sum.LastRefillMS = max(sum.LastRefillMS, pl.LastRefillMS)
			if pl.LastError != "" {
				sum.LastError = strings.TrimPrefix(sum.LastError+"; ", "; ") + n.ID + ": " + pl.LastError
			}
			sum.Nodes = append(sum.Nodes, api.PoolOnNode{Node: n.ID, Ready: pl.Ready, Filling: pl.Filling, Target: pl.Target,
				Hits: pl.Hits, Misses: pl.Misses, LastError: pl.LastError})
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

// askReadyNodes GETs path from every ready node as p (on behalf of req)
// and hands each node's answer to each, in node order. A node that does
// not answer fails the call with ErrUnavailable naming it; a node's error
// answer (the caller's bad filter, say) is passed on as the node gave it.
// It has answered w when it returns false.
func (r *Replica) askReadyNodes(w http.ResponseWriter, req *http.Request, path string, p *principal.Principal,
	writeErr func(http.ResponseWriter, *http.Request, error), each func(n clusterstore.Node, body io.Reader) error) bool {
	nodes, err := r.store.Nodes(req.Context())
	if err != nil {
		writeErr(w, req, err)
		return false
	}
	for _, n := range nodes {
		if n.State != clusterstore.NodeReady {
			continue
		}
		resp, err := r.forwardFor(req.Context(), req, n, http.MethodGet, path, nil, p, "")
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

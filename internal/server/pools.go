package server

import (
	"fmt"
	"net/http"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

// Warm pools (admin): GET/PUT /v1/pools, GET/DELETE /v1/pools/{id}.
//
// A cluster node's pools are the cluster's (mirrorSettings applies them)
// plus its own --pool-default: set and removed through a replica, which asks a
// node to check a spec (the node answers the pool it would make and makes
// nothing) and stores it for every node. A direct write on a node is
// refused, since the mirror would undo it.

func (part templatesAPI) listPools(w http.ResponseWriter, r *http.Request) {
	s := part.s
	writeJSON(w, http.StatusOK, api.PoolList{Pools: s.mgr.WarmPools().Pools(r.Context())})
}

// errClusterPools refuses a pool write made on a cluster node directly.
func (part templatesAPI) errClusterPools() error {
	s := part.s
	if s.cfg.Cluster.Store == "" {
		return nil
	}
	return fmt.Errorf("node %s's warm pools are the cluster's: set and remove them through a cluster replica: %w",
		s.cfg.Cluster.NodeID, errdefs.ErrConflict)
}

// putPool creates or updates the pool keyed by the body's template,
// runtime and limits (min 0, max 0 drains it); a replica's call on a
// cluster node only checks it.
func (part templatesAPI) putPool(w http.ResponseWriter, r *http.Request) {
	s := part.s
	var spec api.PoolSpec
	if err := decodeJSON(w, r, &spec); err != nil {
		writeError(w, r, err)
		return
	}
	if _, vouched := r.Context().Value(replicaKey{}).(string); vouched && s.cfg.Cluster.Store != "" {
		p, err := s.mgr.WarmPools().CheckPool(r.Context(), spec)
		if err != nil {
			writeError(w, r, err)
			return
		}
		writeJSON(w, http.StatusOK, p)
		return
	}
	if err := (templatesAPI{s}).errClusterPools(); err != nil {
		writeError(w, r, err)
		return
	}
	p, err := s.mgr.WarmPools().SetPool(r.Context(), spec)
	if err != nil {
		writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, p)
}

func (part templatesAPI) getPool(w http.ResponseWriter, r *http.Request) {
	s := part.s
	p, err := s.mgr.WarmPools().GetPool(r.Context(), r.PathValue("id"))
	if err != nil {
		writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, p)
}

func (part templatesAPI) deletePool(w http.ResponseWriter, r *http.Request) {
	s := part.s
	if err := (templatesAPI{s}).errClusterPools(); err != nil {
		writeError(w, r, err)
		return
	}
	if err := s.mgr.WarmPools().DeletePool(r.Context(), r.PathValue("id")); err != nil {
		writeError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

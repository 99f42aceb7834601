package server

import (
	"net/http"

	"github.com/spacehq/space/api"
)

// Warm pools (admin): GET/PUT /v1/pools, GET/DELETE /v1/pools/{id}.

func (s *Server) listPools(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, api.PoolList{Pools: s.mgr.Pools(r.Context())})
}

// putPool creates or updates the pool keyed by the body's template,
// runtime and limits (min 0, max 0 drains it).
func (s *Server) putPool(w http.ResponseWriter, r *http.Request) {
	var spec api.PoolSpec
	if err := decodeJSON(w, r, &spec); err != nil {
		writeError(w, r, err)
		return
	}
	p, err := s.mgr.SetPool(r.Context(), spec)
	if err != nil {
		writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, p)
}

func (s *Server) getPool(w http.ResponseWriter, r *http.Request) {
	p, err := s.mgr.GetPool(r.Context(), r.PathValue("id"))
	if err != nil {
		writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, p)
}

func (s *Server) deletePool(w http.ResponseWriter, r *http.Request) {
	if err := s.mgr.DeletePool(r.Context(), r.PathValue("id")); err != nil {
		writeError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

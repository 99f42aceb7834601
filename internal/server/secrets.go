package server

// Secrets routes: the tenant's secrets (never their values) and their
// grants to sandboxes. The store is internal/secrets; the manager keeps
// sandboxes, their env and the gateway in step (sandbox/secrets.go).

import (
	"encoding/base64"
	"fmt"
	"net/http"
	"unicode/utf8"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/audit"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/principal"
	"github.com/spacehq/space/internal/sandbox"
	"github.com/spacehq/space/internal/secrets"
)

// maxSecretBody bounds PUT /v1/secrets/{name}: a 64 KiB value in base64
// and JSON escapes, plus hosts and header.
const maxSecretBody = 512 << 10

// callerTenant is the tenant the request acts for ("default" without a
// principal, until API keys carry one).
func callerTenant(r *http.Request) string {
	if p, ok := principal.From(r.Context()); ok && p.Tenant != "" {
		return p.Tenant
	}
	return principal.DefaultTenant
}

func apiSecret(s secrets.Secret) api.Secret {
	return api.Secret{Name: s.Name, Tenant: s.Tenant, Hosts: s.Hosts, Header: s.Header, Version: s.Version, CreatedAt: s.CreatedAt, UpdatedAt: s.UpdatedAt}
}

func (part secretsAPI) secretStore() (*secrets.Store, error) {
	s := part.s
	if s.secrets == nil {
		return nil, fmt.Errorf("this server has no secrets store: %w", errdefs.ErrUnprocessable)
	}
	return s.secrets, nil
}

// secretValue is the one value of a request: value or value_base64.
func secretValue(req api.SetSecretRequest) ([]byte, error) {
	switch {
	case req.Value != nil && req.ValueBase64 != nil:
		return nil, fmt.Errorf("set one of value and value_base64, not both: %w", errdefs.ErrInvalidArgument)
	case req.Value != nil:
		if !utf8.ValidString(*req.Value) {
			return nil, fmt.Errorf("value is not valid UTF-8 (use value_base64 for binary values): %w", errdefs.ErrInvalidArgument)
		}
		return []byte(*req.Value), nil
	case req.ValueBase64 != nil:
		b, err := base64.StdEncoding.DecodeString(*req.ValueBase64)
		if err != nil {
			// Never quote it: it is the secret.
			return nil, fmt.Errorf("value_base64 is not standard base64: %w", errdefs.ErrInvalidArgument)
		}
		return b, nil
	default:
		return nil, fmt.Errorf("value or value_base64 is required: %w", errdefs.ErrInvalidArgument)
	}
}

func (part secretsAPI) setSecret(w http.ResponseWriter, r *http.Request) {
	s := part.s
	st, err := (secretsAPI{s}).secretStore()
	if err != nil {
		writeError(w, r, err)
		return
	}
	name := r.PathValue("name")
	if err := secrets.ValidName(name); err != nil {
		writeError(w, r, err)
		return
	}
	if r.ContentLength > maxSecretBody {
		writeError(w, r, fmt.Errorf("request body of %d bytes is larger than the limit of %d bytes: %w", r.ContentLength, maxSecretBody, errdefs.ErrTooLarge))
		return
	}
	var req api.SetSecretRequest
	if err := decodeJSON(w, r, &req); err != nil {
		writeError(w, r, err)
		return
	}
	val, err := secretValue(req)
	if err != nil {
		writeError(w, r, err)
		return
	}
	tenant := callerTenant(r)
	sec, created, err := st.Set(r.Context(), secrets.SetRequest{Tenant: tenant, Name: name, Value: val, Hosts: req.Hosts, Header: req.Header})
	clear(val)
	if err != nil {
		writeError(w, r, err)
		return
	}
	action, status := "rotate", http.StatusOK
	if created {
		action, status = "set", http.StatusCreated
	}
	s.audit.Record(r.Context(), audit.Event{Kind: audit.KindSecret, Action: action, Target: name, Result: "ok", Tenant: tenant,
		Detail: map[string]any{"version": sec.Version, "hosts": sec.Hosts}})
	if !created {
		// Rotation holds from the next request of every holder on.
		if err := s.mgr.Secrets().SecretRotated(r.Context(), tenant, name); err != nil {
			writeError(w, r, fmt.Errorf("secret %s is rotated, but not every sandbox holding it has the new value yet: %v: %w", name, err, errdefs.ErrUnavailable))
			return
		}
	}
	writeJSON(w, status, apiSecret(sec))
}

func (part secretsAPI) listSecrets(w http.ResponseWriter, r *http.Request) {
	s := part.s
	st, err := (secretsAPI{s}).secretStore()
	if err != nil {
		writeError(w, r, err)
		return
	}
	list, err := st.List(r.Context(), callerTenant(r))
	if err != nil {
		writeError(w, r, err)
		return
	}
	out := api.SecretList{Secrets: make([]api.Secret, 0, len(list))}
	for _, sec := range list {
		out.Secrets = append(out.Secrets, apiSecret(sec))
	}
	writeJSON(w, http.StatusOK, out)
}

func (part secretsAPI) getSecret(w http.ResponseWriter, r *http.Request) {
	s := part.s
	st, err := (secretsAPI{s}).secretStore()
	if err != nil {
		writeError(w, r, err)
		return
	}
	sec, err := st.Get(r.Context(), callerTenant(r), r.PathValue("name"))
	if err != nil {
		writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, apiSecret(sec))
}

func (part secretsAPI) deleteSecret(w http.ResponseWriter, r *http.Request) {
	s := part.s
	st, err := (secretsAPI{s}).secretStore()
	if err != nil {
		writeError(w, r, err)
		return
	}
	name, tenant := r.PathValue("name"), callerTenant(r)
	ids, err := st.Delete(r.Context(), tenant, name)
	if err != nil {
		writeError(w, r, err)
		return
	}
	s.audit.Record(r.Context(), audit.Event{Kind: audit.KindSecret, Action: "delete", Target: name, Result: "ok", Tenant: tenant,
		Detail: map[string]any{"revoked_from": ids}})
	if err := s.mgr.Secrets().SecretDeleted(r.Context(), name, ids); err != nil {
		writeError(w, r, fmt.Errorf("secret %s is deleted, but not every sandbox that held it is updated yet: %v: %w", name, err, errdefs.ErrUnavailable))
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (part secretsAPI) listSandboxSecrets(w http.ResponseWriter, r *http.Request) {
	s := part.s
	gs, err := s.mgr.Secrets().SandboxSecrets(r.Context(), r.PathValue("id"))
	if err != nil {
		writeError(w, r, err)
		return
	}
	out := api.SecretGrantList{Grants: make([]api.SecretGrant, 0, len(gs))}
	for _, g := range gs {
		out.Grants = append(out.Grants, api.SecretGrant{Name: g.Name, Placeholder: g.Placeholder, CreatedAt: g.CreatedAt})
	}
	writeJSON(w, http.StatusOK, out)
}

func (part secretsAPI) grantSecret(w http.ResponseWriter, r *http.Request) {
	s := part.s
	id, name := r.PathValue("id"), r.PathValue("name")
	g, err := s.mgr.Secrets().GrantSecret(r.Context(), id, name)
	result := "ok"
	if err != nil {
		result = errdefs.Code(err)
	}
	s.audit.Record(r.Context(), audit.Event{Kind: audit.KindSecret, Action: "grant", Sandbox: id, Target: name, Result: result})
	if err != nil {
		writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, api.SecretGrant{Name: g.Name, Placeholder: g.Placeholder, CreatedAt: g.CreatedAt})
}

func (part secretsAPI) revokeSecret(w http.ResponseWriter, r *http.Request) {
	s := part.s
	id, name := r.PathValue("id"), r.PathValue("name")
	err := s.mgr.Secrets().RevokeSecret(r.Context(), id, name)
	result := "ok"
	if err != nil {
		result = errdefs.Code(err)
	}
	s.audit.Record(r.Context(), audit.Event{Kind: audit.KindSecret, Action: "revoke", Sandbox: id, Target: name, Result: result})
	if err != nil {
		writeError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// Network is the server's network gateway (nil: none), for tests that ask
// it what it can do (gwctl's probe: "broker" = "ok" once it intercepts).
func (s *Server) Network() sandbox.Network { return s.netw }

package replica

import (
	"context"
	"fmt"
	"net/http"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/clusterstore"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/principal"
	"github.com/spacehq/space/internal/secrets"
	"github.com/spacehq/space/internal/server"
)

// Secrets through a replica: validated as a node validates them, sealed
// with the cluster's secrets key and stored in PostgreSQL; every node
// mirrors them into its own store (server.applySecrets), where grants, the
// gateway's brokering and rotation work as on a single box. Grants are a
// sandbox's and go to its node like every sandbox call.

// secretStore is what secrets keep in the cluster store.
type secretStore interface {
	PutSecret(ctx context.Context, tenant, name string, hosts []string, header string, seal func(version int) ([]byte, error)) (clusterstore.Secret, bool, error)
	Secrets(ctx context.Context, tenant string) ([]clusterstore.Secret, error)
	GetSecret(ctx context.Context, tenant, name string) (clusterstore.Secret, error)
	DeleteSecret(ctx context.Context, tenant, name string) error
}

var _ secretStore = (*clusterstore.SecretStore)(nil)

// clusterSecrets serves the cluster's secrets.
type clusterSecrets struct {
	store  secretStore
	sealer *secrets.Sealer // nil: no --cluster-secrets-key
}

func (cs *clusterSecrets) on() error {
	if cs.sealer == nil {
		return fmt.Errorf("this replica has no --cluster-secrets-key, so it cannot seal secrets for the cluster: %w", errdefs.ErrNotSupported)
	}
	return nil
}

func clusterSecret(sec clusterstore.Secret) api.Secret {
	return api.Secret{Name: sec.Name, Tenant: sec.Tenant, Hosts: sec.Hosts, Header: sec.Header, Version: sec.Version,
		CreatedAt: sec.CreatedAt.UTC(), UpdatedAt: sec.UpdatedAt.UTC()}
}

func (cs *clusterSecrets) set(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	if err := cs.on(); err != nil {
		server.WriteError(w, req, err)
		return
	}
	name := req.PathValue("name")
	if req.ContentLength > server.MaxSecretBody {
		server.WriteError(w, req, fmt.Errorf("request body of %d bytes is larger than the limit of %d bytes: %w", req.ContentLength, server.MaxSecretBody, errdefs.ErrTooLarge))
		return
	}
	var body api.SetSecretRequest
	if err := server.DecodeJSON(w, req, &body); err != nil {
		server.WriteError(w, req, err)
		return
	}
	val, err := server.SecretValue(body)
	if err != nil {
		server.WriteError(w, req, err)
		return
	}
	defer clear(val)
	tenant := tenantName(p.Tenant)
	hosts, header, err := secrets.SetRequest{Tenant: tenant, Name: name, Value: val, Hosts: body.Hosts, Header: body.Header}.Validate()
	if err != nil {
		server.WriteError(w, req, err)
		return
	}
	sec, created, err := cs.store.PutSecret(req.Context(), tenant, name, hosts, header, func(version int) ([]byte, error) {
		return cs.sealer.Seal(tenant, name, version, val)
	})
	if err != nil {
		server.WriteError(w, req, err)
		return
	}
	status := http.StatusOK
	if created {
		status = http.StatusCreated
	}
	server.WriteJSON(w, status, clusterSecret(sec))
}

func (cs *clusterSecrets) list(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	if err := cs.on(); err != nil {
		server.WriteError(w, req, err)
		return
	}
	list, err := cs.store.Secrets(req.Context(), tenantName(p.Tenant))
	if err != nil {
		server.WriteError(w, req, err)
		return
	}
	out := api.SecretList{Secrets: make([]api.Secret, 0, len(list))}
	for _, sec := range list {
		out.Secrets = append(out.Secrets, clusterSecret(sec))
	}
	server.WriteJSON(w, http.StatusOK, out)
}

func (cs *clusterSecrets) get(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	if err := cs.on(); err != nil {
		server.WriteError(w, req, err)
		return
	}
	sec, err := cs.store.GetSecret(req.Context(), tenantName(p.Tenant), req.PathValue("name"))
	if err != nil {
		server.WriteError(w, req, err)
		return
	}
	server.WriteJSON(w, http.StatusOK, clusterSecret(sec))
}

func (cs *clusterSecrets) delete(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	if err := cs.on(); err != nil {
		server.WriteError(w, req, err)
		return
	}
	if err := cs.store.DeleteSecret(req.Context(), tenantName(p.Tenant), req.PathValue("name")); err != nil {
		server.WriteError(w, req, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

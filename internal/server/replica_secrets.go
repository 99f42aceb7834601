package server

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/clusterstore"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/principal"
	"github.com/spacehq/space/internal/secrets"
)

// Secrets through a replica: validated as a node validates them, sealed
// with the cluster's secrets key and stored in PostgreSQL; every node
// mirrors them into its own store (applySecrets), where grants, the
// gateway's brokering and rotation work as on a single box. Grants are a
// sandbox's and go to its node like every sandbox call.

// loadSealer reads the cluster's secrets key, which must already exist (a
// replica or node never makes it: `space cluster ca` does).
func loadSealer(path string) (*secrets.Sealer, error) {
	_, err := os.Stat(path)
	var key []byte
	if err == nil {
		key, err = secrets.LoadKey(path)
	}
	var sealer *secrets.Sealer
	if err == nil {
		sealer, err = secrets.NewSealer(key)
	}
	if err != nil {
		return nil, fmt.Errorf("--cluster-secrets-key: %v: %w", err, errdefs.ErrInvalidArgument)
	}
	return sealer, nil
}

func (r *Replica) secretsOn() error {
	if r.sealer == nil {
		return fmt.Errorf("this replica has no --cluster-secrets-key, so it cannot seal secrets for the cluster: %w", errdefs.ErrNotSupported)
	}
	return nil
}

func clusterSecret(sec clusterstore.Secret) api.Secret {
	return api.Secret{Name: sec.Name, Tenant: sec.Tenant, Hosts: sec.Hosts, Header: sec.Header, Version: sec.Version,
		CreatedAt: sec.CreatedAt.UTC(), UpdatedAt: sec.UpdatedAt.UTC()}
}

func (r *Replica) setSecret(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	if err := r.secretsOn(); err != nil {
		writeError(w, req, err)
		return
	}
	name := req.PathValue("name")
	if req.ContentLength > maxSecretBody {
		writeError(w, req, fmt.Errorf("request body of %d bytes is larger than the limit of %d bytes: %w", req.ContentLength, maxSecretBody, errdefs.ErrTooLarge))
		return
	}
	var body api.SetSecretRequest
	if err := decodeJSON(w, req, &body); err != nil {
		writeError(w, req, err)
		return
	}
	val, err := secretValue(body)
	if err != nil {
		writeError(w, req, err)
		return
	}
	defer clear(val)
	tenant := tenantName(p.Tenant)
	hosts, header, err := secrets.SetRequest{Tenant: tenant, Name: name, Value: val, Hosts: body.Hosts, Header: body.Header}.Validate()
	if err != nil {
		writeError(w, req, err)
		return
	}
	sec, created, err := r.store.PutSecret(req.Context(), tenant, name, hosts, header, func(version int) ([]byte, error) {
		return r.sealer.Seal(tenant, name, version, val)
	})
	if err != nil {
		writeError(w, req, err)
		return
	}
	status := http.StatusOK
	if created {
		status = http.StatusCreated
	}
	writeJSON(w, status, clusterSecret(sec))
}

func (r *Replica) listSecrets(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	if err := r.secretsOn(); err != nil {
		writeError(w, req, err)
		return
	}
	list, err := r.store.Secrets(req.Context(), tenantName(p.Tenant))
	if err != nil {
		writeError(w, req, err)
		return
	}
	out := api.SecretList{Secrets: make([]api.Secret, 0, len(list))}
	for _, sec := range list {
		out.Secrets = append(out.Secrets, clusterSecret(sec))
	}
	writeJSON(w, http.StatusOK, out)
}

func (r *Replica) getSecret(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	if err := r.secretsOn(); err != nil {
		writeError(w, req, err)
		return
	}
	sec, err := r.store.GetSecret(req.Context(), tenantName(p.Tenant), req.PathValue("name"))
	if err != nil {
		writeError(w, req, err)
		return
	}
	writeJSON(w, http.StatusOK, clusterSecret(sec))
}

func (r *Replica) deleteSecret(w http.ResponseWriter, req *http.Request, p principal.Principal) {
	if err := r.secretsOn(); err != nil {
		writeError(w, req, err)
		return
	}
	if err := r.store.DeleteSecret(req.Context(), tenantName(p.Tenant), req.PathValue("name")); err != nil {
		writeError(w, req, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// applySecrets makes the node's secrets those of the cluster: each one
// whose value, hosts or header differ is set (a rotation reaches the
// sandboxes holding it), each one the cluster does not have is deleted
// (its grants revoked).
func (s *Server) applySecrets(ctx context.Context, cs *clusterstore.Store, sealer *secrets.Sealer) error {
	st, err := s.secretStore()
	if err != nil {
		return err
	}
	want, err := cs.Secrets(ctx, "")
	if err != nil {
		return err
	}
	keep := map[string]bool{}
	var errs []error
	for _, sec := range want {
		keep[sec.Tenant+"\x00"+sec.Name] = true
		val, err := sealer.Open(sec.Tenant, sec.Name, sec.Version, sec.Sealed)
		if err != nil {
			errs = append(errs, fmt.Errorf("secret %s of %s: %w", sec.Name, sec.Tenant, err))
			continue
		}
		have, cur, err := st.Value(ctx, sec.Tenant, sec.Name)
		exists := err == nil
		same := exists && string(cur) == string(val) && have.Header == sec.Header && sameJSON(have.Hosts, sec.Hosts)
		clear(cur)
		if same {
			clear(val)
			continue
		}
		_, _, err = st.Set(ctx, secrets.SetRequest{Tenant: sec.Tenant, Name: sec.Name, Value: val, Hosts: sec.Hosts, Header: sec.Header})
		clear(val)
		if err != nil {
			errs = append(errs, fmt.Errorf("secret %s of %s: %w", sec.Name, sec.Tenant, err))
			continue
		}
		if exists {
			if err := s.mgr.SecretRotated(ctx, sec.Tenant, sec.Name); err != nil {
				errs = append(errs, err)
			}
		}
		s.cfg.Logger.Info("cluster: secret mirrored", "tenant", sec.Tenant, "secret", sec.Name, "version", sec.Version)
	}
	local, err := st.ListAll(ctx)
	if err != nil {
		return err
	}
	for _, sec := range local {
		if keep[sec.Tenant+"\x00"+sec.Name] {
			continue
		}
		ids, err := st.Delete(ctx, sec.Tenant, sec.Name)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if err := s.mgr.SecretDeleted(ctx, sec.Name, ids); err != nil {
			errs = append(errs, err)
		}
		s.cfg.Logger.Info("cluster: secret removed as the cluster's is", "tenant", sec.Tenant, "secret", sec.Name)
	}
	return errors.Join(errs...)
}

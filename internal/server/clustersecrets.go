package server

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/spacehq/space/internal/clusterstore"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/secrets"
)

// The cluster's secrets, as a node sees them: sealed by the replicas
// (internal/replica) with the cluster's secrets key and stored in
// PostgreSQL, mirrored by every node into its own store (applySecrets),
// where grants, the gateway's brokering and rotation work as on a single
// box.

// LoadClusterSealer reads the cluster's secrets key (--cluster-secrets-key),
// which must already exist (a replica or node never makes it: `space
// cluster ca` does).
func LoadClusterSealer(path string) (*secrets.Sealer, error) {
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

// loadSealer is LoadClusterSealer, for a node.
func loadSealer(path string) (*secrets.Sealer, error) { return LoadClusterSealer(path) }

// applySecrets makes the node's secrets those of the cluster: each one
// whose value, hosts or header differ is set (a rotation reaches the
// sandboxes holding it), each one the cluster does not have is deleted
// (its grants revoked).
func (s *Server) applySecrets(ctx context.Context, cs *clusterstore.SecretStore, sealer *secrets.Sealer) error {
	st, err := (secretsAPI{s}).secretStore()
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
			if err := s.mgr.Secrets().SecretRotated(ctx, sec.Tenant, sec.Name); err != nil {
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
		if err := s.mgr.Secrets().SecretDeleted(ctx, sec.Name, ids); err != nil {
			errs = append(errs, err)
		}
		s.cfg.Logger.Info("cluster: secret removed as the cluster's is", "tenant", sec.Tenant, "secret", sec.Name)
	}
	return errors.Join(errs...)
}

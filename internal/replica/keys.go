package replica

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/clusterstore"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/principal"
	"github.com/spacehq/space/internal/server"
	"github.com/spacehq/space/internal/tenancy"
)

// keyCacheTTL bounds how long a replica trusts a key it looked up: a key
// revoked through one replica stops working at every replica within it.
const keyCacheTTL = 2 * time.Second

// keyStore is what the keyring keeps in the cluster store.
type keyStore interface {
	Keys(ctx context.Context, tenant string) ([]api.APIKey, error)
	LiveKey(ctx context.Context, digest string) (api.APIKey, error)
	AddFirstKey(ctx context.Context, k api.APIKey, digest string) (bool, error)
	AddKey(ctx context.Context, k api.APIKey, digest string) error
	RevokeKey(ctx context.Context, id string) (api.APIKey, error)
}

var _ keyStore = (*clusterstore.KeyStore)(nil)

// keyring is the cluster's API keys as a replica sees them: kept in
// PostgreSQL, looked up by digest and cached for keyCacheTTL. It
// authenticates callers and serves /v1/keys.
type keyring struct {
	store keyStore

	mu    sync.Mutex
	cache map[string]cachedKey // digest → key
}

type cachedKey struct {
	key     api.APIKey
	expires time.Time
}

func newKeyring(st keyStore) *keyring { return &keyring{store: st, cache: map[string]cachedKey{}} }

// firstKey stores dataDir/api-key (made now if missing) as the cluster's
// admin key when the cluster has no key yet; with keys present the file is
// only the operator's local credential, as on a single box.
func (k *keyring) firstKey(ctx context.Context, dataDir string, notice *os.File) error {
	keys, err := k.store.Keys(ctx, "")
	if err != nil || len(keys) > 0 {
		return err
	}
	secret, err := server.LoadOrCreateAPIKey(dataDir, notice)
	if err != nil {
		return err
	}
	key, dig, err := tenancy.NewKey(api.CreateKeyRequest{Name: "admin", Tenant: principal.DefaultTenant, Scopes: []string{principal.ScopeAdmin}}, secret)
	if err != nil {
		return err
	}
	stored, err := k.store.AddFirstKey(ctx, key, dig)
	if err == nil && !stored {
		// Another replica stored its own first; this file's key is not one.
		os.Remove(filepath.Join(dataDir, "api-key"))
	}
	return err
}

// authenticate returns the principal of the request's key.
func (k *keyring) authenticate(req *http.Request) (principal.Principal, error) {
	tok, ok := strings.CutPrefix(req.Header.Get("Authorization"), "Bearer ")
	if !ok || tok == "" {
		return principal.Principal{}, fmt.Errorf("missing API key (Authorization: Bearer <key>): %w", errdefs.ErrUnauthorized)
	}
	return k.authenticateKey(req.Context(), tok)
}

// authenticateKey returns the principal of a cluster API key.
func (k *keyring) authenticateKey(ctx context.Context, tok string) (principal.Principal, error) {
	dig := tenancy.Digest(tok)
	k.mu.Lock()
	c, ok := k.cache[dig]
	k.mu.Unlock()
	if !ok || time.Now().After(c.expires) {
		key, err := k.store.LiveKey(ctx, dig)
		if err != nil {
			return principal.Principal{}, err
		}
		c = cachedKey{key: key, expires: time.Now().Add(keyCacheTTL)}
		k.mu.Lock()
		if len(k.cache) > 10000 {
			clear(k.cache)
		}
		k.cache[dig] = c
		k.mu.Unlock()
	}
	return principal.Principal{KeyID: c.key.ID, KeyName: c.key.Name, Tenant: c.key.Tenant, Scopes: slices.Clone(c.key.Scopes)}, nil
}

// handlerFunc is a replica handler, called with the authenticated caller.
type handlerFunc func(http.ResponseWriter, *http.Request, principal.Principal)

// authed is the replica's access check: a valid key holding scope.
func (k *keyring) authed(scope string, h handlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, req *http.Request) {
		p, err := k.authenticate(req)
		if err != nil {
			server.WriteError(w, req, err)
			return
		}
		if scope != "" && !p.Can(scope) {
			server.WriteError(w, req, fmt.Errorf("this API key (%s) lacks the %s scope: %w", p.KeyName, scope, errdefs.ErrPermissionDenied))
			return
		}
		h(w, req.WithContext(principal.With(req.Context(), p)), p)
	}
}

func (k *keyring) createKey(w http.ResponseWriter, req *http.Request, _ principal.Principal) {
	var body api.CreateKeyRequest
	if err := server.DecodeJSON(w, req, &body); err != nil {
		server.WriteError(w, req, err)
		return
	}
	secret := tenancy.NewKeySecret()
	key, dig, err := tenancy.NewKey(body, secret)
	if err != nil {
		server.WriteError(w, req, err)
		return
	}
	if err := k.store.AddKey(req.Context(), key, dig); err != nil {
		server.WriteError(w, req, err)
		return
	}
	server.WriteJSON(w, http.StatusCreated, api.CreatedKey{APIKey: key, Key: secret})
}

func (k *keyring) listKeys(w http.ResponseWriter, req *http.Request, _ principal.Principal) {
	keys, err := k.store.Keys(req.Context(), req.URL.Query().Get("tenant"))
	if err != nil {
		server.WriteError(w, req, err)
		return
	}
	server.WriteJSON(w, http.StatusOK, api.KeyList{Keys: keys})
}

func (k *keyring) revokeKey(w http.ResponseWriter, req *http.Request, _ principal.Principal) {
	key, err := k.store.RevokeKey(req.Context(), req.PathValue("keyid"))
	if err != nil {
		server.WriteError(w, req, err)
		return
	}
	// This replica stops honouring it at once; the others within keyCacheTTL.
	k.mu.Lock()
	clear(k.cache)
	k.mu.Unlock()
	server.WriteJSON(w, http.StatusOK, key)
}

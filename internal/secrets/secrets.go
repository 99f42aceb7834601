// Package secrets is the credential store behind brokering: secrets a
// tenant sets (encrypted at rest with AES-256-GCM under a key file), their
// grants to sandboxes (each with a random placeholder, the only thing a
// sandbox ever sees) and each sandbox's own CA, with which the network
// gateway terminates TLS for the hosts a secret may be sent to.
//
// Values leave this package only through Value and BrokerSecrets, whose one
// caller hands them to the gateway. Nothing here logs, and no error quotes
// a value.
package secrets

import (
	"context"
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/netpolicy"
	"github.com/spacehq/space/internal/store"
)

// Bounds.
const (
	MaxValueBytes = 64 << 10 // one secret's value as the API takes it (413 above)
	// MaxHeaderValueBytes is what the gateway can carry: a brokered value
	// travels in an HTTP header (netpolicy.MaxHeaderValue).
	MaxHeaderValueBytes = netpolicy.MaxHeaderValue
	MaxNameLen          = 64
	MaxHosts            = 64
	MaxHeaderLen        = 1024
	// KeyFile is the name of the encryption key's file in the data directory.
	KeyFile = "secrets.key"
	// PlaceholderPrefix begins every placeholder.
	PlaceholderPrefix = "space-ph-"
)

var nameRE = regexp.MustCompile(`^[A-Z_][A-Z0-9_]*$`)

// forbiddenHeaders may not be brokered: they frame or route the request.
var forbiddenHeaders = map[string]bool{
	"host": true, "content-length": true, "transfer-encoding": true,
	"connection": true, "upgrade": true, "te": true, "trailer": true,
	"keep-alive": true, "proxy-connection": true,
}

// Secret is what anyone may know about a secret: never its value, nor a
// hash of it (a low-entropy value would fall to a dictionary).
type Secret struct {
	Tenant    string
	Name      string
	Hosts     []string
	Header    string
	Version   int
	CreatedAt time.Time
	UpdatedAt time.Time
}

// Grant is one secret granted to one sandbox.
type Grant struct {
	Sandbox     string
	Tenant      string
	Name        string
	Placeholder string
	CreatedAt   time.Time
}

// Store keeps secrets, grants and sandbox CAs in the server's SQLite
// database (tables secrets_*, own schema version).
type Store struct {
	db   *sql.DB
	aead cipher.AEAD
	now  func() time.Time
}

var schema = []string{`
CREATE TABLE secrets_values (
	tenant     TEXT NOT NULL,
	name       TEXT NOT NULL,
	hosts      TEXT NOT NULL,      -- JSON array
	header     TEXT NOT NULL,
	version    INTEGER NOT NULL,
	sealed     BLOB NOT NULL,      -- nonce || AES-256-GCM(value), AAD tenant/name/version
	created_at INTEGER NOT NULL,
	updated_at INTEGER NOT NULL,
	PRIMARY KEY (tenant, name)
);
CREATE TABLE secrets_grants (
	sandbox     TEXT NOT NULL,
	tenant      TEXT NOT NULL,
	name        TEXT NOT NULL,
	placeholder TEXT NOT NULL UNIQUE,
	created_at  INTEGER NOT NULL,
	PRIMARY KEY (sandbox, name)
);
CREATE INDEX secrets_grants_by_secret ON secrets_grants (tenant, name);
CREATE TABLE secrets_cas (
	sandbox    TEXT PRIMARY KEY,
	hosts      TEXT NOT NULL,      -- JSON array: the name constraints
	cert_pem   BLOB NOT NULL,
	sealed_key BLOB NOT NULL,      -- nonce || AES-256-GCM(key PEM), AAD "ca"/sandbox
	created_at INTEGER NOT NULL
);
`}

// Open opens the store over db with the key in dataDir/secrets.key,
// creating the key (32 random bytes, 0600) on first start. A key file that
// the group or others can read, or of the wrong size, is refused: the
// server does not start with a key that may have leaked.
func Open(ctx context.Context, db *sql.DB, dataDir string) (*Store, error) {
	key, err := LoadKey(filepath.Join(dataDir, KeyFile))
	if err != nil {
		return nil, err
	}
	return open(ctx, db, key)
}

func open(ctx context.Context, db *sql.DB, key []byte) (*Store, error) {
	block, err := aes.NewCipher(key)
	if err != nil {
		return nil, err
	}
	aead, err := cipher.NewGCM(block)
	if err != nil {
		return nil, err
	}
	s := &Store{db: db, aead: aead, now: func() time.Time { return time.Now().UTC() }}
	if err := s.migrate(ctx); err != nil {
		return nil, fmt.Errorf("secrets schema: %w", err)
	}
	return s, nil
}

// LoadKey reads the 32-byte key at path, creating it (0600, O_EXCL) if it
// does not exist.
func LoadKey(path string) ([]byte, error) {
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		key := make([]byte, 32)
		if _, err := rand.Read(key); err != nil {
			return nil, err
		}
		nf, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
		if err != nil {
			return nil, fmt.Errorf("creating the secrets key %s: %w", path, err)
		}
		if _, err := nf.Write(key); err != nil {
			nf.Close()
			os.Remove(path)
			return nil, err
		}
		if err := nf.Sync(); err != nil {
			nf.Close()
			return nil, err
		}
		if err := nf.Close(); err != nil {
			return nil, err
		}
		return key, nil
	}
	if err != nil {
		return nil, fmt.Errorf("opening the secrets key: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("the secrets key %s is not a regular file", path)
	}
	if perm := st.Mode().Perm(); perm&0o077 != 0 {
		return nil, fmt.Errorf("the secrets key %s has mode %04o: the group or others may read it; refusing to start (chmod 600 it, and rotate the secrets if it may have leaked)", path, perm)
	}
	key, err := io.ReadAll(io.LimitReader(f, 64))
	if err != nil {
		return nil, err
	}
	if len(key) != 32 {
		return nil, fmt.Errorf("the secrets key %s holds %d bytes, want 32", path, len(key))
	}
	return key, nil
}

func (s *Store) migrate(ctx context.Context) error {
	return store.MigrateTables(ctx, s.db, "secrets", schema)
}

func invalid(format string, a ...any) error {
	return fmt.Errorf(format+": %w", append(a, errdefs.ErrInvalidArgument)...)
}

// ValidName checks a secret's name: an environment variable's name
// ([A-Z_][A-Z0-9_]*), at most 64 bytes.
func ValidName(name string) error {
	if name == "" {
		return invalid("secret name is empty")
	}
	if len(name) > MaxNameLen || !nameRE.MatchString(name) {
		return invalid("secret name %q must match [A-Z_][A-Z0-9_]* (an environment variable's name) and be at most %d bytes", clip(name), MaxNameLen)
	}
	return nil
}

// CanonicalHosts validates hosts (exact names or "*.suffix", as in network
// policies) and returns them lowercased, without trailing dots, sorted and
// de-duplicated.
func CanonicalHosts(hosts []string) ([]string, error) {
	if len(hosts) > MaxHosts {
		return nil, invalid("hosts: %d entries, at most %d", len(hosts), MaxHosts)
	}
	out := make([]string, 0, len(hosts))
	for i, h := range hosts {
		c, err := canonicalHost(h)
		if err != nil {
			return nil, invalid("hosts[%d]: %q: %v", i, clip(h), err)
		}
		out = append(out, c)
	}
	slices.Sort(out)
	return slices.Compact(out), nil
}

func canonicalHost(h string) (string, error) {
	if h == "*" {
		return "", errors.New(`bare "*" is not allowed; name the domain ("*.example.com")`)
	}
	rest, wild := strings.CutPrefix(h, "*.")
	if strings.ContainsAny(rest, "*:/[]") {
		return "", errors.New(`a host is a name or "*.suffix" only (no port, URL, IP or inner "*")`)
	}
	name, ok := netpolicy.CanonicalName(rest)
	if !ok {
		return "", errors.New("not a valid DNS name")
	}
	if wild && !strings.Contains(name, ".") {
		return "", fmt.Errorf(`"*.%s" is too broad; name the domain ("*.example.%s")`, name, name)
	}
	if wild {
		return "*." + name, nil
	}
	return name, nil
}

// ValidHeader checks a header template "Name: text" in which "{}" (at most
// once) stands for the value.
func ValidHeader(h string) error {
	if h == "" {
		return nil
	}
	if len(h) > MaxHeaderLen {
		return invalid("header is %d bytes, at most %d", len(h), MaxHeaderLen)
	}
	name, tmpl, ok := strings.Cut(h, ":")
	if !ok {
		return invalid(`header must be "Name: template" with {} standing for the value (e.g. "Authorization: Bearer {}")`)
	}
	if name == "" {
		return invalid("header has an empty name")
	}
	for i := 0; i < len(name); i++ {
		if !isTchar(name[i]) {
			return invalid("header name %q has an invalid character %q", clip(name), name[i])
		}
	}
	if forbiddenHeaders[strings.ToLower(name)] {
		return invalid("header %s frames or routes the request and may not be brokered", name)
	}
	if n := strings.Count(tmpl, "{}"); n != 1 {
		return invalid("header template must hold {} (standing for the value) once, it holds it %d times", n)
	}
	for i := 0; i < len(tmpl); i++ {
		if c := tmpl[i]; c < ' ' && c != '\t' || c == 0x7f {
			return invalid("header template contains a control character at byte %d", i)
		}
	}
	return nil
}

func isTchar(c byte) bool {
	switch {
	case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
		return true
	}
	return strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0
}

// NormalizeHeader trims the space after the header's colon so "A:  x {}"
// and "A: x {}" are stored alike.
func NormalizeHeader(h string) string {
	if h == "" {
		return ""
	}
	name, tmpl, _ := strings.Cut(h, ":")
	return name + ": " + strings.TrimLeft(tmpl, " \t")
}

func clip(s string) string {
	if len(s) > 64 {
		return s[:64] + "…"
	}
	return s
}

func tenantOr(t string) string {
	if t == "" {
		return "default"
	}
	return t
}

func valueAAD(tenant, name string, version int) []byte {
	return []byte("secret\x00" + tenant + "\x00" + name + "\x00" + strconv.Itoa(version))
}

func (s *Store) seal(plain, aad []byte) ([]byte, error) {
	nonce := make([]byte, s.aead.NonceSize())
	if _, err := rand.Read(nonce); err != nil {
		return nil, err
	}
	return s.aead.Seal(nonce, nonce, plain, aad), nil
}

func (s *Store) open(sealed, aad []byte) ([]byte, error) {
	n := s.aead.NonceSize()
	if len(sealed) < n {
		return nil, errors.New("sealed value is truncated")
	}
	plain, err := s.aead.Open(nil, sealed[:n], sealed[n:], aad)
	if err != nil {
		// The key changed, or the row was edited or moved to another name.
		return nil, fmt.Errorf("decrypting a stored secret failed (wrong key or tampered record): %w", err)
	}
	return plain, nil
}

// SetRequest is a secret to create or rotate.
type SetRequest struct {
	Tenant string
	Name   string
	Value  []byte
	Hosts  []string
	Header string
}

// Set creates the secret or, if it exists, rotates it (a new value, hosts
// and header; the version goes up). created says which.
func (s *Store) Set(ctx context.Context, r SetRequest) (sec Secret, created bool, err error) {
	r.Tenant = tenantOr(r.Tenant)
	hosts, header, err := r.Validate()
	if err != nil {
		return Secret{}, false, err
	}
	hj, _ := json.Marshal(hosts)
	now := s.now()
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return Secret{}, false, err
	}
	defer tx.Rollback()
	var version int
	var createdNS int64
	err = tx.QueryRowContext(ctx, `SELECT version, created_at FROM secrets_values WHERE tenant = ? AND name = ?`, r.Tenant, r.Name).Scan(&version, &createdNS)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		created, createdNS = true, now.UnixNano()
	case err != nil:
		return Secret{}, false, err
	}
	version++
	sealed, err := s.seal(r.Value, valueAAD(r.Tenant, r.Name, version))
	if err != nil {
		return Secret{}, false, err
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO secrets_values (tenant, name, hosts, header, version, sealed, created_at, updated_at)
		VALUES (?, ?, ?, ?, ?, ?, ?, ?)
		ON CONFLICT (tenant, name) DO UPDATE SET hosts = excluded.hosts, header = excluded.header,
			version = excluded.version, sealed = excluded.sealed, updated_at = excluded.updated_at`,
		r.Tenant, r.Name, string(hj), header, version, sealed, createdNS, now.UnixNano()); err != nil {
		return Secret{}, false, err
	}
	if err := tx.Commit(); err != nil {
		return Secret{}, false, err
	}
	return Secret{Tenant: r.Tenant, Name: r.Name, Hosts: hosts, Header: header, Version: version,
		CreatedAt: time.Unix(0, createdNS).UTC(), UpdatedAt: now}, created, nil
}

// Validate checks r as Set does (name, value, hosts, header) and returns
// its canonical hosts and header. A cluster replica validates with it
// before it seals the value for the nodes.
func (r SetRequest) Validate() (hosts []string, header string, err error) {
	if err := ValidName(r.Name); err != nil {
		return nil, "", err
	}
	if len(r.Value) == 0 {
		return nil, "", invalid("secret value is empty")
	}
	if len(r.Value) > MaxValueBytes {
		return nil, "", fmt.Errorf("secret value is %d bytes, at most %d: %w", len(r.Value), MaxValueBytes, errdefs.ErrTooLarge)
	}
	if len(r.Value) > MaxHeaderValueBytes {
		return nil, "", invalid("secret value is %d bytes; a brokered value travels in an HTTP header, at most %d bytes", len(r.Value), MaxHeaderValueBytes)
	}
	for i, c := range r.Value {
		if c < 0x20 && c != '\t' || c == 0x7f {
			// It would split the request it is put in.
			return nil, "", invalid("secret value has a control character at byte %d (a brokered value travels in an HTTP header)", i)
		}
	}
	hosts, err = CanonicalHosts(r.Hosts)
	if err != nil {
		return nil, "", err
	}
	if err := ValidHeader(r.Header); err != nil {
		return nil, "", err
	}
	header = NormalizeHeader(r.Header)
	if header != "" && len(hosts) == 0 {
		return nil, "", invalid("a header needs hosts to be sent to")
	}
	return hosts, header, nil
}

type scanner interface{ Scan(...any) error }

func scanSecret(row scanner, sealed *[]byte) (Secret, error) {
	var (
		sec        Secret
		hj         string
		cns, uns   int64
		discardBuf []byte
	)
	if sealed == nil {
		sealed = &discardBuf
	}
	if err := row.Scan(&sec.Tenant, &sec.Name, &hj, &sec.Header, &sec.Version, sealed, &cns, &uns); err != nil {
		return Secret{}, err
	}
	if err := json.Unmarshal([]byte(hj), &sec.Hosts); err != nil {
		return Secret{}, fmt.Errorf("secret %s: stored hosts: %w", sec.Name, err)
	}
	if sec.Hosts == nil {
		sec.Hosts = []string{}
	}
	sec.CreatedAt, sec.UpdatedAt = time.Unix(0, cns).UTC(), time.Unix(0, uns).UTC()
	return sec, nil
}

const secretCols = `tenant, name, hosts, header, version, sealed, created_at, updated_at`

func notFound(tenant, name string) error {
	return fmt.Errorf("no secret %q in tenant %s: %w", name, tenant, errdefs.ErrNotFound)
}

// Get returns a secret's description.
func (s *Store) Get(ctx context.Context, tenant, name string) (Secret, error) {
	tenant = tenantOr(tenant)
	if err := ValidName(name); err != nil {
		return Secret{}, err
	}
	sec, err := scanSecret(s.db.QueryRowContext(ctx, `SELECT `+secretCols+` FROM secrets_values WHERE tenant = ? AND name = ?`, tenant, name), nil)
	if errors.Is(err, sql.ErrNoRows) {
		return Secret{}, notFound(tenant, name)
	}
	return sec, err
}

// Value returns a secret's description and decrypted value. Its one use is
// the brokerconf.Config the gateway gets.
func (s *Store) Value(ctx context.Context, tenant, name string) (Secret, []byte, error) {
	tenant = tenantOr(tenant)
	var sealed []byte
	sec, err := scanSecret(s.db.QueryRowContext(ctx, `SELECT `+secretCols+` FROM secrets_values WHERE tenant = ? AND name = ?`, tenant, name), &sealed)
	if errors.Is(err, sql.ErrNoRows) {
		return Secret{}, nil, notFound(tenant, name)
	}
	if err != nil {
		return Secret{}, nil, err
	}
	v, err := s.open(sealed, valueAAD(sec.Tenant, sec.Name, sec.Version))
	if err != nil {
		return Secret{}, nil, fmt.Errorf("secret %s: %w", name, err)
	}
	return sec, v, nil
}

// List returns the tenant's secrets by name.
func (s *Store) List(ctx context.Context, tenant string) ([]Secret, error) {
	return s.list(ctx, `SELECT `+secretCols+` FROM secrets_values WHERE tenant = ? ORDER BY name`, tenantOr(tenant))
}

// ListAll lists every tenant's secrets (never their values), by tenant and
// name: what a cluster node compares with the cluster's.
func (s *Store) ListAll(ctx context.Context) ([]Secret, error) {
	return s.list(ctx, `SELECT `+secretCols+` FROM secrets_values ORDER BY tenant, name`)
}

func (s *Store) list(ctx context.Context, query string, args ...any) ([]Secret, error) {
	rows, err := s.db.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := []Secret{}
	for rows.Next() {
		sec, err := scanSecret(rows, nil)
		if err != nil {
			return nil, err
		}
		out = append(out, sec)
	}
	return out, rows.Err()
}

// Delete removes a secret and every grant of it, returning the sandboxes
// that held one (their brokers must be told).
func (s *Store) Delete(ctx context.Context, tenant, name string) ([]string, error) {
	tenant = tenantOr(tenant)
	if err := ValidName(name); err != nil {
		return nil, err
	}
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return nil, err
	}
	defer tx.Rollback()
	res, err := tx.ExecContext(ctx, `DELETE FROM secrets_values WHERE tenant = ? AND name = ?`, tenant, name)
	if err != nil {
		return nil, err
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return nil, notFound(tenant, name)
	}
	ids, err := queryStrings(ctx, tx, `SELECT sandbox FROM secrets_grants WHERE tenant = ? AND name = ? ORDER BY sandbox`, tenant, name)
	if err != nil {
		return nil, err
	}
	if _, err := tx.ExecContext(ctx, `DELETE FROM secrets_grants WHERE tenant = ? AND name = ?`, tenant, name); err != nil {
		return nil, err
	}
	return ids, tx.Commit()
}

// GrantedTo lists the sandboxes holding a grant of a secret.
func (s *Store) GrantedTo(ctx context.Context, tenant, name string) ([]string, error) {
	return queryStrings(ctx, s.db, `SELECT sandbox FROM secrets_grants WHERE tenant = ? AND name = ? ORDER BY sandbox`, tenantOr(tenant), name)
}

type querier interface {
	QueryContext(ctx context.Context, q string, args ...any) (*sql.Rows, error)
}

func queryStrings(ctx context.Context, q querier, query string, args ...any) ([]string, error) {
	rows, err := q.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var x string
		if err := rows.Scan(&x); err != nil {
			return nil, err
		}
		out = append(out, x)
	}
	return out, rows.Err()
}

// NewPlaceholder returns a fresh random placeholder: "space-ph-" and 32
// hex digits (128 bits: nothing guesses another sandbox's).
func NewPlaceholder() string {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(err)
	}
	return PlaceholderPrefix + hex.EncodeToString(b[:])
}

// Grant grants the tenant's secret name to sandbox with a new placeholder,
// or returns the grant it already has (same placeholder). The secret must
// exist.
func (s *Store) Grant(ctx context.Context, sandbox, tenant, name string) (g Grant, created bool, err error) {
	tenant = tenantOr(tenant)
	if err := ValidName(name); err != nil {
		return Grant{}, false, err
	}
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return Grant{}, false, err
	}
	defer tx.Rollback()
	var one int
	if err := tx.QueryRowContext(ctx, `SELECT 1 FROM secrets_values WHERE tenant = ? AND name = ?`, tenant, name).Scan(&one); errors.Is(err, sql.ErrNoRows) {
		return Grant{}, false, notFound(tenant, name)
	} else if err != nil {
		return Grant{}, false, err
	}
	g, err = scanGrant(tx.QueryRowContext(ctx, `SELECT sandbox, tenant, name, placeholder, created_at FROM secrets_grants WHERE sandbox = ? AND name = ?`, sandbox, name))
	if err == nil {
		if g.Tenant != tenant {
			return Grant{}, false, fmt.Errorf("sandbox %s holds a grant of %s from another tenant: %w", sandbox, name, errdefs.ErrConflict)
		}
		return g, false, nil
	}
	if !errors.Is(err, sql.ErrNoRows) {
		return Grant{}, false, err
	}
	g = Grant{Sandbox: sandbox, Tenant: tenant, Name: name, Placeholder: NewPlaceholder(), CreatedAt: s.now()}
	if _, err := tx.ExecContext(ctx, `INSERT INTO secrets_grants (sandbox, tenant, name, placeholder, created_at) VALUES (?, ?, ?, ?, ?)`,
		g.Sandbox, g.Tenant, g.Name, g.Placeholder, g.CreatedAt.UnixNano()); err != nil {
		return Grant{}, false, err
	}
	return g, true, tx.Commit()
}

func scanGrant(row scanner) (Grant, error) {
	var g Grant
	var ns int64
	if err := row.Scan(&g.Sandbox, &g.Tenant, &g.Name, &g.Placeholder, &ns); err != nil {
		return Grant{}, err
	}
	g.CreatedAt = time.Unix(0, ns).UTC()
	return g, nil
}

// Revoke drops sandbox's grant of name; ErrNotFound if it has none.
func (s *Store) Revoke(ctx context.Context, sandbox, name string) error {
	res, err := s.db.ExecContext(ctx, `DELETE FROM secrets_grants WHERE sandbox = ? AND name = ?`, sandbox, name)
	if err != nil {
		return err
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return fmt.Errorf("sandbox %s has no grant of secret %q: %w", sandbox, clip(name), errdefs.ErrNotFound)
	}
	return nil
}

// Grants lists sandbox's grants by name.
func (s *Store) Grants(ctx context.Context, sandbox string) ([]Grant, error) {
	rows, err := s.db.QueryContext(ctx, `SELECT sandbox, tenant, name, placeholder, created_at FROM secrets_grants WHERE sandbox = ? ORDER BY name`, sandbox)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := []Grant{}
	for rows.Next() {
		g, err := scanGrant(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, g)
	}
	return out, rows.Err()
}

// ForgetSandbox drops every grant and the CA of sandbox (it was deleted).
func (s *Store) ForgetSandbox(ctx context.Context, sandbox string) error {
	if _, err := s.db.ExecContext(ctx, `DELETE FROM secrets_grants WHERE sandbox = ?`, sandbox); err != nil {
		return err
	}
	_, err := s.db.ExecContext(ctx, `DELETE FROM secrets_cas WHERE sandbox = ?`, sandbox)
	return err
}

// Sandboxes lists every sandbox that has grants or a CA (reconcile drops
// those whose sandbox is gone).
func (s *Store) Sandboxes(ctx context.Context) ([]string, error) {
	return queryStrings(ctx, s.db, `SELECT sandbox FROM secrets_grants UNION SELECT sandbox FROM secrets_cas ORDER BY 1`)
}

// Sealer seals secret values with a key no single store owns: a cluster's
// (`space cluster ca` writes it beside the CA), with which replicas seal
// what they store in PostgreSQL and nodes open what they mirror. The
// associated data binds a sealed value to its tenant, name and version.
type Sealer struct {
	aead cipher.AEAD
}

// NewSealer makes a Sealer of a 32-byte key (LoadKey).
func NewSealer(key []byte) (*Sealer, error) {
	block, err := aes.NewCipher(key)
	if err != nil {
		return nil, fmt.Errorf("the cluster secrets key: %w", err)
	}
	aead, err := cipher.NewGCM(block)
	if err != nil {
		return nil, err
	}
	return &Sealer{aead: aead}, nil
}

func clusterAAD(tenant, name string, version int) []byte {
	return []byte("cluster-secret\x00" + tenantOr(tenant) + "\x00" + name + "\x00" + strconv.Itoa(version))
}

// Seal encrypts value as version of tenant's secret name.
func (s *Sealer) Seal(tenant, name string, version int, value []byte) ([]byte, error) {
	nonce := make([]byte, s.aead.NonceSize())
	if _, err := rand.Read(nonce); err != nil {
		return nil, err
	}
	return s.aead.Seal(nonce, nonce, value, clusterAAD(tenant, name, version)), nil
}

// Open decrypts what Seal made for the same tenant, name and version.
func (s *Sealer) Open(tenant, name string, version int, sealed []byte) ([]byte, error) {
	n := s.aead.NonceSize()
	if len(sealed) < n {
		return nil, errors.New("sealed value is truncated")
	}
	plain, err := s.aead.Open(nil, sealed[:n], sealed[n:], clusterAAD(tenant, name, version))
	if err != nil {
		return nil, fmt.Errorf("decrypting a cluster secret failed (another cluster key, or a tampered row): %w", err)
	}
	return plain, nil
}

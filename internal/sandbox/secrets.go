package sandbox

// Credential brokering as the manager drives it (internal/secrets keeps the
// values, grants and CAs; the gateway intercepts and substitutes):
//
//   - a grant gives a sandbox a random placeholder, put in its env under the
//     secret's name (the record's env, so every new command sees it; running
//     processes keep the env they started with);
//   - a sandbox whose grants or header rules name any host gets its own CA,
//     name-constrained to exactly those hosts; after its agent is ready on
//     every boot, restore and fork, and after every change while it runs,
//     the CA certificate is written into its trust stores (installTrust);
//   - the gateway gets the sandbox's brokerconf.Config (CA and granted secrets
//     with their current values) on every link attach and after every
//     change: grant, revoke, rotation, deletion, policy change (pushBroker),
//     so a revocation or rotation holds from the next request on;
//   - a fork's children get new placeholders and their own CA; a delete
//     forgets the grants and the CA.

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"maps"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/brokerconf"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/principal"
	"github.com/spacehq/space/internal/secrets"
)

// Broker is how the manager hands the gateway a sandbox's brokering
// config; the network (gwctl client) implements it.
type Broker interface {
	// SetBroker replaces the brokering config of sandbox id's link. An
	// empty config intercepts nothing.
	SetBroker(ctx context.Context, id string, b brokerconf.Config) error
}

// Where the sandbox CA goes inside a sandbox, and the env that points
// TLS clients at it.
const (
	TrustCAPath       = "/etc/space/ca.crt"
	TrustBundlePath   = "/etc/space/ca-bundle.crt"
	TrustAnchorPath   = "/usr/local/share/ca-certificates/space-sandbox.crt"
	SystemBundlePath  = "/etc/ssl/certs/ca-certificates.crt"
	trustBlockBegin   = "# space-sandbox-ca begin (managed by space: replaced on every boot)"
	trustBlockEnd     = "# space-sandbox-ca end"
	maxSystemBundle   = 8 << 20
	trustWriteTimeout = 30 * time.Second
)

// TrustEnv is the env every sandbox with a CA gets.
var TrustEnv = map[string]string{
	"SSL_CERT_FILE":       TrustBundlePath,
	"REQUESTS_CA_BUNDLE":  TrustBundlePath,
	"CURL_CA_BUNDLE":      TrustBundlePath,
	"NODE_EXTRA_CA_CERTS": TrustCAPath,
}

// secretRefRE finds "{secret:NAME}" in a header rule's value.
var secretRefRE = regexp.MustCompile(`\{secret:([^}]*)\}`)

// sandboxTenant is the tenant whose secrets a sandbox may be granted.
func sandboxTenant(ctx context.Context, sb api.Sandbox) string {
	if sb.Tenant != "" {
		return sb.Tenant
	}
	if p, ok := principal.From(ctx); ok && p.Tenant != "" {
		return p.Tenant
	}
	return principal.DefaultTenant
}

// ruleRef is one "{secret:NAME}" in a header rule: the gateway puts
// NAME's value there on requests to the rule's domain.
type ruleRef struct {
	domain, secret string
}

// secretRefs returns the secret references of p's header rules.
func secretRefs(p api.NetworkPolicy) ([]ruleRef, error) {
	var out []ruleRef
	for i, r := range p.Rules {
		for _, k := range slices.Sorted(maps.Keys(r.SetHeaders)) {
			for _, m := range secretRefRE.FindAllStringSubmatch(r.SetHeaders[k], -1) {
				if err := secrets.ValidName(m[1]); err != nil {
					return nil, fmt.Errorf("network.rules[%d].set_headers[%q]: {secret:…}: %w", i, k, err)
				}
				out = append(out, ruleRef{domain: strings.ToLower(strings.TrimSuffix(r.Domain, ".")), secret: m[1]})
			}
		}
	}
	return out, nil
}

// checkSecretRefs refuses a policy whose header rules name a secret that is
// not among granted.
func checkSecretRefs(p api.NetworkPolicy, granted []string) error {
	refs, err := secretRefs(p)
	if err != nil {
		return err
	}
	for _, r := range refs {
		if !slices.Contains(granted, r.secret) {
			return invalid("network.rules: the header rule for %s names secret %s, which is not granted to the sandbox (grant it first, or list it in secrets)", r.domain, r.secret)
		}
	}
	return nil
}

// validateSecretNames checks a create request's secrets list.
func validateSecretNames(names []string, env map[string]string) error {
	if len(names) > secrets.MaxHosts {
		return invalid("secrets: %d names, at most %d", len(names), secrets.MaxHosts)
	}
	seen := map[string]bool{}
	for i, n := range names {
		if err := secrets.ValidName(n); err != nil {
			return fmt.Errorf("secrets[%d]: %w", i, err)
		}
		if seen[n] {
			return invalid("secrets[%d]: %s is listed twice", i, n)
		}
		seen[n] = true
		if _, ok := env[n]; ok {
			return invalid("secrets[%d]: %s is also set in env; a granted secret's env var holds its placeholder", i, n)
		}
	}
	return nil
}

// createSecrets grants names to the new sandbox sb (not yet stored) and
// puts their placeholders in its env. undo revokes them again if the
// sandbox is not created after all.
func (part *Secrets) createSecrets(ctx context.Context, sb *api.Sandbox, names []string) (undo func(), err error) {
	m := part.m
	undo = func() {}
	if len(names) == 0 {
		if sb.Network != nil {
			return undo, checkSecretRefs(*sb.Network, nil)
		}
		return undo, nil
	}
	if err := validateSecretNames(names, sb.Env); err != nil {
		return undo, err
	}
	if sb.Network != nil {
		if err := checkSecretRefs(*sb.Network, names); err != nil {
			return undo, err
		}
	}
	if m.cfg.Secrets == nil {
		return undo, fmt.Errorf("this server has no secrets store: %w", errdefs.ErrUnprocessable)
	}
	tenant := sandboxTenant(ctx, *sb)
	var done []string
	undo = func() {
		for _, n := range done {
			m.cfg.Secrets.Revoke(context.Background(), sb.ID, n)
		}
	}
	env := maps.Clone(sb.Env)
	if env == nil {
		env = map[string]string{}
	}
	for _, n := range names {
		g, _, err := m.cfg.Secrets.Grant(ctx, sb.ID, tenant, n)
		if err != nil {
			undo()
			return func() {}, fmt.Errorf("secrets: %w", err)
		}
		done = append(done, n)
		env[n] = g.Placeholder
	}
	sb.Env = env
	return undo, nil
}

// forkSecrets gives the fork child each of parent's grants with a new
// placeholder, replacing the parent's in the child's env: the parent's
// placeholders (in the child's inherited memory) are worthless there.
func (part *Secrets) forkSecrets(ctx context.Context, parent api.Sandbox, child *api.Sandbox) error {
	m := part.m
	if m.cfg.Secrets == nil {
		return nil
	}
	gs, err := m.cfg.Secrets.Grants(ctx, parent.ID)
	if err != nil || len(gs) == 0 {
		return err
	}
	if child.Env == nil {
		child.Env = map[string]string{}
	}
	for _, pg := range gs {
		g, _, err := m.cfg.Secrets.Grant(ctx, child.ID, pg.Tenant, pg.Name)
		if err != nil {
			return fmt.Errorf("granting %s to fork child %s: %w", pg.Name, child.ID, err)
		}
		child.Env[pg.Name] = g.Placeholder
	}
	return nil
}

// brokerPlan is what the gateway must know about one sandbox.
type brokerPlan struct {
	hosts   []string // the CA's name constraints
	secrets []brokerconf.Secret
}

// planBroker collects sb's grants (with current values) and the header
// rules of pol that name a secret. Hosts are the union of the granted
// secrets' hosts and every header rule's domain.
func (part *Secrets) planBroker(ctx context.Context, sb api.Sandbox, pol api.NetworkPolicy) (brokerPlan, error) {
	m := part.m
	var plan brokerPlan
	if m.cfg.Secrets == nil {
		return plan, nil
	}
	gs, err := m.cfg.Secrets.Grants(ctx, sb.ID)
	if err != nil {
		return plan, err
	}
	hosts := map[string]bool{}
	byName := map[string]*brokerconf.Secret{}
	var order []string
	for _, g := range gs {
		sec, val, err := m.cfg.Secrets.Value(ctx, g.Tenant, g.Name)
		if errors.Is(err, errdefs.ErrNotFound) {
			continue // deleted meanwhile
		}
		if err != nil {
			return plan, err
		}
		byName[g.Name] = &brokerconf.Secret{Name: g.Name, Hosts: slices.Clone(sec.Hosts), Header: sec.Header, Placeholder: g.Placeholder, Value: val}
		order = append(order, g.Name)
	}
	for _, r := range pol.Rules {
		if d, err := secrets.CanonicalHosts([]string{r.Domain}); err == nil && len(d) == 1 {
			hosts[d[0]] = true
		}
	}
	refs, err := secretRefs(pol)
	if err != nil {
		return plan, err
	}
	// The gateway puts a rule's {secret:NAME} only on NAME's own hosts:
	// naming it in a rule for a domain makes that domain one of them.
	for _, r := range refs {
		bs, ok := byName[r.secret]
		if !ok {
			// Revoked or deleted since the policy was set: nothing to send.
			m.log.Warn("a header rule names a secret the sandbox no longer holds; the header is not set", "sandbox", sb.ID, "secret", r.secret, "domain", r.domain)
			continue
		}
		if d, err := secrets.CanonicalHosts([]string{r.domain}); err == nil && len(d) == 1 && !slices.Contains(bs.Hosts, d[0]) {
			bs.Hosts = append(bs.Hosts, d[0])
		}
	}
	for _, name := range order {
		bs := byName[name]
		if len(bs.Hosts) == 0 {
			continue // no host may receive it: nothing to broker
		}
		for _, h := range bs.Hosts {
			hosts[h] = true
		}
		plan.secrets = append(plan.secrets, *bs)
	}
	plan.hosts = slices.Sorted(maps.Keys(hosts))
	return plan, nil
}

// pushBroker sends sandbox sb's brokerconf.Config (policy pol) to the gateway.
// With nothing to broker it sends an empty config only when force (a
// change may have emptied it), so plain sandboxes cost nothing at attach.
func (part *Secrets) pushBroker(ctx context.Context, sb api.Sandbox, pol api.NetworkPolicy, force bool) error {
	m := part.m
	plan, err := m.secrets.planBroker(ctx, sb, pol)
	if err != nil {
		return err
	}
	var cfg brokerconf.Config
	if len(plan.hosts) > 0 {
		ca, err := m.cfg.Secrets.EnsureCA(ctx, sb.ID, plan.hosts)
		if err != nil {
			return fmt.Errorf("the sandbox's CA: %w", err)
		}
		cfg = brokerconf.Config{CACertPEM: ca.CertPEM, CAKeyPEM: ca.KeyPEM, Secrets: plan.secrets}
	} else if !force {
		return nil
	}
	if m.cfg.Broker == nil {
		if len(cfg.Secrets) > 0 {
			m.log.Warn("the network gateway cannot broker secrets; the sandbox's placeholders reach its hosts unreplaced", "sandbox", sb.ID)
		}
		return nil
	}
	if err := m.cfg.Broker.SetBroker(ctx, sb.ID, cfg); err != nil {
		if errdefs.Code(err) == api.CodeInternal {
			err = fmt.Errorf("%w: %w", err, errdefs.ErrUnavailable)
		}
		return fmt.Errorf("handing the sandbox's brokered secrets to the network gateway: %w", err)
	}
	return nil
}

// brokerAtAttach is pushBroker for a link just attached: the sandbox's
// record is read afresh. A failure fails the attach: a sandbox whose
// secrets the gateway does not know must not run as if it did.
func (part *Secrets) brokerAtAttach(ctx context.Context, id string, pol api.NetworkPolicy) error {
	m := part.m
	if m.cfg.Secrets == nil {
		return nil
	}
	sb, err := m.cfg.DB.GetSandbox(ctx, id)
	if err != nil {
		return err
	}
	return m.secrets.pushBroker(ctx, sb, pol, false)
}

// installTrust writes sb's CA certificate into its trust stores through
// the agent, as root, and returns sb with the trust env set. Nothing to do
// for a sandbox without brokered hosts. Idempotent: run after every boot,
// restore and fork, and after every change while the sandbox runs.
func (part *Secrets) installTrust(ctx context.Context, e *entry, sb api.Sandbox) (api.Sandbox, error) {
	m := part.m
	if m.cfg.Secrets == nil {
		return sb, nil
	}
	plan, err := m.secrets.planBroker(ctx, sb, policyOf(sb))
	if err != nil || len(plan.hosts) == 0 {
		return sb, err
	}
	ca, err := m.cfg.Secrets.EnsureCA(ctx, sb.ID, plan.hosts)
	if err != nil {
		return sb, err
	}
	e.cmu.RLock()
	c := e.client
	e.cmu.RUnlock()
	if c == nil {
		return sb, fmt.Errorf("no agent connection to install the sandbox's CA: %w", errdefs.ErrUnavailable)
	}
	ctx, cancel := context.WithTimeout(ctx, trustWriteTimeout)
	defer cancel()
	write := func(path string, data []byte) error {
		if _, err := c.WriteFile(ctx, path, 0o644, bytes.NewReader(data)); err != nil {
			return fmt.Errorf("writing %s: %w", path, err)
		}
		return nil
	}
	for _, d := range []string{"/etc/space", "/usr/local/share/ca-certificates"} {
		if _, err := c.Mkdir(ctx, d, 0o755); err != nil {
			return sb, fmt.Errorf("creating %s: %w", d, err)
		}
	}
	system, hasSystem, err := readBounded(ctx, c, SystemBundlePath)
	if err != nil {
		return sb, err
	}
	system = withoutTrustBlock(system)
	block := []byte(trustBlockBegin + "\n" + string(ca.CertPEM) + trustBlockEnd + "\n")
	if err := write(TrustCAPath, ca.CertPEM); err != nil {
		return sb, err
	}
	if err := write(TrustAnchorPath, ca.CertPEM); err != nil {
		return sb, err
	}
	if err := write(TrustBundlePath, joinPEM(system, block)); err != nil {
		return sb, err
	}
	if hasSystem {
		if err := write(SystemBundlePath, joinPEM(system, block)); err != nil {
			return sb, err
		}
	}
	return m.secrets.setTrustEnv(ctx, sb)
}

// setTrustEnv stores TrustEnv in sb's env if it is not there yet.
func (part *Secrets) setTrustEnv(ctx context.Context, sb api.Sandbox) (api.Sandbox, error) {
	m := part.m
	missing := false
	for k, v := range TrustEnv {
		if sb.Env[k] != v {
			missing = true
		}
	}
	if !missing {
		return sb, nil
	}
	cur, err := m.cfg.DB.GetSandbox(ctx, sb.ID)
	if err != nil {
		return sb, err
	}
	cur.Env = maps.Clone(cur.Env)
	if cur.Env == nil {
		cur.Env = map[string]string{}
	}
	maps.Copy(cur.Env, TrustEnv)
	if err := m.cfg.DB.PutSandbox(ctx, cur); err != nil {
		return sb, err
	}
	sb.Env = cur.Env
	return sb, nil
}

func readBounded(ctx context.Context, c *agentClient, path string) ([]byte, bool, error) {
	r, err := c.ReadFile(ctx, path)
	if errors.Is(err, errdefs.ErrNotFound) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, fmt.Errorf("reading %s: %w", path, err)
	}
	defer r.Close()
	b, err := io.ReadAll(io.LimitReader(r, maxSystemBundle+1))
	if err != nil {
		return nil, false, fmt.Errorf("reading %s: %w", path, err)
	}
	if len(b) > maxSystemBundle {
		return nil, false, fmt.Errorf("%s is larger than %d bytes: %w", path, maxSystemBundle, errdefs.ErrUnprocessable)
	}
	return b, true, nil
}

// withoutTrustBlock removes the block an earlier installTrust appended.
func withoutTrustBlock(b []byte) []byte {
	for {
		i := bytes.Index(b, []byte(trustBlockBegin))
		if i < 0 {
			return b
		}
		j := bytes.Index(b[i:], []byte(trustBlockEnd))
		if j < 0 {
			return b[:i]
		}
		end := i + j + len(trustBlockEnd)
		if end < len(b) && b[end] == '\n' {
			end++
		}
		b = append(b[:i:i], b[end:]...)
	}
}

func joinPEM(a, b []byte) []byte {
	out := slices.Clone(a)
	if len(out) > 0 && out[len(out)-1] != '\n' {
		out = append(out, '\n')
	}
	return append(out, b...)
}

// secretsReady runs after a sandbox's agent is ready (boot, restore, fork
// child): its CA goes into its trust stores (phase "trust"). It returns
// the record with the trust env.
func (part *Secrets) secretsReady(ctx context.Context, p *phases, e *entry, sb api.Sandbox) (api.Sandbox, error) {
	m := part.m
	if m.cfg.Secrets == nil {
		return sb, nil
	}
	plan, err := m.secrets.planBroker(ctx, sb, policyOf(sb))
	if err != nil || len(plan.hosts) == 0 {
		return sb, err
	}
	out := sb
	err = p.run("trust", func() error {
		var err error
		out, err = m.secrets.installTrust(ctx, e, sb)
		return err
	})
	return out, err
}

// secretsChanged brings sandbox sb (the caller holds its lock) up to date
// after a change of its grants, a secret or its policy: the gateway gets
// the new config at once and a running sandbox's trust stores the CA of
// its new host set.
func (part *Secrets) secretsChanged(ctx context.Context, e *entry, sb api.Sandbox) error {
	m := part.m
	if !linked(sb.State) {
		return nil // the next attach and boot read the store
	}
	if sb.State == api.StateRunning {
		e.cmu.RLock()
		c := e.client
		e.cmu.RUnlock()
		if c != nil {
			var err error
			if sb, err = m.secrets.installTrust(ctx, e, sb); err != nil {
				m.log.Warn("installing the sandbox's CA after a change failed; its next boot installs it", "sandbox", sb.ID, "err", err)
			}
		}
	}
	if m.cfg.Network == nil {
		return nil
	}
	return m.secrets.pushBroker(ctx, sb, policyOf(sb), true)
}

// SandboxSecrets lists the secrets granted to sandbox id.
func (part *Secrets) SandboxSecrets(ctx context.Context, id string) ([]secrets.Grant, error) {
	m := part.m
	if _, err := m.Get(ctx, id); err != nil {
		return nil, err
	}
	if m.cfg.Secrets == nil {
		return []secrets.Grant{}, nil
	}
	return m.cfg.Secrets.Grants(ctx, id)
}

// lockedSandbox reads sandbox id under its entry lock, which the caller
// releases with the returned func.
func (part *Secrets) lockedSandbox(ctx context.Context, id string) (*entry, api.Sandbox, func(), error) {
	m := part.m
	if err := ValidID(id); err != nil {
		return nil, api.Sandbox{}, nil, err
	}
	if _, err := m.cfg.DB.GetSandbox(ctx, id); err != nil {
		return nil, api.Sandbox{}, nil, err
	}
	e := m.entry(id)
	e.mu.Lock()
	sb, err := m.cfg.DB.GetSandbox(ctx, id)
	if err != nil {
		e.mu.Unlock()
		return nil, api.Sandbox{}, nil, err
	}
	if sb.State == api.StateDeleting {
		e.mu.Unlock()
		return nil, api.Sandbox{}, nil, wrongState(id, sb.State, "change the secrets of")
	}
	return e, sb, e.mu.Unlock, nil
}

// GrantSecret grants the sandbox's tenant's secret name to sandbox id (the
// existing grant if it has one): its placeholder goes into the sandbox's
// env for new commands and the gateway learns it at once.
func (part *Secrets) GrantSecret(ctx context.Context, id, name string) (secrets.Grant, error) {
	m := part.m
	if err := secrets.ValidName(name); err != nil {
		return secrets.Grant{}, err
	}
	if m.cfg.Secrets == nil {
		return secrets.Grant{}, fmt.Errorf("this server has no secrets store: %w", errdefs.ErrUnprocessable)
	}
	e, sb, unlock, err := m.secrets.lockedSandbox(ctx, id)
	if err != nil {
		return secrets.Grant{}, err
	}
	defer unlock()
	g, _, err := m.cfg.Secrets.Grant(ctx, id, sandboxTenant(ctx, sb), name)
	if err != nil {
		return secrets.Grant{}, err
	}
	if sb.Env[name] != g.Placeholder {
		sb.Env = maps.Clone(sb.Env)
		if sb.Env == nil {
			sb.Env = map[string]string{}
		}
		sb.Env[name] = g.Placeholder
		sb.UpdatedAt = time.Now().UTC()
		m.withActivity(&sb)
		if err := m.cfg.DB.PutSandbox(ctx, sb); err != nil {
			return secrets.Grant{}, err
		}
	}
	return g, m.secrets.secretsChanged(ctx, e, sb)
}

// RevokeSecret drops sandbox id's grant of name: its env var goes, and
// the gateway stops substituting its placeholder from the next request.
// A grant a header rule of the sandbox's policy names is refused (409):
// change the policy first.
func (part *Secrets) RevokeSecret(ctx context.Context, id, name string) error {
	m := part.m
	if err := secrets.ValidName(name); err != nil {
		return err
	}
	if m.cfg.Secrets == nil {
		return fmt.Errorf("sandbox %s has no grant of secret %s: %w", id, name, errdefs.ErrNotFound)
	}
	e, sb, unlock, err := m.secrets.lockedSandbox(ctx, id)
	if err != nil {
		return err
	}
	defer unlock()
	if refs, _ := secretRefs(policyOf(sb)); slices.ContainsFunc(refs, func(r ruleRef) bool { return r.secret == name }) {
		return fmt.Errorf("a header rule of sandbox %s's network policy names secret %s; remove it from the policy first: %w", id, name, errdefs.ErrConflict)
	}
	if err := m.cfg.Secrets.Revoke(ctx, id, name); err != nil {
		return err
	}
	return m.secrets.dropSecretEnv(ctx, e, sb, name)
}

// dropSecretEnv removes name's placeholder from sb's env and updates the
// gateway; the caller holds the sandbox's lock.
func (part *Secrets) dropSecretEnv(ctx context.Context, e *entry, sb api.Sandbox, name string) error {
	m := part.m
	if v, ok := sb.Env[name]; ok && strings.HasPrefix(v, secrets.PlaceholderPrefix) {
		sb.Env = maps.Clone(sb.Env)
		delete(sb.Env, name)
		sb.UpdatedAt = time.Now().UTC()
		m.withActivity(&sb)
		if err := m.cfg.DB.PutSandbox(ctx, sb); err != nil {
			return err
		}
	}
	return m.secrets.secretsChanged(ctx, e, sb)
}

// SecretRotated pushes the new value of a rotated secret to every sandbox
// holding it. Errors are joined; each sandbox is tried.
func (part *Secrets) SecretRotated(ctx context.Context, tenant, name string) error {
	m := part.m
	if m.cfg.Secrets == nil {
		return nil
	}
	ids, err := m.cfg.Secrets.GrantedTo(ctx, tenant, name)
	if err != nil {
		return err
	}
	var errs []error
	for _, id := range ids {
		e, sb, unlock, err := m.secrets.lockedSandbox(ctx, id)
		if err != nil {
			continue
		}
		if err := m.secrets.secretsChanged(ctx, e, sb); err != nil {
			errs = append(errs, fmt.Errorf("sandbox %s: %w", id, err))
		}
		unlock()
	}
	return errors.Join(errs...)
}

// SecretDeleted updates the sandboxes that held a deleted secret (ids,
// from secrets.Store.Delete): the env var goes and the gateway forgets it.
func (part *Secrets) SecretDeleted(ctx context.Context, name string, ids []string) error {
	m := part.m
	var errs []error
	for _, id := range ids {
		e, sb, unlock, err := m.secrets.lockedSandbox(ctx, id)
		if err != nil {
			continue
		}
		if err := m.secrets.dropSecretEnv(ctx, e, sb, name); err != nil {
			errs = append(errs, fmt.Errorf("sandbox %s: %w", id, err))
		}
		unlock()
	}
	return errors.Join(errs...)
}

// checkPolicySecrets validates the secret references of a new policy for
// sandbox id against its grants.
func (part *Secrets) checkPolicySecrets(ctx context.Context, id string, p api.NetworkPolicy) error {
	m := part.m
	var names []string
	if m.cfg.Secrets != nil {
		gs, err := m.cfg.Secrets.Grants(ctx, id)
		if err != nil {
			return err
		}
		for _, g := range gs {
			names = append(names, g.Name)
		}
	}
	return checkSecretRefs(p, names)
}

// forgetSecrets drops a deleted sandbox's grants and CA.
func (part *Secrets) forgetSecrets(id string) {
	m := part.m
	if m.cfg.Secrets == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := m.cfg.Secrets.ForgetSandbox(ctx, id); err != nil && !errors.Is(err, sql.ErrNoRows) {
		m.log.Warn("forgetting a deleted sandbox's secrets failed", "sandbox", id, "err", err)
	}
}

// Package principal is who is calling: the API key a request was
// authenticated by, its tenant and its scopes. The server puts one in every
// authenticated request's context; the layers below (audit, policy,
// secrets) read it from there instead of re-parsing credentials.
package principal

import (
	"context"
	"slices"
	"strings"
)

// Scopes a key may hold. "<area>:read" lets a key look, "<area>:write" act;
// write implies read. Admin implies every scope and every tenant.
const (
	ScopeSandboxRead    = "sandbox:read"    // get/list sandboxes, operations, stats
	ScopeSandboxWrite   = "sandbox:write"   // create/delete and lifecycle verbs
	ScopeExecWrite      = "exec:write"      // exec, commands, attach, signals
	ScopeExecRead       = "exec:read"       // list/get commands and their output
	ScopeFilesRead      = "files:read"      // read, stat, list, tar get, watch
	ScopeFilesWrite     = "files:write"     // write, remove, mkdir, rename, tar put
	ScopeTemplatesRead  = "templates:read"  // list/get/export templates
	ScopeTemplatesWrite = "templates:write" // build, pull, import, tag, remove, gc
	ScopeNetworkRead    = "network:read"    // get network, events, ports
	ScopeNetworkWrite   = "network:write"   // put network policy, ports
	ScopeSecretsRead    = "secrets:read"    // list secrets (never values)
	ScopeSecretsWrite   = "secrets:write"   // set, rotate, delete, grant
	ScopePolicyRead     = "policy:read"     // list rules, approvals
	ScopePolicyWrite    = "policy:write"    // set rules, answer approvals
	ScopeAuditRead      = "audit:read"      // list, export, verify the audit log
	ScopeAdmin          = "admin"           // everything, every tenant, keys and tenants
)

// AllScopes lists every scope in a stable order.
var AllScopes = []string{
	ScopeSandboxRead, ScopeSandboxWrite, ScopeExecRead, ScopeExecWrite,
	ScopeFilesRead, ScopeFilesWrite, ScopeTemplatesRead, ScopeTemplatesWrite,
	ScopeNetworkRead, ScopeNetworkWrite, ScopeSecretsRead, ScopeSecretsWrite,
	ScopePolicyRead, ScopePolicyWrite, ScopeAuditRead, ScopeAdmin,
}

// DefaultTenant is the tenant of keys created without one, and of every
// sandbox and template made before tenants existed.
const DefaultTenant = "default"

// Principal is an authenticated caller.
type Principal struct {
	KeyID   string   // stable id of the key (never the secret), "" for internal callers
	KeyName string   // the operator's name for it
	Tenant  string   // the tenant it acts for
	Scopes  []string // as granted
}

// Admin reports whether p holds the admin scope.
func (p Principal) Admin() bool { return slices.Contains(p.Scopes, ScopeAdmin) }

// Can reports whether p holds scope, directly, through admin, or (for a
// ":read" scope) through the same area's ":write".
func (p Principal) Can(scope string) bool {
	if p.Admin() || slices.Contains(p.Scopes, scope) {
		return true
	}
	if area, ok := strings.CutSuffix(scope, ":read"); ok {
		return slices.Contains(p.Scopes, area+":write")
	}
	return false
}

// Sees reports whether p may see objects of tenant t (its own tenant;
// admin sees all).
func (p Principal) Sees(t string) bool {
	if t == "" {
		t = DefaultTenant
	}
	return p.Admin() || p.Tenant == t
}

type ctxKey struct{}

// With returns ctx carrying p.
func With(ctx context.Context, p Principal) context.Context {
	return context.WithValue(ctx, ctxKey{}, p)
}

// From returns the principal in ctx, if any.
func From(ctx context.Context) (Principal, bool) {
	p, ok := ctx.Value(ctxKey{}).(Principal)
	return p, ok
}

// System is the principal of the server's own work (reconcile, expiry,
// builds): admin, no key.
var System = Principal{KeyName: "system", Tenant: DefaultTenant, Scopes: []string{ScopeAdmin}}

package sandbox

// Warm pools (issue 14): per (template, runtime, limits) a set of sandboxes
// made ahead of demand by the normal create path (no tenant, no labels, no
// env, the server's default network policy, the template's start command
// not run), waiting with their agent up. A create that matches a pool
// claims a member and personalises it (claim.go); a miss falls back to the
// normal create. Members are sandbox records marked with PoolLabel: no
// answer, list, quota or policy ever sees them (isPoolMember).

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/agentproto"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/principal"
	"github.com/spacehq/space/internal/runtime"
	"github.com/spacehq/space/internal/store"
)

// PoolLabel marks the record of a pool member; its value is the pool's id.
// It never reaches an answer: members are hidden, and a claim replaces the
// labels with the caller's. Requests may not set it.
const PoolLabel = "space.pool"

// Pool bounds.
const (
	maxPoolSize = 64
	// poolShrinkAfter without a miss lowers a raised target by one.
	poolShrinkAfter = time.Minute
	// DefaultPoolMemFloor is the host MemAvailable under which pools do
	// not fill and shed idle members.
	DefaultPoolMemFloor = 1 << 30
)

// PoolObserver is the optional part of an Observer that measures pools.
type PoolObserver interface {
	PoolClaim(pool string, hit bool)
	PoolRefill(pool string, d time.Duration)
}

// poolIdleMode is how members of each runtime wait: paused where that buys
// the claim latency per MiB held (docs/BENCHMARKS.md, "Warm pools").
var poolIdleMode = map[string]string{}

func idleModeFor(rtName string, rt runtime.Runtime) string {
	if m := poolIdleMode[rtName]; m != "" {
		return m
	}
	return api.PoolIdleRunning
}

// member is one ready pool member.
type member struct {
	id     string
	digest string
	paused bool
}

// pool is one warm pool's in-memory state; pools.mu guards every field.
type pool struct {
	id      string
	spec    api.PoolSpec // normalised: runtime "auto" or a name, limits resolved
	runtime string       // resolved runtime name
	idle    string

	digest  string
	ready   []member // oldest first
	filling int
	target  int
	hits    int64
	misses  int64
	// savedHits and savedMisses are the counters as last written to the
	// store (save).
	savedHits, savedMisses int64
	lastRefill             time.Duration
	lastErr                string
	lastMiss               time.Time
	lastShrink             time.Time
	deleted                bool
}

// pools is the manager's set of warm pools.
type pools struct {
	m *Manager

	// setMu serialises SetPool and EnsureDefaultPool, so two writes
	// cannot both find no twin (twin reads templates outside mu).
	setMu sync.Mutex
	mu    sync.Mutex
	byID  map[string]*pool
	// fillSem bounds fills server-wide: one at a time, so refilling never
	// takes more than one core's worth of runtime work from API calls.
	fillSem chan struct{}
	// memAvailable reads the host's MemAvailable (tests replace it).
	memAvailable func() (int64, error)
}

func newPools(m *Manager) *pools {
	return &pools{m: m, byID: map[string]*pool{}, fillSem: make(chan struct{}, 1), memAvailable: HostMemAvailable}
}

var poolSchema = []string{`
CREATE TABLE pool_pools (
	id   TEXT PRIMARY KEY,
	data TEXT NOT NULL -- api.PoolSpec JSON
) STRICT;
`,
	// The claim counters, kept across restarts (issue 26); save writes
	// them.
	`ALTER TABLE pool_pools ADD COLUMN hits INTEGER NOT NULL DEFAULT 0`,
	`ALTER TABLE pool_pools ADD COLUMN misses INTEGER NOT NULL DEFAULT 0`,
}

// isPoolMember says whether sb is an unclaimed pool member.
func isPoolMember(sb api.Sandbox) bool { return sb.Labels[PoolLabel] != "" }

// PoolTemplates returns the digests of the templates pool members are made
// from. Members keep their templates alive like any sandbox (template
// removal and gc must not take a tree from under one), though no listing
// shows them.
func (part *WarmPools) PoolTemplates(ctx context.Context) (map[string]bool, error) {
	m := part.m
	sbs, err := m.cfg.DB.ListSandboxes(ctx, store.SandboxFilter{})
	if err != nil {
		return nil, err
	}
	out := map[string]bool{}
	for _, sb := range sbs {
		if isPoolMember(sb) && sb.TemplateDigest != "" && sb.State != api.StateDeleted {
			out[sb.TemplateDigest] = true
		}
	}
	return out, nil
}

// PoolID is the deterministic id of the pool with spec s (normalised).
func PoolID(s api.PoolSpec) string {
	// The idle mode is how members wait, not what they are: not in the key.
	key, _ := json.Marshal(struct {
		T, R string
		L    api.Limits
	}{s.Template, s.Runtime, s.Limits})
	h := sha256.Sum256(key)
	return "pool-" + hex.EncodeToString(h[:6])
}

// normalisePool checks s and fills its defaults; errors name the field.
func (part *WarmPools) normalisePool(ctx context.Context, s api.PoolSpec, checkTemplate bool) (api.PoolSpec, runtime.Runtime, error) {
	m := part.m
	if s.Template == "" {
		return s, nil, invalid("template is required")
	}
	if err := validateTemplateRef(s.Template); err != nil {
		return s, nil, err
	}
	if s.Min < 0 || s.Max < 0 {
		return s, nil, invalid("min and max must not be negative, got min %d max %d", s.Min, s.Max)
	}
	if s.Min > s.Max {
		return s, nil, invalid("min (%d) must not exceed max (%d)", s.Min, s.Max)
	}
	if s.Max > maxPoolSize {
		return s, nil, invalid("max must be at most %d, got %d", maxPoolSize, s.Max)
	}
	lim, err := resolveLimits(s.Limits)
	if err != nil {
		return s, nil, err
	}
	s.Limits = lim
	if s.Runtime == "" {
		s.Runtime = runtime.Auto
	}
	rt, caps, err := m.creates.pickRuntime(ctx, s.Runtime)
	if err != nil {
		return s, nil, err
	}
	switch s.IdleMode {
	case "", api.PoolIdleRunning:
	case api.PoolIdlePaused:
		if !caps.Verbs[api.OpPause] {
			return s, nil, runtime.NotSupported(rt.Name(), api.OpPause, caps.VerbReasons[api.OpPause])
		}
	default:
		return s, nil, invalid("idle_mode must be running or paused, got %q", truncate(s.IdleMode, 32))
	}
	if checkTemplate {
		if _, err := m.cfg.Templates.Get(ctx, s.Template); err != nil {
			return s, nil, fmt.Errorf("template %q: %w", truncate(s.Template, 128), err)
		}
	}
	return s, rt, nil
}

// validateTemplateRef checks a template reference's syntax.
func validateTemplateRef(ref string) error {
	if len(ref) > 256 || strings.ContainsAny(ref, " \t\r\n\x00/\\") {
		return invalid("template %q is not a template reference (name[:tag] or sha256:…)", truncate(ref, 64))
	}
	return nil
}

// loadPools reads the persisted pools (at Reconcile).
func (ps *pools) load(ctx context.Context) error {
	db := ps.m.cfg.DB.SQL()
	if err := store.MigrateTables(ctx, db, "pool", poolSchema); err != nil {
		return fmt.Errorf("pool tables: %w", err)
	}
	rows, err := db.QueryContext(ctx, `SELECT id, data, hits, misses FROM pool_pools`)
	if err != nil {
		return err
	}
	defer rows.Close()
	ps.mu.Lock()
	defer ps.mu.Unlock()
	for rows.Next() {
		var id, data string
		var hits, misses int64
		if err := rows.Scan(&id, &data, &hits, &misses); err != nil {
			return err
		}
		var s api.PoolSpec
		if err := json.Unmarshal([]byte(data), &s); err != nil {
			return fmt.Errorf("pool %s: %w", id, err)
		}
		if ps.byID[id] == nil {
			p := ps.newPool(ctx, id, s)
			p.hits, p.misses, p.savedHits, p.savedMisses = hits, misses, hits, misses
			ps.byID[id] = p
		}
	}
	return rows.Err()
}

func (ps *pools) newPool(ctx context.Context, id string, s api.PoolSpec) *pool {
	p := &pool{id: id, spec: s, target: s.Min, lastShrink: time.Now()}
	ps.resolveRuntime(ctx, p)
	return p
}

// resolveRuntime fills p.runtime and p.idle (the caller holds ps.mu or
// owns p).
func (ps *pools) resolveRuntime(ctx context.Context, p *pool) {
	rt, _, err := ps.m.creates.pickRuntime(ctx, p.spec.Runtime)
	if err != nil {
		p.runtime, p.lastErr = "", err.Error()
		return
	}
	p.runtime = rt.Name()
	p.idle = idleModeFor(rt.Name(), rt)
	if p.spec.IdleMode != "" {
		p.idle = p.spec.IdleMode
	}
}

// SetPool creates or updates the pool of spec s (keyed by template,
// runtime and limits). A spec another pool already serves under other
// words (the template's digest or another tag of it, "auto" for the
// runtime it picks) is refused naming that pool: a claim could not tell
// the two apart (DECISIONS.md).
func (part *WarmPools) SetPool(ctx context.Context, s api.PoolSpec) (api.Pool, error) {
	m := part.m
	s, rt, err := m.warm.normalisePool(ctx, s, true)
	if err != nil {
		return api.Pool{}, err
	}
	ps := m.pools
	ps.setMu.Lock()
	defer ps.setMu.Unlock()
	if other, ok := ps.twin(ctx, PoolID(s), s, rt.Name()); ok {
		return api.Pool{}, fmt.Errorf("pool %s (template %s, runtime %s) already keeps sandboxes of this template, runtime and limits: change or delete it instead: %w",
			other.ID, truncate(other.Spec.Template, 128), other.Spec.Runtime, errdefs.ErrConflict)
	}
	return m.warm.putPool(ctx, s)
}

// twin returns the pool other than id whose members spec s (normalised,
// its runtime resolving to rtName) would duplicate: the same limits, the
// same resolved runtime and the same template — the same digest, or the
// same reference while either does not resolve.
func (ps *pools) twin(ctx context.Context, id string, s api.PoolSpec, rtName string) (api.Pool, bool) {
	digest := func(ref string) string {
		if t, err := ps.m.cfg.Templates.Get(ctx, ref); err == nil {
			return t.Digest
		}
		return ""
	}
	ps.mu.Lock()
	var others []api.Pool
	for _, p := range ps.byID {
		if p.id != id && p.spec.Limits == s.Limits && p.runtime == rtName {
			others = append(others, ps.view(p))
		}
	}
	ps.mu.Unlock()
	slices.SortFunc(others, func(a, b api.Pool) int { return strings.Compare(a.ID, b.ID) })
	want := digest(s.Template)
	for _, o := range others {
		if o.Spec.Template == s.Template {
			return o, true
		}
		if d := digest(o.Spec.Template); d != "" && d == want {
			return o, true
		}
	}
	return api.Pool{}, false
}

func (part *WarmPools) putPool(ctx context.Context, s api.PoolSpec) (api.Pool, error) {
	m := part.m
	id := PoolID(s)
	data, err := json.Marshal(s)
	if err != nil {
		return api.Pool{}, err
	}
	if _, err := m.cfg.DB.SQL().ExecContext(ctx, `INSERT INTO pool_pools (id, data) VALUES (?, ?)
ON CONFLICT (id) DO UPDATE SET data = excluded.data`, id, string(data)); err != nil {
		return api.Pool{}, fmt.Errorf("storing pool %s: %w", id, err)
	}
	ps := m.pools
	ps.mu.Lock()
	p := ps.byID[id]
	if p == nil {
		p = ps.newPool(ctx, id, s)
		ps.byID[id] = p
	} else {
		p.spec = s
		p.target = min(max(p.target, s.Min), s.Max)
		ps.resolveRuntime(ctx, p)
	}
	out := ps.view(p)
	ps.mu.Unlock()
	ps.kick()
	return out, nil
}

// CheckPool validates and normalises s exactly as SetPool would, the
// template included, and answers the pool it would make without making it
// (a cluster replica asks a node this, then stores the spec for every node
// to mirror with MirrorPool).
func (part *WarmPools) CheckPool(ctx context.Context, s api.PoolSpec) (api.Pool, error) {
	m := part.m
	s, rt, err := m.warm.normalisePool(ctx, s, true)
	if err != nil {
		return api.Pool{}, err
	}
	idle := idleModeFor(rt.Name(), rt)
	if s.IdleMode != "" {
		idle = s.IdleMode
	}
	return api.Pool{ID: PoolID(s), Spec: s, Runtime: rt.Name(), IdleMode: idle, Target: s.Min}, nil
}

// MirrorPool makes pool id hold spec s, a spec a node already normalised
// (see CheckPool): a cluster node's copy of the cluster's pool. The
// template need not be here yet (the pool fills once it is). It changes
// nothing when the pool already has s, and says whether it changed
// anything.
func (part *WarmPools) MirrorPool(ctx context.Context, id string, s api.PoolSpec) (bool, error) {
	m := part.m
	// The mirror calls this at every poll: an unchanged spec (already
	// normalised where it was checked) costs one comparison.
	m.pools.mu.Lock()
	p := m.pools.byID[id]
	same := p != nil && p.spec == s
	m.pools.mu.Unlock()
	if same {
		return false, nil
	}
	n, _, err := m.warm.normalisePool(ctx, s, false)
	if err != nil {
		return false, err
	}
	if PoolID(n) != id {
		return false, fmt.Errorf("pool %s: its spec is pool %s's: %w", truncate(id, 64), PoolID(n), errdefs.ErrInvalidArgument)
	}
	_, err = m.warm.putPool(ctx, n)
	return err == nil, err
}

// defaultPoolSpec is the spec of the pool EnsureDefaultPool keeps with n
// ready members, normalised.
func (part *WarmPools) defaultPoolSpec(ctx context.Context, n int) (api.PoolSpec, error) {
	m := part.m
	s, _, err := m.warm.normalisePool(ctx, api.PoolSpec{Template: m.cfg.BaseTemplateRef, Runtime: runtime.Auto, Min: n, Max: max(n, 4*n)}, false)
	return s, err
}

// DefaultPoolID is the id of the pool EnsureDefaultPool keeps ("" when
// the base template's spec does not normalise here).
func (part *WarmPools) DefaultPoolID(ctx context.Context) string {
	m := part.m
	s, err := m.warm.defaultPoolSpec(ctx, 0)
	if err != nil {
		return ""
	}
	return PoolID(s)
}

// EnsureDefaultPool keeps n sandboxes of the base template on the auto
// runtime with the default limits ready (n = 0 removes that pool). The base
// template need not exist yet: the pool fills once it does.
func (part *WarmPools) EnsureDefaultPool(ctx context.Context, n int) error {
	m := part.m
	s, err := m.warm.defaultPoolSpec(ctx, n)
	if err != nil {
		if n == 0 {
			return nil
		}
		return err
	}
	if n == 0 {
		err := m.warm.DeletePool(ctx, PoolID(s))
		if errors.Is(err, errdefs.ErrNotFound) {
			return nil
		}
		return err
	}
	ps := m.pools
	ps.setMu.Lock()
	defer ps.setMu.Unlock()
	ps.mu.Lock()
	_, exists := ps.byID[PoolID(s)]
	ps.mu.Unlock()
	if exists {
		return nil // the operator's min and max stand
	}
	if rt, _, err := m.creates.pickRuntime(ctx, s.Runtime); err == nil {
		if _, ok := ps.twin(ctx, PoolID(s), s, rt.Name()); ok {
			return nil // the operator's pool of the same members stands
		}
	}
	_, err = m.warm.putPool(ctx, s)
	return err
}

// Pools lists every pool.
func (part *WarmPools) Pools(ctx context.Context) []api.Pool {
	m := part.m
	ps := m.pools
	ps.mu.Lock()
	defer ps.mu.Unlock()
	out := make([]api.Pool, 0, len(ps.byID))
	for _, p := range ps.byID {
		out = append(out, ps.view(p))
	}
	slices.SortFunc(out, func(a, b api.Pool) int { return strings.Compare(a.ID, b.ID) })
	return out
}

// GetPool returns pool id.
func (part *WarmPools) GetPool(ctx context.Context, id string) (api.Pool, error) {
	m := part.m
	ps := m.pools
	ps.mu.Lock()
	defer ps.mu.Unlock()
	p := ps.byID[id]
	if p == nil {
		return api.Pool{}, fmt.Errorf("pool %s not found: %w", truncate(id, 64), errdefs.ErrNotFound)
	}
	return ps.view(p), nil
}

// DeletePool removes pool id and destroys its members.
func (part *WarmPools) DeletePool(ctx context.Context, id string) error {
	m := part.m
	ps := m.pools
	ps.mu.Lock()
	p := ps.byID[id]
	if p == nil {
		ps.mu.Unlock()
		return fmt.Errorf("pool %s not found: %w", truncate(id, 64), errdefs.ErrNotFound)
	}
	if _, err := m.cfg.DB.SQL().ExecContext(ctx, `DELETE FROM pool_pools WHERE id = ?`, id); err != nil {
		ps.mu.Unlock()
		return err
	}
	delete(ps.byID, id)
	p.deleted = true
	drain := p.ready
	p.ready = nil
	ps.mu.Unlock()
	for _, mb := range drain {
		ps.destroyAsync(mb.id, "pool deleted")
	}
	return nil
}

// view is p's public answer; the caller holds ps.mu.
func (ps *pools) view(p *pool) api.Pool {
	return api.Pool{ID: p.id, Spec: p.spec, TemplateDigest: p.digest, Runtime: p.runtime, IdleMode: p.idle,
		Ready: len(p.ready), Filling: p.filling, Target: p.target, Hits: p.hits, Misses: p.misses,
		LastRefillMS: float64(p.lastRefill.Microseconds()) / 1000, LastError: p.lastErr}
}

// match returns the pool whose members are digest on runtime rt with
// limits lim, if any. SetPool refuses a second such pool, but a tag moved
// since, or a cluster's pools, can still make two: the lowest id then
// serves, every time.
func (ps *pools) match(digest, rt string, lim api.Limits) *pool {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	var best *pool
	for _, p := range ps.byID {
		if p.digest == digest && p.runtime == rt && p.spec.Limits == lim && p.spec.Max > 0 && (best == nil || p.id < best.id) {
			best = p
		}
	}
	return best
}

// take removes and returns a ready member of p (the oldest), or false:
// a miss, which raises the target. Under ps.mu, so no two claims ever get
// the same member.
func (ps *pools) take(p *pool) (member, bool) {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	for len(p.ready) > 0 {
		mb := p.ready[0]
		p.ready = p.ready[1:]
		if mb.digest == p.digest {
			return mb, true
		}
		ps.destroyAsync(mb.id, "template changed")
	}
	return member{}, false
}

// count records a claim's outcome.
func (ps *pools) count(p *pool, hit bool) {
	ps.mu.Lock()
	if hit {
		p.hits++
	} else {
		p.misses++
		p.lastMiss = time.Now()
		p.target = min(p.target+1, p.spec.Max)
	}
	ps.mu.Unlock()
	if o, ok := ps.m.obs.(PoolObserver); ok {
		o.PoolClaim(p.id, hit)
	}
	if !hit {
		ps.kick()
	}
}

// giveBack returns an untouched member to p (a claim that stopped before
// writing the caller's record).
func (ps *pools) giveBack(p *pool, mb member) {
	ps.mu.Lock()
	if !p.deleted {
		p.ready = append([]member{mb}, p.ready...)
		ps.mu.Unlock()
		return
	}
	ps.mu.Unlock()
	ps.destroyAsync(mb.id, "pool deleted")
}

// save writes the claim counters that changed since the last save. The
// filler's round calls it (≤ 1 s behind a claim, which itself writes
// nothing more), and the filler once more as the manager closes: a crash
// loses at most the last second's counts.
func (ps *pools) save(ctx context.Context) {
	type counts struct {
		id           string
		hits, misses int64
	}
	ps.mu.Lock()
	var dirty []counts
	for _, p := range ps.byID {
		if p.hits != p.savedHits || p.misses != p.savedMisses {
			dirty = append(dirty, counts{p.id, p.hits, p.misses})
		}
	}
	ps.mu.Unlock()
	for _, c := range dirty {
		if _, err := ps.m.cfg.DB.SQL().ExecContext(ctx, `UPDATE pool_pools SET hits = ?, misses = ? WHERE id = ?`, c.hits, c.misses, c.id); err != nil {
			ps.m.log.Warn("saving a warm pool's claim counters", "pool", c.id, "err", err)
			continue
		}
		ps.mu.Lock()
		if p := ps.byID[c.id]; p != nil {
			p.savedHits, p.savedMisses = c.hits, c.misses
		}
		ps.mu.Unlock()
	}
}

// kick wakes the fill loop.
func (ps *pools) kick() {
	select {
	case ps.m.poolKick <- struct{}{}:
	default:
	}
}

// run keeps every pool at its target until the manager closes.
func (ps *pools) run() {
	m := ps.m
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		tick := time.NewTicker(time.Second)
		defer tick.Stop()
		for {
			ps.round(m.ctx)
			select {
			case <-m.ctx.Done():
				ps.save(context.Background()) // the counts since the last round
				return
			case <-tick.C:
			case <-m.poolKick:
			}
		}
	}()
}

// round brings each pool one step toward its target.
func (ps *pools) round(ctx context.Context) {
	m := ps.m
	ps.mu.Lock()
	list := make([]*pool, 0, len(ps.byID))
	for _, p := range ps.byID {
		list = append(list, p)
	}
	ps.mu.Unlock()
	ps.save(ctx)
	avail, memErr := ps.memAvailable()
	low := memErr == nil && avail < m.cfg.PoolMemFloor
	if low {
		ps.shedNewest("host memory under the pool floor")
	}
	for _, p := range list {
		digest := ""
		if t, err := m.cfg.Templates.Get(ctx, p.spec.Template); err == nil {
			digest = t.Digest
		} else if ctx.Err() != nil {
			return
		}
		var drop []string
		ps.mu.Lock()
		if p.deleted {
			ps.mu.Unlock()
			continue
		}
		if p.runtime == "" {
			ps.resolveRuntime(ctx, p)
		}
		p.digest = digest
		if digest == "" {
			p.lastErr = fmt.Sprintf("template %s does not resolve; the pool fills once it does", p.spec.Template)
		}
		// Members of another digest (a moved or removed tag) go.
		keep := p.ready[:0]
		for _, mb := range p.ready {
			if mb.digest == digest && ps.alive(mb.id) {
				keep = append(keep, mb)
			} else {
				drop = append(drop, mb.id)
			}
		}
		p.ready = keep
		if p.target > p.spec.Min && time.Since(p.lastMiss) > poolShrinkAfter && time.Since(p.lastShrink) > poolShrinkAfter {
			p.target--
			p.lastShrink = time.Now()
		}
		p.target = max(min(p.target, p.spec.Max), p.spec.Min)
		for len(p.ready) > p.target {
			last := p.ready[len(p.ready)-1]
			p.ready = p.ready[:len(p.ready)-1]
			drop = append(drop, last.id)
		}
		need := digest != "" && p.runtime != "" && !low && p.filling == 0 && len(p.ready) < p.target
		if need {
			select {
			case ps.fillSem <- struct{}{}:
				p.filling++
			default:
				need = false
			}
		}
		rt, idle := p.runtime, p.idle
		ps.mu.Unlock()
		for _, id := range drop {
			ps.destroyAsync(id, "pool member no longer wanted")
		}
		if need {
			m.ops.spawn(func() {
				defer func() { <-ps.fillSem }()
				ps.fill(p, digest, rt, idle)
			})
		}
	}
}

// alive says whether ready member id's instance still runs (the caller
// holds ps.mu; no I/O beyond a pidfd check).
func (ps *pools) alive(id string) bool {
	e := ps.m.peek(id)
	if e == nil {
		return false
	}
	e.cmu.RLock()
	inst := e.inst
	e.cmu.RUnlock()
	return inst != nil && inst.Alive()
}

// fill makes one member of p by the normal create path.
func (ps *pools) fill(p *pool, digest, rtName, idle string) {
	m := ps.m
	ctx := m.ops.baseCtx()
	t0 := time.Now()
	var err error
	id := newID("sb")
	paused, written := false, false
	// A member is the server's own sandbox, planned as any create is (so
	// its record is the one a claim would build) but written without a
	// tenant's admission: nobody's quota pays for a pool.
	sctx := principal.With(ctx, principal.System)
	pl, err := m.creates.plan(sctx, api.CreateSandboxRequest{Template: digest, Runtime: rtName, Limits: p.spec.Limits})
	if err == nil {
		var sb api.Sandbox
		sb, err = m.creates.record(sctx, pl)
		// The label a caller may not set marks the record as a member.
		sb.ID, sb.Tenant, sb.Labels = id, "", map[string]string{PoolLabel: p.id}
		if err == nil {
			err = m.cfg.DB.PutSandbox(ctx, sb)
			written = err == nil
		}
		pl.release()
		if err == nil {
			e := m.entry(id)
			e.mu.Lock()
			err = m.creates.doCreate(ctx, &phases{kind: "pool_fill", obs: nopObserver{}}, id, false, pl.tmpl)
			if err == nil {
				ps.warm(ctx, e)
			}
			if err == nil && idle == api.PoolIdlePaused {
				paused, err = ps.pause(ctx, e, sb)
			}
			e.mu.Unlock()
		}
	}
	d := time.Since(t0)
	ps.mu.Lock()
	p.filling--
	if err != nil {
		p.lastErr = "filling: " + err.Error()
	} else {
		p.lastErr = ""
		p.lastRefill = d
	}
	keep := err == nil && !p.deleted && p.digest == digest
	if keep {
		p.ready = append(p.ready, member{id: id, digest: digest, paused: paused})
	}
	ps.mu.Unlock()
	if err != nil {
		m.log.Warn("filling a warm pool failed", "pool", p.id, "err", err)
	}
	if !keep && written {
		ps.destroy(id, "pool member not wanted after its fill")
	}
	if err == nil {
		if o, ok := m.obs.(PoolObserver); ok {
			o.PoolRefill(p.id, d)
		}
	}
	ps.kick()
}

// warm runs `true` once in a fresh member through its agent, outside the
// manager (no audit record, no process entry): a sandbox's first process
// start pays for what later ones find cached — the sentry's page and
// dentry caches on gvisor, translated code in a TCG guest (≈ 200 ms there),
// the agent's own spawn path — and a claim should not. It leaves nothing
// a command could see: the process is reaped, the agent keeps no record of
// a synchronous exec, and pids in a sandbox already vary with the agent's
// threads. Best effort: a template without `true` only loses the warm-up.
func (ps *pools) warm(ctx context.Context, e *entry) {
	e.cmu.RLock()
	c := e.client
	e.cmu.RUnlock()
	if c == nil {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if _, err := c.Exec(ctx, agentproto.ExecRequest{Cmd: []string{"true"}, TimeoutSeconds: 10}); err != nil {
		ps.m.log.Debug("warming a pool member", "sandbox", e.id, "err", err)
	}
}

// pause freezes a fresh member (idle mode paused).
func (ps *pools) pause(ctx context.Context, e *entry, sb api.Sandbox) (bool, error) {
	e.cmu.RLock()
	inst := e.inst
	e.cmu.RUnlock()
	pz, ok := inst.(runtime.Pauser)
	if !ok {
		return false, nil
	}
	ps.m.verbs.dropClient(e)
	if err := pz.Pause(ctx); err != nil {
		return false, err
	}
	_, err := ps.m.setState(sb.ID, api.StatePaused, "", "")
	return true, err
}

// shedNewest destroys the newest ready member of any pool (memory floor).
func (ps *pools) shedNewest(why string) {
	ps.mu.Lock()
	var (
		victim *pool
		newest = ""
	)
	for _, p := range ps.byID {
		if n := len(p.ready); n > 0 && p.ready[n-1].id > newest {
			// Ids are random: any member is as good; the newest of a
			// pool is its last.
			victim, newest = p, p.ready[n-1].id
		}
	}
	if victim == nil {
		ps.mu.Unlock()
		return
	}
	victim.ready = victim.ready[:len(victim.ready)-1]
	ps.mu.Unlock()
	ps.m.log.Info("destroying a warm pool member", "pool", victim.id, "sandbox", newest, "why", why)
	ps.destroyAsync(newest, why)
}

func (ps *pools) destroyAsync(id, why string) {
	ps.m.ops.spawn(func() { ps.destroy(id, why) })
}

// destroy deletes member id: instance, host resources, record.
func (ps *pools) destroy(id, why string) {
	m := ps.m
	e := m.entry(id)
	e.mu.Lock()
	defer e.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := m.verbs.doDelete(ctx, &phases{kind: "pool_drain", obs: nopObserver{}}, id); err != nil {
		m.log.Warn("destroying a warm pool member failed; the sweep retries", "sandbox", id, "why", why, "err", err)
	}
}

// reconcileMember re-adopts a member found at start if its pool still
// exists with the same digest and it answers; anything else is destroyed.
func (ps *pools) reconcileMember(ctx context.Context, sb api.Sandbox) {
	m := ps.m
	pid := sb.Labels[PoolLabel]
	ps.mu.Lock()
	p := ps.byID[pid]
	ps.mu.Unlock()
	adopt := func() (bool, error) {
		if p == nil {
			return false, nil
		}
		t, err := m.cfg.Templates.Get(ctx, p.spec.Template)
		if err != nil || t.Digest != sb.TemplateDigest || sb.Runtime != p.runtime || sb.Limits != p.spec.Limits {
			return false, nil
		}
		if sb.State != api.StateRunning && sb.State != api.StatePaused {
			return false, nil
		}
		e := m.entry(sb.ID)
		inst, _, err := m.verbs.instance(ctx, e, sb)
		if err != nil || !inst.Alive() {
			return false, err
		}
		if sb.State == api.StateRunning {
			if err := m.creates.connect(ctx, e, inst); err != nil {
				return false, err
			}
		}
		m.creates.watchExit(e, inst)
		ps.mu.Lock()
		p.digest = t.Digest
		p.ready = append(p.ready, member{id: sb.ID, digest: t.Digest, paused: sb.State == api.StatePaused})
		ps.mu.Unlock()
		return true, nil
	}
	ok, err := adopt()
	if ok {
		m.log.Info("re-adopted warm pool member", "pool", pid, "sandbox", sb.ID)
		return
	}
	m.log.Info("destroying a warm pool member left from before the restart", "pool", pid, "sandbox", sb.ID, "err", err)
	ps.destroy(sb.ID, "reconcile")
}

// HostMemAvailable reads MemAvailable from /proc/meminfo, in bytes.
func HostMemAvailable() (int64, error) {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "MemAvailable:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
			return kb << 10, err
		}
	}
	return 0, errors.New("no MemAvailable in /proc/meminfo")
}

// PoolMembers lists the ids of pool id's ready members (benchmarks and
// debugging measure their host processes; no API answer carries them).
func (part *WarmPools) PoolMembers(id string) []string {
	m := part.m
	ps := m.pools
	ps.mu.Lock()
	defer ps.mu.Unlock()
	p := ps.byID[id]
	if p == nil {
		return nil
	}
	out := make([]string, 0, len(p.ready))
	for _, mb := range p.ready {
		out = append(out, mb.id)
	}
	return out
}

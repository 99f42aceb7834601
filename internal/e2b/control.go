package e2b

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/sandbox"
	"github.com/spacehq/space/internal/template"
)

// The control plane: E2B's REST API (its OpenAPI "sandboxes" and
// "snapshots" operations) mapped onto the sandbox manager.

const (
	// defaultTimeout is E2B's sandbox timeout when a create names none.
	defaultTimeout = 300 * time.Second
	// maxBody bounds a control-plane JSON body.
	maxBody = 1 << 20
	// maxListLimit bounds one page of GET /v2/sandboxes.
	maxListLimit = 1000
	// maxTimeoutSeconds bounds a sandbox timeout (the manager's longest TTL).
	maxTimeoutSeconds = 365 * 24 * 3600
	// allTraffic is E2B's ALL_TRAFFIC selector.
	allTraffic = "0.0.0.0/0"
)

func (h *Handler) controlRoutes() {
	a := h.authAPI
	h.route("POST "+Prefix+"/v2/sandboxes", a(h.create))
	h.route("POST "+Prefix+"/sandboxes", a(h.create))
	h.route("GET "+Prefix+"/v2/sandboxes", a(h.list))
	h.route("GET "+Prefix+"/sandboxes", a(h.list))
	h.route("GET "+Prefix+"/sandboxes/{id}", a(h.get))
	h.route("DELETE "+Prefix+"/sandboxes/{id}", a(h.kill))
	h.route("POST "+Prefix+"/sandboxes/{id}/timeout", a(h.setTimeout))
	h.route("POST "+Prefix+"/sandboxes/{id}/refreshes", a(h.refresh))
	h.route("POST "+Prefix+"/sandboxes/{id}/pause", a(h.pause))
	h.route("POST "+Prefix+"/v2/sandboxes/{id}/connect", a(h.connect))
	h.route("POST "+Prefix+"/sandboxes/{id}/resume", a(h.connect))
	h.route("POST "+Prefix+"/sandboxes/{id}/fork", a(h.fork))
	h.route("GET "+Prefix+"/sandboxes/{id}/metrics", a(h.metrics))
	h.route("PUT "+Prefix+"/sandboxes/{id}/network", a(h.updateNetwork))
	h.route("POST "+Prefix+"/sandboxes/{id}/snapshots", a(h.createSnapshot))
	h.route("GET "+Prefix+"/snapshots", a(h.listSnapshots))
	h.route("DELETE "+Prefix+"/templates/{id}", a(h.deleteTemplate))
	// Everything else under the prefix that is not envd: E2B's error
	// shape, saying what is not served.
	h.route(Prefix+"/", a(func(w http.ResponseWriter, r *http.Request) {
		h.writeAPIError(w, r, fmt.Errorf("%s %s is not part of the E2B API this server implements (sandboxes, commands, PTY, files and network are; templates, volumes, secrets and teams are managed with space's own API): %w",
			r.Method, strings.TrimPrefix(r.URL.Path, Prefix), errdefs.ErrNotFound))
	}))
}

// decodeBody reads a bounded JSON body (an empty body is an empty object).
func decodeBody(r *http.Request, v any) error {
	if r.ContentLength > maxBody {
		return fmt.Errorf("request body of %d bytes is larger than %d: %w", r.ContentLength, maxBody, errdefs.ErrTooLarge)
	}
	b, err := io.ReadAll(io.LimitReader(r.Body, maxBody+1))
	if err != nil {
		return fmt.Errorf("reading request body: %w: %w", err, errdefs.ErrInvalidArgument)
	}
	if len(b) > maxBody {
		return fmt.Errorf("request body larger than %d bytes: %w", maxBody, errdefs.ErrTooLarge)
	}
	if len(strings.TrimSpace(string(b))) == 0 {
		return nil
	}
	if err := json.Unmarshal(b, v); err != nil {
		return fmt.Errorf("request body is not valid JSON for this call: %v: %w", err, errdefs.ErrInvalidArgument)
	}
	return nil
}

// e2bNetwork is E2B's SandboxNetworkConfig.
type e2bNetwork struct {
	AllowOut           []string        `json:"allowOut,omitempty"`
	DenyOut            []string        `json:"denyOut,omitempty"`
	AllowPublicTraffic *bool           `json:"allowPublicTraffic,omitempty"`
	MaskRequestHost    *string         `json:"maskRequestHost,omitempty"`
	HTTPSPorts         []int           `json:"httpsPorts,omitempty"`
	Rules              json.RawMessage `json:"rules,omitempty"`
	EgressProxy        *struct {
		Address  string `json:"address"`
		Username string `json:"username,omitempty"`
		Password string `json:"password,omitempty"`
	} `json:"egressProxy,omitempty"`
}

// newSandboxRequest is E2B's NewSandbox.
type newSandboxRequest struct {
	TemplateID          string            `json:"templateID"`
	Metadata            map[string]string `json:"metadata,omitempty"`
	EnvVars             map[string]string `json:"envVars,omitempty"`
	Timeout             *int64            `json:"timeout,omitempty"`
	Secure              *bool             `json:"secure,omitempty"`
	AllowInternetAccess *bool             `json:"allow_internet_access,omitempty"`
	Network             *e2bNetwork       `json:"network,omitempty"`
	AutoPause           *bool             `json:"autoPause,omitempty"`
	AutoPauseMemory     *bool             `json:"autoPauseMemory,omitempty"`
	AutoResume          *struct {
		Enabled bool `json:"enabled"`
	} `json:"autoResume,omitempty"`
	MCP          json.RawMessage `json:"mcp,omitempty"`
	IAM          json.RawMessage `json:"iam,omitempty"`
	VolumeMounts json.RawMessage `json:"volumeMounts,omitempty"`
}

// e2bSandbox is E2B's Sandbox (the answer of create, connect and fork).
type e2bSandbox struct {
	TemplateID         string  `json:"templateID"`
	SandboxID          string  `json:"sandboxID"`
	Alias              string  `json:"alias,omitempty"`
	ClientID           string  `json:"clientID"`
	EnvdVersion        string  `json:"envdVersion"`
	EnvdAccessToken    string  `json:"envdAccessToken,omitempty"`
	TrafficAccessToken *string `json:"trafficAccessToken"`
	Domain             *string `json:"domain"`
}

// e2bListed is E2B's ListedSandbox; e2bDetail its SandboxDetail.
type e2bListed struct {
	TemplateID   string            `json:"templateID"`
	Alias        string            `json:"alias,omitempty"`
	SandboxID    string            `json:"sandboxID"`
	ClientID     string            `json:"clientID"`
	StartedAt    time.Time         `json:"startedAt"`
	EndAt        time.Time         `json:"endAt"`
	CPUCount     int               `json:"cpuCount"`
	MemoryMB     int64             `json:"memoryMB"`
	DiskSizeMB   int64             `json:"diskSizeMB"`
	Metadata     map[string]string `json:"metadata"`
	State        string            `json:"state"`
	EnvdVersion  string            `json:"envdVersion"`
	VolumeMounts []any             `json:"volumeMounts"`
}

type e2bDetail struct {
	e2bListed
	EnvdAccessToken     string          `json:"envdAccessToken,omitempty"`
	Domain              *string         `json:"domain"`
	AllowInternetAccess *bool           `json:"allowInternetAccess,omitempty"`
	Network             *e2bNetworkInfo `json:"network,omitempty"`
	Lifecycle           *e2bLifecycle   `json:"lifecycle,omitempty"`
}

type e2bNetworkInfo struct {
	AllowOut           []string `json:"allowOut,omitempty"`
	DenyOut            []string `json:"denyOut,omitempty"`
	AllowPublicTraffic bool     `json:"allowPublicTraffic"`
}

type e2bLifecycle struct {
	OnTimeout  string `json:"onTimeout"`
	AutoResume bool   `json:"autoResume"`
}

// policyFromE2B maps E2B's egress selectors onto a space network policy:
// ALL_TRAFFIC in allowOut is "internet" (public addresses only — private
// and host addresses stay closed, as for every space sandbox), in denyOut
// it turns the internet off so that only allowOut is reachable.
func policyFromE2B(internet *bool, n *e2bNetwork, base *api.NetworkPolicy) (*api.NetworkPolicy, error) {
	if internet == nil && (n == nil || (n.AllowOut == nil && n.DenyOut == nil && n.EgressProxy == nil)) {
		return base, nil
	}
	p := api.NetworkPolicy{}
	if base != nil {
		p = sandbox.ClonePolicy(*base)
	}
	if internet != nil {
		p.Internet = *internet
	}
	if n != nil {
		if n.AllowOut != nil {
			p.AllowOut = nil
		}
		if n.DenyOut != nil {
			p.DenyOut = nil
		}
		for _, a := range n.AllowOut {
			if a == allTraffic {
				p.Internet = true
				continue
			}
			p.AllowOut = append(p.AllowOut, a)
		}
		for _, d := range n.DenyOut {
			if d == allTraffic {
				p.Internet = false
				continue
			}
			p.DenyOut = append(p.DenyOut, d)
		}
		if n.EgressProxy != nil {
			if n.EgressProxy.Username != "" || n.EgressProxy.Password != "" {
				return nil, notSupported("network.egressProxy with a username or password")
			}
			p.EgressProxy = "socks5://" + n.EgressProxy.Address
		}
	}
	return &p, nil
}

// refuseUnsupported names the E2B create options this server does not serve.
func refuseNetworkExtras(n *e2bNetwork) error {
	if n == nil {
		return nil
	}
	if n.MaskRequestHost != nil {
		return notSupported("network.maskRequestHost (requests reach a sandbox's ports with their own Host)")
	}
	if len(n.Rules) > 0 && string(n.Rules) != "null" && string(n.Rules) != "{}" {
		return notSupported("network.rules (per-domain request transforms are not applied by this server yet)")
	}
	if len(n.HTTPSPorts) > 0 {
		return notSupported("network.httpsPorts (ingress reaches sandbox ports over plain HTTP or raw TCP)")
	}
	return nil
}

func present(raw json.RawMessage) bool {
	s := strings.TrimSpace(string(raw))
	return s != "" && s != "null" && s != "{}" && s != "[]"
}

func (h *Handler) create(w http.ResponseWriter, r *http.Request) {
	var req newSandboxRequest
	if err := decodeBody(r, &req); err != nil {
		h.writeAPIError(w, r, err)
		return
	}
	switch {
	case present(req.MCP):
		h.writeAPIError(w, r, notSupported("mcp (the MCP gateway inside a sandbox); space serves MCP itself at /mcp"))
		return
	case present(req.IAM):
		h.writeAPIError(w, r, notSupported("iam workload tokens"))
		return
	case present(req.VolumeMounts):
		h.writeAPIError(w, r, notSupported("volumeMounts"))
		return
	}
	if err := refuseNetworkExtras(req.Network); err != nil {
		h.writeAPIError(w, r, err)
		return
	}
	if req.AutoResume != nil && req.AutoResume.Enabled && (req.AutoPause == nil || !*req.AutoPause) {
		h.writeAPIError(w, r, fmt.Errorf("autoResume needs autoPause: %w", errdefs.ErrInvalidArgument))
		return
	}
	timeout := defaultTimeout
	if req.Timeout != nil {
		if *req.Timeout <= 0 || *req.Timeout > maxTimeoutSeconds {
			h.writeAPIError(w, r, fmt.Errorf("timeout must be 1..%d seconds, got %d: %w", maxTimeoutSeconds, *req.Timeout, errdefs.ErrInvalidArgument))
			return
		}
		timeout = time.Duration(*req.Timeout) * time.Second
	}
	tmpl := req.TemplateID
	if tmpl == "" {
		tmpl = "base"
	}
	creq := api.CreateSandboxRequest{
		Template:   tmpl,
		Env:        req.EnvVars,
		Labels:     req.Metadata,
		TTLSeconds: int64(timeout / time.Second),
	}
	if req.AutoPause != nil && *req.AutoPause {
		creq.OnExpiry = api.ExpirySuspend
	}
	pol, err := policyFromE2B(req.AllowInternetAccess, req.Network, nil)
	if err != nil {
		h.writeAPIError(w, r, err)
		return
	}
	creq.Network = pol
	if req.Network == nil || req.Network.AllowPublicTraffic == nil || *req.Network.AllowPublicTraffic {
		creq.AllPortsPublic = true
	}
	sb, op, err := h.cfg.Manager.Creates().Create(r.Context(), creq)
	if err != nil {
		h.writeAPIError(w, r, templateNotFound(err, tmpl))
		return
	}
	if op, err = h.cfg.Manager.Verbs().Wait(r.Context(), op.ID); err != nil {
		h.writeAPIError(w, r, err)
		return
	}
	if op.Error != nil {
		// The create failed: nothing of it should linger. Cleanup, not
		// the caller's delete: the policy does not decide it.
		h.cfg.Manager.Verbs().Discard(context.WithoutCancel(r.Context()), sb.ID)
		h.writeAPIError(w, r, templateNotFound(sandbox.OpError(op), tmpl))
		return
	}
	sb, err = h.cfg.Manager.Get(r.Context(), sb.ID)
	if err != nil {
		h.writeAPIError(w, r, err)
		return
	}
	writeJSON(w, http.StatusCreated, h.sandboxOut(r, sb))
}

// templateNotFound says which template an E2B create named when it is
// missing (E2B programs name E2B's templates, e.g. "code-interpreter-v1").
func templateNotFound(err error, tmpl string) error {
	if errors.Is(err, errdefs.ErrNotFound) {
		return fmt.Errorf("template %q not found on this server (`space template ls` lists them; E2B's own templates are not available): %w", truncate(tmpl, 128), errdefs.ErrNotFound)
	}
	return err
}

func (h *Handler) sandboxOut(r *http.Request, sb api.Sandbox) e2bSandbox {
	dom := h.cfg.Domain(r)
	out := e2bSandbox{
		TemplateID: sb.Template, SandboxID: sb.ID, ClientID: "space", EnvdVersion: EnvdVersion,
		EnvdAccessToken: h.envdToken(sb), Domain: &dom,
	}
	if !sb.AllPortsPublic {
		t := h.cfg.PortToken(sb)
		out.TrafficAccessToken = &t
	}
	return out
}

// e2bState maps a space state to E2B's two: running or paused. Other
// states (error) are not E2B sandboxes a program can use.
func e2bState(state string) (string, bool) {
	switch state {
	case api.StateRunning, api.StateCreating:
		return "running", true
	case api.StatePaused, api.StateSuspended, api.StateStopped:
		return "paused", true
	}
	return "", false
}

func (h *Handler) listed(sb api.Sandbox, state string) e2bListed {
	cpus := int(sb.Limits.CPUs + 0.999)
	if cpus < 1 {
		cpus = 1
	}
	end := time.Date(9999, 12, 31, 0, 0, 0, 0, time.UTC)
	if sb.ExpiresAt != nil {
		end = *sb.ExpiresAt
	}
	md := sb.Labels
	if md == nil {
		md = map[string]string{}
	}
	return e2bListed{
		TemplateID: sb.Template, SandboxID: sb.ID, ClientID: "space",
		StartedAt: sb.CreatedAt, EndAt: end, CPUCount: cpus, MemoryMB: sb.Limits.MemoryMiB,
		DiskSizeMB: sb.Limits.DiskMiB, Metadata: md, State: state, EnvdVersion: EnvdVersion, VolumeMounts: []any{},
	}
}

func (h *Handler) get(w http.ResponseWriter, r *http.Request) {
	sb, err := h.cfg.Manager.Get(r.Context(), r.PathValue("id"))
	if err != nil {
		h.writeAPIError(w, r, err)
		return
	}
	state, ok := e2bState(sb.State)
	if !ok {
		h.writeAPIError(w, r, fmt.Errorf("sandbox %s is in state %s (%s): %w", sb.ID, sb.State, sb.Error, errdefs.ErrNotFound))
		return
	}
	dom := h.cfg.Domain(r)
	d := e2bDetail{e2bListed: h.listed(sb, state), EnvdAccessToken: h.envdToken(sb), Domain: &dom}
	if sb.Network != nil {
		in := sb.Network.Internet
		d.AllowInternetAccess = &in
		n := &e2bNetworkInfo{AllowOut: slices.Clone(sb.Network.AllowOut), DenyOut: slices.Clone(sb.Network.DenyOut), AllowPublicTraffic: sb.AllPortsPublic}
		if in {
			n.AllowOut = append(n.AllowOut, allTraffic)
		}
		d.Network = n
	}
	lc := &e2bLifecycle{OnTimeout: "kill"}
	if sb.OnExpiry == api.ExpirySuspend {
		lc.OnTimeout, lc.AutoResume = "pause", true
	}
	d.Lifecycle = lc
	writeJSON(w, http.StatusOK, d)
}

func (h *Handler) list(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	var labels map[string]string
	if md := q.Get("metadata"); md != "" {
		// The SDK sends metadata=<urlencoded "k=v&k2=v2"> of URI-encoded pairs.
		vals, err := url.ParseQuery(md)
		if err != nil {
			h.writeAPIError(w, r, fmt.Errorf("metadata must be URL-encoded key=value pairs: %w", errdefs.ErrInvalidArgument))
			return
		}
		labels = map[string]string{}
		for k, v := range vals {
			labels[k] = v[0]
		}
	}
	wantStates := map[string]bool{"running": true, "paused": true}
	if st := q.Get("state"); st != "" {
		wantStates = map[string]bool{}
		for _, s := range strings.Split(st, ",") {
			if s != "running" && s != "paused" {
				h.writeAPIError(w, r, fmt.Errorf("state must be running or paused, got %q: %w", truncate(s, 32), errdefs.ErrInvalidArgument))
				return
			}
			wantStates[s] = true
		}
	}
	var after time.Time
	if s := q.Get("startedAfter"); s != "" {
		t, err := time.Parse(time.RFC3339Nano, s)
		if err != nil {
			h.writeAPIError(w, r, fmt.Errorf("startedAfter must be an RFC 3339 time: %w", errdefs.ErrInvalidArgument))
			return
		}
		after = t
	}
	tmplFilter := q.Get("template")
	sbs, err := h.cfg.Manager.List(r.Context(), "", labels)
	if err != nil {
		h.writeAPIError(w, r, err)
		return
	}
	var out []e2bListed
	for _, sb := range sbs {
		st, ok := e2bState(sb.State)
		if !ok || !wantStates[st] || (!after.IsZero() && !sb.CreatedAt.After(after)) || (tmplFilter != "" && sb.Template != tmplFilter) {
			continue
		}
		out = append(out, h.listed(sb, st))
	}
	page, next, err := pageListed(out, q)
	if err != nil {
		h.writeAPIError(w, r, err)
		return
	}
	if next != "" {
		w.Header().Set("X-Next-Token", next)
	}
	writeJSON(w, http.StatusOK, page)
}

// pageListed orders a listing and cuts the page q asks for: oldest first
// unless order=desc, ties by id (a stable order makes the page token a
// position), after nextToken, at most limit (default 100). next is the
// next page's token, "" on the last.
func pageListed(out []e2bListed, q url.Values) (page []e2bListed, next string, err error) {
	limit := 100
	if l := q.Get("limit"); l != "" {
		n, err := strconv.Atoi(l)
		if err != nil || n < 1 || n > maxListLimit {
			return nil, "", fmt.Errorf("limit must be 1..%d, got %q: %w", maxListLimit, truncate(l, 16), errdefs.ErrInvalidArgument)
		}
		limit = n
	}
	desc := strings.EqualFold(q.Get("order"), "desc")
	sort.Slice(out, func(i, j int) bool {
		a, b := out[i], out[j]
		if !a.StartedAt.Equal(b.StartedAt) {
			return a.StartedAt.Before(b.StartedAt) != desc
		}
		return (a.SandboxID < b.SandboxID) != desc
	})
	if tok := q.Get("nextToken"); tok != "" {
		// The token is the id of the last sandbox of the previous page.
		i := slices.IndexFunc(out, func(s e2bListed) bool { return s.SandboxID == tok })
		if i < 0 {
			if sandbox.ValidID(tok) != nil {
				return nil, "", fmt.Errorf("nextToken %q is not one this server issued: %w", truncate(tok, 64), errdefs.ErrInvalidArgument)
			}
			// That sandbox is gone since: restart after the first one
			// that sorts after where it would have been is not knowable;
			// its creation time is lost, so the listing restarts.
			i = -1
		}
		out = out[i+1:]
	}
	if len(out) > limit {
		next = out[limit-1].SandboxID
		out = out[:limit]
	}
	if out == nil {
		out = []e2bListed{}
	}
	return out, next, nil
}

func (h *Handler) kill(w http.ResponseWriter, r *http.Request) {
	if err := h.runOp(r.Context(), r.PathValue("id"), api.OpDelete, true); err != nil {
		h.writeAPIError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (h *Handler) setTimeout(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Timeout *int64 `json:"timeout"`
	}
	if err := decodeBody(r, &req); err != nil {
		h.writeAPIError(w, r, err)
		return
	}
	if req.Timeout == nil || *req.Timeout < 0 || *req.Timeout > maxTimeoutSeconds {
		h.writeAPIError(w, r, fmt.Errorf("timeout (seconds) is required, 0..%d: %w", maxTimeoutSeconds, errdefs.ErrInvalidArgument))
		return
	}
	at := time.Now().Add(time.Duration(*req.Timeout) * time.Second)
	if _, err := h.cfg.Manager.Verbs().SetExpiry(r.Context(), r.PathValue("id"), &at); err != nil {
		h.writeAPIError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// refresh is E2B's older keep-alive: extend the deadline by duration seconds.
func (h *Handler) refresh(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Duration int64 `json:"duration"`
	}
	if err := decodeBody(r, &req); err != nil {
		h.writeAPIError(w, r, err)
		return
	}
	if req.Duration < 0 || req.Duration > 3600 {
		h.writeAPIError(w, r, fmt.Errorf("duration must be 0..3600 seconds: %w", errdefs.ErrInvalidArgument))
		return
	}
	if req.Duration == 0 {
		req.Duration = int64(defaultTimeout / time.Second)
	}
	at := time.Now().Add(time.Duration(req.Duration) * time.Second)
	if _, err := h.cfg.Manager.Verbs().SetExpiry(r.Context(), r.PathValue("id"), &at); err != nil {
		h.writeAPIError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// pause is E2B's pause: suspend (memory and disk to disk, nothing left
// running) where the runtime can, else pause in memory. 409 when it is
// already paused, as E2B answers.
func (h *Handler) pause(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Memory *bool `json:"memory"`
	}
	if err := decodeBody(r, &req); err != nil {
		h.writeAPIError(w, r, err)
		return
	}
	id := r.PathValue("id")
	sb, err := h.cfg.Manager.Get(r.Context(), id)
	if err != nil {
		h.writeAPIError(w, r, err)
		return
	}
	if st, _ := e2bState(sb.State); st == "paused" {
		h.writeAPIError(w, r, fmt.Errorf("sandbox %s is already paused (%s): %w", id, sb.State, errdefs.ErrConflict))
		return
	}
	verb := api.OpSuspend
	if req.Memory != nil && !*req.Memory {
		// Filesystem only: the processes end, the disk stays.
		verb = api.OpStop
	}
	err = h.runOp(r.Context(), id, verb, false)
	if errors.Is(err, errdefs.ErrNotSupported) && verb == api.OpSuspend {
		err = h.runOp(r.Context(), id, api.OpPause, false)
	}
	if err != nil {
		h.writeAPIError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// runOp runs lifecycle verb on sandbox id and waits for it to end.
func (h *Handler) runOp(ctx context.Context, id, verb string, force bool) error {
	op, err := h.cfg.Manager.Verbs().Lifecycle(ctx, id, verb, force)
	if err != nil {
		return err
	}
	op, err = h.cfg.Manager.Verbs().Wait(ctx, op.ID)
	if err != nil {
		return err
	}
	if op.Error != nil {
		return sandbox.OpError(op)
	}
	return nil
}

// connect wakes a paused sandbox (resume, restore or start, whichever its
// state needs), sets its timeout when given, and returns it: 201 when it
// had to be woken, 200 when it was running.
func (h *Handler) connect(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Timeout *int64 `json:"timeout"`
		Memory  *bool  `json:"memory"`
	}
	if err := decodeBody(r, &req); err != nil {
		h.writeAPIError(w, r, err)
		return
	}
	id := r.PathValue("id")
	sb, err := h.cfg.Manager.Get(r.Context(), id)
	if err != nil {
		h.writeAPIError(w, r, err)
		return
	}
	if _, ok := e2bState(sb.State); !ok {
		h.writeAPIError(w, r, fmt.Errorf("sandbox %s is in state %s and cannot be connected to: %w", id, sb.State, errdefs.ErrNotFound))
		return
	}
	status := http.StatusOK
	if sb.State != api.StateRunning {
		if err := h.runOp(r.Context(), id, api.OpWake, false); err != nil {
			h.writeAPIError(w, r, err)
			return
		}
		status = http.StatusCreated
	}
	if req.Timeout != nil {
		if *req.Timeout < 0 || *req.Timeout > maxTimeoutSeconds {
			h.writeAPIError(w, r, fmt.Errorf("timeout must be 0..%d seconds: %w", maxTimeoutSeconds, errdefs.ErrInvalidArgument))
			return
		}
		at := time.Now().Add(time.Duration(*req.Timeout) * time.Second)
		if sb, err = h.cfg.Manager.Verbs().SetExpiry(r.Context(), id, &at); err != nil {
			h.writeAPIError(w, r, err)
			return
		}
	} else if sb.ExpiresAt == nil || sb.ExpiresAt.Before(time.Now()) {
		// A sandbox whose deadline suspended it gets E2B's default again.
		at := time.Now().Add(defaultTimeout)
		if sb, err = h.cfg.Manager.Verbs().SetExpiry(r.Context(), id, &at); err != nil {
			h.writeAPIError(w, r, err)
			return
		}
	}
	writeJSON(w, status, h.sandboxOut(r, sb))
}

type forkResult struct {
	Sandbox *e2bSandbox `json:"sandbox,omitempty"`
	Error   *apiError   `json:"error,omitempty"`
}

func (h *Handler) fork(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Timeout *int64 `json:"timeout"`
		Count   int    `json:"count"`
	}
	if err := decodeBody(r, &req); err != nil {
		h.writeAPIError(w, r, err)
		return
	}
	if req.Count == 0 {
		req.Count = 1
	}
	id := r.PathValue("id")
	op, err := h.cfg.Manager.Verbs().Fork(r.Context(), id, api.ForkRequest{Count: req.Count})
	if err != nil {
		h.writeAPIError(w, r, err)
		return
	}
	if op, err = h.cfg.Manager.Verbs().Wait(r.Context(), op.ID); err != nil {
		h.writeAPIError(w, r, err)
		return
	}
	if op.Error != nil && len(op.Children) == 0 {
		h.writeAPIError(w, r, sandbox.OpError(op))
		return
	}
	timeout := defaultTimeout
	if req.Timeout != nil && *req.Timeout > 0 {
		timeout = time.Duration(*req.Timeout) * time.Second
	}
	out := make([]forkResult, 0, len(op.Children))
	for _, cid := range op.Children {
		at := time.Now().Add(timeout)
		child, err := h.cfg.Manager.Verbs().SetExpiry(r.Context(), cid, &at)
		if err != nil {
			st := errdefs.HTTPStatus(err)
			out = append(out, forkResult{Error: &apiError{Code: st, Message: err.Error()}})
			continue
		}
		s := h.sandboxOut(r, child)
		out = append(out, forkResult{Sandbox: &s})
	}
	writeJSON(w, http.StatusOK, out)
}

// e2bMetric is E2B's SandboxMetric.
type e2bMetric struct {
	Timestamp     time.Time `json:"timestamp"`
	TimestampUnix int64     `json:"timestampUnix"`
	CPUCount      float64   `json:"cpuCount"`
	CPUUsedPct    float64   `json:"cpuUsedPct"`
	MemUsed       int64     `json:"memUsed"`
	MemTotal      int64     `json:"memTotal"`
	MemCache      int64     `json:"memCache"`
	DiskUsed      int64     `json:"diskUsed"`
	DiskTotal     int64     `json:"diskTotal"`
}

// metrics answers with the sandbox's current sample (Manager.Stats, as
// GET /v1/sandboxes/{id}/stats): space keeps no history of metrics, so
// start/end select nothing older.
func (h *Handler) metrics(w http.ResponseWriter, r *http.Request) {
	st, err := h.cfg.Manager.Stats(r.Context(), r.PathValue("id"))
	if err != nil {
		h.writeAPIError(w, r, err)
		return
	}
	m := e2bMetric{
		Timestamp: st.Timestamp, TimestampUnix: st.Timestamp.Unix(), CPUCount: st.CPUCount, CPUUsedPct: st.CPUUsedPct,
		MemUsed: st.MemUsedBytes, MemTotal: st.MemTotalBytes, MemCache: st.MemCacheBytes,
		DiskUsed: st.DiskUsedBytes, DiskTotal: st.DiskTotalBytes,
	}
	writeJSON(w, http.StatusOK, []e2bMetric{m})
}

func (h *Handler) updateNetwork(w http.ResponseWriter, r *http.Request) {
	var req struct {
		e2bNetwork
		AllowInternetAccess *bool `json:"allow_internet_access,omitempty"`
	}
	if err := decodeBody(r, &req); err != nil {
		h.writeAPIError(w, r, err)
		return
	}
	if err := refuseNetworkExtras(&req.e2bNetwork); err != nil {
		h.writeAPIError(w, r, err)
		return
	}
	if req.AllowPublicTraffic != nil {
		h.writeAPIError(w, r, notSupported("changing allowPublicTraffic of a running sandbox"))
		return
	}
	id := r.PathValue("id")
	sb, err := h.cfg.Manager.Get(r.Context(), id)
	if err != nil {
		h.writeAPIError(w, r, err)
		return
	}
	// E2B replaces the egress configuration: omitted selectors clear.
	n := req.e2bNetwork
	if n.AllowOut == nil {
		n.AllowOut = []string{}
	}
	if n.DenyOut == nil {
		n.DenyOut = []string{}
	}
	base := &api.NetworkPolicy{}
	if sb.Network != nil {
		base.Internet = sb.Network.Internet
	}
	if req.AllowInternetAccess != nil {
		base.Internet = *req.AllowInternetAccess
	}
	pol, err := policyFromE2B(nil, &n, base)
	if err != nil {
		h.writeAPIError(w, r, err)
		return
	}
	if _, err := h.cfg.Manager.Networking().SetNetwork(r.Context(), id, *pol); err != nil {
		h.writeAPIError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// Snapshots are templates: createSnapshot saves a running sandbox's
// filesystem as a template new sandboxes start from (Verbs.Snapshot: a
// fork of it is committed, the sandbox runs on); its id is the template's
// tag, which Sandbox.create takes as its template. Memory is not kept.
func (h *Handler) createSnapshot(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Name string `json:"name"`
	}
	if err := decodeBody(r, &req); err != nil {
		h.writeAPIError(w, r, err)
		return
	}
	id := r.PathValue("id")
	tag := req.Name
	if tag == "" {
		tag = fmt.Sprintf("snapshot-%s:%d", id, time.Now().UnixMilli())
	}
	norm, err := template.ParseTag(tag)
	if err != nil {
		h.writeAPIError(w, r, err)
		return
	}
	if _, err := h.cfg.Manager.Verbs().Snapshot(r.Context(), id, norm); err != nil {
		h.writeAPIError(w, r, err)
		return
	}
	writeJSON(w, http.StatusCreated, e2bSnapshot{SnapshotID: norm, Names: []string{norm}})
}

type e2bSnapshot struct {
	SnapshotID string   `json:"snapshotID"`
	Names      []string `json:"names"`
}

func (h *Handler) listSnapshots(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	ts, err := h.cfg.Templates.List(r.Context())
	if err != nil {
		h.writeAPIError(w, r, err)
		return
	}
	var out []e2bSnapshot
	for _, t := range ts {
		of, ok := sandbox.SnapshotOf(t)
		if !ok || len(t.Tags) == 0 || (q.Get("sandboxID") != "" && of != q.Get("sandboxID")) {
			continue
		}
		if n := q.Get("name"); n != "" && !slices.Contains(t.Tags, n) && !slices.Contains(t.Tags, n+":latest") {
			continue
		}
		for _, tag := range t.Tags {
			out = append(out, e2bSnapshot{SnapshotID: tag, Names: []string{tag}})
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].SnapshotID < out[j].SnapshotID })
	if tok := q.Get("nextToken"); tok != "" {
		i := sort.Search(len(out), func(i int) bool { return out[i].SnapshotID > tok })
		out = out[i:]
	}
	limit := 100
	if l := q.Get("limit"); l != "" {
		n, err := strconv.Atoi(l)
		if err != nil || n < 1 || n > maxListLimit {
			h.writeAPIError(w, r, fmt.Errorf("limit must be 1..%d, got %q: %w", maxListLimit, truncate(l, 16), errdefs.ErrInvalidArgument))
			return
		}
		limit = n
	}
	if len(out) > limit {
		w.Header().Set("X-Next-Token", out[limit-1].SnapshotID)
		out = out[:limit]
	}
	if out == nil {
		out = []e2bSnapshot{}
	}
	writeJSON(w, http.StatusOK, out)
}

// deleteTemplate is E2B's deleteSnapshot: only templates made by
// createSnapshot are removed here (others through space's own API).
func (h *Handler) deleteTemplate(w http.ResponseWriter, r *http.Request) {
	ref := r.PathValue("id")
	t, err := h.cfg.Templates.Get(r.Context(), ref)
	if err == nil {
		if _, ok := sandbox.SnapshotOf(t); !ok {
			err = fmt.Errorf("template %q is not a snapshot (templates are removed with `space template rm`): %w", truncate(ref, 64), errdefs.ErrNotFound)
		}
	}
	if err == nil {
		// Its tags go with it: a snapshot is one template under its names.
		err = h.cfg.Templates.Remove(r.Context(), t.Digest, true)
	}
	if err != nil {
		h.writeAPIError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

package sdk

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"sort"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

// Lifecycle verbs accepted by POST /v1/sandboxes/{id}/{verb}.
var lifecycleVerbs = map[string]bool{
	api.OpStop: true, api.OpStart: true, api.OpPause: true, api.OpResume: true,
	api.OpWake: true, api.OpSuspend: true, api.OpRestore: true, api.OpFork: true,
}

// LifecycleVerbs lists the verbs Lifecycle accepts, sorted.
func LifecycleVerbs() []string {
	out := make([]string, 0, len(lifecycleVerbs))
	for v := range lifecycleVerbs {
		out = append(out, v)
	}
	sort.Strings(out)
	return out
}

type idempotencyKey struct{}

// WithIdempotencyKey makes the creates made with ctx carry key as their
// Idempotency-Key: a cluster makes one sandbox for all creates of a tenant
// with one key (a retry after a lost answer gets the first one's sandbox).
// A single server ignores it.
func WithIdempotencyKey(ctx context.Context, key string) context.Context {
	return context.WithValue(ctx, idempotencyKey{}, key)
}

// CreateSandbox is POST /v1/sandboxes. The sandbox is not running yet when it
// returns; wait for the returned operation (WaitOperation) for that.
func (c *Client) CreateSandbox(ctx context.Context, req api.CreateSandboxRequest) (*api.CreateSandboxResponse, error) {
	var out api.CreateSandboxResponse
	if err := c.do(ctx, request{method: http.MethodPost, path: "/v1/sandboxes", json: req}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// CreateSandboxWait is POST /v1/sandboxes?wait=: the server answers once
// the create operation has finished (Operation.Done, whether it succeeded
// or failed), with the sandbox as it is then, or when wait (at most 60s)
// has passed, as CreateSandbox does.
func (c *Client) CreateSandboxWait(ctx context.Context, req api.CreateSandboxRequest, wait time.Duration) (*api.CreateSandboxResponse, error) {
	var out api.CreateSandboxResponse
	q := url.Values{"wait": {wait.String()}}
	if err := c.do(ctx, request{method: http.MethodPost, path: "/v1/sandboxes", query: q, json: req}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// CreateSandboxAndWait creates a sandbox and waits until its create
// operation has finished, returning the sandbox as it is then.
func (c *Client) CreateSandboxAndWait(ctx context.Context, req api.CreateSandboxRequest) (*api.Sandbox, error) {
	// The server waits for the create itself (?wait=) and answers with the
	// sandbox as it is then: one round trip where polling takes three. An
	// older server ignores the parameter and answers at once.
	res, err := c.CreateSandboxWait(ctx, req, pollWait)
	if err != nil {
		return nil, err
	}
	if res.Operation.Done() && res.Operation.ID != "" {
		if res.Operation.State == api.OpFailed {
			return &res.Sandbox, fmt.Errorf("creating sandbox %s: %w", res.Sandbox.ID, &OperationError{Operation: &res.Operation})
		}
		return &res.Sandbox, nil
	}
	if _, err := c.WaitOperation(ctx, res.Operation.ID); err != nil {
		return &res.Sandbox, fmt.Errorf("creating sandbox %s: %w", res.Sandbox.ID, err)
	}
	return c.GetSandbox(ctx, res.Sandbox.ID)
}

// ListOptions filters ListSandboxes.
type ListOptions struct {
	State  string            // only sandboxes in this state
	Labels map[string]string // only sandboxes carrying all of these labels
}

// ListSandboxes is GET /v1/sandboxes.
func (c *Client) ListSandboxes(ctx context.Context, opts ListOptions) ([]api.Sandbox, error) {
	q := url.Values{}
	if opts.State != "" {
		q.Set("state", opts.State)
	}
	keys := make([]string, 0, len(opts.Labels))
	for k := range opts.Labels {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		q.Add("label", k+"="+opts.Labels[k])
	}
	var out api.SandboxList
	if err := c.do(ctx, request{method: http.MethodGet, path: "/v1/sandboxes", query: q}, &out); err != nil {
		return nil, err
	}
	return out.Sandboxes, nil
}

// GetSandbox is GET /v1/sandboxes/{id}.
func (c *Client) GetSandbox(ctx context.Context, id string) (*api.Sandbox, error) {
	if err := checkID("sandbox", id); err != nil {
		return nil, err
	}
	var out api.Sandbox
	if err := c.do(ctx, request{method: http.MethodGet, path: "/v1/sandboxes/" + seg(id)}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// DeleteSandbox is DELETE /v1/sandboxes/{id}. Without force the server only
// deletes a stopped or failed sandbox (otherwise ErrConflict).
func (c *Client) DeleteSandbox(ctx context.Context, id string, force bool) (*api.Operation, error) {
	if err := checkID("sandbox", id); err != nil {
		return nil, err
	}
	q := url.Values{}
	if force {
		q.Set("force", "true")
	}
	var out api.Operation
	if err := c.do(ctx, request{method: http.MethodDelete, path: "/v1/sandboxes/" + seg(id), query: q}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// Lifecycle is POST /v1/sandboxes/{id}/{verb} for verb in LifecycleVerbs
// (fork with its default body; use Fork for a count).
func (c *Client) Lifecycle(ctx context.Context, id, verb string) (*api.Operation, error) {
	if !lifecycleVerbs[verb] {
		return nil, fmt.Errorf("unknown lifecycle verb %q (want one of %v): %w", verb, LifecycleVerbs(), errdefs.ErrInvalidArgument)
	}
	var body any
	if verb == api.OpFork {
		body = api.ForkRequest{}
	}
	return c.lifecycle(ctx, id, verb, body)
}

func (c *Client) lifecycle(ctx context.Context, id, verb string, body any) (*api.Operation, error) {
	if err := checkID("sandbox", id); err != nil {
		return nil, err
	}
	var out api.Operation
	if err := c.do(ctx, request{method: http.MethodPost, path: "/v1/sandboxes/" + seg(id) + "/" + verb, json: body}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// Stop stops a sandbox (disk kept, memory not).
func (c *Client) Stop(ctx context.Context, id string) (*api.Operation, error) {
	return c.Lifecycle(ctx, id, api.OpStop)
}

// Start starts a stopped sandbox.
func (c *Client) Start(ctx context.Context, id string) (*api.Operation, error) {
	return c.Lifecycle(ctx, id, api.OpStart)
}

// Pause freezes a sandbox in memory.
func (c *Client) Pause(ctx context.Context, id string) (*api.Operation, error) {
	return c.Lifecycle(ctx, id, api.OpPause)
}

// Resume thaws a paused sandbox.
func (c *Client) Resume(ctx context.Context, id string) (*api.Operation, error) {
	return c.Lifecycle(ctx, id, api.OpResume)
}

// Wake brings a sandbox back to running by whichever path is valid.
func (c *Client) Wake(ctx context.Context, id string) (*api.Operation, error) {
	return c.Lifecycle(ctx, id, api.OpWake)
}

// Suspend saves a running or paused sandbox's processes, memory and open
// files to disk and releases every host resource (state "suspended"). The
// operation fails with the runtime's message if the checkpoint fails, and the
// sandbox keeps running. Any later exec, command or file call restores it
// transparently; a runtime without the ability answers ErrNotSupported.
func (c *Client) Suspend(ctx context.Context, id string) (*api.Operation, error) {
	return c.Lifecycle(ctx, id, api.OpSuspend)
}

// Restore continues a suspended sandbox where it was (Wake does the same
// and also resumes paused and starts stopped sandboxes).
func (c *Client) Restore(ctx context.Context, id string) (*api.Operation, error) {
	return c.Lifecycle(ctx, id, api.OpRestore)
}

// Fork is POST /v1/sandboxes/{id}/fork: req.Count (default 1, at most 16)
// new sandboxes continue from the running sandbox's memory, each with its own
// disk copy, hostname (its id) and entropy, labelled "space.fork_of" = id.
// The returned operation's Children are the new sandboxes' ids; they exist at
// once (state "creating") and run when the operation has succeeded. On
// failure every child is left in state "error" with the reason.
func (c *Client) Fork(ctx context.Context, id string, req api.ForkRequest) (*api.Operation, error) {
	if req.Count < 0 {
		return nil, fmt.Errorf("fork count %d: %w", req.Count, errdefs.ErrInvalidArgument)
	}
	return c.lifecycle(ctx, id, api.OpFork, req)
}

// GetOperation is GET /v1/operations/{id}. A positive wait long-polls: the
// server answers when the operation is done or wait has elapsed (at most 60s).
func (c *Client) GetOperation(ctx context.Context, id string, wait time.Duration) (*api.Operation, error) {
	if err := checkID("operation", id); err != nil {
		return nil, err
	}
	q := url.Values{}
	if wait > 0 {
		q.Set("wait", wait.Round(time.Second).String())
	}
	var out api.Operation
	if err := c.do(ctx, request{method: http.MethodGet, path: "/v1/operations/" + seg(id), query: q}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// OperationError is returned by WaitOperation for an operation that failed.
// It unwraps to the errdefs sentinel of the operation's error code.
type OperationError struct {
	Operation *api.Operation
}

func (e *OperationError) Error() string {
	op := e.Operation
	msg := "failed"
	if op.Error != nil {
		msg = op.Error.Code + ": " + op.Error.Message
	}
	return fmt.Sprintf("operation %s (%s of sandbox %s) failed: %s", op.ID, op.Kind, op.SandboxID, msg)
}

// Unwrap returns the sentinel of the operation's error code, if any.
func (e *OperationError) Unwrap() error {
	if e.Operation.Error == nil {
		return nil
	}
	return errdefs.FromCode(e.Operation.Error.Code)
}

// pollWait is the long-poll window WaitOperation asks for; under the
// server's 60s cap and short enough to notice a dead server.
const pollWait = 30 * time.Second

// WaitOperation long-polls the operation until it is done or ctx ends. A
// failed operation is returned together with an *OperationError. Transient
// server errors (unavailable, timeout) are retried with backoff.
func (c *Client) WaitOperation(ctx context.Context, id string) (*api.Operation, error) {
	backoff := 100 * time.Millisecond
	for {
		op, err := c.GetOperation(ctx, id, pollWait)
		switch {
		case err == nil:
			backoff = 100 * time.Millisecond
			if op.Done() {
				if op.State == api.OpFailed {
					return op, &OperationError{Operation: op}
				}
				return op, nil
			}
			// The long-poll elapsed (or the server does not long-poll);
			// avoid spinning if it answers at once.
			if err := sleepCtx(ctx, 50*time.Millisecond); err != nil {
				return op, err
			}
		case retryable(err) && ctx.Err() == nil:
			if err := sleepCtx(ctx, backoff); err != nil {
				return nil, err
			}
			backoff = min(backoff*2, 5*time.Second)
		default:
			return nil, err
		}
	}
}

// checkID rejects ids that could not name a resource, before a request is
// built from them ("" would address the collection, "." or ".." another route).
func checkID(what, id string) error {
	if id == "" || id == "." || id == ".." {
		return fmt.Errorf("%s id %q: %w", what, id, errdefs.ErrInvalidArgument)
	}
	return nil
}

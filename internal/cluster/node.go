package cluster

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/clusterstore"
	"github.com/spacehq/space/internal/errdefs"
)

// NodeStore is the part of the cluster store a node's reconciler uses.
type NodeStore interface {
	Pending(ctx context.Context, node string) ([]clusterstore.Sandbox, error)
	Report(ctx context.Context, node, id string, gen int64, status api.Sandbox) error
	Listen(ctx context.Context, node string, wake func()) error
	OnNode(ctx context.Context, node string) ([]clusterstore.Sandbox, error)
	GetSandbox(ctx context.Context, id string) (clusterstore.Sandbox, error)
}

var _ NodeStore = (*clusterstore.SandboxStore)(nil)

// Local is the node's own sandboxes, as its sandbox manager has them.
type Local interface {
	// List returns the sandboxes the cluster knows of (not warm-pool
	// members or build steps, which are the node's own business).
	List(ctx context.Context) ([]api.Sandbox, error)
	// Apply runs lifecycle verb (api.OpDelete, OpPause, OpResume,
	// OpSuspend, OpWake) on sandbox id and waits for it to finish.
	Apply(ctx context.Context, id, verb string) error
}

// Discarder is a Local that deletes a sandbox as the node's own cleanup
// (an orphan, a stale copy), apart from Apply, whose verbs replicas asked
// for and the node's policy decides.
type Discarder interface {
	Discard(ctx context.Context, id string) error
}

// discard deletes sandbox id as the node's own cleanup.
func (n *Node) discard(ctx context.Context, id string) error {
	if d, ok := n.Local.(Discarder); ok {
		return d.Discard(ctx, id)
	}
	return n.Local.Apply(ctx, id, api.OpDelete)
}

// Node keeps one node's sandboxes and the cluster's rows of them in step:
// it applies the desired state replicas wrote (Pending), reports every
// change of a local sandbox (Report), and deletes a sandbox it made that
// never got a row (a replica that died between the node's create and its
// own write of the row) once OrphanGrace has passed.
type Node struct {
	ID    string
	Store NodeStore
	Local Local
	Log   *slog.Logger
	// Poll is how often the node looks without being woken (default 2 s):
	// a notification is a hint, the rows are the truth.
	Poll time.Duration
	// OrphanGrace is how long a sandbox created since this node started may
	// go without a row before it is deleted (default 30 s). Sandboxes older
	// than the node process are never deleted for lack of a row: a node
	// pointed at the wrong database must not wipe itself.
	OrphanGrace time.Duration
	// Changed, when set, hears of every change the node reports of a
	// sandbox (nil: it is gone), after the report.
	Changed func(ctx context.Context, id string, sb *api.Sandbox)

	wake     chan struct{} // Wake's nudge to Run (capacity 1: wakes coalesce)
	wakeOnce sync.Once
	started  time.Time
	reported map[string]string // id → the state key last reported
	// swept is set once the rows of sandboxes that went while the node
	// was down have been reported deleted.
	swept bool
}

// Run reconciles until ctx ends.
func (n *Node) Run(ctx context.Context) error {
	if n.ID == "" || n.Store == nil || n.Local == nil {
		return fmt.Errorf("cluster node needs an id, a store and its sandboxes: %w", errdefs.ErrInvalidArgument)
	}
	if n.Poll <= 0 {
		n.Poll = 2 * time.Second
	}
	if n.OrphanGrace <= 0 {
		n.OrphanGrace = 30 * time.Second
	}
	if n.Log == nil {
		n.Log = slog.Default()
	}
	n.started = time.Now()
	n.reported = map[string]string{}
	wake := n.wakeCh()
	go n.Store.Listen(ctx, n.ID, n.Wake)
	t := time.NewTicker(n.Poll)
	defer t.Stop()
	for {
		if err := n.Reconcile(ctx); err != nil && ctx.Err() == nil {
			n.Log.Warn("cluster reconcile", "node", n.ID, "err", err)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-wake:
		case <-t.C:
		}
	}
}

// Wake makes Run reconcile now rather than at its next poll: a local
// operation ended, so the rows should say so at once. Safe from any
// goroutine, before or during Run; wakes coalesce.
func (n *Node) Wake() {
	select {
	case n.wakeCh() <- struct{}{}:
	default:
	}
}

func (n *Node) wakeCh() chan struct{} {
	n.wakeOnce.Do(func() { n.wake = make(chan struct{}, 1) })
	return n.wake
}

// Reconcile does one pass: desired state first, then reports.
func (n *Node) Reconcile(ctx context.Context) error {
	if n.reported == nil {
		n.reported = map[string]string{}
	}
	pending, err := n.Store.Pending(ctx, n.ID)
	if err != nil {
		return err
	}
	local, err := n.localByID(ctx)
	if err != nil {
		return err
	}
	var errs []error
	if !n.swept {
		// Sandboxes deleted while this process was not running (or before
		// it first reported them) still have rows that say otherwise.
		rows, err := n.Store.OnNode(ctx, n.ID)
		if err != nil {
			return err
		}
		for _, r := range rows {
			if _, ok := local[r.ID]; !ok && r.Observed > 0 && r.State != api.StateDeleted && r.Desired != clusterstore.DesiredDeleted {
				if err := n.Store.Report(ctx, n.ID, r.ID, 0, api.Sandbox{ID: r.ID, State: api.StateDeleted}); err != nil {
					errs = append(errs, err)
				}
			}
		}
		n.swept = len(errs) == 0
	}
	for _, row := range pending {
		sb, ok := local[row.ID]
		if err := n.apply(ctx, row, sb, ok); err != nil {
			errs = append(errs, fmt.Errorf("sandbox %s: %w", row.ID, err))
		}
	}
	// Reports of what changed, from a fresh look (apply changed things).
	if len(pending) > 0 {
		if local, err = n.localByID(ctx); err != nil {
			return errors.Join(append(errs, err)...)
		}
	}
	for id, sb := range local {
		key := stateKey(sb)
		if n.reported[id] == key {
			continue
		}
		err := n.Store.Report(ctx, n.ID, id, 0, sb)
		switch {
		case err == nil:
			n.reported[id] = key
			if n.Changed != nil {
				n.Changed(ctx, id, &sb)
			}
		case errors.Is(err, errdefs.ErrNotFound):
			n.orphan(ctx, sb)
		default:
			errs = append(errs, fmt.Errorf("report %s: %w", id, err))
		}
	}
	// Deleted on this node without a replica asking (a direct API call, a
	// TTL): the row says so, and stays until a replica forgets it.
	for id, key := range n.reported {
		if _, ok := local[id]; ok {
			continue
		}
		if key != "orphan" {
			if err := n.Store.Report(ctx, n.ID, id, 0, api.Sandbox{ID: id, State: api.StateDeleted}); err != nil && !errors.Is(err, errdefs.ErrNotFound) {
				errs = append(errs, fmt.Errorf("report deletion of %s: %w", id, err))
				continue
			}
		}
		delete(n.reported, id)
		if n.Changed != nil {
			n.Changed(ctx, id, nil)
		}
	}
	return errors.Join(errs...)
}

func (n *Node) localByID(ctx context.Context) (map[string]api.Sandbox, error) {
	list, err := n.Local.List(ctx)
	if err != nil {
		return nil, fmt.Errorf("local sandboxes: %w", err)
	}
	m := make(map[string]api.Sandbox, len(list))
	for _, sb := range list {
		m[sb.ID] = sb
	}
	return m, nil
}

// stateKey is what makes a report worth sending again.
func stateKey(sb api.Sandbox) string {
	return sb.State + "\x00" + sb.Error + "\x00" + sb.OperationID + "\x00" + sb.UpdatedAt.Format(time.RFC3339Nano)
}

// apply moves one sandbox toward row.Desired and reports the outcome with
// the row's generation, so the row stops being pending whether the verb
// worked or not (a refusal is reported as the sandbox's error, not retried
// forever).
func (n *Node) apply(ctx context.Context, row clusterstore.Sandbox, sb api.Sandbox, exists bool) error {
	if !exists {
		st := api.Sandbox{ID: row.ID, State: api.StateDeleted}
		if row.Desired != clusterstore.DesiredDeleted {
			st = api.Sandbox{ID: row.ID, State: api.StateError, Error: fmt.Sprintf("sandbox %s is not on node %s", row.ID, n.ID)}
		}
		return n.Store.Report(ctx, n.ID, row.ID, row.Generation, st)
	}
	verb := verbToward(row.Desired, sb.State)
	var applyErr error
	if verb != "" {
		n.Log.Info("cluster: applying desired state", "sandbox", row.ID, "desired", row.Desired, "verb", verb, "generation", row.Generation)
		applyErr = n.Local.Apply(ctx, row.ID, verb)
	}
	if verb == api.OpDelete && applyErr == nil {
		delete(n.reported, row.ID)
		return n.Store.Report(ctx, n.ID, row.ID, row.Generation, api.Sandbox{ID: row.ID, State: api.StateDeleted})
	}
	local, err := n.localByID(ctx)
	if err != nil {
		return err
	}
	now, ok := local[row.ID]
	if !ok {
		now = sb
	}
	// The key is the local record's, so the refusal's reason stays in the
	// row until the sandbox itself changes.
	key := stateKey(now)
	if applyErr != nil {
		now.Error = fmt.Sprintf("%s toward %s: %v", verb, row.Desired, applyErr)
	}
	if err := n.Store.Report(ctx, n.ID, row.ID, row.Generation, now); err != nil {
		return err
	}
	n.reported[row.ID] = key
	return applyErr
}

// verbToward is the lifecycle verb that moves a sandbox in state toward
// desired, or "" when it is there (or on its way).
func verbToward(desired, state string) string {
	switch desired {
	case clusterstore.DesiredDeleted:
		if state == api.StateDeleting || state == api.StateDeleted {
			return ""
		}
		return api.OpDelete
	case clusterstore.DesiredPaused:
		if state == api.StateRunning {
			return api.OpPause
		}
	case clusterstore.DesiredSuspended:
		if state == api.StateRunning || state == api.StatePaused {
			return api.OpSuspend
		}
	case clusterstore.DesiredRunning:
		switch state {
		case api.StatePaused:
			return api.OpResume
		case api.StateSuspended:
			return api.OpWake
		}
	}
	return ""
}

// orphan handles a local sandbox the cluster has no row for on this node.
func (n *Node) orphan(ctx context.Context, sb api.Sandbox) {
	if row, err := n.Store.GetSandbox(ctx, sb.ID); err == nil && row.Node != n.ID {
		// The cluster moved it while this node was lost (a suspended
		// sandbox continued elsewhere): this copy is stale.
		n.Log.Warn("cluster: deleting the stale copy of a sandbox now on another node", "sandbox", sb.ID, "node", row.Node)
		if err := n.discard(ctx, sb.ID); err != nil {
			n.Log.Warn("cluster: deleting a stale copy", "sandbox", sb.ID, "err", err)
		}
		return
	}
	if sb.CreatedAt.Before(n.started) {
		if n.reported[sb.ID] != "orphan" {
			n.Log.Warn("cluster: sandbox older than this node process has no row; left alone", "sandbox", sb.ID)
			n.reported[sb.ID] = "orphan"
		}
		return
	}
	if time.Since(sb.CreatedAt) < n.OrphanGrace {
		return // its replica may still be writing the row
	}
	n.Log.Warn("cluster: deleting a sandbox that never got a row", "sandbox", sb.ID, "created", sb.CreatedAt)
	if err := n.discard(ctx, sb.ID); err != nil {
		n.Log.Warn("cluster: deleting orphan", "sandbox", sb.ID, "err", err)
	}
}

package clusterstore

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

// StateLost is the state of a sandbox whose node stopped heart-beating.
const StateLost = "lost"

// Desired states a replica asks for.
const (
	DesiredRunning   = "running"
	DesiredPaused    = "paused"
	DesiredSuspended = "suspended"
	DesiredDeleted   = "deleted"
)

// notifyChannel carries, as payload, the id of a node that has new desired
// state to apply. One channel: node ids are data, not identifiers.
const notifyChannel = "space_node"

// SandboxStore keeps the sandbox rows: what replicas ask of each sandbox
// (its desired state, with a generation that counts the changes) and what
// its node last observed, a create's idempotency key, and the move of a
// lost node's sandbox. Every change of desired state NOTIFYs the node that
// runs the sandbox; Listen is the node's side of that.
type SandboxStore struct {
	pool *pgxpool.Pool
}

// Sandbox is one sandbox's row: what a replica asked for and what its node
// last reported.
type Sandbox struct {
	ID      string
	Node    string
	Tenant  string
	Request api.CreateSandboxRequest
	Desired string
	// Generation counts changes of Desired; Observed is the generation the
	// node last applied. Generation > Observed: the node has work.
	Generation  int64
	Observed    int64
	Status      *api.Sandbox // nil until the node first reports
	State       string
	StateReason string
	Created     time.Time
	Updated     time.Time
	// CreateOperation is the id of the create's operation on the node.
	CreateOperation string
}

// ErrIdempotencyKeyUsed is AddSandboxRecord's error when the tenant
// already has a sandbox under that idempotency key (SandboxByKey finds it).
var ErrIdempotencyKeyUsed = fmt.Errorf("idempotency key already used: %w", errdefs.ErrConflict)

// AddSandbox records a new sandbox placed on node and wakes that node. An
// id that exists is ErrConflict.
func (ss *SandboxStore) AddSandbox(ctx context.Context, id, node, tenant string, req api.CreateSandboxRequest) error {
	return ss.AddSandboxRecord(ctx, NewSandbox{ID: id, Node: node, Tenant: tenant, Request: req})
}

// NewSandbox is the row of a sandbox a node has just made.
type NewSandbox struct {
	ID, Node, Tenant string
	// IdempotencyKey is the caller's ("" for none).
	IdempotencyKey string
	// CreateOperation is the id of the create's operation on the node.
	CreateOperation string
	Request         api.CreateSandboxRequest
}

// AddSandboxRecord is AddSandbox with the create's idempotency key and
// operation: a key the tenant already used is ErrIdempotencyKeyUsed, so of
// two creates with one key exactly one gets a row.
func (ss *SandboxStore) AddSandboxRecord(ctx context.Context, n NewSandbox) error {
	id, node, tenant, key, req := n.ID, n.Node, n.Tenant, n.IdempotencyKey, n.Request
	if id == "" || node == "" {
		return fmt.Errorf("a sandbox row needs an id and a node: %w", errdefs.ErrInvalidArgument)
	}
	body, err := json.Marshal(req)
	if err != nil {
		return err
	}
	var idem *string
	if key != "" {
		idem = &key
	}
	err = pgx.BeginFunc(ctx, ss.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO sandboxes (id, node, tenant, request, desired, idempotency_key, create_operation) VALUES ($1, $2, $3, $4, 'running', $5, $6)`,
			id, node, tenant, body, idem, n.CreateOperation); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `SELECT pg_notify($1, $2)`, notifyChannel, node)
		return err
	})
	var pgErr *pgconn.PgError
	switch {
	case errors.As(err, &pgErr) && pgErr.Code == "23505" && pgErr.ConstraintName == "sandboxes_idempotency":
		return fmt.Errorf("tenant %q: %w", tenant, ErrIdempotencyKeyUsed)
	case errors.As(err, &pgErr) && pgErr.Code == "23505":
		return fmt.Errorf("sandbox %q already exists: %w", id, errdefs.ErrConflict)
	case errors.As(err, &pgErr) && pgErr.Code == "23503":
		return fmt.Errorf("node %q: %w", node, errdefs.ErrNotFound)
	case errors.As(err, &pgErr) && pgErr.Code == "23514":
		return fmt.Errorf("sandbox row %q: %s: %w", id, pgErr.Message, errdefs.ErrInvalidArgument)
	case err != nil:
		return fmt.Errorf("add sandbox %q: %w", id, err)
	}
	return nil
}

// StateMoving is the state of a lost node's suspended sandbox while a
// replica moves it to another node.
const StateMoving = "moving"

// ClaimMove takes a lost sandbox for a move from node from to node to: one
// UPDATE, so of replicas racing to move it exactly one wins (the others get
// ErrConflict and follow the row). EndMove settles it.
func (ss *SandboxStore) ClaimMove(ctx context.Context, id, from, to string) error {
	tag, err := ss.pool.Exec(ctx, `UPDATE sandboxes SET node = $3, state = 'moving', state_reason = 'moving from ' || $2,
			updated_at = now()
		WHERE id = $1 AND node = $2 AND state = 'lost'`, id, from, to)
	if err != nil {
		return fmt.Errorf("claim the move of %q: %w", id, err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("sandbox %q is not a lost sandbox of node %s: %w", id, from, errdefs.ErrConflict)
	}
	return nil
}

// EndMove settles a claimed move: done, the row is the new node's
// suspended sandbox; failed, it goes back to the old node, lost, with why.
func (ss *SandboxStore) EndMove(ctx context.Context, id, from, to string, failure error) error {
	var err error
	if failure == nil {
		_, err = ss.pool.Exec(ctx, `UPDATE sandboxes SET state = 'suspended', state_reason = '', updated_at = now()
			WHERE id = $1 AND node = $2 AND state = 'moving'`, id, to)
	} else {
		_, err = ss.pool.Exec(ctx, `UPDATE sandboxes SET node = $3, state = 'lost', state_reason = $4, updated_at = now()
			WHERE id = $1 AND node = $2 AND state = 'moving'`, id, to, from, "moving to "+to+" failed: "+failure.Error())
	}
	if err != nil {
		return fmt.Errorf("settle the move of %q: %w", id, err)
	}
	return nil
}

// SandboxByKey returns the tenant's sandbox created under an idempotency key.
func (ss *SandboxStore) SandboxByKey(ctx context.Context, tenant, key string) (Sandbox, error) {
	rows, err := ss.pool.Query(ctx, `SELECT `+sandboxColumns+` FROM sandboxes WHERE tenant = $1 AND idempotency_key = $2`, tenant, key)
	if err != nil {
		return Sandbox{}, fmt.Errorf("sandbox by idempotency key: %w", err)
	}
	sb, err := pgx.CollectExactlyOneRow(rows, scanSandbox)
	if errors.Is(err, pgx.ErrNoRows) {
		return Sandbox{}, fmt.Errorf("no sandbox of tenant %q has idempotency key %q: %w", tenant, key, errdefs.ErrNotFound)
	}
	return sb, err
}

// Sandboxes lists the sandbox rows of tenant ("" for every tenant), oldest first.
func (ss *SandboxStore) Sandboxes(ctx context.Context, tenant string) ([]Sandbox, error) {
	rows, err := ss.pool.Query(ctx, `SELECT `+sandboxColumns+` FROM sandboxes
		WHERE $1 = '' OR tenant = $1 ORDER BY created_at, id`, tenant)
	if err != nil {
		return nil, fmt.Errorf("list sandboxes: %w", err)
	}
	return pgx.CollectRows(rows, scanSandbox)
}

// SetDesired changes what a sandbox should be, bumps its generation and
// wakes its node.
func (ss *SandboxStore) SetDesired(ctx context.Context, id, desired string) error {
	switch desired {
	case DesiredRunning, DesiredPaused, DesiredSuspended, DesiredDeleted:
	default:
		return fmt.Errorf("desired state %q: want running, paused, suspended or deleted: %w", desired, errdefs.ErrInvalidArgument)
	}
	return pgx.BeginFunc(ctx, ss.pool, func(tx pgx.Tx) error {
		var node string
		err := tx.QueryRow(ctx, `UPDATE sandboxes SET desired = $2, generation = generation + 1, updated_at = now()
			WHERE id = $1 RETURNING node`, id, desired).Scan(&node)
		if errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("sandbox %q: %w", id, errdefs.ErrNotFound)
		}
		if err != nil {
			return fmt.Errorf("set desired state of %q: %w", id, err)
		}
		_, err = tx.Exec(ctx, `SELECT pg_notify($1, $2)`, notifyChannel, node)
		return err
	})
}

const sandboxColumns = `id, node, tenant, request, desired, generation, observed, status, state, state_reason, created_at, updated_at, create_operation`

func scanSandbox(r pgx.CollectableRow) (Sandbox, error) {
	var sb Sandbox
	var req, status []byte
	if err := r.Scan(&sb.ID, &sb.Node, &sb.Tenant, &req, &sb.Desired, &sb.Generation, &sb.Observed, &status,
		&sb.State, &sb.StateReason, &sb.Created, &sb.Updated, &sb.CreateOperation); err != nil {
		return Sandbox{}, err
	}
	if err := json.Unmarshal(req, &sb.Request); err != nil {
		return Sandbox{}, fmt.Errorf("sandbox %s: request: %w", sb.ID, err)
	}
	if status != nil {
		sb.Status = new(api.Sandbox)
		if err := json.Unmarshal(status, sb.Status); err != nil {
			return Sandbox{}, fmt.Errorf("sandbox %s: status: %w", sb.ID, err)
		}
	}
	return sb, nil
}

// GetSandbox returns one sandbox's row.
func (ss *SandboxStore) GetSandbox(ctx context.Context, id string) (Sandbox, error) {
	rows, err := ss.pool.Query(ctx, `SELECT `+sandboxColumns+` FROM sandboxes WHERE id = $1`, id)
	if err != nil {
		return Sandbox{}, fmt.Errorf("get sandbox %q: %w", id, err)
	}
	sb, err := pgx.CollectExactlyOneRow(rows, scanSandbox)
	if errors.Is(err, pgx.ErrNoRows) {
		return Sandbox{}, fmt.Errorf("sandbox %q: %w", id, errdefs.ErrNotFound)
	}
	return sb, err
}

// Pending returns the sandboxes on node whose desired state the node has
// not applied yet (generation > observed), oldest first.
func (ss *SandboxStore) Pending(ctx context.Context, node string) ([]Sandbox, error) {
	rows, err := ss.pool.Query(ctx, `SELECT `+sandboxColumns+` FROM sandboxes
		WHERE node = $1 AND generation > observed ORDER BY created_at, id`, node)
	if err != nil {
		return nil, fmt.Errorf("pending sandboxes of %q: %w", node, err)
	}
	return pgx.CollectRows(rows, scanSandbox)
}

// OnNode returns every sandbox row placed on node (a node reconciling after
// its restart compares them with what it runs).
func (ss *SandboxStore) OnNode(ctx context.Context, node string) ([]Sandbox, error) {
	rows, err := ss.pool.Query(ctx, `SELECT `+sandboxColumns+` FROM sandboxes WHERE node = $1 ORDER BY id`, node)
	if err != nil {
		return nil, fmt.Errorf("sandboxes of %q: %w", node, err)
	}
	return pgx.CollectRows(rows, scanSandbox)
}

// Report records what node observed of sandbox id after applying
// generation gen: its record and state. Only the node the row names may
// report (a sandbox moved elsewhere is not overwritten by its old node), and
// observed never goes backwards. A sandbox reported deleted loses its row,
// whoever asked for the deletion (a replica, or a call to the node's own
// API): it is gone, and the cluster answers 404 for it as a single box does.
func (ss *SandboxStore) Report(ctx context.Context, node, id string, gen int64, status api.Sandbox) error {
	body, err := json.Marshal(status)
	if err != nil {
		return err
	}
	if status.State == api.StateDeleted {
		tag, err := ss.pool.Exec(ctx, `DELETE FROM sandboxes WHERE id = $1 AND node = $2`, id, node)
		if err != nil {
			return fmt.Errorf("report deletion of %q: %w", id, err)
		}
		if tag.RowsAffected() == 0 {
			return fmt.Errorf("sandbox %q on node %q: %w", id, node, errdefs.ErrNotFound)
		}
		return nil
	}
	tag, err := ss.pool.Exec(ctx, `UPDATE sandboxes SET status = $4, state = $5, state_reason = $6,
			observed = greatest(observed, $3), updated_at = now()
		WHERE id = $1 AND node = $2`, id, node, gen, body, status.State, status.Error)
	if err != nil {
		return fmt.Errorf("report sandbox %q: %w", id, err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("sandbox %q on node %q: %w", id, node, errdefs.ErrNotFound)
	}
	return nil
}

// CountSandboxes is how many sandbox rows tenant has (what a replica checks
// a cluster-wide sandbox quota against).
func (ss *SandboxStore) CountSandboxes(ctx context.Context, tenant string) (int, error) {
	var n int
	err := ss.pool.QueryRow(ctx, `SELECT count(*) FROM sandboxes WHERE tenant = $1 AND desired <> 'deleted'`, tenant).Scan(&n)
	return n, err
}

// Listen calls wake each time a replica notifies node of new desired state,
// until ctx ends; it reconnects after a lost connection and calls wake once
// after every (re)connect, since notifications sent while it was away are
// gone. Nodes poll Pending too: a notification is a hint, not the truth.
func (ss *SandboxStore) Listen(ctx context.Context, node string, wake func()) error {
	return listen(ctx, ss.pool, notifyChannel, func(payload string) bool { return payload == node }, wake)
}

package clusterstore

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/spacehq/space/internal/errdefs"
)

// Node states.
const (
	NodeReady    = "ready"
	NodeDraining = "draining"
	NodeLost     = "lost"
)

// NodeStatus is what a node reports with every heartbeat.
type NodeStatus struct {
	ID      string
	Address string // the node's API, https://host:port, for replicas to proxy to
	// MemFree is the memory the node can still give sandboxes, in bytes.
	MemFree   int64
	CPUs      int
	Sandboxes int
	// Templates are the digests of the templates the node holds, so
	// placement can prefer a node that need not fetch one.
	Templates []string
	// Warm names, once per ready warm-pool member, the template it was
	// made from (by digest and by each of its tags), so placement can
	// prefer a node where a create is a claim.
	Warm []string
}

// Node is a node's row as replicas see it.
type Node struct {
	NodeStatus
	State       string
	StateReason string
	Registered  time.Time
	Heartbeat   time.Time
}

// NodeStore keeps the nodes that run sandboxes: their heartbeats (and,
// through MarkLost, the loss of one that stopped beating, with its
// sandboxes), an admin's drain, and placement, which picks the node for a
// new sandbox and charges it until that node's next heartbeat.
type NodeStore struct {
	pool *pgxpool.Pool
}

// Heartbeat records that the node is alive with status s, registering it on
// first call. A node that had been marked lost and beats again is ready.
func (ns *NodeStore) Heartbeat(ctx context.Context, st NodeStatus) error {
	if st.ID == "" || st.Address == "" {
		return fmt.Errorf("heartbeat needs the node's id and address: %w", errdefs.ErrInvalidArgument)
	}
	if st.MemFree < 0 || st.CPUs < 0 || st.Sandboxes < 0 {
		return fmt.Errorf("heartbeat of node %q: negative capacity: %w", st.ID, errdefs.ErrInvalidArgument)
	}
	if st.Templates == nil {
		st.Templates = []string{}
	}
	if st.Warm == nil {
		st.Warm = []string{}
	}
	_, err := ns.pool.Exec(ctx, `
		INSERT INTO nodes (id, address, mem_free, cpus, sandboxes, templates, warm)
		VALUES ($1, $2, $3, $4, $5, $6, $7)
		ON CONFLICT (id) DO UPDATE SET
			address = EXCLUDED.address, mem_free = EXCLUDED.mem_free, cpus = EXCLUDED.cpus,
			sandboxes = EXCLUDED.sandboxes, templates = EXCLUDED.templates, warm = EXCLUDED.warm,
			heartbeat_at = now(),
			state = CASE WHEN nodes.state = 'draining' THEN 'draining' ELSE 'ready' END,
			state_reason = CASE WHEN nodes.state = 'draining' THEN nodes.state_reason ELSE '' END`,
		st.ID, st.Address, st.MemFree, st.CPUs, st.Sandboxes, st.Templates, st.Warm)
	if err != nil {
		return fmt.Errorf("heartbeat of node %q: %w", st.ID, err)
	}
	return nil
}

// MarkLost marks every node whose last heartbeat is older than window as
// lost, with the reason, and every sandbox on it that is not being deleted
// as lost with "node <id> lost: <reason>", in one transaction; it returns
// the nodes' ids. Any replica may call it: each node is reported by exactly
// one caller.
func (ns *NodeStore) MarkLost(ctx context.Context, window time.Duration) ([]string, error) {
	if window <= 0 {
		return nil, fmt.Errorf("heartbeat window %v must be positive: %w", window, errdefs.ErrInvalidArgument)
	}
	var ids []string
	err := pgx.BeginFunc(ctx, ns.pool, func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, `
			UPDATE nodes SET state = 'lost',
				state_reason = format('no heartbeat for %s (last at %s)',
					date_trunc('second', now() - heartbeat_at), to_char(heartbeat_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"'))
			WHERE state <> 'lost' AND heartbeat_at < now() - make_interval(secs => $1)
			RETURNING id`, window.Seconds())
		if err != nil {
			return err
		}
		if ids, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil || len(ids) == 0 {
			return err
		}
		_, err = tx.Exec(ctx, `
			UPDATE sandboxes s SET state = 'lost', state_reason = format('node %s lost: %s', n.id, n.state_reason), updated_at = now()
			FROM nodes n WHERE n.id = ANY($1) AND s.node = n.id AND s.desired <> 'deleted'`, ids)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("mark lost nodes: %w", err)
	}
	return ids, nil
}

// Drain stops placement on a node (its sandboxes keep running).
func (ns *NodeStore) Drain(ctx context.Context, id, reason string) error {
	tag, err := ns.pool.Exec(ctx, `UPDATE nodes SET state = 'draining', state_reason = $2 WHERE id = $1`, id, reason)
	if err != nil {
		return fmt.Errorf("drain node %q: %w", id, err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("node %q: %w", id, errdefs.ErrNotFound)
	}
	return nil
}

// Undrain lets placement use a draining node again (a lost one stays
// lost until it beats).
func (ns *NodeStore) Undrain(ctx context.Context, id string) error {
	tag, err := ns.pool.Exec(ctx, `UPDATE nodes SET state = CASE WHEN state = 'draining' THEN 'ready' ELSE state END,
		state_reason = CASE WHEN state = 'draining' THEN '' ELSE state_reason END WHERE id = $1`, id)
	if err != nil {
		return fmt.Errorf("undrain node %q: %w", id, err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("node %q: %w", id, errdefs.ErrNotFound)
	}
	return nil
}

const nodeColumns = `id, address, mem_free, cpus, sandboxes, templates, warm, state, state_reason, registered_at, heartbeat_at`

func scanNode(r pgx.CollectableRow) (Node, error) {
	var n Node
	err := r.Scan(&n.ID, &n.Address, &n.MemFree, &n.CPUs, &n.Sandboxes, &n.Templates, &n.Warm,
		&n.State, &n.StateReason, &n.Registered, &n.Heartbeat)
	return n, err
}

// Nodes lists every node, by id.
func (ns *NodeStore) Nodes(ctx context.Context) ([]Node, error) {
	rows, err := ns.pool.Query(ctx, `SELECT `+nodeColumns+` FROM nodes ORDER BY id`)
	if err != nil {
		return nil, fmt.Errorf("list nodes: %w", err)
	}
	return pgx.CollectRows(rows, scanNode)
}

// Place picks the node for a new sandbox of template digest needing mem
// bytes: among ready nodes that beat within window and have mem free, one
// with a warm-pool member of the template first, then one that holds the
// template, then the one with the fewest sandboxes per CPU, then the most
// free memory, then by id (deterministic).
// ErrUnavailable when none fits.
func (ns *NodeStore) Place(ctx context.Context, digest string, mem int64, window time.Duration) (Node, error) {
	return ns.PlaceExcept(ctx, digest, mem, window, nil)
}

// PlaceExcept is Place among the nodes not in exclude (a replica retrying
// a create whose first node did not answer). The chosen node's row is
// charged with the sandbox (free memory down by mem, sandboxes up by one)
// until its next heartbeat says what it really has, and one warm member
// of the template is taken off it, so a burst of creates spreads instead
// of piling onto the node that looked emptiest or warmest.
func (ns *NodeStore) PlaceExcept(ctx context.Context, digest string, mem int64, window time.Duration, exclude []string) (Node, error) {
	if exclude == nil {
		exclude = []string{}
	}
	rows, err := ns.pool.Query(ctx, `UPDATE nodes SET mem_free = greatest(mem_free - $2, 0), sandboxes = sandboxes + 1,
			warm = CASE WHEN array_position(warm, $1) IS NULL THEN warm
				ELSE warm[:array_position(warm, $1) - 1] || warm[array_position(warm, $1) + 1:] END
		WHERE id = (SELECT id FROM nodes
			WHERE state = 'ready' AND heartbeat_at >= now() - make_interval(secs => $3) AND mem_free >= $2
				AND NOT (id = ANY($4))
			ORDER BY ($1 = ANY(warm)) DESC, ($1 = ANY(templates)) DESC, sandboxes::float8 / greatest(cpus, 1) ASC,
				mem_free DESC, id
			LIMIT 1 FOR UPDATE)
		RETURNING `+nodeColumns, digest, mem, window.Seconds(), exclude)
	if err != nil {
		return Node{}, fmt.Errorf("place sandbox: %w", err)
	}
	n, err := pgx.CollectExactlyOneRow(rows, scanNode)
	if errors.Is(err, pgx.ErrNoRows) {
		return Node{}, fmt.Errorf("no ready node has %d bytes free: %w", mem, errdefs.ErrUnavailable)
	}
	if err != nil {
		return Node{}, fmt.Errorf("place sandbox: %w", err)
	}
	return n, nil
}

package sandbox

import (
	"context"
	"time"

	"github.com/spacehq/space/api"
)

// updateRecord is the one read-modify-write of a sandbox's stored record
// outside a lifecycle operation (a policy, a port, a deadline). Under the
// sandbox's lock (entry.mu, which every lifecycle action holds, so a start
// in flight sees the record either before the change or after it, never
// loses it) it reads the record, refuses a sandbox being deleted — verb
// says what cannot be done, as wrongState words it ("change the ports
// of") — and calls change on it. When change reports a change, the record
// is stamped (UpdatedAt now, LastActiveAt from memory) and written back;
// then, if not nil, runs with the record as written, still under the
// lock, for what must not interleave with a lifecycle action (SetNetwork
// applies the stored policy to the live link there).
//
// It returns the record as stored, with then's error if any; on any other
// error the record is the zero value. The caller validates id first.
func (m *Manager) updateRecord(ctx context.Context, id, verb string, change func(*api.Sandbox) (changed bool, err error), then func(*entry, api.Sandbox) error) (api.Sandbox, error) {
	e := m.entry(id)
	e.mu.Lock()
	defer e.mu.Unlock()
	sb, err := m.cfg.DB.GetSandbox(ctx, id)
	if err != nil {
		return api.Sandbox{}, err
	}
	if sb.State == api.StateDeleting {
		return api.Sandbox{}, wrongState(id, sb.State, verb)
	}
	changed, err := change(&sb)
	if err != nil {
		return api.Sandbox{}, err
	}
	if changed {
		sb.UpdatedAt = time.Now().UTC()
		m.withActivity(&sb)
		if err := m.cfg.DB.PutSandbox(ctx, sb); err != nil {
			return api.Sandbox{}, err
		}
	}
	if then == nil {
		return sb, nil
	}
	return sb, then(e, sb)
}

package sandbox

import (
	"context"

	"github.com/spacehq/space/internal/runtime"
)

// stopInstance stops inst on a path that is already handling another
// outcome (a failed boot, an init that died, a lost image), detaching its
// network link first. A failure to stop cannot change that outcome, but it
// may leave host resources behind until the next sweep, so it is logged
// rather than dropped.
func (part *Verbs) stopInstance(ctx context.Context, inst runtime.Instance, during string) {
	m := part.m
	m.net.detachNetwork(inst.ID(), during)
	if err := inst.Stop(ctx); err != nil {
		m.log.Warn("stopping sandbox instance failed; reconcile will retry", "sandbox", inst.ID(), "during", during, "err", err)
	}
}

// destroyInstance is stopInstance for Destroy: used where a create, fork or
// re-driven operation throws an instance away.
func (part *Verbs) destroyInstance(ctx context.Context, inst runtime.Instance, during string) {
	m := part.m
	m.net.detachNetwork(inst.ID(), during)
	if err := inst.Destroy(ctx); err != nil {
		m.log.Warn("destroying sandbox instance failed; reconcile will retry", "sandbox", inst.ID(), "during", during, "err", err)
	}
}

package microvm

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime/microvm/vmctl"
)

// seedBytes is the entropy handed to a restored guest's kernel.
const seedBytes = 64

// guestCtl owns the host's end of the guest init's control port (package
// vmctl, vm/ctl.sock): the pings of the boot and of the watchdog, the disk
// syncs before a stop or a suspend, the guest's stats and its last
// answer, and the notice a restored guest gets. Its client is the
// process-wide one of the socket (conns.go); a call whose transport fails
// drops it, so the next call dials again.
type guestCtl struct {
	id      string      // the sandbox's id, for errors
	sock    string      // vm/ctl.sock
	running func() bool // QEMU runs: there is a guest to talk to

	mu        sync.Mutex
	lastStats vmctl.Stats // the guest's last answer to stats
}

// client is the guest init's vmctl client (dialled when there is none).
func (g *guestCtl) client(ctx context.Context) (*vmctl.Client, error) {
	if !g.running() {
		return nil, fmt.Errorf("sandbox %s is not running: %w", g.id, errdefs.ErrUnavailable)
	}
	c, err := sharedCtl(ctx, g.sock)
	if err != nil {
		return nil, fmt.Errorf("sandbox %s: control port: %w: %w", g.id, err, errdefs.ErrUnavailable)
	}
	return c, nil
}

// ping asks the guest's init for a sign of life.
func (g *guestCtl) ping(ctx context.Context) error {
	c, err := g.client(ctx)
	if err != nil {
		return err
	}
	if err := c.Ping(ctx); err != nil {
		dropCtl(g.sock, c)
		return err
	}
	return nil
}

// sync makes the guest's init write the guest's page cache to its disk
// (vmctl sync).
func (g *guestCtl) sync(ctx context.Context) error {
	c, err := g.client(ctx)
	if err != nil {
		return err
	}
	if err := c.Sync(ctx); err != nil {
		if errors.Is(err, errdefs.ErrUnavailable) {
			dropCtl(g.sock, c)
		}
		return err
	}
	return nil
}

// stats asks the guest's init for the sandbox's counters (clamped by
// vmctl) and keeps the answer for last.
func (g *guestCtl) stats(ctx context.Context) (vmctl.Stats, error) {
	c, err := g.client(ctx)
	if err != nil {
		return vmctl.Stats{}, err
	}
	gs, err := c.Stats(ctx)
	if err != nil {
		if errors.Is(err, errdefs.ErrUnavailable) {
			dropCtl(g.sock, c)
		}
		return vmctl.Stats{}, fmt.Errorf("sandbox %s: %w", g.id, err)
	}
	g.mu.Lock()
	g.lastStats = gs
	g.mu.Unlock()
	return gs, nil
}

// last is the guest's last answer to stats (zero since forget).
func (g *guestCtl) last() vmctl.Stats {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.lastStats
}

// forget drops the last answer to stats: a new QEMU runs.
func (g *guestCtl) forget() {
	g.mu.Lock()
	g.lastStats = vmctl.Stats{}
	g.mu.Unlock()
}

// restored tells the restored guest's init: fresh entropy, the current
// time, its hostname.
func (g *guestCtl) restored(ctx context.Context, hostname string) error {
	seed := make([]byte, seedBytes)
	if _, err := rand.Read(seed); err != nil {
		return err
	}
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	c, err := g.client(cctx)
	if err != nil {
		return err
	}
	if err := c.Restored(cctx, seed, time.Now(), hostname); err != nil {
		dropCtl(g.sock, c)
		return fmt.Errorf("the restored guest's init: %w", err)
	}
	return nil
}

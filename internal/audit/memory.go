package audit

import (
	"context"
	"sync"

	"github.com/spacehq/space/internal/principal"
)

// Memory is a Sink that keeps events in memory, filling KeyID and Tenant
// from the context as the Log does (tests of producers).
type Memory struct {
	mu     sync.Mutex
	events []Event
}

var _ Sink = (*Memory)(nil)

// Record keeps e.
func (m *Memory) Record(ctx context.Context, e Event) {
	if p, ok := principal.From(ctx); ok {
		if e.KeyID == "" {
			e.KeyID = p.KeyID
		}
		if e.Tenant == "" {
			e.Tenant = p.Tenant
		}
	}
	if e.Tenant == "" {
		e.Tenant = principal.DefaultTenant
	}
	m.mu.Lock()
	m.events = append(m.events, e)
	m.mu.Unlock()
}

// Events returns a copy of what was recorded.
func (m *Memory) Events() []Event {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]Event(nil), m.events...)
}

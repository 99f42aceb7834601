package sandbox

import (
	"context"
	"slices"
	"sync"

	"github.com/spacehq/space/internal/brokerconf"
)

// FakeBroker is a Broker for tests: it records every config it is sent.
// Safe for concurrent use.
type FakeBroker struct {
	mu    sync.Mutex
	calls []BrokerCall
	fail  error
}

// BrokerCall is one recorded SetBroker.
type BrokerCall struct {
	ID     string
	Config brokerconf.Config
}

var _ Broker = (*FakeBroker)(nil)

// SetBroker records b for id (or fails with the error FailWith set).
func (f *FakeBroker) SetBroker(_ context.Context, id string, b brokerconf.Config) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fail != nil {
		return f.fail
	}
	b.Secrets = slices.Clone(b.Secrets)
	f.calls = append(f.calls, BrokerCall{ID: id, Config: b})
	return nil
}

// FailWith makes every later SetBroker fail with err (nil: succeed again).
func (f *FakeBroker) FailWith(err error) {
	f.mu.Lock()
	f.fail = err
	f.mu.Unlock()
}

// Calls returns the recorded calls for id ("" = all), oldest first.
func (f *FakeBroker) Calls(id string) []BrokerCall {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []BrokerCall
	for _, c := range f.calls {
		if id == "" || c.ID == id {
			out = append(out, c)
		}
	}
	return out
}

// Last returns the last config sent for id and whether there was one.
func (f *FakeBroker) Last(id string) (brokerconf.Config, bool) {
	cs := f.Calls(id)
	if len(cs) == 0 {
		return brokerconf.Config{}, false
	}
	return cs[len(cs)-1].Config, true
}

package shim

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"time"

	eventsapi "github.com/containerd/containerd/api/services/events/v1"
	ttrpcevents "github.com/containerd/containerd/api/services/ttrpc/events/v1"
	"github.com/containerd/containerd/api/types"
	"github.com/containerd/ttrpc"
	"github.com/containerd/typeurl/v2"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// Topics of the task events containerd (and CRI) need.
const (
	TopicCreate      = "/tasks/create"
	TopicStart       = "/tasks/start"
	TopicExit        = "/tasks/exit"
	TopicDelete      = "/tasks/delete"
	TopicExecAdded   = "/tasks/exec-added"
	TopicExecStarted = "/tasks/exec-started"
	TopicPaused      = "/tasks/paused"
	TopicResumed     = "/tasks/resumed"
	TopicOOM         = "/tasks/oom"
)

// Publisher sends task events to containerd.
type Publisher interface {
	// Publish queues event under topic; events go out in order.
	Publish(topic string, event any)
	// Close sends what is queued (bounded in time) and stops.
	Close()
}

var (
	_ Publisher = (*TTRPCPublisher)(nil)
	_ Publisher = (*FakePublisher)(nil)
)

// TTRPCPublisher forwards events to containerd's ttrpc events service
// ($TTRPC_ADDRESS, Events/Forward) in order, redialling after containerd
// restarts (the old connection reports "ttrpc: closed").
type TTRPCPublisher struct {
	addr, ns string
	q        chan envelopeItem
	done     chan struct{}
	client   *ttrpc.Client
	closeMu  sync.Once
	log      *slog.Logger
	v1Events bool
}

type envelopeItem struct {
	topic string
	event any
	at    time.Time
}

// NewTTRPCPublisher starts a publisher for namespace ns to the ttrpc
// socket addr (a path, or unix://path).
func NewTTRPCPublisher(addr, ns string, log *slog.Logger) *TTRPCPublisher {
	p := &TTRPCPublisher{addr: strings.TrimPrefix(addr, "unix://"), ns: ns, q: make(chan envelopeItem, 1024), done: make(chan struct{}), log: log}
	go p.run()
	return p
}

// Publish implements Publisher.
func (p *TTRPCPublisher) Publish(topic string, event any) {
	select {
	case p.q <- envelopeItem{topic, event, time.Now()}:
	default: // containerd has been away for 1024 events: drop
	}
}

// Close implements Publisher.
func (p *TTRPCPublisher) Close() {
	p.closeMu.Do(func() { close(p.q) })
	select {
	case <-p.done:
	case <-time.After(5 * time.Second):
	}
}

func (p *TTRPCPublisher) run() {
	defer close(p.done)
	for it := range p.q {
		env, err := Envelope(p.ns, it.topic, it.event, it.at)
		if err != nil {
			continue // a type without a registered URL: a bug, nothing to send
		}
		// containerd may be restarting: keep trying for a while.
		deadline := time.Now().Add(30 * time.Second)
		for {
			err := p.forward(env)
			if err == nil || time.Now().After(deadline) {
				break
			}
			if p.log != nil {
				p.log.Debug("forwarding an event", "topic", it.topic, "err", err)
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
	if p.client != nil {
		p.client.Close()
	}
}

func (p *TTRPCPublisher) forward(env *types.Envelope) error {
	if p.client == nil {
		conn, err := net.DialTimeout("unix", p.addr, 2*time.Second)
		if err != nil {
			return err
		}
		p.client = ttrpc.NewClient(conn)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	// containerd 1.6 serves containerd.services.events.ttrpc.v1.Events to
	// shims; later ones may serve only containerd.services.events.v1.Events
	// over ttrpc: the first that is not Unimplemented is kept.
	var err error
	if !p.v1Events {
		_, err = ttrpcevents.NewEventsClient(p.client).Forward(ctx, &ttrpcevents.ForwardRequest{Envelope: env})
		if status.Code(err) == codes.Unimplemented {
			p.v1Events = true
		}
	}
	if p.v1Events {
		_, err = eventsapi.NewTTRPCEventsClient(p.client).Forward(ctx, &eventsapi.ForwardRequest{Envelope: env})
		if status.Code(err) == codes.Unimplemented {
			p.v1Events = false
		}
	}
	if err != nil {
		p.client.Close()
		p.client = nil
	}
	return err
}

// Envelope wraps an event for containerd: its Any carries the bare type
// URL (containerd.events.TaskExit), which is what containerd's typeurl
// registry resolves.
func Envelope(ns, topic string, event any, at time.Time) (*types.Envelope, error) {
	a, err := typeurl.MarshalAnyToProto(event)
	if err != nil {
		return nil, fmt.Errorf("event %s: %w", topic, err)
	}
	return &types.Envelope{Timestamp: timestamppb.New(at), Namespace: ns, Topic: topic, Event: a}, nil
}

// FakePublisher records events for tests.
type FakePublisher struct {
	mu     sync.Mutex
	Events []FakeEvent
}

// FakeEvent is one recorded event.
type FakeEvent struct {
	Topic string
	Event any
}

// Publish implements Publisher.
func (f *FakePublisher) Publish(topic string, event any) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.Events = append(f.Events, FakeEvent{topic, event})
}

// Close implements Publisher.
func (f *FakePublisher) Close() {}

// Topics lists the recorded topics in order.
func (f *FakePublisher) Topics() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for _, e := range f.Events {
		out = append(out, e.Topic)
	}
	return out
}

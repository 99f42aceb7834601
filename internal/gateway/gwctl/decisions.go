package gwctl

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"time"

	"github.com/spacehq/space/internal/actions"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/gateway"
)

// The decisions stream: the policy engine lives in the server, the gateway
// process only asks. The server opens the stream (op "decisions": the
// gateway has no way to reach the server, and needs none), keeps it open
// and re-opens it after a gateway restart. On it the gateway sends one
// decisionRequest line per question and the server answers each with a
// decisionReply line of the same id, in any order: a question waiting for
// an approval holds up no other. A request whose link goes away is
// withdrawn with a cancel line.
//
// Fail closed: a question asked while no stream is open waits up to
// StreamDecider.Wait for one (a server restarting), then is denied; a
// question whose stream ends before its answer is denied.

// DefaultStreamWait is how long a decision waits for the server's stream
// when there is none.
const DefaultStreamWait = 3 * time.Second

// maxDecisionLine bounds one line of the stream either way (an action the
// gateway asks about is a few hundred bytes).
const maxDecisionLine = 64 << 10

// maxInFlight bounds the questions the server answers at once on one
// stream (each may wait for an approval); beyond it they are denied.
const maxInFlight = 4096

type decisionRequest struct {
	ID     uint64            `json:"id"`
	Action *actions.Action   `json:"action,omitempty"`
	Conn   *gateway.ConnInfo `json:"conn,omitempty"`
	Cancel bool              `json:"cancel,omitempty"` // the gateway no longer waits for id
}

type decisionReply struct {
	ID       uint64           `json:"id"`
	Decision actions.Decision `json:"decision"`
	Exe      string           `json:"exe,omitempty"`
}

// StreamDecider is the gateway process's Decider: it asks the server over
// the decisions stream. Safe for concurrent use.
type StreamDecider struct {
	// Wait bounds how long a decision waits for a stream when there is
	// none; 0 is DefaultStreamWait.
	Wait time.Duration

	mu      sync.Mutex
	cur     *decisionStream
	arrived chan struct{} // closed (and replaced) when a stream opens
	next    uint64
}

var _ gateway.ConnDecider = (*StreamDecider)(nil)

type decisionStream struct {
	c       net.Conn
	wmu     sync.Mutex
	mu      sync.Mutex
	pending map[uint64]chan decisionReply
	done    chan struct{}
}

func deny(why string) actions.Decision { return actions.Decision{Verdict: actions.Deny, Reason: why} }

// Decide implements actions.Decider.
func (d *StreamDecider) Decide(ctx context.Context, a actions.Action) actions.Decision {
	dec, _ := d.ask(ctx, a, nil)
	return dec
}

// DecideConn implements gateway.ConnDecider: the server also learns the
// connection's addresses (and names its executable when it can see it).
func (d *StreamDecider) DecideConn(ctx context.Context, a actions.Action, c gateway.ConnInfo) (actions.Decision, string) {
	return d.ask(ctx, a, &c)
}

// stream returns the open stream, waiting up to Wait for one.
func (d *StreamDecider) stream(ctx context.Context) *decisionStream {
	wait := d.Wait
	if wait <= 0 {
		wait = DefaultStreamWait
	}
	t := time.NewTimer(wait)
	defer t.Stop()
	for {
		d.mu.Lock()
		s := d.cur
		if d.arrived == nil {
			d.arrived = make(chan struct{})
		}
		arrived := d.arrived
		d.mu.Unlock()
		if s != nil {
			return s
		}
		select {
		case <-arrived:
		case <-t.C:
			return nil
		case <-ctx.Done():
			return nil
		}
	}
}

func (d *StreamDecider) ask(ctx context.Context, a actions.Action, c *gateway.ConnInfo) (actions.Decision, string) {
	s := d.stream(ctx)
	if s == nil {
		if ctx.Err() != nil {
			return deny("no policy decision in time"), ""
		}
		return deny("no policy decision: the server is not connected (fail closed)"), ""
	}
	d.mu.Lock()
	d.next++
	id := d.next
	d.mu.Unlock()
	ch := make(chan decisionReply, 1)
	s.mu.Lock()
	s.pending[id] = ch
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.pending, id)
		s.mu.Unlock()
	}()
	if err := s.send(decisionRequest{ID: id, Action: &a, Conn: c}); err != nil {
		return deny("no policy decision: the decisions stream failed (fail closed)"), ""
	}
	select {
	case r := <-ch:
		return r.Decision, r.Exe
	case <-s.done:
		return deny("no policy decision: the decisions stream ended before the answer (fail closed)"), ""
	case <-ctx.Done():
		_ = s.send(decisionRequest{ID: id, Cancel: true})
		return deny("no policy decision in time"), ""
	}
}

func (s *decisionStream) send(r decisionRequest) error {
	s.wmu.Lock()
	defer s.wmu.Unlock()
	_ = s.c.SetWriteDeadline(time.Now().Add(10 * time.Second))
	_, err := s.c.Write(marshalLine(r))
	return err
}

// serve makes c the stream (replacing, and so ending, any other) and reads
// the server's answers until c or ctx ends.
func (d *StreamDecider) serve(ctx context.Context, c net.Conn) {
	s := &decisionStream{c: c, pending: map[uint64]chan decisionReply{}, done: make(chan struct{})}
	d.mu.Lock()
	old := d.cur
	d.cur = s
	if d.arrived != nil {
		close(d.arrived)
	}
	d.arrived = make(chan struct{})
	d.mu.Unlock()
	if old != nil {
		old.c.Close()
	}
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	defer func() {
		d.mu.Lock()
		if d.cur == s {
			d.cur = nil
		}
		d.mu.Unlock()
		close(s.done)
		c.Close()
	}()
	sc := bufio.NewScanner(c)
	sc.Buffer(make([]byte, 4096), maxDecisionLine)
	for sc.Scan() {
		var r decisionReply
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			return
		}
		s.mu.Lock()
		ch := s.pending[r.ID]
		s.mu.Unlock()
		if ch != nil {
			select {
			case ch <- r:
			default: // a second answer to one question: the first stands
			}
		}
	}
}

// DecideFunc answers one question of the gateway: the action, and the
// connection it is about (nil for DNS). It returns the decision and the
// executable behind the connection if the server could see it. It may
// block (an approval); ctx ends when the gateway withdraws the question or
// the stream ends.
type DecideFunc func(ctx context.Context, a actions.Action, c *gateway.ConnInfo) (actions.Decision, string)

// ServeDecisions opens the gateway's decisions stream and answers every
// question on it with decide, each in its own goroutine, until the stream
// or ctx ends. opened, if not nil, is called once the gateway accepted it.
func (c *Client) ServeDecisions(ctx context.Context, decide DecideFunc, opened func()) error {
	var dl net.Dialer
	conn, err := dl.DialContext(ctx, "unix", c.Path)
	if err != nil {
		return fmt.Errorf("%w: %w: %v", errdefs.ErrUnavailable, errNoGateway, err)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	defer conn.Close()
	if _, err := conn.Write(marshalLine(request{Op: opDecisions})); err != nil {
		return fmt.Errorf("%w: gateway: %v", errdefs.ErrUnavailable, err)
	}
	sc := bufio.NewScanner(conn)
	sc.Buffer(make([]byte, 4096), maxDecisionLine)
	if !sc.Scan() {
		return fmt.Errorf("%w: gateway: no reply to the decisions stream: %v", errdefs.ErrUnavailable, sc.Err())
	}
	var resp response
	if err := json.Unmarshal(sc.Bytes(), &resp); err != nil || !resp.Done {
		return fmt.Errorf("%w: gateway: a bad reply to the decisions stream", errdefs.ErrUnavailable)
	}
	if err := asError(resp.Error); err != nil {
		return err
	}
	if opened != nil {
		opened()
	}
	var wmu sync.Mutex
	write := func(r decisionReply) {
		wmu.Lock()
		defer wmu.Unlock()
		_ = conn.SetWriteDeadline(time.Now().Add(10 * time.Second))
		if _, err := conn.Write(marshalLine(r)); err != nil {
			conn.Close() // the gateway denies what it still waits for
		}
	}
	var mu sync.Mutex
	inFlight := map[uint64]context.CancelFunc{}
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	for sc.Scan() {
		var q decisionRequest
		if err := json.Unmarshal(sc.Bytes(), &q); err != nil {
			return fmt.Errorf("gateway sent a bad decision request: %w", err)
		}
		mu.Lock()
		if q.Cancel {
			if f := inFlight[q.ID]; f != nil {
				f()
			}
			mu.Unlock()
			continue
		}
		_, dup := inFlight[q.ID]
		if q.Action == nil || dup || len(inFlight) >= maxInFlight {
			mu.Unlock()
			write(decisionReply{ID: q.ID, Decision: deny("the server refused the question (malformed, repeated, or too many at once)")})
			continue
		}
		qctx, qcancel := context.WithCancel(ctx)
		inFlight[q.ID] = qcancel
		mu.Unlock()
		wg.Add(1)
		go func() {
			defer wg.Done()
			dec, exe := decide(qctx, *q.Action, q.Conn)
			mu.Lock()
			delete(inFlight, q.ID)
			mu.Unlock()
			if qctx.Err() != nil {
				return // withdrawn, or the stream ends: nobody waits for it
			}
			qcancel()
			write(decisionReply{ID: q.ID, Decision: dec, Exe: exe})
		}()
	}
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if err := sc.Err(); err != nil {
		return fmt.Errorf("%w: decisions stream: %v", errdefs.ErrUnavailable, err)
	}
	return fmt.Errorf("%w: the gateway ended the decisions stream", errdefs.ErrUnavailable)
}

// RunDecisions keeps the decisions stream open until ctx ends: it opens it,
// answers on it, and re-opens it whenever it ends (a restarted gateway),
// retrying every 20 ms at first and at most every 500 ms.
func (c *Client) RunDecisions(ctx context.Context, decide DecideFunc, log *slog.Logger) {
	backoff := 20 * time.Millisecond
	for ctx.Err() == nil {
		err := c.ServeDecisions(ctx, decide, func() {
			backoff = 20 * time.Millisecond
			log.Debug("decisions stream open")
		})
		if ctx.Err() != nil {
			return
		}
		if !errors.Is(err, errNoGateway) {
			log.Debug("decisions stream ended", "err", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 500*time.Millisecond)
	}
}

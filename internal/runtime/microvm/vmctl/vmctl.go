// Package vmctl is the control channel between the microvm runtime on the
// host and the init (PID 1) of its guest: a second virtio-serial port,
// separate from the agent's, served by the guest's init outside the
// sandbox's user namespace.
//
// Why a second channel: inside the guest the agent runs confined (a user
// namespace, seccomp), so it can neither credit entropy to the guest
// kernel, nor set the guest's clock, nor be trusted to report the sandbox's
// resource use. The guest's init can, and the sandbox's code cannot reach
// its port (the device node belongs to guest root of the initial user
// namespace).
//
// Wire format: one JSON Request per line from the host, one JSON Response
// per line back, strictly in turn. Lines are bounded (MaxLine) both ways;
// the host treats every byte from the guest as untrusted.
package vmctl

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"syscall"
	"time"

	"github.com/spacehq/space/internal/errdefs"
)

// PortName is the name of the guest's control port (-device
// virtserialport,name=…).
const PortName = "ctl"

// MaxLine bounds one request or response line, newline included.
const MaxLine = 64 << 10

// Operations.
const (
	// OpPing answers an empty Response: the host's liveness check of a
	// running guest (a hung guest does not answer).
	OpPing = "ping"
	// OpStats answers Stats of the sandbox's cgroup in the guest.
	OpStats = "stats"
	// OpRestored runs after every restore of a snapshot (suspend/restore,
	// fork, warm template): credit Seed to the guest kernel's entropy pool
	// and reseed its CRNG, set the clock to TimeUnixNano, and set the
	// hostname when Hostname is not empty.
	OpRestored = "restored"
	// OpSync writes the guest's dirty page cache to its disks (sync(2))
	// and answers when done: the host asks before it stops a guest, so a
	// stop keeps what the sandbox wrote. Serve does it itself.
	OpSync = "sync"
)

// Request is one host → guest message.
type Request struct {
	// ID is echoed in the Response: a reply to a call whose caller gave
	// up (or that was in flight when a snapshot was taken, so that a
	// restored copy sends it to a new host) is never taken for another.
	ID           uint64 `json:"id,omitempty"`
	Op           string `json:"op"`
	Seed         []byte `json:"seed,omitempty"`
	TimeUnixNano int64  `json:"time_unix_nano,omitempty"`
	Hostname     string `json:"hostname,omitempty"`
}

// Stats are the guest kernel's counters for the sandbox's cgroup and disk.
type Stats struct {
	MemoryBytes int64 `json:"memory_bytes"` // memory.current
	OOMKills    int64 `json:"oom_kills"`    // memory.events oom_kill
	Pids        int64 `json:"pids"`         // pids.current
	// MemoryCacheBytes is memory.stat's file (page cache).
	MemoryCacheBytes int64 `json:"memory_cache_bytes,omitempty"`
	// DiskUsedBytes is what the sandbox's ext4 disk holds (statfs).
	DiskUsedBytes int64 `json:"disk_used_bytes,omitempty"`
}

// Response is one guest → host message.
type Response struct {
	ID    uint64 `json:"id,omitempty"`
	Error string `json:"error,omitempty"`
	Stats *Stats `json:"stats,omitempty"`
}

// Handler does the guest side's work.
type Handler interface {
	Stats() (Stats, error)
	Restored(seed []byte, timeUnixNano int64, hostname string) error
}

// Serve answers requests read from rw until it reads EOF or fails. A line
// longer than MaxLine ends the session with an error.
func Serve(rw io.ReadWriter, h Handler) error {
	sc := bufio.NewScanner(rw)
	sc.Buffer(make([]byte, 4096), MaxLine)
	for sc.Scan() {
		var req Request
		var resp Response
		if err := json.Unmarshal(sc.Bytes(), &req); err != nil {
			resp.Error = "decoding request: " + err.Error()
		} else {
			resp.ID = req.ID
			switch req.Op {
			case OpPing:
			case OpStats:
				s, err := h.Stats()
				if err != nil {
					resp.Error = err.Error()
				} else {
					resp.Stats = &s
				}
			case OpSync:
				syscall.Sync()
			case OpRestored:
				if err := h.Restored(req.Seed, req.TimeUnixNano, req.Hostname); err != nil {
					resp.Error = err.Error()
				}
			default:
				resp.Error = fmt.Sprintf("unknown op %q", req.Op)
			}
		}
		b, _ := json.Marshal(resp)
		if _, err := rw.Write(append(b, '\n')); err != nil {
			return err
		}
	}
	return sc.Err()
}

// Client is the host side of one control connection. Calls are serialized;
// a call whose context ends closes the connection (the guest's answer
// could otherwise be taken for the next call's), after which every call
// fails with errdefs.ErrUnavailable.
type Client struct {
	mu     sync.Mutex
	conn   net.Conn
	r      *bufio.Reader
	err    error
	nextID uint64
}

// NewClient wraps a connection to the guest's control port.
func NewClient(conn net.Conn) *Client {
	return &Client{conn: conn, r: bufio.NewReaderSize(conn, 4096)}
}

// Close closes the connection.
func (c *Client) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err == nil {
		c.err = errors.New("control connection closed")
	}
	return c.conn.Close()
}

// Ping checks that the guest's init answers.
func (c *Client) Ping(ctx context.Context) error {
	_, err := c.call(ctx, Request{Op: OpPing})
	return err
}

// Stats returns the sandbox's counters as the guest kernel reports them.
// Values are clamped to be non-negative; they come from the guest.
func (c *Client) Stats(ctx context.Context) (Stats, error) {
	resp, err := c.call(ctx, Request{Op: OpStats})
	if err != nil {
		return Stats{}, err
	}
	if resp.Stats == nil {
		return Stats{}, fmt.Errorf("guest answered stats without stats: %w", errdefs.ErrUnavailable)
	}
	s := *resp.Stats
	s.MemoryBytes, s.OOMKills, s.Pids = max(s.MemoryBytes, 0), max(s.OOMKills, 0), max(s.Pids, 0)
	s.MemoryCacheBytes = min(max(s.MemoryCacheBytes, 0), s.MemoryBytes)
	s.DiskUsedBytes = max(s.DiskUsedBytes, 0)
	return s, nil
}

// Sync asks the guest to write its dirty page cache to its disks.
func (c *Client) Sync(ctx context.Context) error {
	_, err := c.call(ctx, Request{Op: OpSync})
	return err
}

// Restored tells the guest's init it was restored from a snapshot.
func (c *Client) Restored(ctx context.Context, seed []byte, now time.Time, hostname string) error {
	_, err := c.call(ctx, Request{Op: OpRestored, Seed: seed, TimeUnixNano: now.UnixNano(), Hostname: hostname})
	return err
}

func (c *Client) call(ctx context.Context, req Request) (Response, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err != nil {
		return Response{}, fmt.Errorf("vm control: %w: %w", c.err, errdefs.ErrUnavailable)
	}
	c.nextID++
	req.ID = c.nextID
	b, err := json.Marshal(req)
	if err != nil {
		return Response{}, err
	}
	stop := context.AfterFunc(ctx, func() { _ = c.conn.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	resp, err := c.exchange(append(b, '\n'), req.ID)
	if err != nil {
		if ctx.Err() != nil {
			err = ctx.Err()
		}
		c.err = err
		_ = c.conn.Close()
		return Response{}, fmt.Errorf("vm control %s: %w: %w", req.Op, err, errdefs.ErrUnavailable)
	}
	if resp.Error != "" {
		return resp, fmt.Errorf("guest init: %s: %s", req.Op, truncate(resp.Error, 512))
	}
	return resp, nil
}

// exchange sends line and reads replies until the one for id, skipping
// stale ones (at most maxStale: a guest cannot keep the host reading).
func (c *Client) exchange(line []byte, id uint64) (Response, error) {
	if _, err := c.conn.Write(line); err != nil {
		return Response{}, err
	}
	for range maxStale {
		resp, err := c.readResponse()
		if err != nil || resp.ID == id {
			return resp, err
		}
	}
	return Response{}, fmt.Errorf("guest sent %d replies to other calls", maxStale)
}

// maxStale bounds the replies to earlier calls skipped by one call.
const maxStale = 16

func (c *Client) readResponse() (Response, error) {
	var buf []byte
	for {
		part, isPrefix, err := c.r.ReadLine()
		if err != nil {
			return Response{}, err
		}
		if len(buf)+len(part) > MaxLine {
			return Response{}, fmt.Errorf("guest sent a line over %d bytes", MaxLine)
		}
		buf = append(buf, part...)
		if !isPrefix {
			break
		}
	}
	var resp Response
	if err := json.Unmarshal(buf, &resp); err != nil {
		return Response{}, fmt.Errorf("decoding guest response: %w", err)
	}
	return resp, nil
}

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n] + "…"
	}
	return s
}

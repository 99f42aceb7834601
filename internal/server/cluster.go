package server

import (
	"context"
	"errors"
	"fmt"
	goruntime "runtime"
	"slices"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/cluster"
	"github.com/spacehq/space/internal/clusterstore"
	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/sandbox"
)

// ClusterNodeOptions make the server a node of a cluster whose shared state
// is in PostgreSQL: it registers and heart-beats there, reports its
// sandboxes, and applies the desired state replicas write. Empty Store:
// the single box, nothing else to run.
type ClusterNodeOptions struct {
	Store     string        // PostgreSQL DSN (postgres://… or key=value)
	NodeID    string        // this node's name in the cluster
	Advertise string        // the address replicas reach this node's API at
	Heartbeat time.Duration // between heartbeats (default 2 s)
}

func (o ClusterNodeOptions) check() error {
	if o.Store == "" {
		return nil
	}
	if o.NodeID == "" || o.Advertise == "" {
		return fmt.Errorf("a cluster node needs its node id and the address replicas reach it at: %w", errdefs.ErrInvalidArgument)
	}
	if o.Heartbeat < 0 {
		return fmt.Errorf("heartbeat interval %v is negative: %w", o.Heartbeat, errdefs.ErrInvalidArgument)
	}
	return nil
}

// startClusterNode joins the cluster: one synchronous heartbeat (so a bad
// DSN or an unreachable database fails the start), then the heartbeat and
// reconcile loops until ctx ends. The returned function waits for them.
func (s *Server) startClusterNode(ctx context.Context, o ClusterNodeOptions) (wait func(), err error) {
	if err := o.check(); err != nil {
		return nil, err
	}
	if o.Heartbeat == 0 {
		o.Heartbeat = 2 * time.Second
	}
	cs, err := clusterstore.Open(ctx, o.Store)
	if err != nil {
		return nil, fmt.Errorf("joining the cluster: %w", err)
	}
	local := &clusterLocal{mgr: s.mgr}
	status := func(ctx context.Context) (clusterstore.NodeStatus, error) {
		mem, err := sandbox.HostMemAvailable()
		if err != nil {
			return clusterstore.NodeStatus{}, err
		}
		sbs, err := local.List(ctx)
		if err != nil {
			return clusterstore.NodeStatus{}, err
		}
		st := clusterstore.NodeStatus{ID: o.NodeID, Address: o.Advertise, MemFree: mem, CPUs: goruntime.NumCPU(), Sandboxes: len(sbs)}
		tmpls, err := s.tmpl.List(ctx)
		if err != nil {
			return clusterstore.NodeStatus{}, err
		}
		for _, t := range tmpls {
			for _, name := range append([]string{t.Digest}, t.Tags...) {
				if name != "" && !slices.Contains(st.Templates, name) {
					st.Templates = append(st.Templates, name)
				}
			}
		}
		return st, nil
	}
	beat, err := cluster.Beat(ctx, cs, o.Heartbeat, status, s.cfg.Logger)
	if err != nil {
		cs.Close()
		return nil, fmt.Errorf("joining the cluster: %w", err)
	}
	node := &cluster.Node{ID: o.NodeID, Store: cs, Local: local, Log: s.cfg.Logger}
	done := make(chan struct{})
	go func() {
		defer close(done)
		node.Run(ctx)
	}()
	s.cfg.Logger.Info("joined the cluster", "node", o.NodeID, "advertise", o.Advertise, "heartbeat", o.Heartbeat)
	return func() {
		<-beat
		<-done
		cs.Close()
	}, nil
}

// clusterLocal is the node's sandbox manager as the reconciler sees it:
// the server's own work (build steps) is not the cluster's business, and
// the manager already hides warm-pool members.
type clusterLocal struct{ mgr *sandbox.Manager }

var _ cluster.Local = (*clusterLocal)(nil)

func (l *clusterLocal) List(ctx context.Context) ([]api.Sandbox, error) {
	all, err := l.mgr.List(ctx, "", nil)
	if err != nil {
		return nil, err
	}
	out := all[:0]
	for _, sb := range all {
		if sb.Labels[sandbox.BuildLabel] == "" {
			out = append(out, sb)
		}
	}
	return out, nil
}

func (l *clusterLocal) Apply(ctx context.Context, id, verb string) error {
	op, err := l.mgr.Lifecycle(ctx, id, verb, verb == api.OpDelete)
	if err != nil {
		return err
	}
	op, err = l.mgr.Wait(ctx, op.ID)
	if err != nil {
		return err
	}
	if op.State == api.OpFailed {
		if op.Error != nil {
			return errors.New(op.Error.Message)
		}
		return fmt.Errorf("%s failed", verb)
	}
	return nil
}

package server

import (
	"context"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/spacehq/space/internal/sandbox"
	"github.com/spacehq/space/internal/store"
)

// metrics implements sandbox.Observer with Prometheus collectors.
type metrics struct {
	reg      *prometheus.Registry
	opPhase  *prometheus.HistogramVec
	opDone   *prometheus.HistogramVec
	execs    *prometheus.CounterVec
	httpReqs *prometheus.CounterVec
	poolUse  *prometheus.CounterVec
	refill   *prometheus.HistogramVec
}

var _ sandbox.Observer = (*metrics)(nil)

// networkCounters is what the metrics need of the gateway.
type networkCounters interface {
	Counters(ctx context.Context) (map[string]int64, int, error)
}

// networkCollector reads the gateway's counters at scrape time. The gateway
// counts since it started: a restarted gateway resets them, which
// Prometheus counters tolerate.
type networkCollector struct{ net networkCounters }

var (
	netEventsDesc = prometheus.NewDesc("space_network_events_total", "Network events of sandboxes (DNS queries, connection attempts, drops) by protocol and verdict.", []string{"protocol", "verdict"}, nil)
	netLinksDesc  = prometheus.NewDesc("space_network_links", "Sandbox network links the gateway serves.", nil, nil)
)

func (c *networkCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- netEventsDesc
	ch <- netLinksDesc
}

func (c *networkCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	counts, links, err := c.net.Counters(ctx)
	if err != nil {
		return
	}
	for k, v := range counts {
		proto, verdict, _ := strings.Cut(k, "/")
		ch <- prometheus.MustNewConstMetric(netEventsDesc, prometheus.CounterValue, float64(v), proto, verdict)
	}
	ch <- prometheus.MustNewConstMetric(netLinksDesc, prometheus.GaugeValue, float64(links))
}

func newMetrics(db *store.DB) *metrics {
	m := &metrics{reg: prometheus.NewRegistry()}
	buckets := []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 120}
	m.opPhase = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "space_operation_phase_seconds", Help: "Duration of each phase of lifecycle operations.", Buckets: buckets,
	}, []string{"kind", "phase"})
	m.opDone = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "space_operation_seconds", Help: "Duration of lifecycle operations by kind and final state.", Buckets: buckets,
	}, []string{"kind", "state"})
	m.execs = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "space_exec_total", Help: "Processes started in sandboxes, by kind (sync, session).",
	}, []string{"kind"})
	m.httpReqs = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "space_http_requests_total", Help: "API requests by method and status code.",
	}, []string{"method", "code"})
	m.poolUse = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "space_pool_claims_total", Help: "Creates that matched a warm pool, by pool and result (hit, miss).",
	}, []string{"pool", "result"})
	m.refill = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "space_pool_refill_seconds", Help: "Time to make one warm pool member.", Buckets: buckets,
	}, []string{"pool"})
	m.reg.MustRegister(m.opPhase, m.opDone, m.execs, m.httpReqs, m.poolUse, m.refill, &sandboxCollector{db: db},
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

func (m *metrics) OperationPhase(kind, phase string, d time.Duration) {
	m.opPhase.WithLabelValues(kind, phase).Observe(d.Seconds())
}
func (m *metrics) OperationDone(kind, state string, d time.Duration) {
	m.opDone.WithLabelValues(kind, state).Observe(d.Seconds())
}
func (m *metrics) Exec(kind string) { m.execs.WithLabelValues(kind).Inc() }

var _ sandbox.PoolObserver = (*metrics)(nil)

func (m *metrics) PoolClaim(pool string, hit bool) {
	r := "miss"
	if hit {
		r = "hit"
	}
	m.poolUse.WithLabelValues(pool, r).Inc()
}
func (m *metrics) PoolRefill(pool string, d time.Duration) {
	m.refill.WithLabelValues(pool).Observe(d.Seconds())
}

// poolCollector reports each warm pool's ready members at scrape time.
type poolCollector struct{ mgr *sandbox.Manager }

var poolReadyDesc = prometheus.NewDesc("space_pool_ready", "Ready members of each warm pool.", []string{"pool", "runtime"}, nil)

func (c *poolCollector) Describe(ch chan<- *prometheus.Desc) { ch <- poolReadyDesc }

func (c *poolCollector) Collect(ch chan<- prometheus.Metric) {
	for _, p := range c.mgr.WarmPools().Pools(context.Background()) {
		ch <- prometheus.MustNewConstMetric(poolReadyDesc, prometheus.GaugeValue, float64(p.Ready), p.ID, p.Runtime)
	}
}

// sandboxCollector counts sandboxes by state and runtime from the store at
// scrape time, so the gauge can never drift from the truth.
type sandboxCollector struct{ db *store.DB }

var sandboxesDesc = prometheus.NewDesc("space_sandboxes", "Sandboxes by state and runtime.", []string{"state", "runtime"}, nil)

func (c *sandboxCollector) Describe(ch chan<- *prometheus.Desc) { ch <- sandboxesDesc }

func (c *sandboxCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	sbs, err := c.db.ListSandboxes(ctx, store.SandboxFilter{})
	if err != nil {
		return
	}
	counts := map[[2]string]int{}
	for _, s := range sbs {
		if s.Labels[sandbox.PoolLabel] != "" {
			continue // warm pool members are nobody's sandboxes (space_pool_ready)
		}
		counts[[2]string{s.State, s.Runtime}]++
	}
	for k, n := range counts {
		ch <- prometheus.MustNewConstMetric(sandboxesDesc, prometheus.GaugeValue, float64(n), k[0], k[1])
	}
}

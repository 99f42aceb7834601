package sdk

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"time"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/errdefs"
)

// maxStatsLine bounds one sample of a followed stats stream (a sample is
// a few hundred bytes).
const maxStatsLine = 64 << 10

// Stats is GET /v1/sandboxes/{id}/stats: one sample of the sandbox's
// resource use. It does not wake a stopped or suspended sandbox (that
// answers its state and zeros). The first call for a sandbox takes about
// 200 ms (the server measures the CPU rate over that window); later calls
// about a second apart measure it since the previous one.
func (c *Client) Stats(ctx context.Context, id string) (api.SandboxStats, error) {
	var out api.SandboxStats
	if err := checkID("sandbox", id); err != nil {
		return out, err
	}
	err := c.do(ctx, request{method: http.MethodGet, path: "/v1/sandboxes/" + seg(id) + "/stats"}, &out)
	return out, err
}

// FollowStats is GET /v1/sandboxes/{id}/stats?follow=true: it calls fn with
// a sample every interval (0 means the server's default, 1 s; the server
// takes 250 ms to 60 s) until ctx ends or the server ends the stream (the
// sandbox was deleted), then returns nil; an error of fn ends it and is
// returned.
func (c *Client) FollowStats(ctx context.Context, id string, interval time.Duration, fn func(api.SandboxStats) error) error {
	if err := checkID("sandbox", id); err != nil {
		return err
	}
	if interval < 0 {
		return fmt.Errorf("stats: negative interval: %w", errdefs.ErrInvalidArgument)
	}
	q := url.Values{"follow": {"true"}}
	if interval > 0 {
		q.Set("interval", interval.String())
	}
	resp, err := c.send(ctx, request{method: http.MethodGet, path: "/v1/sandboxes/" + seg(id) + "/stats", query: q})
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	return readNDJSON(ctx, resp.Body, ndjsonStream{what: "stats of " + id, item: "sample", maxLine: maxStatsLine}, fn)
}

package sdk

import (
	"context"
	"net/http"
	"net/url"
	"strconv"

	"github.com/spacehq/space/api"
)

// maxNetworkEvent bounds one line of a network event stream.
const maxNetworkEvent = 64 << 10

// SandboxNetwork is GET /v1/sandboxes/{id}/network: the policy in force,
// the link's addresses and counters.
func (c *Client) SandboxNetwork(ctx context.Context, id string) (*api.NetworkInfo, error) {
	if err := checkID("sandbox", id); err != nil {
		return nil, err
	}
	var out api.NetworkInfo
	if err := c.do(ctx, request{method: http.MethodGet, path: "/v1/sandboxes/" + seg(id) + "/network"}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// SetSandboxNetwork is PUT /v1/sandboxes/{id}/network: it replaces the
// sandbox's whole policy (the zero policy reaches nothing) and returns the
// network as it is then. A running sandbox's link applies it at once.
func (c *Client) SetSandboxNetwork(ctx context.Context, id string, p api.NetworkPolicy) (*api.NetworkInfo, error) {
	if err := checkID("sandbox", id); err != nil {
		return nil, err
	}
	var out api.NetworkInfo
	if err := c.do(ctx, request{method: http.MethodPut, path: "/v1/sandboxes/" + seg(id) + "/network", json: p}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// NetworkEvents is GET /v1/sandboxes/{id}/network/events: it calls fn for
// each event with Seq > after, oldest first. Without follow it returns
// when the buffered events are done; with follow it waits for new ones
// until ctx ends (then it returns nil) or fn returns an error (returned).
func (c *Client) NetworkEvents(ctx context.Context, id string, after uint64, follow bool, fn func(api.NetworkEvent) error) error {
	if err := checkID("sandbox", id); err != nil {
		return err
	}
	q := url.Values{}
	if after > 0 {
		q.Set("after", strconv.FormatUint(after, 10))
	}
	if follow {
		q.Set("follow", "true")
	}
	resp, err := c.send(ctx, request{method: http.MethodGet, path: "/v1/sandboxes/" + seg(id) + "/network/events", query: q})
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	return readNDJSON(ctx, resp.Body, ndjsonStream{what: "network events of " + id, item: "event", maxLine: maxNetworkEvent}, fn)
}

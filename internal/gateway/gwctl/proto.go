// Package gwctl is the control channel between the API server and the
// gateway process (cmd/space-gateway): a unix stream socket carrying one
// JSON request per connection (a NIC descriptor rides along in SCM_RIGHTS)
// and JSON lines back. Server runs in the gateway; Client is the API
// server's sandbox.Network; Supervisor starts, re-adopts and restarts the
// gateway process.
package gwctl

import (
	"encoding/json"
	"errors"
	"fmt"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/brokerconf"
	"github.com/spacehq/space/internal/errdefs"
)

// maxRequest bounds one request (a policy of 2×1024 entries and its rules
// fits many times over).
const maxRequest = 4 << 20

// Ops.
const (
	opAttach    = "attach"
	opSetPolicy = "set-policy"
	opDetach    = "detach"
	opInfo      = "info"
	opEvents    = "events"
	opAttached  = "attached"
	opPing      = "ping"
	opCounters  = "counters"
	// opProbe has the gateway try what its confinement must refuse and
	// report each result (tests; nothing it does has an effect).
	opProbe = "probe"
	// opDial opens a TCP connection to a port of the sandbox: after a
	// success reply line the control connection carries its raw bytes both
	// ways (a half-close of either side is passed on).
	opDial = "dial"
	// opBroker replaces a sandbox's credential-brokering config (its CA and
	// granted secrets, values included: this socket is host-only, in a
	// 0700 directory, and only root connects). The gateway keeps it in
	// memory only, for as long as the sandbox's link.
	opBroker = "broker"
	// opSetDecide turns asking the server's policy on or off for one
	// link (Decide); attach carries the same flag.
	opSetDecide = "set-decide"
	// opDecisions opens the decisions stream (decisions.go): after a
	// success reply line the gateway sends decision requests up the
	// connection and the server answers them, multiplexed by id.
	opDecisions = "decisions"
)

type request struct {
	Op     string             `json:"op"`
	ID     string             `json:"id,omitempty"`
	Policy *api.NetworkPolicy `json:"policy,omitempty"`
	After  uint64             `json:"after,omitempty"`
	Follow bool               `json:"follow,omitempty"`
	Port   uint16             `json:"port,omitempty"`
	Broker *brokerconf.Config `json:"broker,omitempty"`
	// Decide (attach, set-decide): whether the gateway asks the server's
	// policy about this sandbox's DNS queries and connections. An attach
	// that does not say asks (fail closed).
	Decide *bool `json:"decide,omitempty"`
}

type response struct {
	Error *api.ErrorBody    `json:"error,omitempty"`
	Info  *api.NetworkInfo  `json:"info,omitempty"`
	IDs   []string          `json:"ids,omitempty"`
	Event *api.NetworkEvent `json:"event,omitempty"`
	Done  bool              `json:"done,omitempty"` // last line of a reply
	Pid   int               `json:"pid,omitempty"`
	// Counters: events by "protocol/verdict" since the gateway started.
	Counters map[string]int64 `json:"counters,omitempty"`
	// Probe: what the gateway tried → the error it got ("" = it worked).
	Probe map[string]string `json:"probe,omitempty"`
}

func errorBody(err error) *api.ErrorBody {
	code := errdefs.Code(err)
	return &api.ErrorBody{Code: code, Message: err.Error()}
}

// asError turns a reply's error back into one wrapping the sentinel of its
// code, so the API answers the same status the gateway meant.
func asError(b *api.ErrorBody) error {
	if b == nil {
		return nil
	}
	return fmt.Errorf("%w: %s", errdefs.FromCode(b.Code), b.Message)
}

func marshalLine(v any) []byte {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err) // our own types always marshal
	}
	return append(b, '\n')
}

var errNoGateway = errors.New("network gateway is not running")

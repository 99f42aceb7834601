package server

import (
	"net/netip"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/netpolicy"
)

// boundaryCheck reports every entry of p outside boundary (400, naming
// them), proved exactly by netpolicy.Subset under the server's opened
// private ranges.
func boundaryCheck(p, boundary api.NetworkPolicy, allowPrivate []netip.Prefix) error {
	return netpolicy.SubsetError(netpolicy.Subset(p, boundary, netpolicy.Options{AllowPrivate: allowPrivate}))
}

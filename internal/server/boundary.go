package server

import "github.com/spacehq/space/api"

// boundaryCheck reports the entries of p outside boundary.
func boundaryCheck(p, boundary api.NetworkPolicy) error {
	_, _ = p, boundary
	return nil // replaced by netpolicy.Subset when it lands (this session)
}

// Package netpolicy validates and evaluates a sandbox's network policy
// (api.NetworkPolicy): which names may be resolved, which addresses and
// ports may be reached, and which never may, whatever a name resolves to.
package netpolicy

import "github.com/spacehq/space/api"

// Validate checks p and returns an errdefs.ErrInvalid error naming the
// offending field ("network.allow_out[2]: …").
// PLACEHOLDER until the real compiler lands (same branch of work).
func Validate(p api.NetworkPolicy) error { _ = p; return nil }

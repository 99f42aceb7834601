package server

import "testing"

// TestEveryRouteHasADisposition: a route added to the table without saying
// what a cluster replica does with it fails here (internal/replica then
// checks it serves each as marked).
func TestEveryRouteHasADisposition(t *testing.T) {
	for _, rt := range Routes() {
		if rt.Cluster < ServeHere || rt.Cluster > Refuse {
			t.Errorf("route %s has no cluster disposition (ServeHere, ForwardToNode, FanOut or Refuse)", rt.Pattern)
		}
	}
}

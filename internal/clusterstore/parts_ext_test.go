package clusterstore_test

import (
	"github.com/spacehq/space/internal/cluster"
	"github.com/spacehq/space/internal/clusterstore"
)

// A node's loops need one part each, not the whole Store.
var (
	_ cluster.Store     = (*clusterstore.NodeStore)(nil)
	_ cluster.NodeStore = (*clusterstore.SandboxStore)(nil)
)

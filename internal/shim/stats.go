package shim

import (
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/spacehq/space/api"
)

// MetricsTypeURL is the type CRI decodes a cgroup v1 task's stats as.
const MetricsTypeURL = "io.containerd.cgroups.v1.Metrics"

// encodeMetrics maps a sandbox's stats to io.containerd.cgroups.v1.Metrics
// (github.com/containerd/cgroups stats/v1/metrics.proto), encoded field by
// field instead of importing that module for one message: pids
// (current/limit), cpu usage total (ns) and memory usage/limit. The
// sandbox is the pod: every container of it reports the pod's numbers. The
// page cache part is not reported as inactive file (unknown), so CRI's
// working set equals the usage.
func encodeMetrics(st api.SandboxStats) *anypb.Any {
	msg := func(fields ...[]byte) []byte {
		var b []byte
		for _, f := range fields {
			b = append(b, f...)
		}
		return b
	}
	u64 := func(num protowire.Number, v int64) []byte {
		if v <= 0 {
			return nil
		}
		b := protowire.AppendTag(nil, num, protowire.VarintType)
		return protowire.AppendVarint(b, uint64(v))
	}
	sub := func(num protowire.Number, body []byte) []byte {
		b := protowire.AppendTag(nil, num, protowire.BytesType)
		return protowire.AppendBytes(b, body)
	}
	pids := msg(u64(1, st.Pids), u64(2, st.PidsMax))
	cpu := sub(1, msg(u64(1, int64(st.CPUSeconds*1e9)))) // CPUStat.usage.total
	memUsage := msg(u64(1, st.MemTotalBytes), u64(2, st.MemUsedBytes))
	memory := msg(u64(1, st.MemCacheBytes), sub(33, memUsage)) // MemoryStat.cache, .usage
	body := msg(sub(2, pids), sub(3, cpu), sub(4, memory))
	return &anypb.Any{TypeUrl: MetricsTypeURL, Value: body}
}

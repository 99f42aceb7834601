package shim

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	eventstypes "github.com/containerd/containerd/api/events"
	taskapi "github.com/containerd/containerd/api/runtime/task/v2"
	runtimeoptions "github.com/containerd/containerd/api/types/runtimeoptions/v1"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/spacehq/space/api"
)

func TestSocketPath(t *testing.T) {
	long := strings.Repeat("n", 200)
	p, err := SocketPath(SocketDir, long, strings.Repeat("f", 64))
	if err != nil || len(p) > maxSocketPath || !strings.HasPrefix(p, SocketDir+"/") {
		t.Fatalf("socket path %q (%d bytes): %v", p, len(p), err)
	}
	q, _ := SocketPath(SocketDir, long, strings.Repeat("f", 64))
	r, _ := SocketPath(SocketDir, long, strings.Repeat("e", 64))
	if p != q || p == r {
		t.Fatalf("same group must share a socket, another must not: %s %s %s", p, q, r)
	}
	if _, err := SocketPath("/"+strings.Repeat("d", 100), "k8s.io", "x"); err == nil {
		t.Fatal("a path over 106 bytes was accepted")
	}
	if Address(p) != "unix://"+p {
		t.Fatalf("address %q", Address(p))
	}
}

func TestGroupBySandboxID(t *testing.T) {
	pod := &ociSpec{Annotations: map[string]string{criContainerType: criContainerTypeBox, criSandboxID: "pod1"}}
	ctr := &ociSpec{Annotations: map[string]string{criContainerType: "container", criSandboxID: "pod1"}}
	lone := &ociSpec{}
	if !pod.isPod() || ctr.isPod() || pod.group("pod1") != "pod1" || ctr.group("ctr1") != "pod1" || lone.group("x") != "x" {
		t.Fatal("grouping by io.kubernetes.cri.sandbox-id is wrong")
	}
}

func TestSandboxRequestAnnotations(t *testing.T) {
	cfg := &Config{Runtime: "gvisor", Template: "base:latest"}
	ann := map[string]string{criSandboxNamespace: "default", criSandboxName: "web", criSandboxUID: "u-1"}
	req, err := SandboxRequest(cfg, "k8s.io", "pod1", ann)
	if err != nil {
		t.Fatal(err)
	}
	if req.Runtime != "gvisor" || req.Template != "base:latest" || req.Network != nil ||
		req.Labels[LabelPodName] != "web" || req.Labels[LabelPodNamespace] != "default" || req.Labels[LabelPodUID] != "u-1" ||
		req.Labels[LabelContainerdID] != "pod1" || req.Labels[LabelContainerdNS] != "k8s.io" {
		t.Fatalf("request %+v", req)
	}
	// A space-gvisor handler's pod cannot pick native by annotation unless
	// the handler's config allows it.
	if _, err := SandboxRequest(cfg, "k8s.io", "pod1", map[string]string{AnnotationRuntime: "native"}); err == nil ||
		!strings.Contains(err.Error(), "allowed_runtimes") || !strings.Contains(err.Error(), AnnotationRuntime) {
		t.Fatalf("annotation chose a runtime the handler does not allow: %v", err)
	}
	if req, err := SandboxRequest(cfg, "k8s.io", "pod1", map[string]string{AnnotationRuntime: "gvisor"}); err != nil || req.Runtime != "gvisor" {
		t.Fatalf("annotation restating the handler's runtime: %+v %v", req, err)
	}
	cfg.AllowedRuntimes = []string{"gvisor", "native"}
	req, err = SandboxRequest(cfg, "k8s.io", "pod1", map[string]string{AnnotationRuntime: "native", AnnotationTemplate: "tiny:1", AnnotationEgress: "pypi.org, *.github.com:443,10.1.0.0/16"})
	if err != nil {
		t.Fatal(err)
	}
	if req.Runtime != "native" || req.Template != "tiny:1" || req.Network == nil || len(req.Network.AllowOut) != 3 || req.Network.Internet {
		t.Fatalf("overrides: %+v %+v", req, req.Network)
	}
	req, err = SandboxRequest(cfg, "k8s.io", "pod1", map[string]string{AnnotationEgress: "db.default.svc.cluster.local:5432, private=10.96.0.0/12"})
	if err != nil || req.Network == nil || len(req.Network.AllowOut) != 1 || len(req.Network.AllowPrivate) != 1 || req.Network.AllowPrivate[0] != "10.96.0.0/12" {
		t.Fatalf("egress with private=: %+v %v", req.Network, err)
	}
	req, err = SandboxRequest(cfg, "k8s.io", "pod1", map[string]string{AnnotationEgress: "none"})
	if err != nil || req.Network == nil || len(req.Network.AllowOut) != 0 {
		t.Fatalf("egress none: %+v %v", req.Network, err)
	}
	for _, c := range []struct{ k, v, want string }{
		{AnnotationRuntime, "kvm", "runtime must be one of"},
		{AnnotationTemplate, "", "template reference"},
		{AnnotationEgress, "pypi.org,,x", "empty destination"},
		{AnnotationEgress, "*", "space.dev/egress"},
		{AnnotationEgress, "db.example,private=8.8.8.0/24", "allow_private[0]"},
		{"space.dev/memory", "1Gi", "not one the space runtime knows"},
	} {
		_, err := SandboxRequest(cfg, "k8s.io", "pod1", map[string]string{c.k: c.v})
		if err == nil || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), c.k) {
			t.Errorf("%s=%q: error %v, want one naming the annotation and %q", c.k, c.v, err, c.want)
		}
	}
}

func TestEventTypeURLs(t *testing.T) {
	for _, c := range []struct {
		ev   any
		want string
	}{
		{&eventstypes.TaskExit{ContainerID: "c"}, "containerd.events.TaskExit"},
		{&eventstypes.TaskCreate{}, "containerd.events.TaskCreate"},
		{&eventstypes.TaskExecStarted{}, "containerd.events.TaskExecStarted"},
		{&eventstypes.TaskOOM{}, "containerd.events.TaskOOM"},
	} {
		env, err := Envelope("k8s.io", TopicExit, c.ev, time.Now())
		if err != nil {
			t.Fatal(err)
		}
		if env.Event.TypeUrl != c.want || env.Namespace != "k8s.io" {
			t.Errorf("type url %q, want the bare %q", env.Event.TypeUrl, c.want)
		}
	}
}

func TestExitCode(t *testing.T) {
	for _, c := range []struct {
		st   api.ExitStatus
		want uint32
	}{
		{api.ExitStatus{ExitCode: 3}, 3},
		{api.ExitStatus{Signal: "KILL", ExitCode: -1}, 137},
		{api.ExitStatus{Signal: "TERM"}, 143},
		{api.ExitStatus{Signal: "15"}, 143},
		{api.ExitStatus{ExitCode: 999}, 255},
	} {
		if got := exitCode(c.st); got != c.want {
			t.Errorf("%+v → %d, want %d", c.st, got, c.want)
		}
	}
}

// TestMetricsEncoding reads the hand-encoded cgroup v1 Metrics back field
// by field (numbers from containerd/cgroups stats/v1/metrics.proto).
func TestMetricsEncoding(t *testing.T) {
	a := encodeMetrics(api.SandboxStats{Pids: 7, PidsMax: 100, CPUSeconds: 1.5, MemUsedBytes: 4096, MemTotalBytes: 1 << 20})
	if a.TypeUrl != MetricsTypeURL {
		t.Fatal(a.TypeUrl)
	}
	fields := func(b []byte) map[protowire.Number][]any {
		out := map[protowire.Number][]any{}
		for len(b) > 0 {
			num, typ, n := protowire.ConsumeTag(b)
			b = b[n:]
			switch typ {
			case protowire.VarintType:
				v, n := protowire.ConsumeVarint(b)
				out[num] = append(out[num], v)
				b = b[n:]
			case protowire.BytesType:
				v, n := protowire.ConsumeBytes(b)
				out[num] = append(out[num], v)
				b = b[n:]
			default:
				t.Fatalf("wire type %d", typ)
			}
		}
		return out
	}
	m := fields(a.Value)
	pids := fields(m[2][0].([]byte))
	cpu := fields(fields(m[3][0].([]byte))[1][0].([]byte))
	mem := fields(fields(m[4][0].([]byte))[33][0].([]byte))
	if pids[1][0] != uint64(7) || pids[2][0] != uint64(100) || cpu[1][0] != uint64(1.5e9) || mem[2][0] != uint64(4096) || mem[1][0] != uint64(1<<20) {
		t.Fatalf("decoded pids=%v cpu=%v mem=%v", pids, cpu, mem)
	}
}

// bundle writes a bundle with a config.json carrying ann.
func bundle(t *testing.T, ann map[string]string) string {
	t.Helper()
	dir := t.TempDir()
	b, _ := json.Marshal(map[string]any{"process": map[string]any{"args": []string{"sh"}, "cwd": "/"}, "annotations": ann})
	os.WriteFile(filepath.Join(dir, "config.json"), b, 0o644)
	return dir
}

func optionsFor(t *testing.T, cfg string) *anypb.Any {
	b, err := proto.Marshal(&runtimeoptions.Options{ConfigPath: cfg})
	if err != nil {
		t.Fatal(err)
	}
	return &anypb.Any{TypeUrl: "runtimeoptions.v1.Options", Value: b}
}

// TestServiceRefusals: what the task service refuses before it reaches a
// space server — errors containerd turns into the pod's events.
func TestServiceRefusals(t *testing.T) {
	pub := &FakePublisher{}
	svc := NewService(context.Background(), "k8s.io", pub, slog.New(slog.NewTextHandler(io.Discard, nil)), nil)
	ctx := context.Background()
	cfg := filepath.Join(t.TempDir(), "space.json")
	os.WriteFile(cfg, []byte(`{"server":"unix:///nonexistent/space.sock","runtime":"gvisor"}`), 0o644)

	// A bad annotation on the pod fails its Create with the reason.
	b := bundle(t, map[string]string{criContainerType: criContainerTypeBox, criSandboxID: "pod1", AnnotationRuntime: "vmware"})
	_, err := svc.Create(ctx, &taskapi.CreateTaskRequest{ID: "pod1", Bundle: b, Options: optionsFor(t, cfg)})
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "space.dev/runtime") {
		t.Fatalf("bad annotation: %v", err)
	}
	// No config: a clear error.
	b = bundle(t, map[string]string{criContainerType: criContainerTypeBox, criSandboxID: "pod1"})
	_, err = svc.Create(ctx, &taskapi.CreateTaskRequest{ID: "pod1", Bundle: b})
	if err == nil || !strings.Contains(err.Error(), "ConfigPath") {
		t.Fatalf("no config: %v", err)
	}
	// A bad config file.
	bad := filepath.Join(t.TempDir(), "bad.json")
	os.WriteFile(bad, []byte(`{"server":"unix:///x","runtime":"hyperv"}`), 0o644)
	_, err = svc.Create(ctx, &taskapi.CreateTaskRequest{ID: "pod1", Bundle: b, Options: optionsFor(t, bad)})
	if err == nil || !strings.Contains(err.Error(), "hyperv") {
		t.Fatalf("bad config: %v", err)
	}
	// A container of a pod this shim does not serve.
	b = bundle(t, map[string]string{criContainerType: "container", criSandboxID: "pod9"})
	_, err = svc.Create(ctx, &taskapi.CreateTaskRequest{ID: "c1", Bundle: b, Options: optionsFor(t, cfg)})
	if status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("foreign container: %v", err)
	}
	// Unknown tasks are NotFound (containerd tolerates that on cleanup).
	if _, err := svc.State(ctx, &taskapi.StateRequest{ID: "nope"}); status.Code(err) != codes.NotFound {
		t.Fatalf("state of unknown task: %v", err)
	}
	if _, err := svc.Kill(ctx, &taskapi.KillRequest{ID: "nope", Signal: 9}); status.Code(err) != codes.NotFound {
		t.Fatalf("kill of unknown task: %v", err)
	}
	if _, err := svc.Update(ctx, &taskapi.UpdateTaskRequest{ID: "x"}); status.Code(err) != codes.Unimplemented {
		t.Fatalf("update: %v", err)
	}
	if _, err := svc.Checkpoint(ctx, &taskapi.CheckpointTaskRequest{ID: "x"}); status.Code(err) != codes.Unimplemented {
		t.Fatalf("checkpoint: %v", err)
	}
	if len(pub.Topics()) != 0 {
		t.Fatalf("events for tasks that were never created: %v", pub.Topics())
	}
}

// TestProcessEndsOnce: a session's end and a kill that raced its start
// both try to end a process; the first wins, the second is a no-op.
func TestProcessEndsOnce(t *testing.T) {
	p := newProcess("", &ociProcess{}, "", "", "", false)
	p.pid = 42
	p.mu.Lock()
	ended, pid, _ := p.finish(137)
	again, _, _ := p.finish(0)
	p.mu.Unlock()
	if !ended || again || pid != 42 || p.exitCode != 137 {
		t.Fatalf("finish: %v %v pid %d code %d", ended, again, pid, p.exitCode)
	}
	select {
	case <-p.exited:
	default:
		t.Fatal("exited is not closed")
	}
}

func TestLoadConfigChecksAllowedRuntimes(t *testing.T) {
	dir := t.TempDir()
	for body, want := range map[string]string{
		`{"server": "http://127.0.0.1:1", "runtime": "gvisor", "allowed_runtimes": ["gvisor", "xen"]}`: `allowed_runtimes: "xen"`,
		`{"server": "http://127.0.0.1:1", "runtime": "gvisor", "allowed_runtime": ["native"]}`:         `unknown field`,
	} {
		p := filepath.Join(dir, "c.json")
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		if _, err := LoadConfig(p); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("config %s: error %v, want %q", body, err, want)
		}
	}
}

// -v prints the version as containerd's shims do and needs no other flag
// (issue 26: it failed with "flag provided but not defined").
func TestVersionFlag(t *testing.T) {
	for _, args := range [][]string{{"-v"}, {"--v"}, {"-v", "-namespace", "k8s.io"}} {
		var out, errOut strings.Builder
		if err := Main(args, strings.NewReader(""), &out, &errOut); err != nil {
			t.Fatalf("Main(%q) = %v (stderr %q)", args, err, errOut.String())
		}
		if !strings.HasPrefix(out.String(), "containerd-shim-space-v2:\n  Version: ") || !strings.Contains(out.String(), "Go version: go") {
			t.Errorf("Main(%q) printed %q", args, out.String())
		}
	}
}

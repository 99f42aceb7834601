package shim

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	eventstypes "github.com/containerd/containerd/api/events"
	taskapi "github.com/containerd/containerd/api/runtime/task/v2"
	tasktypes "github.com/containerd/containerd/api/types/task"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/emptypb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/sdk"
)

// ContainersDir is where a pod's sandbox keeps its containers' image trees
// (<dir>/<container id>/rootfs): on the sandbox's own disk, not a tmpfs.
const ContainersDir = "/var/lib/space-containers"

// stateFile is the file the daemon leaves in each bundle for `delete`,
// which may run after the daemon died.
const stateFile = "space-shim.json"

// bundleState is stateFile's content.
type bundleState struct {
	ConfigPath string `json:"config_path"`
	SandboxID  string `json:"sandbox_id"`
	Pod        bool   `json:"pod"`
}

// Service is the task service of one pod's shim daemon.
type Service struct {
	ns     string
	events Publisher
	log    *slog.Logger
	// exit is called once Shutdown finds no task left.
	exit func()
	// ctx bounds the processes' attachments: the daemon's lifetime.
	ctx context.Context

	mu    sync.Mutex
	pod   *podState
	tasks map[string]*task
}

var _ taskapi.TaskService = (*Service)(nil)

// podState is the pod's sandbox, known after the pod task's Create.
type podState struct {
	id        string // the pod task's id
	sandboxID string
	client    *sdk.Client
	cfg       *Config
	paused    bool // by Pause, until Resume (under Service.mu)
}

// task is a pod task or a container task.
type task struct {
	id, bundle string
	pod        bool
	root       string // container: its tree in the sandbox
	init       *process
	execs      map[string]*process
}

// process is a container's main process or one of its execs.
type process struct {
	id     string // exec id, "" for the init process
	spec   *ociProcess
	stdin  string
	stdout string
	stderr string
	tty    bool

	mu        sync.Mutex
	status    tasktypes.Status
	pid       uint32
	cmd       *api.Command
	sess      *sdk.Session
	stdinFile *os.File
	exitCode  uint32
	exitedAt  time.Time
	exited    chan struct{}
}

func newProcess(id string, spec *ociProcess, stdin, stdout, stderr string, tty bool) *process {
	return &process{id: id, spec: spec, stdin: stdin, stdout: stdout, stderr: stderr, tty: tty, status: tasktypes.Status_CREATED, exited: make(chan struct{})}
}

// NewService returns the task service of a shim daemon for namespace ns.
func NewService(ctx context.Context, ns string, events Publisher, log *slog.Logger, exit func()) *Service {
	return &Service{ns: ns, events: events, log: log, exit: exit, ctx: ctx, tasks: map[string]*task{}}
}

func notFound(what string) error { return status.Errorf(codes.NotFound, "%s: not found", what) }

func (s *Service) get(id, execID string) (*task, *process, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	t, ok := s.tasks[id]
	if !ok {
		return nil, nil, notFound("task " + id)
	}
	if execID == "" {
		return t, t.init, nil
	}
	p, ok := t.execs[execID]
	if !ok {
		return nil, nil, notFound("exec " + execID + " of task " + id)
	}
	return t, p, nil
}

// Create creates the pod's sandbox (pod task) or copies a container's
// image into it (container task).
func (s *Service) Create(ctx context.Context, r *taskapi.CreateTaskRequest) (*taskapi.CreateTaskResponse, error) {
	spec, err := readSpec(r.Bundle)
	if err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "space shim: %v", err)
	}
	if spec.Process == nil {
		spec.Process = &ociProcess{}
	}
	cfgPath, err := ConfigPathFromOptions(r.Options)
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	s.mu.Lock()
	_, dup := s.tasks[r.ID]
	pod := s.pod
	s.mu.Unlock()
	if dup {
		return nil, status.Errorf(codes.AlreadyExists, "task %s already exists", r.ID)
	}
	t := &task{id: r.ID, bundle: r.Bundle, execs: map[string]*process{}}
	t.init = newProcess("", spec.Process, r.Stdin, r.Stdout, r.Stderr, r.Terminal)
	lone := false
	if spec.isPod() || pod == nil && spec.Annotations[criSandboxID] == "" {
		// The pod, or a lone task outside Kubernetes: a sandbox of its own.
		if pod != nil {
			return nil, status.Errorf(codes.FailedPrecondition, "space shim: this shim already serves pod %s", pod.id)
		}
		pod, err = s.createPod(ctx, r.ID, cfgPath, spec)
		if err != nil {
			return nil, err
		}
		t.pod = spec.isPod()
		lone = !t.pod
		if err := writeBundleState(r.Bundle, bundleState{ConfigPath: cfgPath, SandboxID: pod.sandboxID, Pod: true}); err != nil {
			s.log.Warn("writing bundle state", "err", err)
		}
	} else if pod == nil || spec.Annotations[criSandboxID] != pod.id {
		return nil, status.Errorf(codes.FailedPrecondition, "space shim: container %s belongs to pod %s, which this shim does not serve", r.ID, spec.Annotations[criSandboxID])
	}
	if !t.pod {
		// space.dev/* annotations configure the pod's sandbox; on a
		// container (CRI copies the pod's there too) they are only checked,
		// so a misspelt or invalid one fails the container visibly.
		if !lone {
			if _, err := SandboxRequest(pod.cfg, s.ns, r.ID, spec.Annotations); err != nil {
				return nil, status.Errorf(codes.InvalidArgument, "space shim: container %s: %v", r.ID, err)
			}
		}
		t.root = path.Join(ContainersDir, r.ID, "rootfs")
		if err := s.copyRootfs(ctx, pod, r, t.root); err != nil {
			if lone { // its sandbox goes too
				s.deleteSandbox(pod)
				s.mu.Lock()
				s.pod = nil
				s.mu.Unlock()
			}
			return nil, err
		}
		if !lone {
			if err := writeBundleState(r.Bundle, bundleState{ConfigPath: cfgPath, SandboxID: pod.sandboxID}); err != nil {
				s.log.Warn("writing bundle state", "err", err)
			}
		}
	}
	pid := uint32(0)
	if t.pod {
		// The pod has no process of its own on the host: its "pid" is the
		// shim's, which lives exactly as long as the pod.
		pid = uint32(os.Getpid())
		t.init.pid = pid
	}
	s.mu.Lock()
	s.tasks[r.ID] = t
	s.mu.Unlock()
	s.events.Publish(TopicCreate, &eventstypes.TaskCreate{
		ContainerID: r.ID, Bundle: r.Bundle, Rootfs: r.Rootfs, Pid: pid,
		IO: &eventstypes.TaskIO{Stdin: r.Stdin, Stdout: r.Stdout, Stderr: r.Stderr, Terminal: r.Terminal},
	})
	return &taskapi.CreateTaskResponse{Pid: pid}, nil
}

// createPod creates the space sandbox of the pod whose task is id.
func (s *Service) createPod(ctx context.Context, id, cfgPath string, spec *ociSpec) (*podState, error) {
	cfg, err := LoadConfig(cfgPath)
	if err != nil {
		return nil, status.Error(codes.FailedPrecondition, err.Error())
	}
	req, err := SandboxRequest(cfg, s.ns, id, spec.Annotations)
	if err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "space shim: %v", err)
	}
	c, err := sdk.New(cfg.Server, cfg.apiKey, sdk.WithUserAgent("containerd-shim-space-v2"))
	if err != nil {
		return nil, status.Errorf(codes.FailedPrecondition, "space shim: config %s: %v", cfg.path, err)
	}
	sb, err := c.CreateSandboxAndWait(ctx, req)
	if err != nil {
		if sb != nil && sb.ID != "" {
			s.deleteSandbox(&podState{sandboxID: sb.ID, client: c})
		}
		return nil, status.Errorf(codes.Unknown, "space shim: creating the pod's sandbox (runtime %s, template %s): %v", req.Runtime, req.Template, err)
	}
	p := &podState{id: id, sandboxID: sb.ID, client: c, cfg: cfg}
	s.mu.Lock()
	s.pod = p
	s.mu.Unlock()
	s.log.Info("pod sandbox created", "pod", id, "sandbox", sb.ID, "runtime", sb.Runtime)
	return p, nil
}

// copyRootfs mounts the container's rootfs on <bundle>/rootfs, streams it
// into the sandbox at root, and unmounts it.
func (s *Service) copyRootfs(ctx context.Context, pod *podState, r *taskapi.CreateTaskRequest, root string) error {
	target := filepath.Join(r.Bundle, "rootfs")
	if err := mountRootfs(r.Rootfs, target); err != nil {
		return status.Errorf(codes.Unknown, "space shim: %v", err)
	}
	defer func() {
		if err := unmountAll(target); err != nil {
			s.log.Warn("unmount rootfs", "err", err)
		}
	}()
	pr, pw := io.Pipe()
	go func() { pw.CloseWithError(writeTree(pw, target)) }()
	err := pod.client.UploadTar(ctx, pod.sandboxID, root, pr)
	pr.CloseWithError(io.ErrClosedPipe)
	if err != nil {
		return status.Errorf(codes.Unknown, "space shim: copying the image of %s into sandbox %s: %v", r.ID, pod.sandboxID, err)
	}
	return nil
}

func (s *Service) deleteSandbox(pod *podState) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	op, err := pod.client.DeleteSandbox(ctx, pod.sandboxID, true)
	if err == nil {
		_, err = pod.client.WaitOperation(ctx, op.ID)
	}
	if err != nil && !errors.Is(err, sdk.ErrNotFound) {
		s.log.Warn("deleting the pod's sandbox", "sandbox", pod.sandboxID, "err", err)
	}
}

func writeBundleState(bundle string, st bundleState) error {
	b, err := json.Marshal(st)
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(bundle, stateFile), b, 0o600)
}

// Start starts a container's process or an exec (the pod task has none).
func (s *Service) Start(ctx context.Context, r *taskapi.StartRequest) (*taskapi.StartResponse, error) {
	t, p, err := s.get(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	if t.pod {
		p.mu.Lock()
		p.status = tasktypes.Status_RUNNING
		pid := p.pid
		p.mu.Unlock()
		s.events.Publish(TopicStart, &eventstypes.TaskStart{ContainerID: t.id, Pid: pid})
		return &taskapi.StartResponse{Pid: pid}, nil
	}
	if err := s.startProcess(ctx, t, p); err != nil {
		return nil, err
	}
	p.mu.Lock()
	pid := p.pid
	p.mu.Unlock()
	if r.ExecID == "" {
		s.events.Publish(TopicStart, &eventstypes.TaskStart{ContainerID: t.id, Pid: pid})
	} else {
		s.events.Publish(TopicExecStarted, &eventstypes.TaskExecStarted{ContainerID: t.id, ExecID: r.ExecID, Pid: pid})
	}
	return &taskapi.StartResponse{Pid: pid}, nil
}

func (s *Service) podOf() (*podState, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.pod == nil {
		return nil, status.Error(codes.FailedPrecondition, "space shim: no pod sandbox")
	}
	return s.pod, nil
}

// startProcess runs p as a command session in the pod's sandbox, rooted
// at the container's tree, its output copied into the FIFOs CRI gave.
func (s *Service) startProcess(ctx context.Context, t *task, p *process) error {
	pod, err := s.podOf()
	if err != nil {
		return err
	}
	p.mu.Lock()
	if p.status != tasktypes.Status_CREATED {
		p.mu.Unlock()
		return status.Errorf(codes.FailedPrecondition, "process %s of %s was already started", p.id, t.id)
	}
	p.status = tasktypes.Status_RUNNING // claimed; reset on failure below
	p.mu.Unlock()
	fail := func(err error) error {
		p.mu.Lock()
		p.status = tasktypes.Status_CREATED
		p.mu.Unlock()
		return err
	}
	sp := p.spec
	if len(sp.Args) == 0 {
		return fail(status.Errorf(codes.InvalidArgument, "space shim: %s has no process args", t.id))
	}
	req := api.CreateCommandRequest{ExecRequest: api.ExecRequest{
		Cmd: sp.Args, Env: envMap(sp.Env), Workdir: sp.Cwd, Root: t.root,
		User: strconv.FormatUint(uint64(sp.User.UID), 10) + ":" + strconv.FormatUint(uint64(sp.User.GID), 10),
		TTY:  p.tty,
	}}
	if req.Workdir == "" {
		req.Workdir = "/"
	}
	if p.tty && sp.ConsoleSize != nil && sp.ConsoleSize.Height > 0 && sp.ConsoleSize.Width > 0 {
		req.Rows, req.Cols = uint16(sp.ConsoleSize.Height), uint16(sp.ConsoleSize.Width)
	}
	stdout, err := openOutput(p.stdout)
	if err != nil {
		return fail(status.Errorf(codes.Unknown, "space shim: stdout: %v", err))
	}
	stderr, err := openOutput(p.stderr)
	if err != nil {
		closeFile(stdout)
		return fail(status.Errorf(codes.Unknown, "space shim: stderr: %v", err))
	}
	closeOut := func() { closeFile(stdout); closeFile(stderr) }
	cmd, err := pod.client.CreateCommand(ctx, pod.sandboxID, req)
	if err != nil {
		closeOut()
		return fail(status.Errorf(codes.Unknown, "space shim: %v", err))
	}
	sess, err := pod.client.Attach(s.ctx, cmd, sdk.AttachOptions{
		Stdout: writerOf(stdout), Stderr: writerOf(stderr),
		OnDropped: func(stream string, n int64) {
			s.log.Warn("output dropped from the replay buffer", "task", t.id, "exec", p.id, "stream", stream, "bytes", n)
		},
	})
	if err != nil {
		closeOut()
		return fail(status.Errorf(codes.Unknown, "space shim: starting %v: %v", sp.Args, err))
	}
	p.mu.Lock()
	p.cmd, p.sess = cmd, sess
	p.mu.Unlock()
	go s.waitProcess(t, p, sess, closeOut)
	if p.stdin != "" {
		go s.copyStdin(p, sess)
	}
	// The pid arrives with the session's first frame.
	deadline := time.Now().Add(5 * time.Second)
	for sess.Pid() == 0 && time.Now().Before(deadline) {
		select {
		case <-p.exited:
			deadline = time.Now()
		case <-time.After(2 * time.Millisecond):
		}
	}
	p.mu.Lock()
	if pid := sess.Pid(); pid > 0 {
		p.pid = uint32(pid)
	}
	p.mu.Unlock()
	return nil
}

// copyStdin copies CRI's stdin FIFO into the process until EOF (or
// CloseIO), then closes the process's stdin.
func (s *Service) copyStdin(p *process, sess *sdk.Session) {
	f, err := os.OpenFile(p.stdin, os.O_RDONLY, 0)
	if err != nil {
		s.log.Warn("opening stdin", "err", err)
		return
	}
	p.mu.Lock()
	if p.status == tasktypes.Status_STOPPED {
		p.mu.Unlock()
		f.Close()
		return
	}
	p.stdinFile = f
	p.mu.Unlock()
	io.Copy(sess.Stdin, f)
	sess.Stdin.Close()
}

// waitProcess records how p ended and tells containerd.
func (s *Service) waitProcess(t *task, p *process, sess *sdk.Session, closeOut func()) {
	st, err := sess.Wait()
	code := exitCode(st)
	if err != nil {
		s.log.Warn("lost the process", "task", t.id, "exec", p.id, "err", err)
		code = 255
	}
	closeOut()
	p.mu.Lock()
	p.status = tasktypes.Status_STOPPED
	p.exitCode = code
	p.exitedAt = time.Now()
	if p.stdinFile != nil {
		p.stdinFile.Close()
	}
	pid, at := p.pid, p.exitedAt
	close(p.exited)
	p.mu.Unlock()
	if st.OOMKilled {
		s.events.Publish(TopicOOM, &eventstypes.TaskOOM{ContainerID: t.id})
	}
	id := p.id
	if id == "" {
		id = t.id
	}
	s.events.Publish(TopicExit, &eventstypes.TaskExit{ContainerID: t.id, ID: id, Pid: pid, ExitStatus: code, ExitedAt: timestamppb.New(at)})
}

// exitCode is the wait status containerd expects: the code, or 128+signal.
func exitCode(st api.ExitStatus) uint32 {
	if st.Signal != "" {
		if n := unix.SignalNum("SIG" + st.Signal); n > 0 {
			return 128 + uint32(n)
		}
		if n, err := strconv.Atoi(st.Signal); err == nil && n > 0 {
			return 128 + uint32(n)
		}
		return 137
	}
	if st.ExitCode < 0 || st.ExitCode > 255 {
		return 255
	}
	return uint32(st.ExitCode)
}

// envMap turns an OCI environment into the API's map (a later entry for
// the same name wins, as in execve's environment lookups by libc).
func envMap(env []string) map[string]string {
	m := make(map[string]string, len(env))
	for _, kv := range env {
		k, v, ok := cutEnv(kv)
		if ok {
			m[k] = v
		}
	}
	return m
}

func cutEnv(kv string) (string, string, bool) {
	for i := 0; i < len(kv); i++ {
		if kv[i] == '=' {
			return kv[:i], kv[i+1:], i > 0
		}
	}
	return "", "", false
}

// openOutput opens a CRI output FIFO for writing. O_RDWR never blocks on
// a FIFO (CRI opened its reader before Create anyway); the shim only
// writes, and closes it when the process exits so CRI sees EOF.
func openOutput(p string) (*os.File, error) {
	if p == "" {
		return nil, nil
	}
	return os.OpenFile(p, os.O_RDWR, 0)
}

func closeFile(f *os.File) {
	if f != nil {
		f.Close()
	}
}

func writerOf(f *os.File) io.Writer {
	if f == nil {
		return nil
	}
	return f
}

// Exec records an exec of a container; Start runs it.
func (s *Service) Exec(ctx context.Context, r *taskapi.ExecProcessRequest) (*emptypb.Empty, error) {
	var sp ociProcess
	if r.Spec == nil || json.Unmarshal(r.Spec.GetValue(), &sp) != nil {
		return nil, status.Errorf(codes.InvalidArgument, "space shim: exec %s: the process spec is not an OCI process (JSON)", r.ExecID)
	}
	s.mu.Lock()
	t, ok := s.tasks[r.ID]
	if !ok {
		s.mu.Unlock()
		return nil, notFound("task " + r.ID)
	}
	if t.pod {
		s.mu.Unlock()
		return nil, status.Errorf(codes.FailedPrecondition, "space shim: the pod task %s runs no processes to exec beside", r.ID)
	}
	if _, dup := t.execs[r.ExecID]; dup {
		s.mu.Unlock()
		return nil, status.Errorf(codes.AlreadyExists, "exec %s already exists", r.ExecID)
	}
	t.execs[r.ExecID] = newProcess(r.ExecID, &sp, r.Stdin, r.Stdout, r.Stderr, r.Terminal)
	s.mu.Unlock()
	s.events.Publish(TopicExecAdded, &eventstypes.TaskExecAdded{ContainerID: r.ID, ExecID: r.ExecID})
	return &emptypb.Empty{}, nil
}

// State reports a task's or exec's state.
func (s *Service) State(ctx context.Context, r *taskapi.StateRequest) (*taskapi.StateResponse, error) {
	t, p, err := s.get(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	st := &taskapi.StateResponse{
		ID: r.ID, ExecID: r.ExecID, Bundle: t.bundle, Pid: p.pid, Status: p.status,
		Stdin: p.stdin, Stdout: p.stdout, Stderr: p.stderr, Terminal: p.tty, ExitStatus: p.exitCode,
	}
	if p.status == tasktypes.Status_RUNNING && s.podPaused() {
		st.Status = tasktypes.Status_PAUSED
	}
	if !p.exitedAt.IsZero() {
		st.ExitedAt = timestamppb.New(p.exitedAt)
	}
	return st, nil
}

// Kill signals a process. Killing an exited process succeeds. The pod
// task has no process: a kill ends it (128+signal).
func (s *Service) Kill(ctx context.Context, r *taskapi.KillRequest) (*emptypb.Empty, error) {
	t, p, err := s.get(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	sig := r.Signal
	if sig == 0 {
		sig = uint32(unix.SIGKILL)
	}
	p.mu.Lock()
	sess, cmd, stat := p.sess, p.cmd, p.status
	p.mu.Unlock()
	if stat == tasktypes.Status_STOPPED {
		return &emptypb.Empty{}, nil
	}
	if t.pod || sess == nil {
		s.endWithoutProcess(t, p, 128+sig)
		return &emptypb.Empty{}, nil
	}
	pod, err := s.podOf()
	if err != nil {
		return nil, err
	}
	if err := pod.client.SignalCommand(ctx, pod.sandboxID, cmd.ID, strconv.FormatUint(uint64(sig), 10)); err != nil {
		select {
		case <-p.exited: // it ended meanwhile
			return &emptypb.Empty{}, nil
		default:
		}
		return nil, status.Errorf(codes.Unknown, "space shim: signal %d to %s: %v", sig, t.id, err)
	}
	return &emptypb.Empty{}, nil
}

// endWithoutProcess ends a task that has no process in the sandbox (the
// pod, or a container killed before it started).
func (s *Service) endWithoutProcess(t *task, p *process, code uint32) {
	p.mu.Lock()
	if p.status == tasktypes.Status_STOPPED {
		p.mu.Unlock()
		return
	}
	p.status = tasktypes.Status_STOPPED
	p.exitCode = code
	p.exitedAt = time.Now()
	pid, at := p.pid, p.exitedAt
	close(p.exited)
	p.mu.Unlock()
	id := p.id
	if id == "" {
		id = t.id
	}
	s.events.Publish(TopicExit, &eventstypes.TaskExit{ContainerID: t.id, ID: id, Pid: pid, ExitStatus: code, ExitedAt: timestamppb.New(at)})
}

// Wait blocks until the process has exited.
func (s *Service) Wait(ctx context.Context, r *taskapi.WaitRequest) (*taskapi.WaitResponse, error) {
	_, p, err := s.get(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	select {
	case <-p.exited:
	case <-ctx.Done():
		return nil, status.FromContextError(ctx.Err()).Err()
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return &taskapi.WaitResponse{ExitStatus: p.exitCode, ExitedAt: timestamppb.New(p.exitedAt)}, nil
}

// Delete forgets an exited process; for a container its tree in the
// sandbox is removed, for the pod the sandbox is deleted.
func (s *Service) Delete(ctx context.Context, r *taskapi.DeleteRequest) (*taskapi.DeleteResponse, error) {
	t, p, err := s.get(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	p.mu.Lock()
	running := p.status == tasktypes.Status_RUNNING && p.sess != nil
	p.mu.Unlock()
	if running {
		return nil, status.Errorf(codes.FailedPrecondition, "space shim: %s %s is still running; kill it first", t.id, r.ExecID)
	}
	if p.status == tasktypes.Status_CREATED || t.pod {
		s.endWithoutProcess(t, p, 128+uint32(unix.SIGKILL))
	}
	p.mu.Lock()
	resp := &taskapi.DeleteResponse{Pid: p.pid, ExitStatus: p.exitCode, ExitedAt: timestamppb.New(p.exitedAt)}
	p.mu.Unlock()
	if r.ExecID != "" {
		s.mu.Lock()
		delete(t.execs, r.ExecID)
		s.mu.Unlock()
		return resp, nil
	}
	pod, _ := s.podOf()
	switch {
	case pod != nil && pod.id == t.id:
		s.deleteSandbox(pod)
		s.mu.Lock()
		s.pod = nil
		s.mu.Unlock()
	case pod != nil && t.root != "":
		if err := pod.client.RemoveFile(ctx, pod.sandboxID, path.Dir(t.root), true); err != nil && !errors.Is(err, sdk.ErrNotFound) {
			s.log.Warn("removing the container's tree", "task", t.id, "err", err)
		}
	}
	if err := unmountAll(filepath.Join(t.bundle, "rootfs")); err != nil {
		s.log.Warn("unmount", "err", err)
	}
	s.mu.Lock()
	delete(s.tasks, t.id)
	s.mu.Unlock()
	s.events.Publish(TopicDelete, &eventstypes.TaskDelete{ContainerID: t.id, Pid: resp.Pid, ExitStatus: resp.ExitStatus, ExitedAt: resp.ExitedAt})
	return resp, nil
}

// Pids lists the task's processes as their pids in the sandbox.
func (s *Service) Pids(ctx context.Context, r *taskapi.PidsRequest) (*taskapi.PidsResponse, error) {
	t, _, err := s.get(r.ID, "")
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	procs := []*process{t.init}
	for _, p := range t.execs {
		procs = append(procs, p)
	}
	s.mu.Unlock()
	var out []*tasktypes.ProcessInfo
	for _, p := range procs {
		p.mu.Lock()
		if p.pid > 0 && p.status == tasktypes.Status_RUNNING {
			out = append(out, &tasktypes.ProcessInfo{Pid: p.pid})
		}
		p.mu.Unlock()
	}
	return &taskapi.PidsResponse{Processes: out}, nil
}

func (s *Service) podPaused() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.pod != nil && s.pod.paused
}

// Pause pauses the pod's sandbox: every container of the pod with it.
func (s *Service) Pause(ctx context.Context, r *taskapi.PauseRequest) (*emptypb.Empty, error) {
	return s.lifecycle(ctx, r.ID, true)
}

// Resume resumes the pod's sandbox.
func (s *Service) Resume(ctx context.Context, r *taskapi.ResumeRequest) (*emptypb.Empty, error) {
	return s.lifecycle(ctx, r.ID, false)
}

func (s *Service) lifecycle(ctx context.Context, id string, pause bool) (*emptypb.Empty, error) {
	if _, _, err := s.get(id, ""); err != nil {
		return nil, err
	}
	pod, err := s.podOf()
	if err != nil {
		return nil, err
	}
	op, err := pod.client.Pause(ctx, pod.sandboxID)
	if !pause {
		op, err = pod.client.Resume(ctx, pod.sandboxID)
	}
	if err == nil {
		_, err = pod.client.WaitOperation(ctx, op.ID)
	}
	if err != nil {
		return nil, status.Errorf(codes.Unknown, "space shim: %v", err)
	}
	s.mu.Lock()
	pod.paused = pause
	s.mu.Unlock()
	if pause {
		s.events.Publish(TopicPaused, &eventstypes.TaskPaused{ContainerID: id})
	} else {
		s.events.Publish(TopicResumed, &eventstypes.TaskResumed{ContainerID: id})
	}
	return &emptypb.Empty{}, nil
}

// Checkpoint is not supported.
func (s *Service) Checkpoint(ctx context.Context, r *taskapi.CheckpointTaskRequest) (*emptypb.Empty, error) {
	return nil, status.Error(codes.Unimplemented, "space shim: checkpoint is not supported (space suspends whole sandboxes through its own API: space sandbox suspend)")
}

// Update is not supported.
func (s *Service) Update(ctx context.Context, r *taskapi.UpdateTaskRequest) (*emptypb.Empty, error) {
	return nil, status.Error(codes.Unimplemented, "space shim: updating a task's resources is not supported (a pod's limits are its sandbox's, fixed at create)")
}

// ResizePty resizes a TTY process's terminal.
func (s *Service) ResizePty(ctx context.Context, r *taskapi.ResizePtyRequest) (*emptypb.Empty, error) {
	_, p, err := s.get(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	p.mu.Lock()
	sess := p.sess
	p.mu.Unlock()
	if sess == nil || !p.tty {
		return &emptypb.Empty{}, nil
	}
	if r.Height == 0 || r.Width == 0 || r.Height > 65535 || r.Width > 65535 {
		return nil, status.Errorf(codes.InvalidArgument, "space shim: resize to %dx%d", r.Width, r.Height)
	}
	if err := sess.Resize(uint16(r.Height), uint16(r.Width)); err != nil {
		return nil, status.Errorf(codes.Unknown, "space shim: resize: %v", err)
	}
	return &emptypb.Empty{}, nil
}

// CloseIO closes a process's stdin.
func (s *Service) CloseIO(ctx context.Context, r *taskapi.CloseIORequest) (*emptypb.Empty, error) {
	_, p, err := s.get(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	p.mu.Lock()
	sess, f := p.sess, p.stdinFile
	p.mu.Unlock()
	if f != nil {
		f.Close()
	}
	if sess != nil {
		sess.Stdin.Close()
	}
	return &emptypb.Empty{}, nil
}

// Stats reports the pod sandbox's use as cgroup v1 metrics.
func (s *Service) Stats(ctx context.Context, r *taskapi.StatsRequest) (*taskapi.StatsResponse, error) {
	if _, _, err := s.get(r.ID, ""); err != nil {
		return nil, err
	}
	pod, err := s.podOf()
	if err != nil {
		return nil, err
	}
	st, err := pod.client.Stats(ctx, pod.sandboxID)
	if err != nil {
		return nil, status.Errorf(codes.Unknown, "space shim: stats: %v", err)
	}
	return &taskapi.StatsResponse{Stats: encodeMetrics(st)}, nil
}

// Connect tells containerd the shim's and the task's pids.
func (s *Service) Connect(ctx context.Context, r *taskapi.ConnectRequest) (*taskapi.ConnectResponse, error) {
	resp := &taskapi.ConnectResponse{ShimPid: uint32(os.Getpid()), Version: "space"}
	if _, p, err := s.get(r.ID, ""); err == nil {
		p.mu.Lock()
		resp.TaskPid = p.pid
		p.mu.Unlock()
	}
	return resp, nil
}

// Shutdown stops the daemon once no task is left (containerd calls it
// after each task's delete).
func (s *Service) Shutdown(ctx context.Context, r *taskapi.ShutdownRequest) (*emptypb.Empty, error) {
	s.mu.Lock()
	n := len(s.tasks)
	s.mu.Unlock()
	if n == 0 && s.exit != nil {
		go s.exit()
	}
	return &emptypb.Empty{}, nil
}

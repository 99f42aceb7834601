package shim

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime/debug"
	"strings"
	"syscall"
	"time"

	taskapi "github.com/containerd/containerd/api/runtime/task/v2"
	"github.com/containerd/ttrpc"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/spacehq/space/sdk"
)

// serveAction is the hidden action `start` runs the daemon with.
const serveAction = "serve"

// flags is containerd's shim command line.
type flags struct {
	namespace, address, publishBinary, id, bundle, socket string
	debug, version                                        bool
	action                                                string
}

func parseFlags(args []string, stderr io.Writer) (*flags, error) {
	var f flags
	fs := flag.NewFlagSet("containerd-shim-space-v2", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&f.namespace, "namespace", "", "containerd namespace")
	fs.StringVar(&f.address, "address", "", "containerd's grpc address")
	fs.StringVar(&f.publishBinary, "publish-binary", "", "containerd binary (unused: events go over ttrpc)")
	fs.StringVar(&f.id, "id", "", "task id")
	fs.StringVar(&f.bundle, "bundle", "", "bundle directory (delete)")
	fs.StringVar(&f.socket, "socket", "", "unused")
	fs.BoolVar(&f.debug, "debug", false, "debug logging")
	// As containerd's own shims (pkg/shim): -v prints the version and
	// exits, needing no other flag.
	fs.BoolVar(&f.version, "v", false, "show the shim version and exit")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	f.action = fs.Arg(0)
	if f.version {
		return &f, nil
	}
	if f.namespace == "" {
		return nil, errors.New("-namespace is required")
	}
	return &f, nil
}

// Main runs the shim binary: `start`, `delete`, or the daemon.
func Main(args []string, stdin io.Reader, stdout, stderr io.Writer) error {
	f, err := parseFlags(args, stderr)
	if err != nil {
		return err
	}
	if f.version {
		_, err := io.WriteString(stdout, versionText())
		return err
	}
	switch f.action {
	case "start":
		addr, err := start(f)
		if err != nil {
			return err
		}
		_, err = io.WriteString(stdout, addr)
		return err
	case "delete":
		resp, err := deleteBundle(f, stderr)
		if err != nil {
			return err
		}
		b, err := proto.Marshal(resp)
		if err != nil {
			return err
		}
		_, err = stdout.Write(b)
		return err
	case serveAction:
		return serve(f)
	default:
		return fmt.Errorf("unknown action %q (want start or delete)", f.action)
	}
}

// versionText is what -v prints, in the layout of containerd's shims
// (name, then indented Version, Revision and Go version lines), from the
// binary's build information.
func versionText() string {
	version, revision, goVersion := "unknown", "unknown", "unknown"
	if bi, ok := debug.ReadBuildInfo(); ok {
		goVersion = bi.GoVersion
		if v := bi.Main.Version; v != "" {
			version = v
		}
		for _, s := range bi.Settings {
			if s.Key == "vcs.revision" {
				revision = s.Value
			}
		}
	}
	return fmt.Sprintf("containerd-shim-space-v2:\n  Version:  %s\n  Revision: %s\n  Go version: %s\n", version, revision, goVersion)
}

// start returns the address of the pod's shim daemon, starting it for the
// pod's first task. cwd is the task's bundle.
func start(f *flags) (string, error) {
	bundle, err := os.Getwd()
	if err != nil {
		return "", err
	}
	spec, err := readSpec(bundle)
	if err != nil {
		return "", err
	}
	dir := socketDir()
	sock, err := SocketPath(dir, f.namespace, spec.group(f.id))
	if err != nil {
		return "", err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", err
	}
	// One start at a time per pod: the lock is the socket path + ".lock".
	lock, err := os.OpenFile(sock+".lock", os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return "", err
	}
	defer lock.Close()
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil {
		return "", err
	}
	addr := Address(sock)
	if c, err := net.DialTimeout("unix", sock, time.Second); err == nil {
		c.Close()
		return addr, writeAddress(bundle, addr)
	}
	os.Remove(sock)
	l, err := net.Listen("unix", sock)
	if err != nil {
		return "", err
	}
	// The daemon serves the socket: closing this copy must not unlink it.
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	defer l.Close()
	if err := os.Chmod(sock, 0o600); err != nil {
		return "", err
	}
	lf, err := l.(*net.UnixListener).File()
	if err != nil {
		return "", err
	}
	defer lf.Close()
	self, err := os.Executable()
	if err != nil {
		return "", err
	}
	logf, err := os.OpenFile(strings.TrimSuffix(sock, ".sock")+".log", os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return "", err
	}
	defer logf.Close()
	args := []string{"-namespace", f.namespace, "-id", f.id, "-address", f.address, "-socket", sock}
	if f.debug {
		args = append(args, "-debug")
	}
	cmd := exec.Command(self, append(args, serveAction)...)
	cmd.Dir = "/"
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.ExtraFiles = []*os.File{lf}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		os.Remove(sock)
		return "", fmt.Errorf("starting the shim daemon: %w", err)
	}
	cmd.Process.Release() // start exits while the daemon serves
	return addr, writeAddress(bundle, addr)
}

// writeAddress writes <bundle>/address, which containerd reads to
// reconnect to a running shim after its own restart.
func writeAddress(bundle, addr string) error {
	tmp := filepath.Join(bundle, ".address.tmp")
	if err := os.WriteFile(tmp, []byte(addr), 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, filepath.Join(bundle, "address"))
}

// serve is the daemon: the task service on the listener `start` passed
// as fd 3, until Shutdown finds no task left.
func serve(f *flags) error {
	level := slog.LevelInfo
	if f.debug {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level})).With("ns", f.namespace)
	l, err := net.FileListener(os.NewFile(3, "listener"))
	if err != nil {
		return fmt.Errorf("listener: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ttrpcAddr := os.Getenv("TTRPC_ADDRESS")
	if ttrpcAddr == "" {
		ttrpcAddr = f.address + ".ttrpc"
	}
	pub := NewTTRPCPublisher(ttrpcAddr, f.namespace, log)
	done := make(chan struct{})
	var once bool
	exit := func() {
		time.Sleep(50 * time.Millisecond) // let Shutdown's reply go out
		if !once {
			once = true
			close(done)
		}
	}
	svc := NewService(ctx, f.namespace, pub, log, exit)
	srv, err := ttrpc.NewServer(ttrpc.WithServerHandshaker(ttrpc.UnixSocketRequireSameUser()), ttrpc.WithUnaryServerInterceptor(svc.RecoverInterceptor))
	if err != nil {
		return err
	}
	taskapi.RegisterTaskService(srv, svc)
	go func() {
		if err := srv.Serve(ctx, l); err != nil && !errors.Is(err, ttrpc.ErrServerClosed) {
			log.Error("ttrpc serve", "err", err)
		}
	}()
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, unix.SIGTERM, unix.SIGINT)
	signal.Ignore(unix.SIGPIPE, unix.SIGHUP)
	select {
	case <-done:
		log.Info("exiting: no task left after Shutdown")
	case s := <-sigs:
		log.Info("exiting on signal", "signal", s)
	}
	sctx, scancel := context.WithTimeout(context.Background(), 2*time.Second)
	srv.Shutdown(sctx)
	scancel()
	pub.Close()
	if f.socket != "" {
		os.Remove(f.socket)
		os.Remove(f.socket + ".lock")
		os.Remove(strings.TrimSuffix(f.socket, ".sock") + ".log")
	}
	return nil
}

// deleteBundle is the `delete` action: it runs after every task's
// deletion, also when the daemon has died. It unmounts <bundle>/rootfs if
// still mounted and, for a pod, deletes the pod's sandbox if it is still
// there (found by its containerd-id label), so a dead shim leaves no
// sandbox behind.
func deleteBundle(f *flags, stderr io.Writer) (*taskapi.DeleteResponse, error) {
	bundle := f.bundle
	if bundle == "" {
		var err error
		if bundle, err = os.Getwd(); err != nil {
			return nil, err
		}
	}
	if err := unmountAll(filepath.Join(bundle, "rootfs")); err != nil {
		fmt.Fprintln(stderr, "space shim delete:", err)
	}
	resp := &taskapi.DeleteResponse{ExitedAt: timestamppb.Now(), ExitStatus: 128 + uint32(unix.SIGKILL)}
	b, err := os.ReadFile(filepath.Join(bundle, stateFile))
	if err != nil {
		return resp, nil
	}
	var st bundleState
	if json.Unmarshal(b, &st) != nil || !st.Pod {
		return resp, nil
	}
	cfg, err := LoadConfig(st.ConfigPath)
	if err != nil {
		fmt.Fprintln(stderr, "space shim delete:", err)
		return resp, nil
	}
	c, err := sdk.New(cfg.Server, cfg.apiKey)
	if err != nil {
		return resp, nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Second)
	defer cancel()
	sbs, err := c.ListSandboxes(ctx, sdk.ListOptions{Labels: map[string]string{LabelContainerdID: f.id, LabelContainerdNS: f.namespace}})
	if err != nil {
		fmt.Fprintln(stderr, "space shim delete: listing sandboxes:", err)
		return resp, nil
	}
	for _, sb := range sbs {
		if _, err := c.DeleteSandbox(ctx, sb.ID, true); err != nil && !errors.Is(err, sdk.ErrNotFound) {
			fmt.Fprintln(stderr, "space shim delete: deleting sandbox", sb.ID+":", err)
		}
	}
	return resp, nil
}

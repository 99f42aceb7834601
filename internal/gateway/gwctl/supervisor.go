package gwctl

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/spacehq/space/internal/runtime/hostproc"
)

// UID is the uid and gid the gateway runs as: no sandbox's user namespace
// maps onto it (sandbox ids start at confine.IDBase), so no sandbox process
// can signal or trace the gateway, and it owns nothing on the host.
const UID = 99999999

// Settings are the gateway process's command-line settings.
type Settings struct {
	DNSUpstream  string   // host:port
	AllowPrivate []string // CIDRs
	Protect      []string // ip or ip:port never reachable (the API listener)
	// DialGuard "loopback" makes the gateway refuse, and log as a
	// violation, every dial off this machine (tests).
	DialGuard string
	// BandwidthMiB caps what one sandbox moves in each direction (MiB/s;
	// 0: no cap).
	BandwidthMiB int64
	// UpstreamCA is a PEM file of extra roots the gateway trusts for the
	// real hosts of intercepted connections (tests' local HTTPS servers).
	UpstreamCA string
}

func (s Settings) args() []string {
	a := []string{"--control-fd", "3", "--user", fmt.Sprint(UID), "--dns-upstream", s.DNSUpstream}
	if len(s.AllowPrivate) > 0 {
		a = append(a, "--allow-private", strings.Join(s.AllowPrivate, ","))
	}
	if len(s.Protect) > 0 {
		a = append(a, "--protect", strings.Join(s.Protect, ","))
	}
	if s.BandwidthMiB > 0 {
		a = append(a, "--bandwidth-mib", fmt.Sprint(s.BandwidthMiB))
	}
	if s.UpstreamCA != "" {
		a = append(a, "--upstream-ca", s.UpstreamCA)
	}
	if s.DialGuard != "" {
		a = append(a, "--dial-guard", s.DialGuard)
	}
	return a
}

// Supervisor keeps one gateway process running for the server: it adopts
// the one a previous server started (so a server restart cuts no sandbox
// off), starts one when there is none, and restarts it if it dies.
type Supervisor struct {
	Binary   string // space-gateway
	Dir      string // <data>/gateway (0700): ctl.sock, gateway.pid, gateway.log
	Settings Settings
	Logger   *slog.Logger
	// OnRestart is called after a new gateway replaced one that died, so
	// the links it lost are attached again.
	OnRestart func()

	client Client
	mu     sync.Mutex
	proc   *hostproc.Process
	cancel context.CancelFunc
	done   chan struct{}
}

func (s *Supervisor) sock() string     { return filepath.Join(s.Dir, "ctl.sock") }
func (s *Supervisor) pidFile() string  { return filepath.Join(s.Dir, "gateway.pid") }
func (s *Supervisor) argsFile() string { return filepath.Join(s.Dir, "gateway.args") }
func (s *Supervisor) logFile() string  { return filepath.Join(s.Dir, "gateway.log") }

// Client returns the control client (valid after Start).
func (s *Supervisor) Client() *Client { return &s.client }

// Start adopts or starts the gateway and begins watching it.
func (s *Supervisor) Start(ctx context.Context) error {
	if s.Logger == nil {
		s.Logger = slog.Default()
	}
	if err := os.MkdirAll(s.Dir, 0o700); err != nil {
		return err
	}
	if err := os.Chmod(s.Dir, 0o700); err != nil {
		return err
	}
	s.client.Path = s.sock()
	proc, err := s.adopt(ctx)
	if err != nil {
		if proc, err = s.spawn(ctx); err != nil {
			return err
		}
	}
	wctx, cancel := context.WithCancel(context.Background())
	s.mu.Lock()
	s.proc, s.cancel, s.done = proc, cancel, make(chan struct{})
	s.mu.Unlock()
	go s.watch(wctx)
	return nil
}

// adopt takes over a gateway that still runs with the same settings.
func (s *Supervisor) adopt(ctx context.Context) (*hostproc.Process, error) {
	proc, err := hostproc.Adopt(s.pidFile())
	if err != nil {
		return nil, err
	}
	want := s.fingerprint()
	got, _ := os.ReadFile(s.argsFile())
	pid, perr := s.client.Ping(ctx)
	if string(got) == want && perr == nil && pid == proc.Pid() {
		s.Logger.Info("gateway adopted", "pid", pid)
		return proc, nil
	}
	// Another binary or other settings: replace it (reconcile re-attaches
	// every running sandbox to the new one).
	s.Logger.Info("replacing gateway", "pid", proc.Pid(), "settings_changed", string(got) != want, "ping_err", perr)
	_ = proc.Signal(syscall.SIGKILL)
	select {
	case <-proc.Exited():
	case <-time.After(5 * time.Second):
	}
	proc.Close()
	return nil, errors.New("replaced")
}

func (s *Supervisor) fingerprint() string {
	h := sha256.New()
	fi, err := os.Stat(s.Binary)
	if err == nil {
		fmt.Fprintf(h, "%s %d %d\n", s.Binary, fi.Size(), fi.ModTime().UnixNano())
	}
	fmt.Fprintln(h, strings.Join(s.Settings.args(), "\x00"))
	return hex.EncodeToString(h.Sum(nil))
}

// spawn starts a new gateway on a fresh control socket.
func (s *Supervisor) spawn(ctx context.Context) (*hostproc.Process, error) {
	_ = os.Remove(s.sock())
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: s.sock(), Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("gateway control socket: %w", err)
	}
	ln.SetUnlinkOnClose(false)
	lf, err := ln.File()
	ln.Close()
	if err != nil {
		return nil, err
	}
	defer lf.Close()
	logf, err := os.OpenFile(s.logFile(), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	cmd := exec.Command(s.Binary, s.Settings.args()...)
	cmd.Dir = "/"
	cmd.Env = []string{"GOMAXPROCS=2"}
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.ExtraFiles = []*os.File{lf}
	cmd.SysProcAttr = &syscall.SysProcAttr{
		// Outlives the server, never gets its terminal's signals. It
		// starts as root and switches to UID itself, first thing (Main).
		Setsid: true,
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start gateway: %w", err)
	}
	go func() { _ = cmd.Wait() }() // reap; the watcher uses the pidfd
	proc, err := hostproc.OpenPid(cmd.Process.Pid)
	if err != nil {
		return nil, fmt.Errorf("gateway exited at once (see %s): %w", s.logFile(), err)
	}
	if err := hostproc.WritePidFile(s.pidFile(), proc.Record()); err != nil {
		_ = proc.Signal(syscall.SIGKILL)
		return nil, err
	}
	_ = os.WriteFile(s.argsFile(), []byte(s.fingerprint()), 0o600)
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := s.client.Ping(ctx); err == nil {
			break
		}
		select {
		case <-proc.Exited():
			return nil, fmt.Errorf("gateway exited at start: %s", tail(s.logFile()))
		case <-time.After(5 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			_ = proc.Signal(syscall.SIGKILL)
			return nil, fmt.Errorf("gateway did not answer in 10s: %s", tail(s.logFile()))
		}
	}
	s.Logger.Info("gateway started", "pid", proc.Pid())
	return proc, nil
}

// watch restarts the gateway whenever it dies, until Close.
func (s *Supervisor) watch(ctx context.Context) {
	defer close(s.done)
	backoff := 100 * time.Millisecond
	for {
		s.mu.Lock()
		proc := s.proc
		s.mu.Unlock()
		select {
		case <-ctx.Done():
			return
		case <-proc.Exited():
		}
		proc.Close()
		s.Logger.Error("gateway died; restarting", "log_tail", tail(s.logFile()))
		for {
			np, err := s.spawn(ctx)
			if err == nil {
				s.mu.Lock()
				s.proc = np
				s.mu.Unlock()
				break
			}
			s.Logger.Error("gateway restart failed", "err", err)
			select {
			case <-ctx.Done():
				return
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, 10*time.Second)
		}
		if s.OnRestart != nil {
			s.OnRestart()
		}
	}
}

// Close stops watching. The gateway keeps running (a restarted server
// adopts it) unless stop is set.
func (s *Supervisor) Close(stop bool) {
	s.mu.Lock()
	cancel, done, proc := s.cancel, s.done, s.proc
	s.mu.Unlock()
	if cancel == nil {
		return
	}
	cancel()
	<-done
	if stop && proc != nil {
		_ = proc.Signal(syscall.SIGTERM)
		select {
		case <-proc.Exited():
		case <-time.After(5 * time.Second):
			_ = proc.Signal(syscall.SIGKILL)
		}
	}
	if proc != nil {
		proc.Close()
	}
}

// Pid is the gateway's current pid (0 if none).
func (s *Supervisor) Pid() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc == nil {
		return 0
	}
	return s.proc.Pid()
}

func tail(path string) string {
	b, _ := os.ReadFile(path)
	if len(b) > 2048 {
		b = b[len(b)-2048:]
	}
	return strings.TrimSpace(string(b))
}

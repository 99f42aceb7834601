package agent

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/yamux"
	"golang.org/x/sys/unix"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/internal/agentproto"
	"github.com/spacehq/space/internal/errdefs"
)

// Version is reported by PathHealth; the build may override it with -ldflags -X.
var Version = "dev"

// DefaultMaxProcs caps the processes (running or exited but not yet
// forgotten) one agent tracks, so a runaway host cannot exhaust its memory
// with replay buffers.
const DefaultMaxProcs = 1024

// Config configures an Agent.
type Config struct {
	// Root is the directory every FILE operation is confined to ("/" inside a
	// sandbox). Processes are not chrooted to it.
	Root string
	// MaxProcs caps tracked processes; 0 means DefaultMaxProcs.
	MaxProcs int
	// MaxWatches caps the directories one recursive watch follows; 0
	// means agentproto.MaxWatches.
	MaxWatches int
	// RingBytes is the replay buffer per output stream; 0 means
	// agentproto.DefaultRingBytes.
	RingBytes int
	// AttachStall is how long a live attach may hold a process's output
	// back without taking any (see proc.pump); 0 means DefaultAttachStall.
	AttachStall time.Duration
	// IdleTrim, if positive, returns free memory to the kernel after this
	// long without a request in flight (see memory.go). The agent binary
	// uses DefaultIdleTrim.
	IdleTrim time.Duration
	// OwnsSystem says the agent is its sandbox's init and may change
	// system-wide state on PathRestored (hostname, clock). Off in tests
	// that run an agent on the host.
	OwnsSystem bool
	Logger     *slog.Logger
}

// idleStreamTimeout closes keep-alive streams nobody uses: each costs a
// goroutine and buffers, and reopening one is cheap (no round trip).
const idleStreamTimeout = 5 * time.Second

// DefaultAttachStall bounds how long an attached client that stopped
// reading can block the process it is attached to.
const DefaultAttachStall = 5 * time.Second

// Agent serves the agentproto protocol. One Agent serves any number of
// connections, one after another or at once; processes outlive connections.
type Agent struct {
	cfg    Config
	log    *slog.Logger
	root   *fsRoot
	reaper *reaper
	srv    *http.Server
	trim   *idleTrimmer // nil without Config.IdleTrim

	mu    sync.Mutex
	procs map[string]*proc

	lc listenCtl // host sessions and listener, for PathQuiesce

	watches atomic.Int64 // open PathFilesWatch streams

	closeOnce sync.Once
}

// New builds an agent. It starts the process-wide reaper (see reaper.go).
func New(cfg Config) (*Agent, error) {
	if cfg.Root == "" {
		cfg.Root = "/"
	}
	if cfg.MaxProcs <= 0 {
		cfg.MaxProcs = DefaultMaxProcs
	}
	if cfg.MaxWatches <= 0 {
		cfg.MaxWatches = agentproto.MaxWatches
	}
	if cfg.RingBytes <= 0 {
		cfg.RingBytes = agentproto.DefaultRingBytes
	}
	if cfg.AttachStall <= 0 {
		cfg.AttachStall = DefaultAttachStall
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	root, err := openRoot(cfg.Root)
	if err != nil {
		return nil, err
	}
	rp, err := startReaper(cfg.Logger)
	if err != nil {
		root.close()
		return nil, err
	}
	a := &Agent{cfg: cfg, log: cfg.Logger, root: root, reaper: rp, procs: map[string]*proc{}}
	var h http.Handler = a.Handler()
	if cfg.IdleTrim > 0 {
		a.trim = newIdleTrimmer(cfg.IdleTrim, cfg.Logger)
		h = a.trim.wrap(h)
	}
	a.srv = &http.Server{
		Handler:           h,
		ReadHeaderTimeout: 30 * time.Second,
		IdleTimeout:       idleStreamTimeout,
		MaxHeaderBytes:    64 << 10,
		ErrorLog:          slog.NewLogLogger(cfg.Logger.Handler(), slog.LevelDebug),
	}
	if a.trim != nil {
		a.srv.ConnState = a.trim.connState
	}
	return a, nil
}

// Handler returns the HTTP handler of the protocol (without yamux).
func (a *Agent) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET "+agentproto.PathHealth, a.handleHealth)
	mux.HandleFunc("POST "+agentproto.PathExec, a.handleExec)
	mux.HandleFunc("POST "+agentproto.PathProcs, a.handleStartProc)
	mux.HandleFunc("GET "+agentproto.PathProcs, a.handleListProcs)
	mux.HandleFunc("GET "+agentproto.PathProcs+"/{id}", a.handleGetProc)
	mux.HandleFunc("DELETE "+agentproto.PathProcs+"/{id}", a.handleForgetProc)
	mux.HandleFunc("GET "+agentproto.PathProcs+"/{id}/attach", a.handleAttach)
	mux.HandleFunc("POST "+agentproto.PathProcs+"/{id}/signal", a.handleSignal)
	mux.HandleFunc("GET "+agentproto.PathFiles, a.handleReadFile)
	mux.HandleFunc("PUT "+agentproto.PathFiles, a.handleWriteFile)
	mux.HandleFunc("DELETE "+agentproto.PathFiles, a.handleRemove)
	mux.HandleFunc("GET "+agentproto.PathFilesStat, a.handleStat)
	mux.HandleFunc("GET "+agentproto.PathFilesList, a.handleList)
	mux.HandleFunc("POST "+agentproto.PathFilesMkdir, a.handleMkdir)
	mux.HandleFunc("POST "+agentproto.PathFilesRename, a.handleRename)
	mux.HandleFunc("POST "+agentproto.PathQuiesce, a.handleQuiesce)
	mux.HandleFunc("POST "+agentproto.PathRestored, a.handleRestored)
	mux.HandleFunc("GET "+agentproto.PathFilesTar, a.handleTarGet)
	mux.HandleFunc("PUT "+agentproto.PathFilesTar, a.handleTarPut)
	mux.HandleFunc("GET "+agentproto.PathFilesWatch, a.handleWatch)
	mux.HandleFunc("GET "+agentproto.PathFilesResolve, a.handleResolve)
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, fmt.Errorf("no route for %s %s: %w", r.Method, r.URL.Path, errdefs.ErrNotFound))
	})
	return mux
}

// YamuxConfig is the multiplexer configuration of the agent's server
// sessions: bounded per-stream windows, keepalives to notice a dead host.
func YamuxConfig() *yamux.Config {
	c := yamux.DefaultConfig()
	c.AcceptBacklog = 256
	c.MaxStreamWindowSize = 256 << 10
	c.KeepAliveInterval = 15 * time.Second
	c.ConnectionWriteTimeout = 10 * time.Second
	c.StreamOpenTimeout = 30 * time.Second
	c.StreamCloseTimeout = time.Minute
	c.LogOutput = nil
	c.Logger = slog.NewLogLogger(slog.New(slog.NewTextHandler(io.Discard, nil)).Handler(), slog.LevelDebug)
	return c
}

// ServeConn runs one yamux server session over conn and serves HTTP on it
// until the session dies. It closes conn.
func (a *Agent) ServeConn(conn io.ReadWriteCloser) error {
	sess, err := yamux.Server(conn, YamuxConfig())
	if err != nil {
		conn.Close()
		return fmt.Errorf("yamux server: %w", err)
	}
	defer sess.Close()
	if !a.lc.track(sess) {
		return nil // quiesced: no host connection until resumed
	}
	defer a.lc.untrack(sess)
	err = a.srv.Serve(sess)
	if errors.Is(err, yamux.ErrSessionShutdown) || errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return err
}

// Serve accepts connections on ln and serves each in its own session. It
// returns when ln fails for good (for example because it was closed).
func (a *Agent) Serve(ln net.Listener) error {
	var backoff time.Duration
	for {
		conn, err := ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return nil
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() || errors.Is(err, unix.EMFILE) || errors.Is(err, unix.ENFILE) || errors.Is(err, unix.ECONNABORTED) {
				backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
				a.log.Warn("accept failed; retrying", "err", err, "backoff", backoff)
				time.Sleep(backoff)
				continue
			}
			return err
		}
		backoff = 0
		go func() {
			if err := a.ServeConn(conn); err != nil {
				a.log.Debug("session ended", "err", err)
			}
		}()
	}
}

// Close kills every tracked process and releases the root.
func (a *Agent) Close() error {
	a.closeOnce.Do(func() {
		a.srv.Close()
		if a.trim != nil {
			a.trim.stop()
		}
		a.mu.Lock()
		procs := make([]*proc, 0, len(a.procs))
		for id, p := range a.procs {
			procs = append(procs, p)
			delete(a.procs, id)
		}
		a.mu.Unlock()
		for _, p := range procs {
			p.kill()
		}
		a.root.close()
	})
	return nil
}

// serveMain is the agent's command line: see package doc and Main.
func serveMain(args []string, envFD string) error {
	fs := flag.NewFlagSet("space-agent", flag.ContinueOnError)
	fd := fs.Int("fd", -1, "listening socket file descriptor (default $"+EnvAgentFD+")")
	sock := fs.String("socket", "", "listen on this unix socket instead of an inherited fd")
	serial := fs.String("serial", "", "serve one session at a time over this character device (virtio-serial port)")
	root := fs.String("root", "/", "directory FILE operations are confined to")
	verbose := fs.Bool("v", false, "debug logging")
	if err := fs.Parse(args); err != nil {
		return err
	}
	level := slog.LevelInfo
	if *verbose {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	if *fd < 0 && *sock == "" && *serial == "" {
		if envFD == "" {
			return errors.New("no listener: pass --fd, --socket or --serial, or set " + EnvAgentFD)
		}
		n, err := strconv.Atoi(envFD)
		if err != nil || n < 0 {
			return fmt.Errorf("%s=%q is not a file descriptor", EnvAgentFD, envFD)
		}
		*fd = n
	}

	if os.Getpid() == 1 {
		// As PID 1 the kernel drops signals without a handler, but the Go
		// runtime installs handlers whose default is to exit: catch the
		// usual termination signals so code in the sandbox cannot stop its
		// agent by `kill 1`. A handler (unlike SIG_IGN) is reset by execve,
		// so children still get default dispositions.
		sigs := make(chan os.Signal, 8)
		signal.Notify(sigs, unix.SIGTERM, unix.SIGINT, unix.SIGHUP, unix.SIGQUIT, unix.SIGUSR1, unix.SIGUSR2, unix.SIGPIPE)
		go func() {
			for s := range sigs {
				log.Debug("ignoring signal", "signal", s)
			}
		}()
	}

	tuneRuntime()
	a, err := New(Config{Root: *root, Logger: log, IdleTrim: DefaultIdleTrim, OwnsSystem: true})
	if err != nil {
		return err
	}
	defer a.Close()

	switch {
	case *serial != "":
		return a.serveSerial(context.Background(), *serial)
	case *sock != "":
		return a.serveSocket(context.Background(), *sock)
	default:
		f := os.NewFile(uintptr(*fd), "agent-listener")
		unix.CloseOnExec(*fd)
		ln, err := net.FileListener(f)
		f.Close()
		if err != nil {
			return fmt.Errorf("fd %d is not a listening socket: %w", *fd, err)
		}
		log.Info("agent listening", "fd", *fd, "root", *root)
		return a.Serve(ln)
	}
}

// serveSerial serves sessions over a character device such as a
// virtio-serial port: one session at a time, reopening the device after the
// host goes away so a reconnecting host gets a fresh session.
func (a *Agent) serveSerial(ctx context.Context, path string) error {
	for ctx.Err() == nil {
		f, err := os.OpenFile(path, os.O_RDWR, 0)
		if err != nil {
			return err
		}
		if err := a.ServeConn(f); err != nil {
			a.log.Info("serial session ended", "err", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	return ctx.Err()
}

func (a *Agent) handleHealth(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, agentproto.Health{Version: Version, Pid: os.Getpid(), Watches: int(a.watches.Load())})
}

// writeJSON writes v with status.
func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		writeError(w, fmt.Errorf("encoding response: %w", err))
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(status)
	w.Write(b)
}

// writeError writes err as an api.Error with the status its sentinel maps to.
func writeError(w http.ResponseWriter, err error) {
	status := errdefs.HTTPStatus(err)
	b, _ := json.Marshal(api.Error{Error: api.ErrorBody{Code: errdefs.Code(err), Message: err.Error()}})
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(status)
	w.Write(b)
}

// decodeJSON reads one bounded JSON value from r's body into v.
func decodeJSON(w http.ResponseWriter, r *http.Request, v any) error {
	body := http.MaxBytesReader(w, r.Body, agentproto.MaxJSONBody)
	dec := json.NewDecoder(body)
	if err := dec.Decode(v); err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			return fmt.Errorf("request body exceeds %d bytes: %w", agentproto.MaxJSONBody, errdefs.ErrTooLarge)
		}
		return fmt.Errorf("decoding request body: %w: %w", err, errdefs.ErrInvalidArgument)
	}
	if dec.More() {
		return fmt.Errorf("request body has trailing data: %w", errdefs.ErrInvalidArgument)
	}
	return nil
}

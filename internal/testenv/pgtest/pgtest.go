// Package pgtest runs a real PostgreSQL server for tests: Debian's
// postgresql package, started on a unix socket in a temporary directory, one
// server per test binary and a fresh database per test.
//
// PostgreSQL refuses to run as root, so initdb and postgres run as the
// "postgres" user the package creates, in a directory under the system temp
// dir chowned to it (t.TempDir() is 0700 root and unreachable for it). The
// postmaster gets SIGQUIT when the test binary dies (Pdeathsig), so a killed
// test leaves no server behind; directories of servers whose postmaster is
// gone are swept at the next start.
package pgtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/spacehq/space/internal/testenv"
)

// Version is the PostgreSQL major version scripts/setup-test.sh installs (Debian 12).
const Version = "15"

// dirPrefix names the server directories under os.TempDir, so the sweep at
// start finds the ones a killed test left.
const dirPrefix = "space-pgtest-"

// BinDir is where Debian installs the server binaries.
func BinDir() string { return filepath.Join("/usr/lib/postgresql", Version, "bin") }

// Server is a running PostgreSQL server owned by this process.
type Server struct {
	dir  string // root of everything: data/, sock/, log
	sock string
	cmd  *exec.Cmd
	done chan struct{} // closed when cmd has been waited for
	// lock is dir/lock, flocked for as long as this process owns dir:
	// another test binary's sweep leaves a locked directory alone.
	lock *os.File
}

// lockFile is the file in a server's directory its owner keeps flocked.
const lockFile = "lock"

var shared struct {
	once sync.Once
	srv  *Server
	err  error
}

// Shared returns the test binary's server, starting it on first use. A host
// without PostgreSQL skips the test locally and fails it in CI. Call
// StopShared from TestMain after m.Run (Pdeathsig stops it anyway if the
// binary dies first).
func Shared(t testing.TB) *Server {
	t.Helper()
	testenv.RequireRoot(t)
	_, err := os.Stat(filepath.Join(BinDir(), "postgres"))
	testenv.Require(t, "postgresql", err == nil, "install Debian's postgresql (scripts/setup-test.sh does)")
	shared.once.Do(func() { shared.srv, shared.err = Start(context.Background()) })
	if shared.err != nil {
		t.Fatalf("start PostgreSQL: %v", shared.err)
	}
	return shared.srv
}

// StopShared stops the shared server if one was started.
func StopShared() {
	if shared.srv != nil {
		shared.srv.Stop()
	}
}

// Start initialises a cluster in a new temporary directory and starts a
// postmaster listening only on a unix socket there.
func Start(ctx context.Context) (*Server, error) {
	pg, err := user.Lookup("postgres")
	if err != nil {
		return nil, fmt.Errorf("the postgres user (from Debian's postgresql package): %w", err)
	}
	uid, _ := strconv.Atoi(pg.Uid)
	gid, _ := strconv.Atoi(pg.Gid)
	sweep()
	dir, err := os.MkdirTemp("", dirPrefix)
	if err != nil {
		return nil, err
	}
	s := &Server{dir: dir, sock: filepath.Join(dir, "sock"), done: make(chan struct{})}
	fail := func(err error) (*Server, error) {
		os.RemoveAll(dir)
		if s.lock != nil {
			s.lock.Close()
		}
		return nil, err
	}
	// Locked before anything else is in the directory: between here and
	// the postmaster's pid file (initdb's single-user backends write a
	// negative pid) only the lock says the directory is in use.
	if s.lock, err = os.OpenFile(filepath.Join(dir, lockFile), os.O_CREATE|os.O_RDWR, 0o600); err != nil {
		return fail(err)
	}
	if err := syscall.Flock(int(s.lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		return fail(fmt.Errorf("locking %s: %w", dir, err))
	}
	if err := os.Mkdir(s.sock, 0o700); err != nil {
		return fail(err)
	}
	for _, p := range []string{dir, s.sock} {
		if err := os.Chown(p, uid, gid); err != nil {
			return fail(err)
		}
	}
	cred := &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}}
	initdb := exec.CommandContext(ctx, filepath.Join(BinDir(), "initdb"), "-D", filepath.Join(dir, "data"),
		"-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8", "--locale=C")
	initdb.Dir = dir
	initdb.SysProcAttr = cred
	if out, err := initdb.CombinedOutput(); err != nil {
		return fail(fmt.Errorf("initdb: %w: %s", err, out))
	}
	logf, err := os.OpenFile(filepath.Join(dir, "postgres.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fail(err)
	}
	defer logf.Close()
	// fsync off: a test database need not survive a power loss, and
	// fsync per commit dominates on this disk.
	s.cmd = exec.Command(filepath.Join(BinDir(), "postgres"), "-D", filepath.Join(dir, "data"),
		"-k", s.sock, "-c", "listen_addresses=", "-c", "fsync=off", "-c", "synchronous_commit=off",
		"-c", "full_page_writes=off", "-c", "max_connections=200")
	s.cmd.Dir = dir
	s.cmd.Stdout, s.cmd.Stderr = logf, logf
	s.cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred.Credential, Pdeathsig: syscall.SIGQUIT, Setpgid: true}
	if err := s.cmd.Start(); err != nil {
		return fail(fmt.Errorf("start postgres: %w", err))
	}
	go func() { s.cmd.Wait(); close(s.done) }()
	deadline := time.Now().Add(30 * time.Second)
	for {
		c, err := pgx.Connect(ctx, s.DSN("postgres"))
		if err == nil {
			c.Close(ctx)
			return s, nil
		}
		select {
		case <-s.done:
			log, _ := os.ReadFile(filepath.Join(dir, "postgres.log"))
			return fail(fmt.Errorf("postgres exited during start: %s", tail(log)))
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			s.Stop()
			return nil, fmt.Errorf("postgres not ready after 30 s: %w", err)
		}
	}
}

// DSN is a connection string for database db on this server.
func (s *Server) DSN(db string) string {
	return fmt.Sprintf("host=%s user=postgres dbname=%s sslmode=disable", s.sock, db)
}

// NewDatabase creates an empty database for t, dropped when t ends, and
// returns its DSN.
func (s *Server) NewDatabase(t testing.TB) string {
	t.Helper()
	var b [6]byte
	rand.Read(b[:])
	name := "t_" + hex.EncodeToString(b[:])
	ctx := context.Background()
	if err := s.admin(ctx, "CREATE DATABASE "+name); err != nil {
		t.Fatalf("create database: %v", err)
	}
	t.Cleanup(func() {
		if err := s.admin(ctx, "DROP DATABASE "+name+" WITH (FORCE)"); err != nil {
			t.Errorf("drop database %s: %v", name, err)
		}
	})
	return s.DSN(name)
}

func (s *Server) admin(ctx context.Context, stmt string) error {
	c, err := pgx.Connect(ctx, s.DSN("postgres"))
	if err != nil {
		return err
	}
	defer c.Close(ctx)
	_, err = c.Exec(ctx, stmt)
	return err
}

// Stop shuts the server down (SIGQUIT: immediate; test data is disposable)
// and removes its directory.
func (s *Server) Stop() {
	if s.cmd != nil && s.cmd.Process != nil {
		s.cmd.Process.Signal(syscall.SIGQUIT)
		select {
		case <-s.done:
		case <-time.After(10 * time.Second):
			syscall.Kill(-s.cmd.Process.Pid, syscall.SIGKILL)
			<-s.done
		}
	}
	os.RemoveAll(s.dir)
	if s.lock != nil {
		s.lock.Close()
	}
}

// sweep removes server directories left by killed test binaries: those
// whose lock no process holds and whose postmaster.pid names no live
// postgres process. A directory with neither lock nor pid file is left
// alone for ten minutes (one made before locks existed). The lock matters
// during initdb, whose single-user backends write a pid file with a
// negative pid: without it another test binary starting at the same
// moment removed a directory in use (an unexplained early failure of
// internal/cluster's tests run beside internal/clusterstore's).
func sweep() {
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), dirPrefix+"*"))
	for _, d := range dirs {
		if locked(filepath.Join(d, lockFile)) {
			continue // a live test binary's server
		}
		pidfile := filepath.Join(d, "data", "postmaster.pid")
		if alive(pidfile) {
			continue
		}
		if _, err := os.Stat(pidfile); errors.Is(err, os.ErrNotExist) {
			if fi, err := os.Stat(d); err == nil && time.Since(fi.ModTime()) < 10*time.Minute {
				continue
			}
		}
		os.RemoveAll(d)
	}
}

// locked reports whether another process holds path's flock.
func locked(path string) bool {
	f, err := os.Open(path)
	if err != nil {
		return false
	}
	defer f.Close()
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		return true
	}
	syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
	return false
}

func alive(pidfile string) bool {
	b, err := os.ReadFile(pidfile)
	if err != nil {
		return false
	}
	first, _, _ := strings.Cut(string(b), "\n")
	pid, err := strconv.Atoi(strings.TrimSpace(first))
	if err != nil || pid <= 0 {
		return false
	}
	comm, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
	return err == nil && strings.HasPrefix(string(comm), "postgres")
}

func tail(b []byte) string {
	if len(b) > 2000 {
		b = b[len(b)-2000:]
	}
	return strings.TrimSpace(string(b))
}

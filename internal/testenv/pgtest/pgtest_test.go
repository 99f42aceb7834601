package pgtest

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

func TestMain(m *testing.M) {
	code := m.Run()
	StopShared()
	os.Exit(code)
}

// The server answers on its socket, a database per test is separate and
// dropped, and the database clock is the host's (heartbeat windows are
// computed on it).
func TestServerAndDatabases(t *testing.T) {
	s := Shared(t)
	ctx := context.Background()
	var dsn string
	t.Run("db", func(t *testing.T) {
		dsn = s.NewDatabase(t)
		c, err := pgx.Connect(ctx, dsn)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close(ctx)
		var now time.Time
		if err := c.QueryRow(ctx, `SELECT now()`).Scan(&now); err != nil {
			t.Fatal(err)
		}
		if d := time.Since(now); d > 5*time.Second || d < -5*time.Second {
			t.Fatalf("database clock %v is %v off the host's", now, d)
		}
	})
	if c, err := pgx.Connect(ctx, dsn); err == nil {
		c.Close(ctx)
		t.Fatal("the test's database survived its cleanup")
	}
}

// A directory whose owner holds its lock survives another binary's sweep,
// even with the negative pid initdb's single-user backends write; once the
// lock is released and no postgres runs, it goes.
func TestSweepSparesALockedDirectory(t *testing.T) {
	dir, err := os.MkdirTemp("", dirPrefix)
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	os.MkdirAll(filepath.Join(dir, "data"), 0o700)
	os.WriteFile(filepath.Join(dir, "data", "postmaster.pid"), []byte("-123456\n"), 0o600)
	f, err := os.OpenFile(filepath.Join(dir, lockFile), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		t.Fatal(err)
	}
	sweep()
	if _, err := os.Stat(dir); err != nil {
		t.Fatalf("sweep removed a locked directory: %v", err)
	}
	f.Close()
	sweep()
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("sweep kept an unlocked directory with no live postgres: %v", err)
	}
}

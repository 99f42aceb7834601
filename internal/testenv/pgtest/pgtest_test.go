package pgtest

import (
	"context"
	"os"
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

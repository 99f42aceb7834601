package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"github.com/spacehq/space/internal/errdefs"
)

// MigrateTables brings the tables of a package that keeps its own tables
// in a SQLite file (named prefix_…; PRAGMA user_version belongs to this
// package) to len(schema): schema[i] migrates version i to i+1, and the
// version lives in the table prefix_schema. One transaction: a crash
// leaves the old version or the new one.
func MigrateTables(ctx context.Context, db *sql.DB, prefix string, schema []string) error {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback()
	table := prefix + "_schema"
	if _, err := tx.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS `+table+` (version INTEGER NOT NULL)`); err != nil {
		return err
	}
	var v int
	err = tx.QueryRowContext(ctx, `SELECT version FROM `+table).Scan(&v)
	if errors.Is(err, sql.ErrNoRows) {
		if _, err := tx.ExecContext(ctx, `INSERT INTO `+table+` (version) VALUES (0)`); err != nil {
			return err
		}
	} else if err != nil {
		return err
	}
	if v > len(schema) {
		return fmt.Errorf("%s schema version %d is newer than this build's %d: %w", prefix, v, len(schema), errdefs.ErrUnprocessable)
	}
	for ; v < len(schema); v++ {
		if _, err := tx.ExecContext(ctx, schema[v]); err != nil {
			return fmt.Errorf("migration %d: %w", v+1, err)
		}
	}
	if _, err := tx.ExecContext(ctx, `UPDATE `+table+` SET version = ?`, v); err != nil {
		return err
	}
	return tx.Commit()
}

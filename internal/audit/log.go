package audit

import (
	"context"
	"crypto/ed25519"
	"database/sql"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	_ "modernc.org/sqlite" // registers the "sqlite" driver (OpenDB)

	"github.com/spacehq/space/internal/principal"
	"github.com/spacehq/space/internal/store"
)

// Defaults of Options.
const (
	DefaultCheckpointEvery    = 1000
	DefaultCheckpointInterval = 60 * time.Second
	DefaultBuffer             = 8192
	DefaultBlockFor           = time.Second
	DefaultRetentionEvery     = time.Minute
)

// maxBatch bounds the records one transaction inserts.
const maxBatch = 1024

// groupCommit is how long the writer waits after a record for the ones that
// usually follow it (an exec's API call, command start and exit arrive
// within a couple of milliseconds), so they share one transaction: a commit
// costs far more than a row. A flush or checkpoint request ends the wait.
const groupCommit = 2 * time.Millisecond

// Options configure a Log.
type Options struct {
	DB  *sql.DB            // where the audit_ tables live (OpenDB, or a store's handle)
	Key ed25519.PrivateKey // signs checkpoints (LoadOrCreateKey)
	// CheckpointEvery signs a checkpoint after this many records;
	// CheckpointInterval after this long when there are unsigned records.
	CheckpointEvery    int
	CheckpointInterval time.Duration
	// RetainAge and RetainRecords bound what is kept (0: no bound). The
	// log is cut only just before a checkpoint, which stays as the signed
	// anchor the rest verifies from, so up to CheckpointEvery more records
	// than asked may remain. RetentionEvery is how often it is applied.
	RetainAge      time.Duration
	RetainRecords  int64
	RetentionEvery time.Duration
	// Buffer is how many events may wait for the writer; when it is full
	// Record waits up to BlockFor, then drops the event and counts it (the
	// count goes into the chain as an "audit"/"dropped" record).
	Buffer   int
	BlockFor time.Duration
	Logger   *slog.Logger
	// Now is the clock (tests); default time.Now.
	Now func() time.Time
}

// Log is the tamper-evident audit log: an append-only hash chain of
// records in SQLite with signed checkpoints. It is a Sink. Record queues
// the event for one writer goroutine, which numbers, chains and inserts
// records in batches (one transaction each, so a crash never leaves half a
// record) and signs checkpoints; Flush waits for what was queued, Close
// flushes, signs the tail and stops.
type Log struct {
	opts  Options
	db    *sql.DB
	keyID string
	log   *slog.Logger

	mu     sync.RWMutex // guards closed against sends on ch
	closed bool
	ch     chan item
	done   chan struct{}

	dropped  atomic.Int64 // events Record gave up on
	lastWarn atomic.Int64

	// Owned by the writer goroutine.
	seq             uint64
	head            string
	lastCP          uint64
	lastCPTime      time.Time
	unsigned        int // records since the last checkpoint
	reportedDropped int64
	inserts         map[int]*sql.Stmt // prepared INSERTs by row count

	nmu     sync.Mutex
	changed chan struct{} // closed and replaced after every commit

	cancel context.CancelFunc // retention
	rwg    sync.WaitGroup
}

var _ Sink = (*Log)(nil)

type item struct {
	ev         Event
	t          time.Time
	isEvent    bool
	flush      chan error
	checkpoint chan cpReply
}

type cpReply struct {
	seq uint64
	err error
}

// schema is the audit_ tables' schema, one migration per entry; its
// version lives in audit_schema (PRAGMA user_version belongs to
// internal/store when the log shares its file).
var schema = []string{`
CREATE TABLE audit_records (
	seq     INTEGER PRIMARY KEY,
	time    INTEGER NOT NULL,  -- unix nanoseconds
	kind    TEXT NOT NULL,
	sandbox TEXT NOT NULL,
	tenant  TEXT NOT NULL,
	line    TEXT NOT NULL      -- the record's JSON, exactly as listed and exported
);
CREATE INDEX audit_records_by_sandbox ON audit_records (sandbox, seq);
CREATE INDEX audit_records_by_kind ON audit_records (kind, seq);
CREATE INDEX audit_records_by_tenant ON audit_records (tenant, seq);
CREATE TABLE audit_anchors (
	seq     INTEGER PRIMARY KEY, -- the checkpoint the log now starts at
	head    TEXT NOT NULL,       -- the hash it signs (of the last record cut)
	cut_at  INTEGER NOT NULL,
	deleted INTEGER NOT NULL
);
`}

// OpenDB opens (creating, mode 0600) a SQLite file for the log alone, with
// the store's settings: WAL, synchronous=NORMAL (a commit survives kill -9
// of the process), immediate write transactions.
func OpenDB(path string) (*sql.DB, error) {
	if strings.ContainsAny(path, "?#") {
		return nil, fmt.Errorf("audit database path %q must not contain '?' or '#'", path)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, err
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, err
	}
	f.Close()
	db, err := sql.Open("sqlite", path+"?_busy_timeout=30000&_journal_mode=WAL&_synchronous=NORMAL&_txlock=immediate")
	if err != nil {
		return nil, err
	}
	db.SetMaxIdleConns(4)
	db.SetConnMaxIdleTime(0)
	if err := db.Ping(); err != nil {
		db.Close()
		return nil, err
	}
	for _, p := range []string{path, path + "-wal", path + "-shm"} {
		os.Chmod(p, 0o600)
	}
	return db, nil
}

// Open migrates the audit tables, loads the chain's head and starts the
// writer (and, with a retention bound, the retention loop).
func Open(ctx context.Context, o Options) (*Log, error) {
	if o.DB == nil || o.Key == nil {
		return nil, errors.New("audit: Options.DB and Options.Key are required")
	}
	if o.CheckpointEvery <= 0 {
		o.CheckpointEvery = DefaultCheckpointEvery
	}
	if o.CheckpointInterval <= 0 {
		o.CheckpointInterval = DefaultCheckpointInterval
	}
	if o.RetentionEvery <= 0 {
		o.RetentionEvery = DefaultRetentionEvery
	}
	if o.Buffer <= 0 {
		o.Buffer = DefaultBuffer
	}
	if o.BlockFor <= 0 {
		o.BlockFor = DefaultBlockFor
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	l := &Log{opts: o, db: o.DB, keyID: KeyID(o.Key.Public().(ed25519.PublicKey)), log: o.Logger,
		ch: make(chan item, o.Buffer), done: make(chan struct{}), changed: make(chan struct{})}
	if err := l.migrate(ctx); err != nil {
		return nil, fmt.Errorf("audit schema: %w", err)
	}
	if err := l.load(ctx); err != nil {
		return nil, fmt.Errorf("audit log: %w", err)
	}
	go l.run()
	rctx, cancel := context.WithCancel(context.Background())
	l.cancel = cancel
	if o.RetainAge > 0 || o.RetainRecords > 0 {
		l.rwg.Add(1)
		go l.retentionLoop(rctx)
	}
	return l, nil
}

func (l *Log) migrate(ctx context.Context) error {
	return store.MigrateTables(ctx, l.db, "audit", schema)
}

// load reads the head of the chain and its last checkpoint. The head
// record's hash is recomputed: a log whose newest record was edited in
// the database refuses to grow a chain on top of it.
func (l *Log) load(ctx context.Context) error {
	var line string
	err := l.db.QueryRowContext(ctx, `SELECT line FROM audit_records ORDER BY seq DESC LIMIT 1`).Scan(&line)
	if errors.Is(err, sql.ErrNoRows) {
		return nil
	}
	if err != nil {
		return err
	}
	var r Record
	if err := json.Unmarshal([]byte(line), &r); err != nil {
		return fmt.Errorf("newest record does not parse: %w", err)
	}
	if h, err := Hash(r); err != nil || h != r.Hash {
		return fmt.Errorf("newest record (seq %d) does not match its hash: the database was altered", r.Seq)
	}
	l.seq, l.head = r.Seq, r.Hash
	var cpSeq, cpTime int64
	err = l.db.QueryRowContext(ctx, `SELECT seq, time FROM audit_records WHERE kind = ? ORDER BY seq DESC LIMIT 1`, KindCheckpoint).Scan(&cpSeq, &cpTime)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		var first int64
		if err := l.db.QueryRowContext(ctx, `SELECT MIN(seq) FROM audit_records`).Scan(&first); err != nil {
			return err
		}
		l.lastCP = uint64(first) - 1
		l.lastCPTime = l.opts.Now()
	case err != nil:
		return err
	default:
		l.lastCP, l.lastCPTime = uint64(cpSeq), time.Unix(0, cpTime)
	}
	l.unsigned = int(l.seq - l.lastCP)
	return nil
}

// Record queues e. KeyID and Tenant come from ctx's principal when empty
// (no principal: no key, tenant "default"). It waits at most BlockFor for
// room in the queue, then drops e and counts it.
func (l *Log) Record(ctx context.Context, e Event) {
	if e.KeyID == "" || e.Tenant == "" {
		if p, ok := principal.From(ctx); ok {
			if e.KeyID == "" {
				e.KeyID = p.KeyID
			}
			if e.Tenant == "" {
				e.Tenant = p.Tenant
			}
		}
	}
	if e.Tenant == "" {
		e.Tenant = principal.DefaultTenant
	}
	it := item{ev: e, t: l.opts.Now(), isEvent: true}
	l.mu.RLock()
	defer l.mu.RUnlock()
	if l.closed {
		l.drop("the log is closed")
		return
	}
	select {
	case l.ch <- it:
		return
	default:
	}
	t := time.NewTimer(l.opts.BlockFor)
	defer t.Stop()
	select {
	case l.ch <- it:
	case <-t.C:
		l.drop("the queue stayed full")
	}
}

func (l *Log) drop(why string) {
	n := l.dropped.Add(1)
	// One warning a second at most: a flood must not flood the log too.
	now := time.Now().UnixNano()
	if last := l.lastWarn.Load(); now-last > int64(time.Second) && l.lastWarn.CompareAndSwap(last, now) {
		l.log.Warn("audit event dropped", "why", why, "dropped_total", n)
	}
}

// Dropped is how many events Record dropped since Open.
func (l *Log) Dropped() int64 { return l.dropped.Load() }

// Flush waits until every event queued before it is committed.
func (l *Log) Flush(ctx context.Context) error {
	ch := make(chan error, 1)
	if err := l.send(ctx, item{flush: ch}); err != nil {
		return err
	}
	select {
	case err := <-ch:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Checkpoint signs the chain's head now if records were added since the
// last checkpoint, and returns the seq of the newest checkpoint (0: none,
// the log is empty).
func (l *Log) Checkpoint(ctx context.Context) (uint64, error) {
	ch := make(chan cpReply, 1)
	if err := l.send(ctx, item{checkpoint: ch}); err != nil {
		return 0, err
	}
	select {
	case r := <-ch:
		return r.seq, r.err
	case <-ctx.Done():
		return 0, ctx.Err()
	}
}

var errClosed = errors.New("audit log is closed")

func (l *Log) send(ctx context.Context, it item) error {
	l.mu.RLock()
	defer l.mu.RUnlock()
	if l.closed {
		return errClosed
	}
	select {
	case l.ch <- it:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Close commits what is queued, signs the tail and stops the writer.
// Records after Close are dropped.
func (l *Log) Close() error {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return nil
	}
	l.closed = true
	close(l.ch)
	l.mu.Unlock()
	l.cancel()
	l.rwg.Wait()
	<-l.done
	return nil
}

// KeyID names the log's signing key.
func (l *Log) KeyID() string { return l.keyID }

// PublicKey is the key checkpoints verify with.
func (l *Log) PublicKey() ed25519.PublicKey { return l.opts.Key.Public().(ed25519.PublicKey) }

// run is the writer goroutine.
func (l *Log) run() {
	defer close(l.done)
	defer func() {
		for _, st := range l.inserts {
			st.Close()
		}
	}()
	tick := time.NewTicker(max(min(l.opts.CheckpointInterval/4, time.Second), 10*time.Millisecond))
	defer tick.Stop()
	for {
		select {
		case it, ok := <-l.ch:
			if !ok {
				l.write(nil, true)
				return
			}
			batch, closing := l.gather(it)
			l.write(batch, closing)
			if closing {
				return
			}
		case <-tick.C:
			if l.unsigned > 0 && l.opts.Now().Sub(l.lastCPTime) >= l.opts.CheckpointInterval {
				l.write(nil, true)
			}
		}
	}
}

// gather collects a batch that starts with first: what is queued, then what
// arrives within groupCommit, unless a caller is waiting on a flush or a
// checkpoint. closing reports that the queue was closed.
func (l *Log) gather(first item) (batch []item, closing bool) {
	batch = []item{first}
	waiting := first.flush != nil || first.checkpoint != nil
	var window <-chan time.Time
	for len(batch) < maxBatch {
		var it item
		var ok bool
		if waiting {
			select {
			case it, ok = <-l.ch:
			default:
				return batch, false
			}
		} else {
			if window == nil {
				t := time.NewTimer(groupCommit)
				defer t.Stop()
				window = t.C
			}
			select {
			case it, ok = <-l.ch:
			case <-window:
				return batch, false
			}
		}
		if !ok {
			return batch, true
		}
		batch = append(batch, it)
		waiting = waiting || it.flush != nil || it.checkpoint != nil
	}
	return batch, false
}

// write turns the batch's events into records (with a checkpoint after
// every CheckpointEvery, and one at the end when sign is set or a caller
// asked for it), commits them in one transaction, then answers the
// batch's flush and checkpoint requests.
func (l *Log) write(batch []item, sign bool) {
	save := struct {
		seq, lastCP uint64
		head        string
		lastCPTime  time.Time
		unsigned    int
		reported    int64
	}{l.seq, l.lastCP, l.head, l.lastCPTime, l.unsigned, l.reportedDropped}
	var recs []Record
	if d := l.dropped.Load(); d > l.reportedDropped {
		// The gap is itself on the record.
		recs = append(recs, l.next(Event{Kind: KindAudit, Action: "dropped", Result: strconv.FormatInt(d-l.reportedDropped, 10),
			Detail: map[string]any{"dropped": d - l.reportedDropped, "dropped_total": d}}, l.opts.Now()))
		l.reportedDropped = d
	}
	for _, it := range batch {
		if it.checkpoint != nil {
			sign = true
		}
		if !it.isEvent {
			continue
		}
		recs = append(recs, l.next(it.ev, it.t))
		if l.unsigned >= l.opts.CheckpointEvery {
			recs = append(recs, l.sign())
		}
	}
	if sign && l.unsigned > 0 {
		recs = append(recs, l.sign())
	}
	var err error
	for try := 0; try < 3; try++ {
		if err = l.insert(recs); err == nil {
			break
		}
		time.Sleep(100 * time.Millisecond << try)
	}
	if err != nil {
		// Nothing of the batch was stored: the chain goes on from where
		// it was, and the loss is counted (and recorded when possible).
		l.seq, l.lastCP, l.head, l.lastCPTime, l.unsigned, l.reportedDropped = save.seq, save.lastCP, save.head, save.lastCPTime, save.unsigned, save.reported
		n := 0
		for _, it := range batch {
			if it.isEvent {
				n++
			}
		}
		l.dropped.Add(int64(n))
		l.log.Error("audit log: writing records failed; events dropped", "events", n, "err", err)
	} else if len(recs) > 0 {
		l.notify()
	}
	for _, it := range batch {
		switch {
		case it.flush != nil:
			it.flush <- err
		case it.checkpoint != nil:
			it.checkpoint <- cpReply{seq: l.lastCP, err: err}
		}
	}
}

// next chains e as the next record.
func (l *Log) next(e Event, t time.Time) Record {
	l.seq++
	r := Record{Seq: l.seq, Time: t.UTC(), Kind: e.Kind, Action: e.Action, Sandbox: e.Sandbox, Target: e.Target,
		Result: e.Result, KeyID: e.KeyID, Tenant: e.Tenant, Prev: l.head}
	if len(e.Detail) > 0 {
		d, err := json.Marshal(e.Detail)
		if err != nil {
			d, _ = json.Marshal(map[string]string{"error": "detail could not be encoded: " + err.Error()})
		}
		r.Detail = d
	}
	r.Hash = mustHash(r)
	l.head = r.Hash
	l.unsigned++
	return r
}

// sign appends a checkpoint covering the records since the last one.
func (l *Log) sign() Record {
	from, to, head := l.lastCP+1, l.seq, l.head
	l.seq++
	t := l.opts.Now().UTC()
	sig := ed25519.Sign(l.opts.Key, CheckpointMessage(l.seq, t, from, to, head))
	d, _ := json.Marshal(CheckpointDetail{From: from, To: to, Head: head, Sig: base64.StdEncoding.EncodeToString(sig), KeyID: l.keyID})
	r := Record{Seq: l.seq, Time: t, Kind: KindCheckpoint, Action: "sign", Target: fmt.Sprintf("%d-%d", from, to),
		Result: "ok", Detail: d, Prev: head}
	r.Hash = mustHash(r)
	l.head, l.lastCP, l.lastCPTime, l.unsigned = r.Hash, r.Seq, t, 0
	return r
}

func mustHash(r Record) string {
	h, err := Hash(r)
	if err != nil {
		panic(err) // detail is always our own json.Marshal output
	}
	return h
}

func (l *Log) insert(recs []Record) error {
	if len(recs) == 0 {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	tx, err := l.db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback()
	// Many rows per statement: database/sql's per-call overhead is most of
	// the cost of one small row.
	const rowsPerStmt = 128
	args := make([]any, 0, 6*rowsPerStmt)
	for len(recs) > 0 {
		chunk := recs[:min(len(recs), rowsPerStmt)]
		recs = recs[len(chunk):]
		args = args[:0]
		for _, r := range chunk {
			line, err := json.Marshal(r)
			if err != nil {
				return err
			}
			args = append(args, int64(r.Seq), r.Time.UnixNano(), r.Kind, r.Sandbox, r.Tenant, string(line))
		}
		stmt, err := l.insertStmt(ctx, len(chunk))
		if err != nil {
			return err
		}
		if _, err := tx.StmtContext(ctx, stmt).ExecContext(ctx, args...); err != nil {
			return err
		}
	}
	return tx.Commit()
}

// insertStmt returns the prepared INSERT of n rows, preparing it once:
// parsing the statement cost as much as running it.
func (l *Log) insertStmt(ctx context.Context, n int) (*sql.Stmt, error) {
	if st := l.inserts[n]; st != nil {
		return st, nil
	}
	q := `INSERT INTO audit_records (seq, time, kind, sandbox, tenant, line) VALUES (?, ?, ?, ?, ?, ?)` +
		strings.Repeat(`, (?, ?, ?, ?, ?, ?)`, n-1)
	st, err := l.db.PrepareContext(ctx, q)
	if err != nil {
		return nil, err
	}
	if l.inserts == nil {
		l.inserts = map[int]*sql.Stmt{}
	}
	l.inserts[n] = st
	return st, nil
}

func (l *Log) notify() {
	l.nmu.Lock()
	close(l.changed)
	l.changed = make(chan struct{})
	l.nmu.Unlock()
}

func (l *Log) changedCh() <-chan struct{} {
	l.nmu.Lock()
	defer l.nmu.Unlock()
	return l.changed
}

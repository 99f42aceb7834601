package native

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// diskPool keeps a few freshly formatted, never-used disk images per size
// under DataDir/pool so that Create renames one into place instead of
// running mkfs on the hot path (mkfs.ext4 is most of Create's time).
//
// The directory is the pool's only state: an image is complete once it has
// its final name (<MiB>-<random>.img), and taking one is a rename, which
// only one taker can win. Images being formatted are named .tmp-*; Sweep
// removes those, and complete images left by a crashed server are simply
// reused by the next one. An image is only ever written by mkfs (and
// mountDetached's empty upper/ and work/), never by a sandbox, so a pooled
// image is as fresh as one formatted on demand.
//
// Each spare made by this process is also mounted already, as a detached
// mount held only by a descriptor (mountDetached), so Create just attaches
// it. Detached mounts are in no mount table and die with the descriptor,
// so a crash or a DataDir removed without Close leaves no mount behind.
type diskPool struct {
	dir   string
	depth int // images kept per size
	max   int // sizes kept at once

	// formatting is held while an image is being formatted, so clean
	// never removes a .tmp- file this pool is still writing.
	formatting sync.Mutex

	mu      sync.Mutex
	mounted map[string]int // spare image → its detached mount
	// active counts Creates and Starts in progress and lastActive is when
	// the last one ended: spares are made only when the runtime has been
	// quiet for quietPeriod, because on a busy host formatting competes for
	// the same cores as the sandboxes starting (measured: it made Start
	// slower by as much as it made Create faster).
	active     int
	lastActive time.Time
	activity   chan struct{}
	sizes      []int64 // most recently used first
	wake       chan struct{}
	stop       chan struct{}
	stopped    bool
	done       chan struct{}
	running    bool
}

const (
	defaultPoolDepth = 2
	defaultPoolSizes = 4
	// quietPeriod covers the agent's own start-up after Start returns.
	quietPeriod = 25 * time.Millisecond
)

func newDiskPool(dir string) *diskPool {
	return &diskPool{dir: dir, depth: defaultPoolDepth, max: defaultPoolSizes,
		mounted: map[string]int{}, wake: make(chan struct{}, 1), stop: make(chan struct{}),
		activity: make(chan struct{}, 1)}
}

func poolName(sizeMiB int64) string {
	b := make([]byte, 8)
	rand.Read(b)
	return fmt.Sprintf("%d-%s.img", sizeMiB, hex.EncodeToString(b))
}

// images lists the complete images of sizeMiB.
func (p *diskPool) images(sizeMiB int64) []string {
	ents, _ := os.ReadDir(p.dir)
	prefix := strconv.FormatInt(sizeMiB, 10) + "-"
	var out []string
	for _, e := range ents {
		if n := e.Name(); strings.HasPrefix(n, prefix) && strings.HasSuffix(n, ".img") {
			out = append(out, filepath.Join(p.dir, n))
		}
	}
	return out
}

// take moves a pooled image of sizeMiB to dst and reports whether it had
// one, with the descriptor of its detached mount (-1 when it has none; the
// caller owns it). Either way it records the size as wanted and wakes the
// refiller.
func (p *diskPool) take(sizeMiB int64, dst string) (int, bool) {
	p.want(sizeMiB)
	for _, img := range p.images(sizeMiB) {
		// Another taker may win the rename: then try the next one.
		if err := os.Rename(img, dst); err == nil {
			p.mu.Lock()
			mfd, ok := p.mounted[img]
			delete(p.mounted, img)
			p.mu.Unlock()
			if !ok {
				mfd = -1
			}
			return mfd, true
		}
	}
	return -1, false
}

func (p *diskPool) want(sizeMiB int64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stopped {
		return
	}
	p.sizes = slices.DeleteFunc(p.sizes, func(s int64) bool { return s == sizeMiB })
	p.sizes = slices.Insert(p.sizes, 0, sizeMiB)
	if len(p.sizes) > p.max {
		p.sizes = p.sizes[:p.max]
	}
	if !p.running {
		p.running = true
		p.done = make(chan struct{})
		go p.refill()
	}
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

// busy marks a Create or Start in progress until the returned func runs.
func (p *diskPool) busy() func() {
	p.mu.Lock()
	p.active++
	p.mu.Unlock()
	return func() {
		p.mu.Lock()
		p.active--
		p.lastActive = time.Now()
		p.mu.Unlock()
		select {
		case p.activity <- struct{}{}:
		default:
		}
	}
}

// waitQuiet blocks until nothing has been created or started for
// quietPeriod; it reports false when the pool is closed.
func (p *diskPool) waitQuiet() bool {
	for {
		p.mu.Lock()
		active, wait := p.active, quietPeriod-time.Since(p.lastActive)
		p.mu.Unlock()
		if active == 0 && wait <= 0 {
			return true
		}
		var timer <-chan time.Time
		if active == 0 {
			t := time.NewTimer(wait)
			defer t.Stop()
			timer = t.C
		}
		select {
		case <-p.stop:
			return false
		case <-p.activity:
		case <-timer:
		}
	}
}

// refill formats images, one at a time so it never takes more than one core
// from the sandboxes, until every wanted size has depth images.
func (p *diskPool) refill() {
	defer close(p.done)
	for {
		select {
		case <-p.stop:
			return
		case <-p.wake:
		}
		for {
			if !p.waitQuiet() {
				return
			}
			size, ok := p.next()
			if !ok {
				break
			}
			if err := p.add(size); err != nil {
				break // mkfs failing now will fail Create too; retry on the next take
			}
		}
	}
}

// next picks a wanted size that is short of images.
func (p *diskPool) next() (int64, bool) {
	p.mu.Lock()
	sizes := slices.Clone(p.sizes)
	stopped := p.stopped
	p.mu.Unlock()
	if stopped {
		return 0, false
	}
	for _, s := range sizes {
		if len(p.images(s)) < p.depth {
			return s, true
		}
	}
	return 0, false
}

func (p *diskPool) add(sizeMiB int64) error {
	// Mkdir, not MkdirAll: a runtime dropped without Close must not
	// recreate a DataDir that its owner has removed.
	if err := os.Mkdir(p.dir, 0o700); err != nil && !errors.Is(err, os.ErrExist) {
		return err
	}
	p.formatting.Lock()
	defer p.formatting.Unlock()
	name := poolName(sizeMiB)
	tmp := filepath.Join(p.dir, ".tmp-"+name)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		select {
		case <-p.stop:
			cancel()
		case <-ctx.Done():
		}
	}()
	if err := formatDisk(ctx, tmp, sizeMiB); err != nil {
		return err
	}
	final := filepath.Join(p.dir, name)
	// Registered before the rename: a taker may find the image at once.
	if mfd, err := mountDetached(tmp); err == nil {
		p.mu.Lock()
		p.mounted[final] = mfd
		p.mu.Unlock()
	}
	if err := os.Rename(tmp, final); err != nil {
		p.forget(final)
		os.Remove(tmp)
		return err
	}
	return nil
}

// forget drops the detached mount of img, if it has one.
func (p *diskPool) forget(img string) {
	p.mu.Lock()
	mfd, ok := p.mounted[img]
	delete(p.mounted, img)
	p.mu.Unlock()
	if ok {
		unix.Close(mfd)
	}
}

// close stops the refiller and removes every pooled image.
func (p *diskPool) close() error {
	p.mu.Lock()
	if !p.stopped {
		p.stopped = true
		close(p.stop)
	}
	done := p.done
	p.mu.Unlock()
	if done != nil {
		<-done
	}
	p.mu.Lock()
	for img, mfd := range p.mounted {
		unix.Close(mfd)
		delete(p.mounted, img)
	}
	p.mu.Unlock()
	return p.clean(true)
}

// clean removes half-formatted images (and, with all, complete ones too).
// Only files the pool names are touched.
func (p *diskPool) clean(all bool) error {
	p.formatting.Lock()
	defer p.formatting.Unlock()
	ents, err := os.ReadDir(p.dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	var errs []error
	for _, e := range ents {
		n := e.Name()
		if strings.HasPrefix(n, ".tmp-") || (all && strings.HasSuffix(n, ".img")) {
			if err := os.Remove(filepath.Join(p.dir, n)); err != nil && !errors.Is(err, os.ErrNotExist) {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

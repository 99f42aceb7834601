package hostfs

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/testenv"
)

// A disk unmounted lazily while something still holds it keeps its ext4
// and loop device alive; mounting the same image again must wait for them
// (or refuse), never make a second filesystem over the same file — the new
// one would miss what the old one had not written back.
func TestMountDiskWaitsForAnEarlierMountToGo(t *testing.T) {
	testenv.RequireRoot(t)
	_, err := os.Stat("/dev/loop-control")
	testenv.Require(t, "loop devices", err == nil, "no /dev/loop-control")
	dir := t.TempDir()
	img := filepath.Join(dir, "disk.img")
	if err := FormatExt4(context.Background(), img, 16, 0); err != nil {
		t.Fatal(err)
	}
	first, second := filepath.Join(dir, "first"), filepath.Join(dir, "second")
	if err := MountDisk(img, first, 0); err != nil {
		t.Fatal(err)
	}
	defer UnmountAll(first)
	defer UnmountAll(second)
	held, err := os.Create(filepath.Join(first, "upper", "kept.txt"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := held.WriteString("kept\n"); err != nil {
		t.Fatal(err)
	}
	// Busy: UnmountAll falls back to a lazy detach; the device stays.
	if err := UnmountAll(first); err != nil {
		t.Fatal(err)
	}
	if devs, err := LoopDevicesOf(img); err != nil || len(devs) != 1 {
		t.Fatalf("loop devices of the lazily unmounted image: %v %v", devs, err)
	}
	defer func(d time.Duration) { loopReleaseTimeout = d }(loopReleaseTimeout)
	loopReleaseTimeout = 300 * time.Millisecond
	err = MountDisk(img, second, 0)
	if !errors.Is(err, errdefs.ErrUnavailable) || !strings.Contains(err.Error(), "still attached") {
		t.Fatalf("second mount while the first lives: %v", err)
	}
	// The holder lets go: the old filesystem writes back and detaches, and
	// the new mount sees the file.
	held.Close()
	loopReleaseTimeout = 10 * time.Second
	if err := MountDisk(img, second, 0); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(second, "upper", "kept.txt"))
	if err != nil || string(b) != "kept\n" {
		t.Fatalf("after the first mount went: %q %v", b, err)
	}
}

package microvm

import (
	"bufio"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/spacehq/space/internal/errdefs"
	"github.com/spacehq/space/internal/runtime/microvm/vminit"
)

// GuestModules are the kernel modules the guest loads, in this order (each
// after the modules it depends on; the Debian cloud kernel builds them all as
// modules): virtio-mmio transport (microvm's devices), virtio-blk (root image
// and writable disk), virtio-console (the agent's port), virtio-rng
// (entropy), virtio-balloon (free page reporting: the guest hands the pages
// it does not use back to the host), erofs (read-only root images) and
// overlay (root image plus writable disk), virtio-net with its
// dependencies failover and net_failover (the sandbox's NIC). No vsock:
// this host has no vhost-vsock.
var GuestModules = []string{
	"virtio_ring", "virtio", "virtio_mmio", "virtio_blk", "virtio_console",
	"virtio-rng", "virtio_balloon", "libcrc32c", "erofs", "overlay",
	"failover", "net_failover", "virtio_net",
}

// initramfsFormat changes whenever the layout BuildInitramfs writes changes,
// so that cached images of an older layout are not reused.
const initramfsFormat = "space-initramfs-1"

// BuildInitramfs returns the path of a gzip-compressed newc initramfs with
// agentBinary as /init and GuestModules from k under vminit.ModulesDir,
// named NN-module.ko so the guest loads them in lexical order. The image is
// cached in cacheDir per digest of its inputs (kernel release, module and
// agent contents): a rebuilt agent gets a new image, an unchanged one is
// reused without packing anything.
func BuildInitramfs(k Kernel, agentBinary, cacheDir string) (string, error) {
	mods, err := resolveModules(k, GuestModules)
	if err != nil {
		return "", err
	}
	h := sha256.New()
	fmt.Fprintf(h, "%s\x00%s\x00", initramfsFormat, k.Release)
	inputs := append([]string{agentBinary}, mods...)
	for _, p := range inputs {
		d, err := fileDigest(p)
		if err != nil {
			return "", err
		}
		fmt.Fprintf(h, "%s\x00%s\x00", filepath.Base(p), d)
	}
	key := hex.EncodeToString(h.Sum(nil))[:24]
	out := filepath.Join(cacheDir, "initramfs-"+key+".cpio.gz")
	if _, err := os.Stat(out); err == nil {
		return out, nil
	}
	if err := os.MkdirAll(cacheDir, 0o755); err != nil {
		return "", err
	}
	tmp, err := os.CreateTemp(cacheDir, ".initramfs-*")
	if err != nil {
		return "", err
	}
	defer os.Remove(tmp.Name()) // no-op after the rename
	if err := writeInitramfs(tmp, agentBinary, mods); err != nil {
		tmp.Close()
		return "", fmt.Errorf("initramfs: %w", err)
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return "", err
	}
	if err := tmp.Close(); err != nil {
		return "", err
	}
	if err := os.Chmod(tmp.Name(), 0o644); err != nil {
		return "", err
	}
	// Concurrent builders write identical bytes; the last rename wins.
	if err := os.Rename(tmp.Name(), out); err != nil {
		return "", err
	}
	return out, nil
}

func writeInitramfs(w io.Writer, agentBinary string, mods []string) error {
	bw := bufio.NewWriterSize(w, 1<<20)
	// Decompression runs in the guest before init: under TCG it is slow
	// instructions, so a fast level beats a small image (QEMU copies the
	// compressed image into guest memory at host speed anyway).
	zw, err := gzip.NewWriterLevel(bw, gzip.BestSpeed)
	if err != nil {
		return err
	}
	c := &cpioWriter{w: zw}
	for _, d := range []string{"dev", "proc", "sys", "tmp", "run", "lib", "lib/modules", strings.TrimPrefix(vminit.ModulesDir, "/")} {
		c.dir(d)
	}
	// The kernel opens /dev/console for init's stdio before devtmpfs is
	// mounted: without this node init would start without stdin/out/err.
	c.charDev("dev/console", 0o600, 5, 1)
	if err := addFile(c, "init", 0o755, agentBinary); err != nil {
		return err
	}
	for i, m := range mods {
		name := fmt.Sprintf("%s/%02d-%s", strings.TrimPrefix(vminit.ModulesDir, "/"), i, filepath.Base(m))
		if err := addFile(c, name, 0o644, m); err != nil {
			return err
		}
	}
	if err := c.close(); err != nil {
		return err
	}
	if err := zw.Close(); err != nil {
		return err
	}
	return bw.Flush()
}

func addFile(c *cpioWriter, name string, perm uint32, src string) error {
	f, err := os.Open(src)
	if err != nil {
		return err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return err
	}
	if !st.Mode().IsRegular() {
		return fmt.Errorf("%s is not a regular file: %w", src, errdefs.ErrInvalidArgument)
	}
	c.file(name, perm, st.Size(), f)
	return c.err
}

// resolveModules finds each named module's file under k.ModulesDir/kernel.
// Module names treat '-' and '_' alike, as modprobe does. Only
// uncompressed .ko files are accepted: the pinned Debian 6.1 kernel ships
// them so, and the guest loads them with finit_module without
// decompression flags (a kernel packaging .ko.xz needs
// MODULE_INIT_COMPRESSED_FILE and CONFIG_MODULE_DECOMPRESS; refuse rather
// than boot a guest that cannot load them).
func resolveModules(k Kernel, names []string) ([]string, error) {
	norm := func(s string) string { return strings.ReplaceAll(s, "-", "_") }
	found := map[string]string{}
	compressed := map[string]string{}
	err := filepath.WalkDir(filepath.Join(k.ModulesDir, "kernel"), func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			return nil
		}
		base := d.Name()
		switch {
		case strings.HasSuffix(base, ".ko"):
			found[norm(strings.TrimSuffix(base, ".ko"))] = p
		case strings.HasSuffix(base, ".ko.xz"), strings.HasSuffix(base, ".ko.zst"), strings.HasSuffix(base, ".ko.gz"):
			compressed[norm(base[:strings.Index(base, ".ko")])] = p
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("guest kernel modules: %w", err)
	}
	out := make([]string, 0, len(names))
	for _, n := range names {
		p, ok := found[norm(n)]
		if !ok {
			if c, ok := compressed[norm(n)]; ok {
				return nil, fmt.Errorf("guest module %s is compressed (%s); only .ko is supported: %w", n, c, errdefs.ErrNotSupported)
			}
			return nil, fmt.Errorf("guest module %s not in %s: %w", n, k.ModulesDir, errdefs.ErrNotFound)
		}
		out = append(out, p)
	}
	return out, nil
}

func fileDigest(p string) (string, error) {
	f, err := os.Open(p)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

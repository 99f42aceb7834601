package template

import (
	"archive/tar"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacehq/space/api"
)

// Template archives are plain tars: a header file first, then the tree
// under rootfs/. The header names the digest; importing recomputes it from
// the content and refuses a mismatch, so an archive moves a template between
// hosts with its digest intact or not at all.
const (
	archiveHeaderName = "space-template.json"
	archiveFormat     = "space-template-archive/v1"
	archiveRoot       = "rootfs"
	maxArchiveHeader  = 1 << 20
)

type archiveHeader struct {
	Format     string              `json:"format"`
	Digest     string              `json:"digest"`
	TreeDigest string              `json:"tree_digest"`
	Config     api.TemplateConfig  `json:"config"`
	Source     string              `json:"source"`
	Parent     string              `json:"parent,omitempty"`
	Layers     []api.TemplateLayer `json:"layers,omitempty"`
	CreatedAt  time.Time           `json:"created_at"`
}

// Export writes the template ref as a template archive to w.
func (s *Store) Export(ctx context.Context, ref string, w io.Writer) error {
	t, root, err := s.Resolve(ctx, ref)
	if err != nil {
		return err
	}
	defer s.Hold(t.Digest)()
	hdr, err := json.MarshalIndent(archiveHeader{
		Format: archiveFormat, Digest: t.Digest, TreeDigest: t.TreeDigest, Config: t.Config,
		Source: t.Source, Parent: t.Parent, Layers: t.Layers, CreatedAt: t.CreatedAt,
	}, "", "  ")
	if err != nil {
		return err
	}
	tw := tar.NewWriter(w)
	if err := tw.WriteHeader(&tar.Header{Name: archiveHeaderName, Typeflag: tar.TypeReg, Mode: 0o644,
		Size: int64(len(hdr)), ModTime: t.CreatedAt, Format: tar.FormatPAX}); err != nil {
		return err
	}
	if _, err := tw.Write(hdr); err != nil {
		return err
	}
	type inode struct{ dev, ino uint64 }
	links := map[inode]string{}
	n := 0
	err = filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if n++; n%1024 == 0 {
			if err := ctx.Err(); err != nil {
				return err
			}
		}
		rel, err := filepath.Rel(root, p)
		if err != nil {
			return err
		}
		name := archiveRoot
		if rel != "." {
			name = archiveRoot + "/" + filepath.ToSlash(rel)
		}
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return err
		}
		h := &tar.Header{Name: name, Mode: int64(st.Mode & 0o7777), Uid: int(st.Uid), Gid: int(st.Gid),
			ModTime: time.Unix(st.Mtim.Unix()), Format: tar.FormatPAX}
		if x := userXattrs(p); len(x) > 0 {
			h.PAXRecords = map[string]string{}
			for k, v := range x {
				h.PAXRecords["SCHILY.xattr."+k] = v
			}
		}
		var body *os.File
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFDIR:
			h.Typeflag, h.Name = tar.TypeDir, h.Name+"/"
		case unix.S_IFLNK:
			h.Typeflag = tar.TypeSymlink
			if h.Linkname, err = os.Readlink(p); err != nil {
				return err
			}
		case unix.S_IFIFO:
			h.Typeflag = tar.TypeFifo
		case unix.S_IFREG:
			k := inode{st.Dev, st.Ino}
			if first, ok := links[k]; ok && st.Nlink > 1 {
				h.Typeflag, h.Linkname = tar.TypeLink, first
				break
			}
			if st.Nlink > 1 {
				links[k] = name
			}
			h.Typeflag, h.Size = tar.TypeReg, st.Size
			if body, err = os.OpenFile(p, os.O_RDONLY|unix.O_NOFOLLOW, 0); err != nil {
				return err
			}
			defer body.Close()
		default:
			return nil // the stager never stores anything else
		}
		if err := tw.WriteHeader(h); err != nil {
			return fmt.Errorf("export %s: %w", name, err)
		}
		if body != nil {
			if _, err := io.CopyN(tw, body, h.Size); err != nil {
				return fmt.Errorf("export %s: %w", name, err)
			}
		}
		return nil
	})
	if err != nil {
		return err
	}
	return tw.Close()
}

// userXattrs returns the user.* extended attributes of p (the only ones a
// template keeps).
func userXattrs(p string) map[string]string {
	buf := make([]byte, 4096)
	n, err := unix.Llistxattr(p, buf)
	if err != nil || n <= 0 {
		return nil
	}
	out := map[string]string{}
	for _, k := range strings.Split(strings.TrimRight(string(buf[:n]), "\x00"), "\x00") {
		if !strings.HasPrefix(k, "user.") {
			continue
		}
		v := make([]byte, 64<<10)
		m, err := unix.Lgetxattr(p, k, v)
		if err == nil {
			out[k] = string(v[:m])
		}
	}
	return out
}

// ImportArchive imports a template archive written by Export (plain or
// gzip-compressed). The digest is recomputed and must match the header's;
// o.Tags are applied; o.Config/Layers/Source/ExpectDigest come from the
// archive.
func (s *Store) ImportArchive(ctx context.Context, r io.Reader, o ImportOptions) (api.Template, error) {
	var hdr archiveHeader
	first := func(h *tar.Header, body io.Reader) error {
		if h.Name != archiveHeaderName || h.Typeflag != tar.TypeReg {
			return invalid("not a template archive: the first entry is %q, want %s", h.Name, archiveHeaderName)
		}
		if h.Size > maxArchiveHeader {
			return invalid("template archive header is %d bytes (limit %d)", h.Size, maxArchiveHeader)
		}
		b, err := io.ReadAll(io.LimitReader(body, maxArchiveHeader))
		if err != nil {
			return invalid("template archive header: %v", err)
		}
		if err := json.Unmarshal(b, &hdr); err != nil {
			return invalid("template archive header is not valid JSON: %v", err)
		}
		if hdr.Format != archiveFormat {
			return invalid("template archive format %q is not supported (want %s)", hdr.Format, archiveFormat)
		}
		if !strings.HasPrefix(hdr.Digest, "sha256:") || !hexDigest.MatchString(strings.TrimPrefix(hdr.Digest, "sha256:")) {
			return invalid("template archive header has an invalid digest %q", hdr.Digest)
		}
		if err := ValidateConfig(hdr.Config); err != nil {
			return fmt.Errorf("template archive header: %w", err)
		}
		return nil
	}
	return s.importWith(ctx, o, func(st *stager) error {
		if err := extractTar(ctx, st, r, o.Progress, &tarHooks{first: first, prefix: archiveRoot}); err != nil {
			return err
		}
		if hdr.Digest == "" {
			return invalid("not a template archive: no %s", archiveHeaderName)
		}
		return nil
	}, func(o *ImportOptions) {
		o.Config, o.Layers, o.ExpectDigest = hdr.Config, hdr.Layers, hdr.Digest
		o.Source = "archive:" + hdr.Source
		if hdr.Parent != "" {
			o.Parent = hdr.Parent
		}
	})
}

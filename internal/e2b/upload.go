package e2b

import (
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"mime"
	"mime/multipart"
	"net/http"
	"path"
	"strings"

	"github.com/spacehq/space/internal/errdefs"
)

// Uploads (POST /files): a body bounded by the server's file size limit
// before and after gzip, as envd's octet-stream or multipart form.

// capReader fails reads past its limit and remembers that it did, so the
// handler can answer 413 however the agent client wrapped the read error.
type capReader struct {
	r        io.Reader
	left     int64
	exceeded *bool
}

func (c *capReader) Read(p []byte) (int, error) {
	if c.left <= 0 {
		// Probe one byte: a body of exactly the limit is fine.
		var one [1]byte
		if n, _ := c.r.Read(one[:]); n > 0 {
			*c.exceeded = true
			return 0, fmt.Errorf("%w: %w", errBodyTooLarge, errdefs.ErrTooLarge)
		}
		return 0, io.EOF
	}
	if int64(len(p)) > c.left {
		p = p[:c.left]
	}
	n, err := c.r.Read(p)
	c.left -= int64(n)
	return n, err
}

// upload is a request body, decompressed if it was gzip-encoded, bounded
// on both sides of the decompression.
type upload struct {
	io.Reader
	gz       *gzip.Reader
	limit    int64
	exceeded bool
}

func (u *upload) Close() error {
	if u.gz != nil {
		return u.gz.Close()
	}
	return nil
}

// check turns any error into a 413 when the body went over the limit.
func (u *upload) check(err error) error {
	if err != nil && u.exceeded {
		return fmt.Errorf("%w (%d bytes): %w", errBodyTooLarge, u.limit, errdefs.ErrTooLarge)
	}
	return err
}

func uploadReader(r *http.Request, limit int64) (*upload, error) {
	u := &upload{limit: limit}
	u.Reader = &capReader{r: r.Body, left: limit, exceeded: &u.exceeded}
	switch enc := strings.ToLower(strings.TrimSpace(r.Header.Get("Content-Encoding"))); enc {
	case "", "identity":
	case "gzip":
		gz, err := gzip.NewReader(u.Reader)
		if err != nil {
			return nil, u.check(fmt.Errorf("body is not gzip: %v: %w", err, errdefs.ErrInvalidArgument))
		}
		u.gz = gz
		// A small gzip body can inflate to anything: bound what it
		// becomes too.
		u.Reader = &capReader{r: gz, left: limit, exceeded: &u.exceeded}
	default:
		return nil, fmt.Errorf("Content-Encoding %q is not supported: send gzip or nothing: %w", truncate(enc, 32), errdefs.ErrInvalidArgument)
	}
	return u, nil
}

// writeParts stores the "file" parts of a multipart upload: each at path
// when the URL names one, else at its own filename (envd's multi-file
// write), which is taken whole — the SDK sends the destination path there.
func (f *fsCall) writeParts(ctx context.Context, r *http.Request, body io.Reader, hasPath bool, urlPath string) ([]writeInfo, error) {
	_, params, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if err != nil || params["boundary"] == "" {
		return nil, fmt.Errorf("multipart body without a boundary in its Content-Type: %w", errdefs.ErrInvalidArgument)
	}
	mr := multipart.NewReader(body, params["boundary"])
	var out []writeInfo
	seen := map[string]bool{}
	for {
		part, err := mr.NextPart()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return out, fmt.Errorf("reading the multipart form: %v: %w", err, errdefs.ErrInvalidArgument)
		}
		if part.FormName() != "file" {
			part.Close()
			continue
		}
		if len(out) >= maxUploadParts {
			return out, fmt.Errorf("more than %d files in one upload: %w", maxUploadParts, errdefs.ErrInvalidArgument)
		}
		dest := urlPath
		if !hasPath {
			dest = partFilename(part)
			if dest == "" {
				return out, fmt.Errorf("a file part has no filename and the URL no path: one of them names the destination: %w", errdefs.ErrInvalidArgument)
			}
		}
		p, err := f.resolve(dest)
		if err != nil {
			return out, err
		}
		if seen[p] {
			return out, fmt.Errorf("several files of one upload go to %s: only the first was written: %w", p, errdefs.ErrInvalidArgument)
		}
		seen[p] = true
		err = f.write(ctx, p, fullReader{part})
		part.Close()
		if err != nil {
			return out, err
		}
		out = append(out, writeInfo{Name: path.Base(p), Type: "file", Path: p})
	}
	return out, nil
}

// partFilename is a part's filename as sent: multipart.Part.FileName
// keeps only its last element, but here it is the destination path.
func partFilename(p *multipart.Part) string {
	_, params, err := mime.ParseMediaType(p.Header.Get("Content-Disposition"))
	if err != nil {
		return ""
	}
	return params["filename"]
}

// gzipWriter compresses a download for a client that accepts gzip.
func gzipWriter(w io.Writer) *gzip.Writer {
	gz, _ := gzip.NewWriterLevel(w, gzip.BestSpeed)
	return gz
}

// fullReader fills each read as far as its source allows. A multipart
// part reads at most 4 KiB at a time, and each read would become its own
// write to the agent's stream (each a system call through the sandbox's
// kernel): filled reads halve an upload's time.
type fullReader struct{ r io.Reader }

func (f fullReader) Read(p []byte) (int, error) {
	n, err := io.ReadFull(f.r, p)
	if errors.Is(err, io.ErrUnexpectedEOF) {
		err = io.EOF
	}
	return n, err
}

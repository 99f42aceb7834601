package template

import (
	"context"
	"io"
	"log/slog"
)

// ExtractTar extracts a plain or gzip-compressed tar stream into dir, an
// existing directory, under exactly the hostile-input policy of ImportTar
// (see stager): no entry lands outside dir or writes through a symlink,
// devices are skipped, setuid/setgid bits dropped, and maxBytes (0 = no
// limit) bounds content plus 512 bytes per entry. Truncated or corrupt
// archives fail with ErrInvalidArgument, too large ones with ErrTooLarge.
// On error dir may hold part of the archive; the caller removes it.
//
// It exists for inputs that are not templates but just as untrusted, such
// as a build context uploaded to the server.
func ExtractTar(ctx context.Context, r io.Reader, dir string, maxBytes int64) error {
	st, err := newStager(dir, maxBytes, slog.Default())
	if err != nil {
		return err
	}
	err = extractTar(ctx, st, r, nil, nil)
	if err == nil {
		err = st.finish()
	}
	st.close()
	return err
}

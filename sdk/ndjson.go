package sdk

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
)

// ndjsonStream names and bounds one newline-delimited JSON response
// (application/x-ndjson) for readNDJSON.
type ndjsonStream struct {
	// what names the stream in errors: "stats of sb-1".
	what string
	// item names one line's value in errors: "sample" gives "bad sample
	// line".
	item string
	// maxLine bounds one line, in bytes; a longer one ends the stream with
	// an error (bufio.ErrTooLong).
	maxLine int
	// broken, if set, is wrapped into the error of a stream that failed
	// while being read (a broken connection, a line too long).
	broken error
}

// errStopStream, returned by readNDJSON's fn, ends the stream early without
// an error (the final line of a stream that has one).
var errStopStream = errors.New("stop reading the stream")

// readNDJSON is the one reader of the server's NDJSON streams: it calls fn
// with each line of body decoded as a T, skipping blank lines, until
//   - the stream ends: nil;
//   - fn returns an error: that error as it is (errStopStream: nil);
//   - a line is not JSON of a T: "<what>: bad <item> line: …";
//   - reading fails: "<what>: …" (wrapping s.broken if set), or nil if ctx
//     has ended by then, as it does when a caller stops following a stream.
func readNDJSON[T any](ctx context.Context, body io.Reader, s ndjsonStream, fn func(T) error) error {
	sc := bufio.NewScanner(body)
	sc.Buffer(make([]byte, 0, min(4<<10, s.maxLine)), s.maxLine)
	for sc.Scan() {
		if len(sc.Bytes()) == 0 {
			continue
		}
		var v T
		if err := json.Unmarshal(sc.Bytes(), &v); err != nil {
			return fmt.Errorf("%s: bad %s line: %w", s.what, s.item, err)
		}
		if err := fn(v); err != nil {
			if err == errStopStream {
				return nil
			}
			return err
		}
	}
	err := sc.Err()
	switch {
	case err == nil, ctx.Err() != nil:
		return nil
	case s.broken != nil:
		return fmt.Errorf("%s: %w: %w", s.what, err, s.broken)
	default:
		return fmt.Errorf("%s: %w", s.what, err)
	}
}

package mcpserver

import (
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"path"
	"strconv"
	"time"
	"unicode/utf8"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/spacehq/space/api"
	"github.com/spacehq/space/sdk"
)

// FileReadIn is file_read's input.
type FileReadIn struct {
	ID     string `json:"id" jsonschema:"the sandbox id"`
	Path   string `json:"path" jsonschema:"absolute path of the file inside the sandbox"`
	Offset int64  `json:"offset,omitempty" jsonschema:"byte offset to start reading at; default 0"`
	Limit  int    `json:"limit,omitempty" jsonschema:"most bytes to return; default 65536, at most 1048576"`
}

// FileReadOut is file_read's output.
type FileReadOut struct {
	Path       string `json:"path"`
	Content    string `json:"content" jsonschema:"the bytes read: text, or base64 when encoding is base64"`
	Encoding   string `json:"encoding" jsonschema:"utf-8 for text, base64 for binary content"`
	Offset     int64  `json:"offset"`
	Bytes      int    `json:"bytes" jsonschema:"how many bytes of the file content holds"`
	Size       int64  `json:"size" jsonschema:"the file's whole size"`
	NextOffset int64  `json:"next_offset" jsonschema:"offset of the first byte not returned"`
	EOF        bool   `json:"eof" jsonschema:"the read reached the end of the file"`
}

// FileWriteIn is file_write's input.
type FileWriteIn struct {
	ID      string `json:"id" jsonschema:"the sandbox id"`
	Path    string `json:"path" jsonschema:"absolute path of the file inside the sandbox; missing parent directories are created"`
	Content string `json:"content" jsonschema:"the whole new content of the file (text, or base64 when base64 is true)"`
	Base64  bool   `json:"base64,omitempty" jsonschema:"content is base64-encoded bytes (for binary files)"`
	Mode    string `json:"mode,omitempty" jsonschema:"permission bits in octal, e.g. 0755 for a script; default 0644 for a new file, unchanged for an existing one"`
}

// FileWriteOut is file_write's output.
type FileWriteOut struct {
	Path string `json:"path"`
	Size int64  `json:"size"`
	Mode string `json:"mode"`
}

// FileListIn is file_list's input.
type FileListIn struct {
	ID    string `json:"id" jsonschema:"the sandbox id"`
	Path  string `json:"path" jsonschema:"absolute path of the directory to list"`
	Depth int    `json:"depth,omitempty" jsonschema:"how many levels to descend: 1 (default) lists the directory itself, at most 5"`
}

// FileEntry is one entry of file_list.
type FileEntry struct {
	Path    string `json:"path"`
	Type    string `json:"type" jsonschema:"file, dir, symlink or other"`
	Size    int64  `json:"size"`
	Mode    string `json:"mode" jsonschema:"permission bits in octal"`
	ModTime string `json:"mod_time"`
	Target  string `json:"target,omitempty" jsonschema:"where a symlink points"`
}

// FileListOut is file_list's output.
type FileListOut struct {
	Entries   []FileEntry `json:"entries"`
	Truncated bool        `json:"truncated,omitempty" jsonschema:"more entries exist than returned; list a subdirectory or use less depth"`
}

func (t *tools) addFileTools(s *mcp.Server) {
	mcp.AddTool(s, &mcp.Tool{
		Name:  "file_read",
		Title: "Read a file",
		Description: "Read a file inside a sandbox. Returns up to limit bytes (64 KiB unless asked) from offset; for a larger " +
			"file call again with offset = next_offset until eof. Text comes back as is; binary content is base64 " +
			"(encoding says which).",
		Annotations: &mcp.ToolAnnotations{ReadOnlyHint: true, OpenWorldHint: boolPtr(false)},
	}, t.fileRead)
	mcp.AddTool(s, &mcp.Tool{
		Name:  "file_write",
		Title: "Write a file",
		Description: fmt.Sprintf("Create or replace a file inside a sandbox with the given content (at most %d MiB; "+
			"base64 for binary). Missing parent directories are created. Returns the file's size and mode.", MaxWriteBytes>>20),
		Annotations: &mcp.ToolAnnotations{DestructiveHint: boolPtr(true), IdempotentHint: true, OpenWorldHint: boolPtr(false)},
	}, t.fileWrite)
	mcp.AddTool(s, &mcp.Tool{
		Name:  "file_list",
		Title: "List a directory",
		Description: fmt.Sprintf("List a directory inside a sandbox: each entry's path, type, size and mode; depth > 1 "+
			"descends into subdirectories (at most %d entries in all).", MaxListFiles),
		Annotations: &mcp.ToolAnnotations{ReadOnlyHint: true, OpenWorldHint: boolPtr(false)},
	}, t.fileList)
}

func (t *tools) fileRead(ctx context.Context, _ *mcp.CallToolRequest, in FileReadIn) (*mcp.CallToolResult, FileReadOut, error) {
	limit := in.Limit
	switch {
	case limit == 0:
		limit = DefaultReadBytes
	case limit < 0 || limit > MaxReadBytes:
		return nil, FileReadOut{}, invalid("limit must be 1 to %d, got %d", MaxReadBytes, limit)
	}
	if in.Offset < 0 {
		return nil, FileReadOut{}, invalid("offset must not be negative")
	}
	fi, err := t.c.StatFile(ctx, in.ID, in.Path)
	if err != nil {
		return nil, FileReadOut{}, toolError("reading "+in.Path, err)
	}
	if fi.Type == "dir" {
		return nil, FileReadOut{}, fmt.Errorf("%s is a directory: list it with file_list", in.Path)
	}
	rc, err := t.c.ReadFile(ctx, in.ID, in.Path)
	if err != nil {
		return nil, FileReadOut{}, toolError("reading "+in.Path, err)
	}
	defer rc.Close()
	// The API streams whole files: skip to the offset, then read one byte
	// more than asked to know whether the end was reached.
	if _, err := io.CopyN(io.Discard, rc, in.Offset); err != nil && !errors.Is(err, io.EOF) {
		return nil, FileReadOut{}, toolError("reading "+in.Path, err)
	}
	buf, err := io.ReadAll(io.LimitReader(rc, int64(limit)+1))
	if err != nil {
		return nil, FileReadOut{}, toolError("reading "+in.Path, err)
	}
	eof := len(buf) <= limit
	if !eof {
		// Cut text at a rune boundary (the extra byte read shows where
		// one is), so the content is valid text and next_offset exact.
		if c := utf8Cut(buf, limit); c > 0 && isText(buf[:c]) {
			buf = buf[:c]
		} else {
			buf = buf[:limit]
		}
	}
	out := FileReadOut{Path: fi.Path, Offset: in.Offset, Size: fi.Size, EOF: eof, Encoding: "utf-8"}
	if isText(buf) {
		out.Content = string(buf)
	} else {
		out.Encoding, out.Content = "base64", base64.StdEncoding.EncodeToString(buf)
	}
	out.Bytes = len(buf)
	out.NextOffset = in.Offset + int64(len(buf))
	msg := fmt.Sprintf("%s: bytes %d-%d of %d", out.Path, out.Offset, out.NextOffset, out.Size)
	if !eof {
		msg += fmt.Sprintf(" (more: call file_read again with offset %d)", out.NextOffset)
	}
	if out.Encoding == "base64" {
		msg += ", binary, base64-encoded"
	}
	return text(msg + ":\n" + out.Content), out, nil
}

// isText reports whether b reads as UTF-8 text: valid, without NUL bytes.
func isText(b []byte) bool {
	return bytes.IndexByte(b, 0) < 0 && utf8.Valid(b)
}

func (t *tools) fileWrite(ctx context.Context, _ *mcp.CallToolRequest, in FileWriteIn) (*mcp.CallToolResult, FileWriteOut, error) {
	data := []byte(in.Content)
	if in.Base64 {
		var err error
		if data, err = base64.StdEncoding.DecodeString(in.Content); err != nil {
			return nil, FileWriteOut{}, invalid("content is not valid base64: %v", err)
		}
	}
	if len(data) > MaxWriteBytes {
		return nil, FileWriteOut{}, invalid("content is %d bytes, more than %d; split it (write parts and join them with command_run)", len(data), MaxWriteBytes)
	}
	var mode fs.FileMode
	if in.Mode != "" {
		m, err := strconv.ParseUint(in.Mode, 8, 32)
		// The API takes permission bits only (no setuid, setgid, sticky).
		if err != nil || m > 0o777 || m == 0 {
			return nil, FileWriteOut{}, invalid("mode %q is not an octal permission (1 to 0777) such as 0644 or 0755", in.Mode)
		}
		mode = fs.FileMode(m)
	}
	fi, err := t.c.WriteFile(ctx, in.ID, in.Path, bytes.NewReader(data), mode)
	if errors.Is(err, sdk.ErrNotFound) {
		// Most likely a missing parent directory: make it and try once more.
		if _, merr := t.c.Mkdir(ctx, in.ID, path.Dir(path.Clean("/"+in.Path)), 0o755); merr == nil {
			fi, err = t.c.WriteFile(ctx, in.ID, in.Path, bytes.NewReader(data), mode)
		}
	}
	if err != nil {
		return nil, FileWriteOut{}, toolError("writing "+in.Path, err)
	}
	out := FileWriteOut{Path: fi.Path, Size: fi.Size, Mode: fmt.Sprintf("%04o", fi.Mode)}
	return text(fmt.Sprintf("Wrote %d bytes to %s (mode %s).", fi.Size, fi.Path, out.Mode)), out, nil
}

func (t *tools) fileList(ctx context.Context, _ *mcp.CallToolRequest, in FileListIn) (*mcp.CallToolResult, FileListOut, error) {
	depth := in.Depth
	switch {
	case depth == 0:
		depth = 1
	case depth < 0 || depth > MaxListDepth:
		return nil, FileListOut{}, invalid("depth must be 1 to %d, got %d", MaxListDepth, depth)
	}
	out := FileListOut{Entries: []FileEntry{}}
	// Breadth first, so a cut list still shows the upper levels whole.
	type dir struct {
		path  string
		level int
	}
	queue := []dir{{in.Path, 1}}
	for len(queue) > 0 && !out.Truncated {
		d := queue[0]
		queue = queue[1:]
		ents, err := t.c.ListDir(ctx, in.ID, d.path)
		if err != nil {
			if d.level > 1 {
				continue // a subdirectory that vanished or cannot be read
			}
			return nil, FileListOut{}, toolError("listing "+d.path, err)
		}
		for _, e := range ents {
			if len(out.Entries) == MaxListFiles {
				out.Truncated = true
				break
			}
			out.Entries = append(out.Entries, fileEntry(e))
			if e.Type == "dir" && d.level < depth {
				queue = append(queue, dir{e.Path, d.level + 1})
			}
		}
	}
	return nil, out, nil
}

func fileEntry(e api.FileInfo) FileEntry {
	return FileEntry{Path: e.Path, Type: e.Type, Size: e.Size, Mode: fmt.Sprintf("%04o", e.Mode),
		ModTime: e.ModTime.UTC().Format(time.RFC3339), Target: e.Target}
}

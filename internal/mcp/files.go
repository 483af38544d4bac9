package mcp

import (
	"bytes"
	"context"
	"encoding/base64"
	"fmt"
	"path"
	"strings"
	"unicode/utf8"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/errdefs"
)

type readArgs struct {
	ID       string `json:"id" jsonschema:"the sandbox"`
	Path     string `json:"path" jsonschema:"the file, absolute"`
	Offset   int64  `json:"offset,omitempty" jsonschema:"start at this byte (default 0), to read a large file in parts"`
	MaxBytes int    `json:"max_bytes,omitempty" jsonschema:"read at most this many bytes (default 65536)"`
	Encoding string `json:"encoding,omitempty" jsonschema:"text (default; bytes that are not UTF-8 become U+FFFD) or base64 (exact bytes, for binary files)"`
}

type readResult struct {
	Path      string `json:"path"`
	Size      int64  `json:"size" jsonschema:"the file's size in bytes"`
	Offset    int64  `json:"offset"`
	Bytes     int    `json:"bytes" jsonschema:"bytes returned in content"`
	Content   string `json:"content"`
	Encoding  string `json:"encoding" jsonschema:"text or base64"`
	Truncated bool   `json:"truncated,omitempty" jsonschema:"the file goes on past what was returned: read again from offset+bytes"`
	Binary    bool   `json:"binary,omitempty" jsonschema:"the content is not UTF-8 text; read it with encoding base64 for its exact bytes"`
}

func (r *readResult) text() string {
	if r.Encoding != "text" {
		b, _ := jsonText(r)
		return b
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%s: %d bytes", r.Path, r.Size)
	if r.Offset > 0 || r.Truncated {
		fmt.Fprintf(&b, ", bytes %d to %d shown", r.Offset, r.Offset+int64(r.Bytes))
	}
	if r.Truncated {
		fmt.Fprintf(&b, " (truncated: read on with offset %d)", r.Offset+int64(r.Bytes))
	}
	if r.Binary {
		b.WriteString(" (not UTF-8 text: use encoding base64 for the exact bytes)")
	}
	b.WriteString("\n")
	b.WriteString(r.Content)
	return b.String()
}

type writeArgs struct {
	ID       string `json:"id" jsonschema:"the sandbox"`
	Path     string `json:"path" jsonschema:"the file, absolute; replaced whole if it exists"`
	Content  string `json:"content" jsonschema:"the file's new content"`
	Encoding string `json:"encoding,omitempty" jsonschema:"text (default) or base64 (content holds base64 of the exact bytes)"`
	Mode     string `json:"mode,omitempty" jsonschema:"octal permission bits such as 0644 or 0755 (default: kept, or 0644 for a new file)"`
	NoMkdir  bool   `json:"no_mkdir,omitempty" jsonschema:"fail when the parent directory is missing instead of making it"`
}

type writeResult struct {
	Path  string `json:"path"`
	Bytes int64  `json:"bytes"`
}

type listArgs struct {
	ID    string `json:"id" jsonschema:"the sandbox"`
	Path  string `json:"path" jsonschema:"the directory, absolute"`
	Depth int    `json:"depth,omitempty" jsonschema:"levels to list (default 1: the directory's own entries)"`
}

type listResult struct {
	Path      string      `json:"path"`
	Entries   []entryView `json:"entries"`
	Truncated bool        `json:"truncated,omitempty" jsonschema:"there were more than 1000 entries; list a deeper directory or a smaller depth"`
	Total     int         `json:"total"`
}

type entryView struct {
	Path   string `json:"path"`
	Type   string `json:"type" jsonschema:"file, dir, symlink or other"`
	Size   int64  `json:"size"`
	Mode   string `json:"mode" jsonschema:"octal permission bits"`
	MTime  string `json:"mtime"`
	Target string `json:"target,omitempty" jsonschema:"a symlink's target"`
}

func (r *listResult) text() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s: %d entries", r.Path, r.Total)
	if r.Truncated {
		fmt.Fprintf(&b, " (the first %d shown)", len(r.Entries))
	}
	b.WriteString("\n")
	for _, e := range r.Entries {
		name := e.Path
		switch e.Type {
		case apiv1.FileTypeDir:
			name += "/"
		case apiv1.FileTypeSymlink:
			name += " -> " + e.Target
		}
		fmt.Fprintf(&b, "%s %5s %10d %s %s\n", typeChar(e.Type), e.Mode, e.Size, e.MTime, name)
	}
	return b.String()
}

func typeChar(t string) string {
	switch t {
	case apiv1.FileTypeDir:
		return "d"
	case apiv1.FileTypeSymlink:
		return "l"
	case apiv1.FileTypeFile:
		return "-"
	}
	return "?"
}

func (t *tools) fileTools(s *sdk.Server) {
	add(s, tool[readArgs, readResult]{
		name: "read_file", title: "Read a file in a sandbox", readOnly: true,
		desc: "Read a file in a sandbox: up to max_bytes (default 64 KiB) from offset, as text or base64. " +
			"The result says the file's size and whether it goes on, so a large file is read in parts.",
		props: map[string][]prop{"id": idProp, "path": pathProp, "offset": {between(0, 1<<62)},
			"max_bytes": {between(1, maxReadBytes), byDefault(MaxField)}, "encoding": {oneOf("text", "base64"), byDefault("text")}},
		run: t.readFile,
	})
	add(s, tool[writeArgs, writeResult]{
		name: "write_file", title: "Write a file in a sandbox", destructive: true,
		desc: "Write a file in a sandbox, replacing it whole (atomically) if it exists and making its parent directories. " +
			"content is text, or base64 with encoding base64.",
		props: map[string][]prop{"id": idProp, "path": pathProp, "encoding": {oneOf("text", "base64"), byDefault("text")},
			"mode": {pattern(`^0?[0-7]{3,4}$`)}},
		run: t.writeFile,
	})
	add(s, tool[listArgs, listResult]{
		name: "list_files", title: "List a directory in a sandbox", readOnly: true,
		desc:  "List a directory in a sandbox: each entry's path, type, size, mode and modification time, to depth levels (default 1).",
		props: map[string][]prop{"id": idProp, "path": pathProp, "depth": {between(1, maxListDepth), byDefault(1)}},
		run:   t.listFiles,
	})
}

func (t *tools) readFile(ctx context.Context, _ *call, in *readArgs) (*readResult, error) {
	if err := checkID(in.ID); err != nil {
		return nil, err
	}
	if err := checkPath("path", in.Path); err != nil {
		return nil, err
	}
	if in.Offset < 0 {
		return nil, errdefs.InvalidArgument("offset = %d: want 0 or more", in.Offset)
	}
	limit := in.MaxBytes
	if limit == 0 {
		limit = MaxField
	}
	if err := checkInt("max_bytes", limit, 1, maxReadBytes); err != nil {
		return nil, err
	}
	enc := in.Encoding
	if enc == "" {
		enc = "text"
	}
	if err := checkOneOf("encoding", enc, "text", "base64"); err != nil {
		return nil, err
	}
	st, err := t.c.Stat(ctx, in.ID, in.Path)
	if err != nil {
		return nil, fileError(in.ID, in.Path, err)
	}
	if st.Type == apiv1.FileTypeDir {
		return nil, errdefs.InvalidArgument("%s is a directory: list it with list_files", in.Path)
	}
	w := &window{skip: in.Offset, limit: limit}
	if in.Offset < st.Size || st.Type != apiv1.FileTypeFile {
		if _, err := t.c.ReadFile(ctx, in.ID, in.Path, w); err != nil && !w.full {
			return nil, fileError(in.ID, in.Path, err)
		}
	}
	out := &readResult{Path: in.Path, Size: st.Size, Offset: in.Offset, Encoding: enc,
		Truncated: w.full || in.Offset+int64(len(w.buf)) < st.Size}
	b := w.buf
	if enc == "base64" {
		out.Content, out.Bytes = base64.StdEncoding.EncodeToString(b), len(b)
		return out, nil
	}
	if out.Truncated {
		// Cut at a character boundary; the next read starts there.
		b = b[:runeStart(b, len(b))]
	}
	out.Bytes = len(b)
	out.Binary = !utf8.Valid(b)
	out.Content = string(bytes.ToValidUTF8(b, []byte("\uFFFD")))
	return out, nil
}

// fileError gives a file call's error the hint that fits it.
func fileError(id, p string, err error) error {
	if errdefs.IsNotFound(err) && !strings.Contains(err.Error(), p) {
		return notFoundSandbox(id, err)
	}
	return withHint(err, errdefs.IsNotFound, fmt.Sprintf("%s does not exist in %s: list_files on its directory shows what does.", p, id))
}

func (t *tools) writeFile(ctx context.Context, _ *call, in *writeArgs) (*writeResult, error) {
	if err := checkID(in.ID); err != nil {
		return nil, err
	}
	if err := checkPath("path", in.Path); err != nil {
		return nil, err
	}
	if strings.HasSuffix(in.Path, "/") {
		return nil, errdefs.InvalidArgument("path %s ends with /: name the file to write", errdefs.Quote(in.Path))
	}
	enc := in.Encoding
	if enc == "" {
		enc = "text"
	}
	if err := checkOneOf("encoding", enc, "text", "base64"); err != nil {
		return nil, err
	}
	mode, err := parseMode("mode", in.Mode)
	if err != nil {
		return nil, err
	}
	data := []byte(in.Content)
	if enc == "base64" {
		if data, err = base64.StdEncoding.DecodeString(strings.TrimSpace(in.Content)); err != nil {
			return nil, errdefs.InvalidArgument("content is not valid base64 (standard alphabet, padded): %v", err)
		}
	}
	if len(data) > maxWriteBytes {
		return nil, errdefs.InvalidArgument("content is %d bytes; the limit is %d", len(data), maxWriteBytes)
	}
	if !in.NoMkdir {
		if dir := path.Dir(in.Path); dir != "/" {
			if _, err := t.c.MakeDir(ctx, in.ID, dir); err != nil {
				return nil, fileError(in.ID, dir, err)
			}
		}
	}
	res, err := t.c.WriteFile(ctx, in.ID, in.Path, bytes.NewReader(data), mode)
	if err != nil {
		return nil, withHint(fileError(in.ID, in.Path, err), errdefs.IsNotFound,
			fmt.Sprintf("The directory of %s does not exist: write without no_mkdir to make it.", in.Path))
	}
	return &writeResult{Path: res.Path, Bytes: res.Bytes}, nil
}

func (t *tools) listFiles(ctx context.Context, _ *call, in *listArgs) (*listResult, error) {
	if err := checkID(in.ID); err != nil {
		return nil, err
	}
	if err := checkPath("path", in.Path); err != nil {
		return nil, err
	}
	depth := in.Depth
	if depth == 0 {
		depth = 1
	}
	if err := checkInt("depth", depth, 1, maxListDepth); err != nil {
		return nil, err
	}
	list, err := t.c.ListDir(ctx, in.ID, in.Path, depth)
	if err != nil {
		return nil, fileError(in.ID, in.Path, err)
	}
	out := &listResult{Path: in.Path, Total: len(list), Entries: []entryView{}}
	for i, e := range list {
		if i == maxListEntries {
			out.Truncated = true
			break
		}
		out.Entries = append(out.Entries, entryView{Path: e.Path, Type: e.Type, Size: e.Size, Mode: fmt.Sprintf("%04o", e.Mode&0o7777),
			MTime: rfc3339(e.ModTime), Target: e.Target})
	}
	return out, nil
}

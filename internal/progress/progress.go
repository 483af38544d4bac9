// Package progress carries a writer for human progress lines in a
// context, so that long work (an image build, a snapshot) reports to
// whoever asked for it: the CLI's stderr, or the operation an API caller
// polls.
package progress

import (
	"context"
	"io"
)

type key struct{}

// With returns ctx carrying w as its progress writer.
func With(ctx context.Context, w io.Writer) context.Context {
	return context.WithValue(ctx, key{}, w)
}

// Writer returns ctx's progress writer, else fallback, else io.Discard.
func Writer(ctx context.Context, fallback io.Writer) io.Writer {
	if w, ok := ctx.Value(key{}).(io.Writer); ok && w != nil {
		return w
	}
	if fallback != nil {
		return fallback
	}
	return io.Discard
}

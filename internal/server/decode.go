package server

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"

	"github.com/forkd/forkd/internal/errdefs"
)

// decodeBody decodes r's JSON body into v strictly (see decodeStrict),
// reading at most limit bytes; a longer body is refused with 413.
func decodeBody(w http.ResponseWriter, r *http.Request, limit int64, v any) error {
	return decodeStrict(http.MaxBytesReader(w, r.Body, limit), v)
}

// tooLarge is a body over the limit: class InvalidArgument, and the
// *http.MaxBytesError that gives it status 413.
type tooLarge struct{ mbe *http.MaxBytesError }

func (e *tooLarge) Error() string {
	return fmt.Sprintf("request body is over the limit of %d bytes", e.mbe.Limit)
}
func (e *tooLarge) Unwrap() []error { return []error{errdefs.ErrInvalidArgument, e.mbe} }

// decodeStrict decodes exactly one JSON object from r into v: unknown
// fields, a value of the wrong type, anything but an object at the top and
// anything after it are errors of class InvalidArgument, with a message
// that says what was wrong and where.
func decodeStrict(r io.Reader, v any) error {
	br := &peekReader{r: r}
	first, err := br.firstNonSpace()
	if err != nil {
		return bodyError(err)
	}
	if first != '{' {
		return errdefs.InvalidArgument("request body: want a JSON object, got %s", describeStart(first))
	}
	dec := json.NewDecoder(br)
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return bodyError(err)
	}
	// Exactly one value: only white space may follow.
	var extra json.RawMessage
	switch err := dec.Decode(&extra); {
	case errors.Is(err, io.EOF):
		return nil
	case err != nil:
		return bodyError(err)
	default:
		return errdefs.InvalidArgument("request body: more than one JSON value")
	}
}

// bodyError turns a decoding error into a clear InvalidArgument error.
func bodyError(err error) error {
	var (
		mbe    *http.MaxBytesError
		syntax *json.SyntaxError
		typ    *json.UnmarshalTypeError
	)
	switch {
	case errors.As(err, &mbe):
		return &tooLarge{mbe}
	case errors.Is(err, io.EOF):
		return errdefs.InvalidArgument("request body is empty: want a JSON object")
	case errors.Is(err, io.ErrUnexpectedEOF):
		return errdefs.InvalidArgument("request body: malformed JSON (ends too soon)")
	case errors.As(err, &syntax):
		return errdefs.InvalidArgument("request body: malformed JSON at byte %d: %s", syntax.Offset, syntax.Error())
	case errors.As(err, &typ):
		field := typ.Field
		if field == "" {
			field = "(top level)"
		}
		return errdefs.InvalidArgument("request body: field %s: want %s, got JSON %s", field, typ.Type, typ.Value)
	case strings.HasPrefix(err.Error(), "json: unknown field "):
		return errdefs.InvalidArgument("request body: %s", strings.TrimPrefix(err.Error(), "json: "))
	}
	if errdefs.Code(err) != "internal" {
		return err
	}
	return errdefs.InvalidArgument("request body: %v", err)
}

func describeStart(b byte) string {
	switch {
	case b == '[':
		return "an array"
	case b == '"':
		return "a string"
	case b == 'n':
		return "null"
	case b == 't' || b == 'f':
		return "a boolean"
	case b == '-' || b >= '0' && b <= '9':
		return "a number"
	}
	return fmt.Sprintf("%q", rune(b))
}

// peekReader lets decodeStrict look at the first non-space byte and then
// read everything again.
type peekReader struct {
	r    io.Reader
	head []byte
}

func (p *peekReader) firstNonSpace() (byte, error) {
	buf := make([]byte, 512)
	for {
		n, err := p.r.Read(buf)
		// Leading white space is dropped as it comes: JSON ignores it.
		if t := bytes.TrimLeft(buf[:n], " \t\r\n"); len(t) > 0 {
			p.head = append(p.head, t...)
			return t[0], nil
		}
		if err != nil {
			return 0, err
		}
	}
}

func (p *peekReader) Read(b []byte) (int, error) {
	if len(p.head) > 0 {
		n := copy(b, p.head)
		p.head = p.head[n:]
		return n, nil
	}
	return p.r.Read(b)
}

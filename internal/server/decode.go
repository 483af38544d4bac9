package server

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"reflect"
	"slices"
	"strconv"
	"strings"

	"github.com/forkd/forkd/internal/errdefs"
)

// jsonType is the media type of JSON request bodies.
const jsonType = "application/json"

// bodyType returns r's media type (lower case, without parameters) when it
// is application/json or one of also; any other, none or a charset other
// than UTF-8 is an unsupportedType error (415).
func bodyType(r *http.Request, also ...string) (string, error) {
	want := append([]string{jsonType}, also...)
	ct := r.Header.Get("Content-Type")
	if ct == "" {
		return "", &unsupportedType{want: want}
	}
	mt, params, err := mime.ParseMediaType(ct)
	if err != nil || mt != jsonType && !slices.Contains(also, mt) {
		return "", &unsupportedType{got: ct, want: want}
	}
	if cs, ok := params["charset"]; ok && !strings.EqualFold(cs, "utf-8") {
		return "", &unsupportedType{got: ct, want: want}
	}
	return mt, nil
}

// unsupportedType is a request body of a media type the route does not
// take: class InvalidArgument, status 415.
type unsupportedType struct {
	got  string // the Content-Type header; "" when absent
	want []string
}

func (e *unsupportedType) Error() string {
	want := strings.Join(e.want, " or ")
	if e.got == "" {
		return "request body without a Content-Type: want " + want
	}
	return fmt.Sprintf("Content-Type %s: want %s (charset utf-8, if given)", errdefs.Quote(e.got), want)
}
func (e *unsupportedType) Unwrap() error { return errdefs.ErrInvalidArgument }

// tooLarge is a body over the limit: class InvalidArgument, and the
// *http.MaxBytesError that gives it status 413.
type tooLarge struct{ mbe *http.MaxBytesError }

func (e *tooLarge) Error() string {
	return fmt.Sprintf("request body is over the limit of %d bytes", e.mbe.Limit)
}
func (e *tooLarge) Unwrap() []error { return []error{errdefs.ErrInvalidArgument, e.mbe} }

// decodeStrict decodes exactly one JSON object from r into v: unknown
// fields (names match exactly, case included), duplicate keys, a value of
// the wrong type, anything but an object at the top and anything after it
// are errors of class InvalidArgument, with a message that says what was
// wrong and where.
func decodeStrict(r io.Reader, v any) error {
	b, err := io.ReadAll(r)
	if err != nil {
		return bodyError(err)
	}
	return decodeStrictBytes(b, v)
}

// decodeStrictBytes is decodeStrict of b. It keeps no reference to b.
func decodeStrictBytes(b []byte, v any) error {
	t := bytes.TrimLeft(b, " \t\r\n")
	if len(t) == 0 {
		return bodyError(io.EOF)
	}
	if t[0] != '{' {
		return errdefs.InvalidArgument("request body: want a JSON object, got %s", describeStart(t[0]))
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return bodyError(err)
	}
	// Exactly one value: only white space may follow.
	if rest := bytes.TrimLeft(b[dec.InputOffset():], " \t\r\n"); len(rest) > 0 {
		if json.Valid(rest) || rest[0] == '{' || rest[0] == '[' {
			return errdefs.InvalidArgument("request body: more than one JSON value")
		}
		return errdefs.InvalidArgument("request body: malformed JSON at byte %d: data after the object", len(b)-len(rest))
	}
	// encoding/json matches names without regard to case and lets a
	// repeated key win silently; the API does neither.
	kdec := json.NewDecoder(bytes.NewReader(b))
	return checkKeys(kdec, reflect.TypeOf(v), "")
}

// checkKeys reads one JSON value from dec and checks that every object key
// names a field of the Go type t exactly (tag name, case included) and
// that no object repeats a key. at is the value's place, for messages.
func checkKeys(dec *json.Decoder, t reflect.Type, at string) error {
	for t != nil && t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	tok, err := dec.Token()
	if err != nil {
		return bodyError(err)
	}
	d, ok := tok.(json.Delim)
	if !ok {
		return nil // a scalar
	}
	switch d {
	case '[':
		var elem reflect.Type
		if t != nil && (t.Kind() == reflect.Slice || t.Kind() == reflect.Array) {
			elem = t.Elem()
		}
		for i := 0; dec.More(); i++ {
			if err := checkKeys(dec, elem, fmt.Sprintf("%s[%d]", at, i)); err != nil {
				return err
			}
		}
	case '{':
		seen := map[string]bool{}
		for dec.More() {
			tok, err := dec.Token()
			if err != nil {
				return bodyError(err)
			}
			key, _ := tok.(string)
			where := key
			if at != "" {
				where = at + "." + key
			}
			if seen[key] {
				return errdefs.InvalidArgument("request body: key %s appears twice", errdefs.Quote(where))
			}
			seen[key] = true
			var ft reflect.Type
			switch {
			case t != nil && t.Kind() == reflect.Struct:
				f, ok := fieldByJSONName(t, key)
				if !ok {
					return errdefs.InvalidArgument("request body: unknown field %s", errdefs.Quote(where))
				}
				ft = f
			case t != nil && t.Kind() == reflect.Map:
				ft = t.Elem()
			}
			if err := checkKeys(dec, ft, where); err != nil {
				return err
			}
		}
	}
	_, err = dec.Token() // the closing delimiter
	return err
}

// fieldByJSONName finds the field of struct t whose JSON name is exactly
// name.
func fieldByJSONName(t reflect.Type, name string) (reflect.Type, bool) {
	for _, f := range jsonFields(t) {
		if f.name == name {
			return f.typ, true
		}
	}
	return nil, false
}

// jsonField is a struct field as encoding/json names it.
type jsonField struct {
	name     string
	optional bool // omitempty or omitzero
	typ      reflect.Type
	doc      string // its `doc` tag: the OpenAPI description
}

// jsonFields lists struct t's fields as encoding/json sees them: by tag
// name (the Go name without one), "-" left out, and the fields of an
// untagged embedded struct in t itself.
func jsonFields(t reflect.Type) []jsonField {
	var out []jsonField
	for i := range t.NumField() {
		f := t.Field(i)
		if f.Anonymous && f.Type.Kind() == reflect.Struct && f.Tag.Get("json") == "" {
			out = append(out, jsonFields(f.Type)...)
			continue
		}
		if !f.IsExported() {
			continue
		}
		name, opts, _ := strings.Cut(f.Tag.Get("json"), ",")
		if name == "-" {
			continue
		}
		if name == "" {
			name = f.Name
		}
		optional := strings.Contains(opts, "omitempty") || strings.Contains(opts, "omitzero")
		out = append(out, jsonField{name: name, optional: optional, typ: f.Type, doc: f.Tag.Get("doc")})
	}
	return out
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
		// Value is a kind, and for a number its text: maybe huge.
		got := typ.Value
		if kind, num, ok := strings.Cut(got, " "); ok && len(got) > errdefs.QuoteMax {
			got = kind + " " + errdefs.Quote(num)
		}
		return errdefs.InvalidArgument("request body: field %s: want %s, got JSON %s", field, typ.Type, got)
	case strings.HasPrefix(err.Error(), "json: unknown field "):
		name := strings.TrimPrefix(err.Error(), "json: unknown field ")
		if s, err := strconv.Unquote(name); err == nil {
			name = errdefs.Quote(s)
		}
		return errdefs.InvalidArgument("request body: unknown field %s", name)
	}
	if errdefs.Classed(err) {
		return err
	}
	return errdefs.InvalidArgument("request body: %w", err)
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

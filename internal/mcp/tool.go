package mcp

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"reflect"
	"slices"
	"strings"

	"github.com/google/jsonschema-go/jsonschema"
	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/forkd/forkd/internal/errdefs"
)

// tool is one MCP tool: its description for the model and its handler.
// In is its arguments (a struct: json names, jsonschema descriptions),
// Out its structured result.
type tool[In, Out any] struct {
	name, title, desc string
	props             map[string][]prop
	// readOnly: it changes nothing; destructive: it removes or replaces
	// something (a sandbox, a file, a policy).
	readOnly, destructive bool
	run                   func(ctx context.Context, call *call, in *In) (*Out, error)
}

// texter is a result that reads better as text than as its JSON (a
// command's output): the text goes in the result's content, the JSON in
// its structured content.
type texter interface{ text() string }

// call is what a tool handler gets besides its arguments: the request,
// for progress.
type call struct {
	req *sdk.CallToolRequest
}

// add registers t on s. Arguments are decoded strictly (unknown or mistyped
// arguments are refused with a message naming them) and then
// checked by the tool itself; every failure, of the arguments or of the
// call, is a tool result with isError set and a message the model can act
// on, never a protocol error.
func add[In, Out any](s *sdk.Server, t tool[In, Out]) {
	in := inputSchema[In](t.props)
	out := outputSchema[Out]()
	ann := &sdk.ToolAnnotations{Title: t.title, ReadOnlyHint: t.readOnly, OpenWorldHint: ptr(false)}
	if !t.readOnly {
		ann.DestructiveHint = ptr(t.destructive)
	}
	s.AddTool(&sdk.Tool{Name: t.name, Title: t.title, Description: t.desc, InputSchema: in, OutputSchema: out, Annotations: ann},
		func(ctx context.Context, req *sdk.CallToolRequest) (*sdk.CallToolResult, error) {
			args, err := decodeArgs[In](req.Params.Arguments, in)
			if err != nil {
				return errorResult(err), nil
			}
			res, err := t.run(ctx, &call{req: req}, args)
			if err != nil {
				return errorResult(err), nil
			}
			return result(res)
		})
}

func ptr[T any](v T) *T { return &v }

// result is a tool's successful result: res as structured content, and
// as text content its text or its JSON.
func result(res any) (*sdk.CallToolResult, error) {
	b, err := json.Marshal(res)
	if err != nil {
		return nil, fmt.Errorf("marshal result: %w", err)
	}
	text := string(b)
	if t, ok := res.(texter); ok {
		text = t.text()
	}
	return &sdk.CallToolResult{Content: []sdk.Content{&sdk.TextContent{Text: text}}, StructuredContent: json.RawMessage(b)}, nil
}

// errorResult is a failed call as a tool result: isError, and a message
// that says what went wrong and what to do about it.
func errorResult(err error) *sdk.CallToolResult {
	return &sdk.CallToolResult{IsError: true, Content: []sdk.Content{&sdk.TextContent{Text: explain(err)}}}
}

// decodeArgs decodes a call's arguments into In strictly, naming what is
// wrong in terms of the tool's schema.
func decodeArgs[In any](raw json.RawMessage, schema *jsonschema.Schema) (*In, error) {
	in := new(In)
	if len(bytes.TrimSpace(raw)) == 0 || string(bytes.TrimSpace(raw)) == "null" {
		raw = json.RawMessage("{}")
	}
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(raw, &obj); err != nil {
		return nil, errdefs.InvalidArgument("arguments: want a JSON object")
	}
	known := slices.Sorted(maps.Keys(schema.Properties))
	for name := range obj {
		if _, ok := schema.Properties[name]; !ok {
			if len(known) == 0 {
				return nil, errdefs.InvalidArgument("unknown argument %s: this tool takes none", errdefs.Quote(name))
			}
			return nil, errdefs.InvalidArgument("unknown argument %s: this tool takes %s", errdefs.Quote(name), strings.Join(known, ", "))
		}
	}
	for _, name := range schema.Required {
		if v, ok := obj[name]; !ok || string(v) == "null" {
			return nil, errdefs.InvalidArgument("missing argument %s (required)", name)
		}
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	if err := dec.Decode(in); err != nil {
		return nil, argError(err, schema)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return nil, errdefs.InvalidArgument("arguments: trailing data after the object")
	}
	return in, nil
}

// argError rephrases a JSON decoding error as a message about the
// argument it concerns.
func argError(err error, schema *jsonschema.Schema) error {
	var te *json.UnmarshalTypeError
	if errors.As(err, &te) && te.Field != "" {
		want := jsonKind(te.Type)
		if sub := schema.Properties[strings.SplitN(te.Field, ".", 2)[0]]; sub != nil && sub.Type != "" && !strings.Contains(te.Field, ".") {
			want = sub.Type
		}
		return errdefs.InvalidArgument("argument %s: want %s, got %s", te.Field, want, te.Value)
	}
	return errdefs.InvalidArgument("arguments: %v", err)
}

// jsonKind names the JSON type a Go type decodes from.
func jsonKind(t reflect.Type) string {
	switch t.Kind() {
	case reflect.String:
		return "string"
	case reflect.Bool:
		return "boolean"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return "integer"
	case reflect.Float32, reflect.Float64:
		return "number"
	case reflect.Slice, reflect.Array:
		return "array"
	case reflect.Map, reflect.Struct:
		return "object"
	}
	return t.String()
}

// jsonText is v as indented JSON.
func jsonText(v any) (string, error) {
	b, err := json.MarshalIndent(v, "", "  ")
	return string(b), err
}

package mcp

import (
	"encoding/json"
	"fmt"
	"slices"

	"github.com/google/jsonschema-go/jsonschema"
)

// A prop refines the inferred schema of one input property: bounds,
// patterns, enums, defaults, which a client may show or check before it
// calls. The tool's own checks (args.go) remain the authority; these only
// describe them.
type prop func(*jsonschema.Schema)

func pattern(re string) prop { return func(s *jsonschema.Schema) { s.Pattern = re } }

func between(lo, hi float64) prop {
	return func(s *jsonschema.Schema) { s.Minimum, s.Maximum = &lo, &hi }
}

func maxLen(n int) prop { return func(s *jsonschema.Schema) { s.MaxLength = &n } }

func minLen(n int) prop { return func(s *jsonschema.Schema) { s.MinLength = &n } }

func maxItems(n int) prop { return func(s *jsonschema.Schema) { s.MaxItems = &n } }

func oneOf(vals ...string) prop {
	return func(s *jsonschema.Schema) {
		s.Enum = nil
		for _, v := range vals {
			s.Enum = append(s.Enum, v)
		}
	}
}

func byDefault(v any) prop {
	return func(s *jsonschema.Schema) {
		b, err := json.Marshal(v)
		if err != nil {
			panic(err)
		}
		s.Default = b
	}
}

// items refines the schema of an array's items.
func items(ps ...prop) prop {
	return func(s *jsonschema.Schema) {
		for _, p := range ps {
			p(s.Items)
		}
	}
}

// field refines the property name of an object property (a nested
// struct such as a network rule).
func field(name string, ps ...prop) prop {
	return func(s *jsonschema.Schema) {
		target := s
		if target.Items != nil {
			target = target.Items
		}
		sub, ok := target.Properties[name]
		if !ok {
			panic(fmt.Sprintf("mcp: schema has no property %q", name))
		}
		for _, p := range ps {
			p(sub)
		}
	}
}

// Refinements shared by many tools.
var (
	idProp   = []prop{pattern(`^sb-[a-z2-7]{10}$`)}
	tagProp  = []prop{pattern(`^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$`)}
	pathProp = []prop{pattern(`^/`), maxLen(maxPathBytes)}
)

// inputSchema is the JSON Schema of a tool's arguments T, inferred from
// its fields (json names, required unless omitempty, descriptions from
// the jsonschema tags, no other properties), made plain for clients (an
// optional field is absent, never null) and refined by props. It panics
// on a property T does not have: a bug caught by the first test.
func inputSchema[T any](props map[string][]prop) *jsonschema.Schema {
	s, err := jsonschema.For[T](nil)
	if err != nil {
		panic(err)
	}
	noNull(s)
	for name, ps := range props {
		sub, ok := s.Properties[name]
		if !ok {
			panic(fmt.Sprintf("mcp: %T has no argument %q", *new(T), name))
		}
		for _, p := range ps {
			p(sub)
		}
	}
	return s
}

// outputSchema is the JSON Schema of a tool's structured result T.
func outputSchema[T any]() *jsonschema.Schema {
	s, err := jsonschema.For[T](nil)
	if err != nil {
		panic(err)
	}
	return s
}

// noNull drops "null" from the types inferred for slices, maps and
// pointers, recursively: arguments are left out, not sent as null.
func noNull(s *jsonschema.Schema) {
	if s == nil {
		return
	}
	if i := slices.Index(s.Types, "null"); i >= 0 {
		rest := slices.Delete(slices.Clone(s.Types), i, i+1)
		if len(rest) == 1 {
			s.Type, s.Types = rest[0], nil
		} else {
			s.Types = rest
		}
	}
	noNull(s.Items)
	noNull(s.AdditionalProperties)
	for _, p := range s.Properties {
		noNull(p)
	}
}

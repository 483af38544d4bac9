package server

import (
	"encoding/json"
	"net/http"
	"reflect"
	"strconv"
	"strings"
	"time"
)

// openAPI builds the OpenAPI 3.1 document of the route table: paths,
// parameters, request and response schemas (from the api/v1 types by
// reflection) and the error shape every route may answer.
func openAPI(version string) ([]byte, error) {
	g := &schemaGen{defs: map[string]any{}}
	paths := map[string]map[string]any{}
	errRef := g.schema(reflect.TypeFor[errorResponseDoc]())
	for _, rt := range routes {
		op := map[string]any{
			"summary":     rt.Summary,
			"operationId": operationID(rt),
		}
		var params []any
		for _, seg := range strings.Split(rt.Path, "/") {
			if strings.HasPrefix(seg, "{") && strings.HasSuffix(seg, "}") {
				params = append(params, map[string]any{
					"name": strings.Trim(seg, "{}"), "in": "path", "required": true, "schema": map[string]any{"type": "string"},
				})
			}
		}
		for _, q := range rt.Query {
			params = append(params, map[string]any{
				"name": q.Name, "in": "query", "required": q.Required, "description": q.Doc, "schema": map[string]any{"type": q.Type},
			})
		}
		if params != nil {
			op["parameters"] = params
		}
		if rt.Public {
			op["security"] = []any{}
		}
		switch {
		case rt.Consumes != "":
			op["requestBody"] = map[string]any{"required": true, "content": map[string]any{
				rt.Consumes: map[string]any{"schema": map[string]any{"type": "string", "format": "binary"}}}}
		case rt.h.req != nil:
			op["requestBody"] = map[string]any{"required": true, "content": map[string]any{
				"application/json": map[string]any{"schema": g.schema(reflect.TypeOf(rt.h.req))}}}
		}
		status := rt.Status
		if status == 0 {
			status = http.StatusOK
		}
		ok := map[string]any{"description": http.StatusText(status)}
		switch {
		case rt.Produces == ndjson:
			ok["content"] = map[string]any{ndjson: map[string]any{
				"schema": g.schema(reflect.TypeOf(rt.Response)), "x-stream": "one JSON object per line"}}
		case rt.Produces != "":
			ok["content"] = map[string]any{rt.Produces: map[string]any{"schema": map[string]any{"type": "string"}}}
		case rt.Response != nil:
			ok["content"] = map[string]any{"application/json": map[string]any{"schema": g.schema(reflect.TypeOf(rt.Response))}}
		}
		op["responses"] = map[string]any{
			strconv.Itoa(status): ok,
			"default": map[string]any{"description": "error", "content": map[string]any{
				"application/json": map[string]any{"schema": errRef}}},
		}
		if paths[rt.Path] == nil {
			paths[rt.Path] = map[string]any{}
		}
		paths[rt.Path][strings.ToLower(rt.Method)] = op
	}
	doc := map[string]any{
		"openapi": "3.1.0",
		"info": map[string]any{
			"title":   "forkd",
			"version": version,
			"description": "forkd REST API v1: microVM sandboxes forked from warm snapshots. Errors are {\"error\":{\"code\",\"message\"}} with a stable code. " +
				"JSON request bodies need Content-Type application/json (415 otherwise), must arrive within the daemon's --body-timeout (408), " +
				"and may be refused with 429 and Retry-After while the daemon holds --max-body-bytes-in-flight of bodies.",
		},
		"paths": paths,
		"components": map[string]any{
			"schemas":         g.defs,
			"securitySchemes": map[string]any{"bearer": map[string]any{"type": "http", "scheme": "bearer"}},
		},
		"security": []any{map[string]any{"bearer": []any{}}},
	}
	return json.MarshalIndent(doc, "", "  ")
}

// errorResponseDoc documents the error body (api/v1.ErrorResponse).
type errorResponseDoc struct {
	Error struct {
		Code    string `json:"code"`
		Message string `json:"message"`
	} `json:"error"`
}

func operationID(rt route) string {
	id := strings.ToLower(rt.Method)
	for _, seg := range strings.Split(rt.Path, "/") {
		seg = strings.Trim(seg, "{}")
		seg = strings.NewReplacer(".", "_", "-", "_").Replace(seg)
		if seg != "" {
			id += "_" + seg
		}
	}
	return id
}

// schemaGen turns Go types into JSON Schema, named structs as $refs.
type schemaGen struct {
	defs map[string]any
}

var timeType = reflect.TypeFor[time.Time]()

func (g *schemaGen) schema(t reflect.Type) map[string]any {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch {
	case t == timeType:
		return map[string]any{"type": "string", "format": "date-time"}
	case t.Kind() == reflect.Struct:
		name := t.Name()
		if name == "" || name == "errorResponseDoc" {
			if name == "" {
				return g.object(t)
			}
			name = "ErrorResponse"
		}
		ref := map[string]any{"$ref": "#/components/schemas/" + name}
		if _, done := g.defs[name]; !done {
			g.defs[name] = map[string]any{} // breaks recursion
			g.defs[name] = g.object(t)
		}
		return ref
	case t.Kind() == reflect.Slice && t.Elem().Kind() == reflect.Uint8:
		return map[string]any{"type": "string", "contentEncoding": "base64"}
	case t.Kind() == reflect.Slice || t.Kind() == reflect.Array:
		return map[string]any{"type": "array", "items": g.schema(t.Elem())}
	case t.Kind() == reflect.Map:
		return map[string]any{"type": "object", "additionalProperties": g.schema(t.Elem())}
	case t.Kind() == reflect.String:
		return map[string]any{"type": "string"}
	case t.Kind() == reflect.Bool:
		return map[string]any{"type": "boolean"}
	case t.Kind() >= reflect.Int && t.Kind() <= reflect.Uint64:
		return map[string]any{"type": "integer"}
	case t.Kind() == reflect.Float32 || t.Kind() == reflect.Float64:
		return map[string]any{"type": "number"}
	}
	return map[string]any{}
}

func (g *schemaGen) object(t reflect.Type) map[string]any {
	props := map[string]any{}
	var required []string
	for _, f := range jsonFields(t) {
		s := g.schema(f.typ)
		if f.doc != "" {
			if _, ref := s["$ref"]; !ref { // a $ref's siblings are ignored
				s["description"] = f.doc
			}
		}
		props[f.name] = s
		if !f.optional {
			required = append(required, f.name)
		}
	}
	out := map[string]any{"type": "object", "properties": props, "additionalProperties": false}
	if required != nil {
		out["required"] = required
	}
	return out
}

func (s *Server) serveOpenAPI(w http.ResponseWriter, r *http.Request) error {
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(s.openapi) // a failed write means the caller left
	return nil
}

package server

import (
	"bytes"
	"encoding/json"
	"reflect"
	"testing"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/request"
	"github.com/forkd/forkd/internal/snapshot"
)

// FuzzDecodeCreateSandbox feeds arbitrary bodies to the decoding and
// validation of POST /v1/sandboxes: it must never panic, must refuse with
// an InvalidArgument-class error (a 4xx), and whatever it accepts must be a
// valid fork spec that survives a round trip through JSON.
func FuzzDecodeCreateSandbox(f *testing.F) {
	for _, seed := range []string{
		`{"snapshot_tag":"base","n":5,"timeout_secs":30,"metadata":{"a":"b"},"memory_limit_mib":512}`,
		`{"snapshot_tag":"base","network":{"egress":"allowlist","allow":[{"cidr":"10.0.0.0/8","proto":"tcp","ports":["443","8000-8100"]}]}}`,
		`{"snapshot_tag":"../x"}`, `{"snapshot_tag":"base","n":1e9}`, `{"snapshot_tag":"base","bogus":1}`,
		`{"snapshot_tag":"base"}{}`, `[]`, `null`, ``, `{"snapshot_tag":"base","n":"1"}`, "{\"snapshot_tag\":\"\u0000\"}",
		`{"snapshot_tag":"b","metadata":{"":"x"}}`, `{"snapshot_tag":"b","keep_partial":true,"n":-0}`,
		"  \n{\"snapshot_tag\":\"b\"}  \n", `{"snapshot_tag":"b","network":{"egress":"deny","allow":[{"cidr":"1.1.1.1/32"}]}}`,
	} {
		f.Add([]byte(seed))
	}
	const maxN = 100
	f.Fuzz(func(t *testing.T, body []byte) {
		var req apiv1.CreateSandboxesRequest
		err := decodeStrict(bytes.NewReader(body), &req)
		if err == nil {
			_, err = request.ForkSpec(&req, maxN)
		}
		if err != nil {
			if !errdefs.IsInvalidArgument(err) || httpStatus(err) != 400 {
				t.Fatalf("body %q: error %v (status %d), want InvalidArgument and 400", body, err, httpStatus(err))
			}
			return
		}
		spec, _ := request.ForkSpec(&req, maxN)
		if snapshot.ValidateTag(spec.Tag) != nil || spec.N < 1 || spec.N > maxN || spec.Timeout < 0 || spec.IDs != nil {
			t.Fatalf("body %q accepted as %+v", body, spec)
		}
		// What was accepted means the same once re-encoded.
		again, _ := json.Marshal(req)
		var req2 apiv1.CreateSandboxesRequest
		if err := decodeStrict(bytes.NewReader(again), &req2); err != nil {
			t.Fatalf("re-encoded %s: %v", again, err)
		}
		spec2, err := request.ForkSpec(&req2, maxN)
		if err != nil || !reflect.DeepEqual(spec, spec2) {
			t.Fatalf("round trip of %q: %+v vs %+v (%v)", body, spec, spec2, err)
		}
	})
}

func TestDecodeStrictMessages(t *testing.T) {
	type small struct {
		A int    `json:"a"`
		B string `json:"b"`
	}
	for body, want := range map[string]string{
		`{"a":1}`:          "",
		` {"a":1} `:        "",
		`{"a":"x"}`:        "field a: want int, got JSON string",
		`{"c":1}`:          `unknown field "c"`,
		`{"a":1`:           "ends too soon",
		`{"a":1,}`:         "malformed JSON at byte",
		`{"a":1} x`:        "malformed JSON",
		`{"A":1}`:          `unknown field "A"`,
		`{"a":1,"a":2}`:    `key "a" appears twice`,
		`{"a":1} {}`:       "more than one JSON value",
		`7`:                "got a number",
		`"s"`:              "got a string",
		`true`:             "got a boolean",
		"":                 "empty",
		"   \n\t ":         "empty",
		`{"b":"\ud800"}`:   "",
		"{\"b\":\"\xff\"}": "",
	} {
		var v small
		err := decodeStrict(bytes.NewReader([]byte(body)), &v)
		switch {
		case want == "" && err != nil:
			t.Errorf("%q: %v", body, err)
		case want != "" && (err == nil || !errdefs.IsInvalidArgument(err) || !bytes.Contains([]byte(err.Error()), []byte(want))):
			t.Errorf("%q: %v, want InvalidArgument with %q", body, err, want)
		}
	}
}

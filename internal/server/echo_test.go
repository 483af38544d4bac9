package server

import (
	"io"
	"net/url"
	"strings"
	"testing"

	"github.com/forkd/forkd/internal/sandbox"
)

// TestLongInputIsNotEchoed: an error about a huge field, path or parameter
// quotes only the start of it (with its length), so the answer stays
// small whatever the caller sent.
func TestLongInputIsNotEchoed(t *testing.T) {
	d := startDaemon(t, fakeNoVMs{}, sandbox.Admission{}, nil)
	big := strings.Repeat("x", 512<<10) // under the 1 MiB body limit
	rel := "rel" + big
	inURL := strings.Repeat("y", 32<<10) // under the header limit
	for _, c := range []struct{ method, path, body string }{
		{"POST", "/v1/sandboxes", `{"snapshot_tag":"` + big + `"}`},
		{"POST", "/v1/sandboxes", `{"snapshot_tag":"a","metadata":{"` + big + `":"v"}}`},
		{"POST", "/v1/sandboxes", `{"snapshot_tag":"a","n":` + strings.Repeat("9", 512<<10) + `}`},
		{"POST", "/v1/sandboxes", `{"snapshot_tag":"a","` + big + `":1}`},
		{"POST", "/v1/sandboxes", `{"snapshot_tag":"a","network":{"` + big + `":1}}`},
		{"POST", "/v1/sandboxes", `{"snapshot_tag":"a","a":1,"a":2,"` + big + `":1}`},
		{"POST", "/v1/sandboxes", `{"snapshot_tag":"a","network":{"egress":"` + big + `"}}`},
		{"POST", "/v1/sandboxes", `{"snapshot_tag":"a","network":{"egress":"allowlist","allow":[{"cidr":"` + big + `"}]}}`},
		{"POST", "/v1/sandboxes", `{"snapshot_tag":"a","network":{"egress":"allowlist","allow":[{"cidr":"1.2.3.0/24","ports":["` + big + `"]}]}}`},
		{"POST", "/v1/sandboxes", `{"snapshot_tag":"a","network":{"egress":"allowlist","allow":[{"cidr":"1.2.3.0/24","proto":"` + big + `"}]}}`},
		{"PUT", "/v1/sandboxes/sb-aaaaaaaaaa/network", `{"egress":"allowlist","allow":[{"cidr":"` + big + `"}]}`},
		{"POST", "/v1/snapshots", `{"tag":"` + big + `"}`},
		{"POST", "/v1/snapshots", `{"tag":"x","image":"` + big + `"}`},
		{"POST", "/v1/snapshots", `{"tag":"x","oci":{"ref":"busybox","extra":["` + big + `!"]}}`},
		{"POST", "/v1/snapshots", `{"tag":"x","oci":{"ref":"busybox","preload":["` + big + `!"]}}`},
		{"POST", "/v1/snapshots", `{"tag":"x","oci":{"ref":"UPPER::` + strings.Repeat("Z", 4000) + `"}}`},
		{"POST", "/v1/sandboxes/sb-aaaaaaaaaa/exec", `{"args":["ls"],"env":{"=` + big + `":"v"}}`},
		{"POST", "/v1/sandboxes/sb-aaaaaaaaaa/files/mkdir", `{"path":"` + rel + `"}`},
		{"POST", "/v1/sandboxes/sb-aaaaaaaaaa/files/rename", `{"from":"/a","to":"` + rel + `"}`},
		{"GET", "/v1/sandboxes/sb-" + inURL, ""},
		{"GET", "/v1/operations/op-" + inURL, ""},
		{"GET", "/v1/snapshots/" + inURL, ""},
		{"GET", "/v1/nope/" + inURL, ""},
		{"PATCH", "/v1/sandboxes?" + inURL + "=1", ""},
		{"GET", "/v1/sandboxes?" + inURL + "=1", ""},
		{"GET", "/version?" + inURL + "=1", ""},
		{"GET", "/v1/sandboxes?status=" + inURL, ""},
		{"GET", "/v1/sandboxes?metadata=" + inURL, ""},
		{"GET", "/v1/sandboxes?snapshot=" + inURL, ""},
		{"GET", "/v1/sandboxes/sb-aaaaaaaaaa/files?path=" + url.QueryEscape("/"+inURL), ""},
		{"GET", "/v1/sandboxes/sb-aaaaaaaaaa/files?path=rel" + inURL, ""},
		{"PUT", "/v1/sandboxes/sb-aaaaaaaaaa/files?path=/a&mode=" + inURL, ""},
		{"DELETE", "/v1/sandboxes/sb-aaaaaaaaaa/files?path=/a&recursive=" + inURL, ""},
		{"GET", "/v1/sandboxes/sb-aaaaaaaaaa/files/list?path=/a&depth=" + inURL, ""},
	} {
		var body *strings.Reader
		if c.body != "" {
			body = strings.NewReader(c.body)
		}
		code, b := d.call(t, c.method, c.path, testToken, bodyOrNil(body))
		e := apiError(t, b)
		if code < 400 || code >= 500 || len(e.Message) > 400 {
			t.Errorf("%s %.60s…: %d with a %d-byte message: %.300s…", c.method, c.path, code, len(e.Message), e.Message)
		}
	}
}

// bodyOrNil keeps a nil *strings.Reader from becoming a non-nil io.Reader.
func bodyOrNil(r *strings.Reader) io.Reader {
	if r == nil {
		return nil
	}
	return r
}

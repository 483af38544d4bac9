package agent_test

import (
	"bytes"
	"encoding/base64"
	"os/exec"
	"testing"
	"time"

	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/testutil"
)

// Contexts are namespaces of their own, each counting its evals; a reset
// empties one; env and dir apply to one eval.
func TestEvalContexts(t *testing.T) {
	c := evalGuest(t)
	ctx := testCtx(t)
	run := func(req proto.EvalRequest) *proto.EvalResult {
		t.Helper()
		req.Timeout = 30 * time.Second
		res, err := c.Eval(ctx, req)
		if err != nil {
			t.Fatalf("eval %+v: %v", req, err)
		}
		return res
	}
	run(proto.EvalRequest{Code: "x = 1"})
	run(proto.EvalRequest{Code: "x = 2", Context: "a"})
	if res := run(proto.EvalRequest{Code: "x", Context: "a"}); res.Value != "2" || res.Count != 2 {
		t.Fatalf("context a: %+v", res)
	}
	if res := run(proto.EvalRequest{Code: "x"}); res.Value != "1" || res.Count != 2 {
		t.Fatalf("main context: %+v", res)
	}
	if res := run(proto.EvalRequest{Context: "a", Reset: true}); res.Error != nil {
		t.Fatalf("reset: %+v", res)
	}
	if res := run(proto.EvalRequest{Code: "x", Context: "a"}); res.Error == nil || res.Error.Name != "NameError" || res.Count != 1 {
		t.Fatalf("after reset: %+v", res)
	}
	dir := t.TempDir()
	res := run(proto.EvalRequest{Code: "import os\nos.getcwd(), os.environ.get('FORKD_T')", Env: map[string]string{"FORKD_T": "v"}, Dir: dir})
	if res.Value != "('"+dir+"', 'v')" {
		t.Fatalf("env and dir: %+v", res)
	}
	if res := run(proto.EvalRequest{Code: "os.environ.get('FORKD_T')"}); res.Value != "" {
		t.Fatalf("env after the eval: %+v", res)
	}
	if res := run(proto.EvalRequest{Code: "1", Dir: "/nonexistent-forkd"}); res.Error == nil || res.Error.Name != "FileNotFoundError" {
		t.Fatalf("bad dir: %+v", res)
	}
	// Rich forms of the last value.
	res = run(proto.EvalRequest{Code: "class H:\n  def _repr_html_(self): return '<b>h</b>'\n  def __repr__(self): return 'H()'\nH()", Rich: true})
	if len(res.Results) != 1 || !res.Results[0].Main || res.Results[0].Formats["html"] != "<b>h</b>" || res.Results[0].Formats["text"] != "H()" {
		t.Fatalf("rich value: %+v", res)
	}
}

// With matplotlib, a figure left open or shown comes back as a PNG, and
// showing it prints no warning.
func TestEvalFigures(t *testing.T) {
	py := python(t)
	if err := exec.Command(py, "-c", "import matplotlib").Run(); err != nil {
		testutil.Unavailable(t, "test needs matplotlib for "+py+" (python3-matplotlib)")
	}
	c := evalGuest(t)
	ctx := testCtx(t)
	res, err := c.Eval(ctx, proto.EvalRequest{Rich: true, Timeout: 60 * time.Second,
		Code: "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()\nfig = plt.figure()\nplt.bar([1], [2])\n1 + 1"})
	if err != nil {
		t.Fatal(err)
	}
	if res.Error != nil || res.Stderr != "" {
		t.Fatalf("figures: error %+v, stderr %q", res.Error, res.Stderr)
	}
	if len(res.Results) != 3 {
		t.Fatalf("results %+v", res.Results)
	}
	for i, d := range res.Results[:2] {
		png, err := base64.StdEncoding.DecodeString(d.Formats["png"])
		if err != nil || !bytes.HasPrefix(png, []byte("\x89PNG")) || d.Main {
			t.Fatalf("figure %d: %v, %q…", i, err, d.Formats["text"])
		}
		if d.Formats["text"] != "<Figure size 640x480 with 1 Axes>" {
			t.Errorf("figure %d text %q", i, d.Formats["text"])
		}
	}
	if m := res.Results[2]; !m.Main || m.Formats["text"] != "2" {
		t.Fatalf("main result %+v", m)
	}
	// Figures were closed once reported; no MPLBACKEND reaches children.
	res, err = c.Eval(ctx, proto.EvalRequest{Rich: true, Timeout: 30 * time.Second,
		Code: "import os\nprint(len(plt.get_fignums()), os.environ.get('MPLBACKEND'))"})
	if err != nil || res.Stdout != "0 None\n" || len(res.Results) != 0 {
		t.Fatalf("after: %+v, %v", res, err)
	}
}

package server

import (
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/request"
	"github.com/forkd/forkd/internal/sandbox"
)

func TestQueryParametersChecked(t *testing.T) {
	d := startDaemon(t, fakeNoVMs{}, sandbox.Admission{}, nil)
	for _, c := range []struct{ path, want string }{
		{"/v1/sandboxes?status=runing", `status "runing": want one of starting, running`}, //nolint:misspell // the misspelled status is the input under test
		{"/v1/sandboxes?stauts=running", `unknown query parameter "stauts": want one of snapshot, metadata, status`},
		{"/v1/snapshots?all=1", `unknown query parameter "all"`},
		{"/v1/sandboxes/sb-aaaaaaaaaa/files/stat?path=/x&recursive=1", `want one of path`},
	} {
		code, b := d.call(t, "GET", c.path, testToken, nil)
		if e := apiError(t, b); code != 400 || !strings.Contains(e.Message, c.want) {
			t.Errorf("GET %s: %d %s, want 400 and %q", c.path, code, b, c.want)
		}
	}
	for _, path := range []string{"/v1/sandboxes?status=running", "/v1/sandboxes?snapshot=base&metadata=a=b", "/v1/sandboxes"} {
		if code, b := d.call(t, "GET", path, testToken, nil); code != 200 {
			t.Errorf("GET %s: %d %s", path, code, b)
		}
	}
}

func TestForkLimitsChecked(t *testing.T) {
	for _, c := range []struct {
		cpus      float64
		read, wri int64
		want      string
	}{
		{cpus: math.NaN(), want: "cpus = NaN"},
		{cpus: math.Inf(1), want: "cpus = +Inf"},
		{cpus: 0.001, want: "cpus = 0.001: want 0 (no limit) or 0.01 to 1024"},
		{cpus: 1025, want: "cpus = 1025"},
		{cpus: -0.5, want: "cpus = -0.5"},
		{read: request.MaxIOBps + 1, want: "io_read_bps"},
		{wri: -1, want: "io_write_bps"},
	} {
		req := apiv1.CreateSandboxesRequest{SnapshotTag: "base", Limits: apiv1.Limits{CPUs: c.cpus, IOReadBps: c.read, IOWriteBps: c.wri}}
		if _, err := request.ForkSpec(&req, 10); !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: %v, want %q", c, err, c.want)
		}
	}
	for _, cpus := range []float64{0, 0.01, 1024} {
		if _, err := request.ForkSpec(&apiv1.CreateSandboxesRequest{SnapshotTag: "base", Limits: apiv1.Limits{CPUs: cpus}}, 10); err != nil {
			t.Errorf("cpus %g: %v", cpus, err)
		}
	}
	for _, mib := range []int{-1, 1, 63, 1<<20 + 1} {
		_, err := request.ForkSpec(&apiv1.CreateSandboxesRequest{SnapshotTag: "base", DiskMiB: mib}, 10)
		if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), fmt.Sprintf("disk_mib = %d: want 0 (no disk) or 64 to 1048576", mib)) {
			t.Errorf("disk_mib %d: %v", mib, err)
		}
		if _, _, err := request.ForkFrom(&apiv1.ForkRequest{DiskMiB: mib}, 10); !errdefs.IsInvalidArgument(err) {
			t.Errorf("fork from with disk_mib %d: %v", mib, err)
		}
	}
	for _, mib := range []int{0, 64, 1 << 20} {
		if spec, err := request.ForkSpec(&apiv1.CreateSandboxesRequest{SnapshotTag: "base", DiskMiB: mib}, 10); err != nil || spec.DiskMiB != mib {
			t.Errorf("disk_mib %d: %v, %d", mib, err, spec.DiskMiB)
		}
	}
	// Over the API, before anything is made.
	d := startDaemon(t, fakeNoVMs{}, sandbox.Admission{}, nil)
	for body, want := range map[string]string{
		`{"snapshot_tag":"base","cpus":0.001}`:  "cpus",
		`{"snapshot_tag":"base","cpus":1e300}`:  "cpus",
		`{"snapshot_tag":"base","disk_mib":32}`: "disk_mib",
		// Negative, huge, not an integer, not a number: each a 400
		// naming the field.
		`{"snapshot_tag":"base","disk_mib":-64}`:                  "disk_mib = -64",
		`{"snapshot_tag":"base","disk_mib":1048577}`:              "disk_mib = 1048577",
		`{"snapshot_tag":"base","disk_mib":99999999999999999999}`: "disk_mib",
		`{"snapshot_tag":"base","disk_mib":1e30}`:                 "disk_mib",
		`{"snapshot_tag":"base","disk_mib":64.5}`:                 "disk_mib",
		`{"snapshot_tag":"base","disk_mib":"64"}`:                 "disk_mib",
	} {
		code, b := d.call(t, "POST", "/v1/sandboxes", testToken, strings.NewReader(body))
		if e := apiError(t, b); code != 400 || !strings.Contains(e.Message, want) {
			t.Errorf("%s: %d %s", body, code, b)
		}
		if fork, ok := strings.CutPrefix(body, `{"snapshot_tag":"base","disk_mib"`); ok {
			fork = `{"disk_mib"` + fork
			code, b := d.call(t, "POST", "/v1/sandboxes/sb-aaaaaaaaaa/fork", testToken, strings.NewReader(fork))
			if e := apiError(t, b); code != 400 || !strings.Contains(e.Message, want) {
				t.Errorf("fork %s: %d %s", fork, code, b)
			}
		}
	}
	if list, err := d.e.State().List(); err != nil || len(list) != 0 {
		t.Errorf("state after refused requests: %v %v", list, err)
	}
}

// TestSnapshotImportChecked: an OCI import the build would refuse, or a
// local path outside the import directory, is refused with the request,
// before an operation starts.
func TestSnapshotImportChecked(t *testing.T) {
	imports := t.TempDir()
	d := startDaemon(t, fakeNoVMs{}, sandbox.Admission{}, func(_ *sandbox.Config, c *Config) { c.ImportDir = imports })
	outside := filepath.Join(t.TempDir(), "img.tar")
	os.WriteFile(outside, []byte("x"), 0o644)
	os.Symlink(outside, filepath.Join(imports, "link.tar"))
	for _, c := range []struct {
		body   string
		status int
		want   string
	}{
		{`{"tag":"x","oci":{"ref":"` + outside + `"}}`, 400, "outside the import directory"},
		{`{"tag":"x","oci":{"ref":"/etc/passwd"}}`, 400, "outside the import directory"},
		{`{"tag":"x","oci":{"ref":"docker-archive:/etc/shadow"}}`, 400, "outside"},
		{`{"tag":"x","oci":{"ref":"oci:/"}}`, 400, "outside"},
		{`{"tag":"x","oci":{"ref":"../../etc/passwd"}}`, 400, "outside"},
		{`{"tag":"x","oci":{"ref":"link.tar"}}`, 400, "outside"},
		{`{"tag":"x","oci":{"ref":"missing.tar"}}`, 404, "no such file"},
		{`{"tag":"x","oci":{"ref":""}}`, 400, "empty image reference"},
		{`{"tag":"x","oci":{"ref":"UPPER/case::x"}}`, 400, "image reference"},
		{`{"tag":"x","oci":{"ref":"busybox","extra":["--force-yes"]}}`, 400, "extra package name"},
		{`{"tag":"x","oci":{"ref":"busybox","extra":["file"]}}`, 400, "--allow-image-scripts"},
		{`{"tag":"x","oci":{"ref":"busybox","preload":["os; rm -rf /"]}}`, 400, "preload module"},
		{`{"tag":"python","oci":{"ref":"busybox"}}`, 409, "built-in image"},
		{`{"tag":"a..b","oci":{"ref":"busybox"}}`, 400, "image name"},
	} {
		code, b := d.call(t, "POST", "/v1/snapshots", testToken, strings.NewReader(c.body))
		if e := apiError(t, b); code != c.status || !strings.Contains(e.Message, c.want) {
			t.Errorf("%s: %d %s, want %d and %q", c.body, code, b, c.status, c.want)
		}
	}
	if code, b := d.call(t, "GET", "/v1/operations", testToken, nil); code != 200 || strings.Contains(string(b), `"id"`) {
		t.Errorf("operations after refused imports: %d %s", code, b)
	}
	if ents, _ := os.ReadDir(filepath.Join(d.data, "snapshots")); len(ents) != 0 {
		t.Errorf("snapshots after refused imports: %v", ents)
	}
}

// TestForkCountZeroMeansOne: n 0 (or absent) forks one child, and the
// message for a bad n says so, as the API documents.
func TestForkCountZeroMeansOne(t *testing.T) {
	if spec, err := request.ForkSpec(&apiv1.CreateSandboxesRequest{SnapshotTag: "base"}, 10); err != nil || spec.N != 1 {
		t.Errorf("n = 0: %+v %v, want one child", spec, err)
	}
	for _, n := range []int{-1, 11} {
		_, err := request.ForkSpec(&apiv1.CreateSandboxesRequest{SnapshotTag: "base", N: n}, 10)
		want := fmt.Sprintf("n = %d: want 1 to 10 (0 means 1)", n)
		if !errdefs.IsInvalidArgument(err) || err.Error() != want {
			t.Errorf("n = %d: %v, want %q", n, err, want)
		}
	}
	d := startDaemon(t, fakeNoVMs{}, sandbox.Admission{}, nil)
	code, b := d.call(t, "GET", "/v1/openapi.json", "", nil)
	if code != 200 || !strings.Contains(string(b), "0 or absent means 1") {
		t.Errorf("the OpenAPI document does not say what n 0 means: %d", code)
	}
}

// TestCreatePublishWithinCap: a create that asks each sandbox to publish
// more ports than the engine's cap per sandbox is refused before any
// child starts.
func TestCreatePublishWithinCap(t *testing.T) {
	d := startDaemon(t, fakeNoVMs{}, sandbox.Admission{}, func(c *sandbox.Config, _ *Config) { c.MaxPortsPerSandbox = 2 })
	code, b := d.call(t, "POST", "/v1/sandboxes", testToken, strings.NewReader(`{"snapshot_tag":"base","network":{"publish":[80,81,82]}}`))
	if e := apiError(t, b); code != 400 || !strings.Contains(e.Message, "at most 2") {
		t.Errorf("3 ports with a cap of 2: %d %s", code, b)
	}
	code, b = d.call(t, "POST", "/v1/sandboxes", testToken, strings.NewReader(`{"snapshot_tag":"base","network":{"publish":[80,81]}}`))
	if code != 404 {
		t.Errorf("2 ports with a cap of 2: %d %s, want 404 (no snapshot)", code, b)
	}
}

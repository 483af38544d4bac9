// Package deb fetches Debian packages with the host's apt and unpacks them
// with dpkg-deb. Nothing is installed on the host: packages are downloaded
// into a directory the caller owns and extracted there.
package deb

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/fsutil"
)

// Tools names the host commands used. A zero field means the command of
// that name, looked up in PATH, /usr/sbin and /sbin.
type Tools struct {
	AptGet   string // apt-get
	AptCache string // apt-cache
	DpkgDeb  string // dpkg-deb
	// ListsDir is apt's lists directory ("" means /var/lib/apt/lists). When
	// it holds no package index, the first lookup runs apt-get update.
	ListsDir string
	// Memo, if set, is a file where Candidate remembers its answers for as
	// long as apt's package lists are unchanged (apt-cache takes most of a
	// second per question when apt keeps no binary cache).
	Memo string
}

// Package is one binary package: its control fields of interest.
type Package struct {
	Name    string
	Version string
	Arch    string
	Depends []string // names only, alternatives and version constraints dropped
}

// Key is a string naming exactly this package version that is safe as a
// single path component: "<name>_<version>" with characters outside
// [A-Za-z0-9.+~_-] (such as the epoch colon) replaced by "_".
func (p Package) Key() string {
	return pathUnsafe.ReplaceAllString(p.Name+"_"+p.Version, "_")
}

var (
	pathUnsafe = regexp.MustCompile(`[^A-Za-z0-9.+~_-]`)
	// NameRE is what Debian policy allows as a package name.
	NameRE = regexp.MustCompile(`^[a-z0-9][a-z0-9+.-]+$`)
)

// ValidName reports whether name is a well-formed Debian package name. Names
// are validated before they reach a command line, so they can never be
// taken for options.
func ValidName(name string) bool { return NameRE.MatchString(name) }

// Candidate returns the version of package name apt would install. If apt
// has no package lists yet, or does not know the package, it runs apt-get
// update once and asks again. Unknown packages are errdefs.ErrNotFound.
func (t Tools) Candidate(ctx context.Context, name string) (Package, error) {
	if !ValidName(name) {
		return Package{}, errdefs.InvalidArgument("package name %q is not valid", name)
	}
	if !t.haveLists() {
		if err := t.Update(ctx); err != nil {
			return Package{}, err
		}
	}
	if p, ok := t.recall(name); ok {
		return p, nil
	}
	p, err := t.candidate(ctx, name)
	if errdefs.IsNotFound(err) {
		if uerr := t.Update(ctx); uerr != nil {
			return Package{}, errors.Join(err, uerr)
		}
		p, err = t.candidate(ctx, name)
	}
	if err == nil {
		t.remember(name, p)
	}
	return p, err
}

// memo is the content of Tools.Memo.
type memo struct {
	Lists    string             `json:"lists"` // fingerprint of apt's lists
	Packages map[string]Package `json:"packages"`
}

// listsFingerprint names the current state of apt's package lists: their
// names, sizes and modification times.
func (t Tools) listsFingerprint() string {
	m, _ := filepath.Glob(filepath.Join(t.listsDir(), "*_Packages*"))
	sort.Strings(m)
	h := sha256.New()
	for _, f := range m {
		if fi, err := os.Stat(f); err == nil {
			fmt.Fprintf(h, "%s %d %d\n", f, fi.Size(), fi.ModTime().UnixNano())
		}
	}
	return hex.EncodeToString(h.Sum(nil))
}

func (t Tools) readMemo() memo {
	var m memo
	if t.Memo == "" {
		return m
	}
	if b, err := os.ReadFile(t.Memo); err == nil {
		_ = json.Unmarshal(b, &m)
	}
	if m.Lists != t.listsFingerprint() {
		m = memo{}
	}
	return m
}

func (t Tools) recall(name string) (Package, bool) {
	p, ok := t.readMemo().Packages[name]
	return p, ok
}

// remember records an answer in the memo file, best effort: it is written
// atomically, so readers never see it half written.
func (t Tools) remember(name string, p Package) {
	if t.Memo == "" {
		return
	}
	m := t.readMemo()
	m.Lists = t.listsFingerprint()
	if m.Packages == nil {
		m.Packages = map[string]Package{}
	}
	m.Packages[name] = p
	b, err := json.Marshal(m)
	if err != nil {
		return
	}
	if err := os.MkdirAll(filepath.Dir(t.Memo), 0o755); err != nil {
		return
	}
	_ = fsutil.WriteFile(t.Memo, b, 0o600)
}

func (t Tools) candidate(ctx context.Context, name string) (Package, error) {
	out, err := run(ctx, "", t.tool(t.AptCache, "apt-cache"), "show", "--no-all-versions", name)
	if err != nil {
		if len(bytes.TrimSpace(out)) == 0 || strings.Contains(err.Error(), "No packages found") ||
			strings.Contains(err.Error(), "Unable to locate") {
			return Package{}, errdefs.NotFound("package %s: apt knows no candidate", name)
		}
		return Package{}, err
	}
	p := parseControl(out)
	if p.Name == "" || p.Version == "" {
		// A purely virtual package has no record of its own.
		return Package{}, errdefs.NotFound("package %s: apt knows no candidate", name)
	}
	return p, nil
}

// Update runs apt-get update. It needs root.
func (t Tools) Update(ctx context.Context) error {
	if _, err := run(ctx, "", t.tool(t.AptGet, "apt-get"), "update", "-q"); err != nil {
		if errdefs.IsFailedPrecondition(err) || ctx.Err() != nil {
			return err
		}
		if os.Geteuid() != 0 {
			return errdefs.FailedPrecondition("apt has no package lists and apt-get update needs root: %w", err)
		}
		return errdefs.Unavailable("apt-get update: %w", err)
	}
	return nil
}

func (t Tools) listsDir() string {
	if t.ListsDir != "" {
		return t.ListsDir
	}
	return "/var/lib/apt/lists"
}

func (t Tools) haveLists() bool {
	m, _ := filepath.Glob(filepath.Join(t.listsDir(), "*_Packages*"))
	return len(m) > 0
}

// Download fetches exactly p.Name=p.Version into dir and returns the path of
// the .deb.
func (t Tools) Download(ctx context.Context, p Package, dir string) (string, error) {
	if !ValidName(p.Name) {
		return "", errdefs.InvalidArgument("package name %q is not valid", p.Name)
	}
	before, _ := filepath.Glob(filepath.Join(dir, "*.deb"))
	if _, err := run(ctx, dir, t.tool(t.AptGet, "apt-get"), "download", "-q", p.Name+"="+p.Version); err != nil {
		return "", errdefs.Unavailable("download %s %s: %w", p.Name, p.Version, err)
	}
	after, _ := filepath.Glob(filepath.Join(dir, p.Name+"_*.deb"))
	for _, f := range after {
		if !slices.Contains(before, f) {
			return f, nil
		}
	}
	return "", fmt.Errorf("download %s %s: apt-get wrote no .deb", p.Name, p.Version)
}

// Fields reads the control fields of the .deb at path.
func (t Tools) Fields(ctx context.Context, path string) (Package, error) {
	if _, err := os.Stat(path); err != nil {
		return Package{}, errdefs.NotFound("package file %s: %w", path, err)
	}
	out, err := run(ctx, "", t.tool(t.DpkgDeb, "dpkg-deb"), "-f", path, "Package", "Version", "Architecture", "Depends")
	if err != nil {
		return Package{}, errdefs.InvalidArgument("%s is not a readable .deb: %w", path, err)
	}
	p := parseControl(out)
	if p.Name == "" || p.Version == "" {
		return Package{}, errdefs.InvalidArgument("%s: no Package or Version field", path)
	}
	return p, nil
}

// Extract unpacks the files of the .deb at path into dir (dpkg-deb -x). No
// maintainer script runs.
func (t Tools) Extract(ctx context.Context, path, dir string) error {
	if _, err := run(ctx, "", t.tool(t.DpkgDeb, "dpkg-deb"), "-x", path, dir); err != nil {
		return errdefs.InvalidArgument("extract %s: %w", filepath.Base(path), err)
	}
	return nil
}

func (t Tools) tool(path, name string) string {
	if path != "" {
		return path
	}
	return name
}

// LookPath finds a host command: an absolute path as is, otherwise name in
// PATH, then /usr/sbin and /sbin (which a non-root PATH often lacks). A
// missing command is errdefs.ErrFailedPrecondition.
func LookPath(name string) (string, error) {
	if filepath.IsAbs(name) {
		if _, err := exec.LookPath(name); err != nil {
			return "", errdefs.FailedPrecondition("command %s: %w", name, err)
		}
		return name, nil
	}
	if p, err := exec.LookPath(name); err == nil {
		return p, nil
	}
	for _, dir := range []string{"/usr/sbin", "/sbin"} {
		if p, err := exec.LookPath(filepath.Join(dir, name)); err == nil {
			return p, nil
		}
	}
	return "", errdefs.FailedPrecondition("command %s not found (install its Debian package)", name)
}

// run runs a host command with a C locale and returns its stdout; a failure
// carries the command's stderr.
func run(ctx context.Context, dir, name string, args ...string) ([]byte, error) {
	path, err := LookPath(name)
	if err != nil {
		return nil, err
	}
	cmd := exec.CommandContext(ctx, path, args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "LC_ALL=C", "LANG=C", "DEBIAN_FRONTEND=noninteractive")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		if ctx.Err() != nil {
			return out, ctx.Err()
		}
		msg := strings.TrimSpace(stderr.String())
		if len(msg) > 2000 {
			msg = msg[len(msg)-2000:]
		}
		return out, fmt.Errorf("%s %s: %w: %s", filepath.Base(path), strings.Join(args, " "), err, msg)
	}
	return out, nil
}

// parseControl reads the first stanza of deb822 control data.
func parseControl(b []byte) Package {
	var p Package
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" {
			if p.Name != "" {
				break
			}
			continue
		}
		k, v, ok := strings.Cut(line, ":")
		if !ok || strings.HasPrefix(line, " ") {
			continue
		}
		v = strings.TrimSpace(v)
		switch k {
		case "Package":
			p.Name = v
		case "Version":
			p.Version = v
		case "Architecture":
			p.Arch = v
		case "Depends":
			p.Depends = parseDepends(v)
		}
	}
	return p
}

// parseDepends keeps the first alternative of each dependency, name only.
func parseDepends(v string) []string {
	var out []string
	for _, dep := range strings.Split(v, ",") {
		alt, _, _ := strings.Cut(dep, "|")
		name, _, _ := strings.Cut(strings.TrimSpace(alt), " ")
		name, _, _ = strings.Cut(name, "(")
		name, _, _ = strings.Cut(name, ":")
		if name = strings.TrimSpace(name); name != "" {
			out = append(out, name)
		}
	}
	return out
}

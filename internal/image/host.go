package image

import (
	"bufio"
	"os"
	"path/filepath"
	"strings"

	"github.com/forkd/forkd/internal/image/rootfs"
)

// distro is the Debian-family release and mirror debootstrap uses when a
// recipe does not name its own.
type distro struct {
	id         string // debian or ubuntu
	suite      string
	mirror     string
	components []string
}

var defaultDistro = distro{id: "debian", suite: "bookworm", mirror: "http://deb.debian.org/debian", components: []string{"main"}}

// hostDistro reads the host's os-release and apt sources: its suite if it
// is Debian or Ubuntu (else bookworm), and the first mirror its sources
// list for that suite (else deb.debian.org, or archive.ubuntu.com).
func (b *Builder) hostDistro() distro {
	etc := b.etcDir()
	osrb, err := os.ReadFile(filepath.Join(etc, "os-release"))
	if err != nil {
		return defaultDistro
	}
	osr := rootfs.ParseOSRelease(osrb)
	d := defaultDistro
	switch osr["ID"] {
	case "debian":
		if osr["VERSION_CODENAME"] != "" {
			d.suite = osr["VERSION_CODENAME"]
		}
	case "ubuntu":
		if osr["VERSION_CODENAME"] == "" {
			return defaultDistro
		}
		d = distro{id: "ubuntu", suite: osr["VERSION_CODENAME"], mirror: "http://archive.ubuntu.com/ubuntu",
			components: []string{"main", "universe"}}
	default:
		return defaultDistro
	}
	if m := aptMirror(etc, d.suite); m != "" {
		d.mirror = m
	}
	return d
}

// aptMirror returns the first http(s) URI the apt sources under etc list
// for suite, in one-line (.list) or deb822 (.sources) format, or "".
func aptMirror(etc, suite string) string {
	files := []string{filepath.Join(etc, "apt", "sources.list")}
	for _, pat := range []string{"*.list", "*.sources"} {
		m, _ := filepath.Glob(filepath.Join(etc, "apt", "sources.list.d", pat))
		files = append(files, m...)
	}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		var m string
		if strings.HasSuffix(f, ".sources") {
			m = mirrorDeb822(string(b), suite)
		} else {
			m = mirrorOneLine(string(b), suite)
		}
		if m != "" {
			return m
		}
	}
	return ""
}

func goodMirror(uri string) bool {
	return strings.HasPrefix(uri, "http://") || strings.HasPrefix(uri, "https://")
}

func mirrorOneLine(s, suite string) string {
	sc := bufio.NewScanner(strings.NewReader(s))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 3 || f[0] != "deb" {
			continue
		}
		f = f[1:]
		if strings.HasPrefix(f[0], "[") { // options: [arch=amd64 signed-by=...]
			for len(f) > 0 && !strings.HasSuffix(f[0], "]") {
				f = f[1:]
			}
			if len(f) > 0 {
				f = f[1:]
			}
		}
		if len(f) >= 2 && f[1] == suite && goodMirror(f[0]) {
			return strings.TrimSuffix(f[0], "/")
		}
	}
	return ""
}

func mirrorDeb822(s, suite string) string {
	for _, stanza := range strings.Split(s, "\n\n") {
		fields := map[string]string{}
		for _, line := range strings.Split(stanza, "\n") {
			if k, v, ok := strings.Cut(line, ":"); ok && !strings.HasPrefix(line, "#") && !strings.HasPrefix(line, " ") {
				fields[strings.ToLower(strings.TrimSpace(k))] = strings.TrimSpace(v)
			}
		}
		if !strings.Contains(" "+fields["types"]+" ", " deb ") {
			continue
		}
		for _, st := range strings.Fields(fields["suites"]) {
			if st != suite {
				continue
			}
			for _, u := range strings.Fields(fields["uris"]) {
				if goodMirror(u) {
					return strings.TrimSuffix(u, "/")
				}
			}
		}
	}
	return ""
}

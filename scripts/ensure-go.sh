#!/bin/sh
# Prints the path of a Go toolchain at least as new as go.mod asks for. When
# none is found (PATH, /usr/local/go, /usr/lib/go, an earlier download) it
# downloads the pinned release from the Go module proxy (the module
# golang.org/toolchain, as `go` itself does with GOTOOLCHAIN) into
# /usr/local/lib/forkd/go<version> as root, or the user's cache otherwise.
#
#   FORKD_GO_VERSION   the release to download (default below)
#   FORKD_GO_DIR       where to put it
#   FORKD_GO_DOWNLOAD  1: ignore toolchains already there
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
want=$(awk '$1 == "go" { print $2; exit }' "$root/go.mod")
pin=${FORKD_GO_VERSION:-1.26.8}
case $(uname -m) in
x86_64) arch=amd64 ;;
aarch64 | arm64) arch=arm64 ;;
*) echo "ensure-go: no Go toolchain download for $(uname -m)" >&2; exit 1 ;;
esac
if [ "$(id -u)" = 0 ]; then
	dest=${FORKD_GO_DIR:-/usr/local/lib/forkd/go$pin}
else
	dest=${FORKD_GO_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/forkd/go$pin}
fi

# new_enough GO: its version is at least $want (asked outside this module,
# so that no toolchain switch happens).
new_enough() {
	v=$(cd / && GOTOOLCHAIN=local "$1" env GOVERSION 2>/dev/null) || return 1
	v=${v#go}
	[ -n "$v" ] && [ "$(printf '%s\n%s\n' "$want" "$v" | sort -V | head -n 1)" = "$want" ]
}

if [ "${FORKD_GO_DOWNLOAD:-}" != 1 ]; then
	for g in "$(command -v go 2>/dev/null || true)" /usr/local/go/bin/go /usr/lib/go/bin/go "$dest/bin/go"; do
		if [ -n "$g" ] && [ -x "$g" ] && new_enough "$g"; then
			echo "$g"
			exit 0
		fi
	done
fi

"$root/scripts/apt-install.sh" curl ca-certificates unzip
proxy=${GOPROXY:-https://proxy.golang.org}
proxy=${proxy%%,*}
proxy=${proxy%%|*}
case $proxy in off | direct | "") proxy=https://proxy.golang.org ;; esac
mod="v0.0.1-go$pin.linux-$arch"
echo "ensure-go: downloading Go $pin from $proxy (golang.org/toolchain@$mod) into $dest" >&2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
curl -fsSL --retry 3 -o "$tmp/go.zip" "$proxy/golang.org/toolchain/@v/$mod.zip"
unzip -q "$tmp/go.zip" -d "$tmp/x"
src="$tmp/x/golang.org/toolchain@$mod"
# Module zips keep no file modes: the binaries get theirs back.
chmod 0755 "$src"/bin/* "$src"/pkg/tool/*/*
if ! new_enough "$src/bin/go"; then
	echo "ensure-go: the downloaded toolchain does not run or is older than $want" >&2
	exit 1
fi
mkdir -p "$(dirname "$dest")"
rm -rf "$dest.new" "$dest"
mv "$src" "$dest.new"
mv "$dest.new" "$dest"
echo "$dest/bin/go"

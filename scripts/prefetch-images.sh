#!/bin/sh
# Builds the images the VM tests boot (minimal, python, code-interpreter)
# into their shared cache ($FORKD_TEST_CACHE/image) by snapshotting each
# once in a scratch data dir that it removes after. `make test` runs it in
# the background while vet, lint, the unit tier and fuzz compile: on a fresh
# machine the kernel download and two debootstraps take ~5 minutes, mostly
# waiting on the mirror and dpkg. With a warm cache each image costs one
# parent boot (6-24 s here, 41 s for the three). Best effort: what it could not build the VM tests
# build (or fail on) themselves, and its exit status says whether it all
# went. Needs root and bin/forkd (make build).
set -u
cd "$(dirname "$0")/.."
cache=${FORKD_TEST_CACHE:-/var/tmp/forkd-test-cache}
mkdir -p "$cache"
dir=$(mktemp -d "$cache/prefetch.XXXXXX") || exit 1
child=""
# A stop (make test failing early) stops the snapshot under way, which
# removes its VM, and then the scratch data dir.
trap '[ -z "$child" ] || { kill "$child" 2>/dev/null; wait "$child"; }; rm -rf "$dir"; exit 143' TERM INT
failed=0
for img in minimal python code-interpreter; do
	start=$(date +%s)
	FORKD_CACHE="$cache/image" FORKD_AGENT="$PWD/bin/forkd-agent" \
		./bin/forkd --data-dir "$dir" snapshot --tag "$img" --image "$img" &
	child=$!
	if wait "$child"; then
		echo "prefetch-images: $img in $(($(date +%s) - start)) s"
	else
		echo "prefetch-images: $img failed; the VM tests build it themselves" >&2
		failed=1
	fi
	child=""
done
rm -rf "$dir"
exit "$failed"

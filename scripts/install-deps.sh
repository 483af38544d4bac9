#!/bin/sh
# Installs the Debian/Ubuntu packages forkd and its tests need
# (scripts/deps.txt), only those missing. Needs root when any is missing.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
missing=""
# Names installed packages provide (nodesource's nodejs provides npm).
provided=$(dpkg-query -W -f='${Status}|${Provides}\n' 2>/dev/null | grep '^install ok installed|' | cut -d'|' -f2 |
	tr ',' '\n' | sed 's/([^)]*)//; s/^ *//; s/ *$//')
for pkg in $(grep -v '^#' "$here/deps.txt" | tr -s ' \n' ' '); do
	if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" &&
		! printf '%s\n' "$provided" | grep -qx "$pkg"; then
		missing="$missing $pkg"
	fi
done
# QEMU drops to this system user once its files are open.
vmm_user=forkd-vmm
need_user=""
getent passwd "$vmm_user" >/dev/null 2>&1 || need_user=1
[ -z "$missing" ] && [ -z "$need_user" ] && exit 0
if [ "$(id -u)" != 0 ]; then
	[ -n "$need_user" ] && echo "missing system user $vmm_user; as root: useradd --system --no-create-home --shell /usr/sbin/nologin $vmm_user" >&2
	[ -z "$missing" ] && exit 0
	echo "missing packages:$missing; run as root or: sudo apt-get install$missing" >&2
	exit 1
fi
if [ -n "$need_user" ]; then
	echo "creating system user $vmm_user" >&2
	useradd --system --no-create-home --shell /usr/sbin/nologin "$vmm_user"
fi
[ -z "$missing" ] && exit 0
echo "installing:$missing" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
# shellcheck disable=SC2086
apt-get install -y -q --no-install-recommends $missing

#!/bin/sh
# Gives a host without any swap a compressed swap device in RAM (zram),
# so that forkd serve's --idle-reclaim can page out the memory of frozen
# sandboxes (docs/controller.md). Best effort and idempotent: it does
# nothing where some swap is already on or without root, and where the
# host will not let it (no zram, a container) it says so, undoes what it
# did and still exits 0. The device does not outlive a reboot:
# packaging/forkd.service runs this before each start of the daemon.
#
# The device holds up to half of RAM, uncompressed; it uses RAM only for
# what is in it, compressed (lz4 where the kernel has it): a paged-out
# VMM's 34 MiB take about 12 MiB, so half of 24 GiB holds some 350.
set -u
[ "$(id -u)" = 0 ] || exit 0
[ -r /proc/swaps ] || exit 0
[ "$(grep -c . /proc/swaps)" -le 1 ] || exit 0
say() { echo "zram-swap: $*" >&2; }
[ -e /sys/class/zram-control ] || modprobe zram 2>/dev/null
if [ ! -e /sys/class/zram-control ]; then
	say "this kernel has no zram; idle sandboxes' memory stays resident"
	exit 0
fi
dev=""
added=""
for d in /sys/block/zram*; do
	if [ -e "$d/disksize" ] && [ "$(cat "$d/disksize")" = 0 ]; then
		dev=${d##*/}
		break
	fi
done
if [ -z "$dev" ]; then
	n=$(cat /sys/class/zram-control/hot_add 2>/dev/null) || n=""
	case $n in
	'' | *[!0-9]*)
		say "no free zram device, and none can be added; idle sandboxes' memory stays resident"
		exit 0
		;;
	esac
	dev=zram$n
	added=$n
fi
# undo puts the device back as it was found, then gives up.
undo() {
	say "$1; idle sandboxes' memory stays resident"
	swapoff "/dev/$dev" 2>/dev/null
	echo 1 >"/sys/block/$dev/reset" 2>/dev/null
	[ -z "$added" ] || echo "$added" >/sys/class/zram-control/hot_remove 2>/dev/null
	exit 0
}
[ -b "/dev/$dev" ] || undo "no /dev/$dev here (a container?)"
if grep -qw lz4 "/sys/block/$dev/comp_algorithm"; then
	echo lz4 >"/sys/block/$dev/comp_algorithm" 2>/dev/null || undo "cannot set $dev's compressor"
fi
kib=$(awk '/^MemTotal:/ {print int($2 / 2)}' /proc/meminfo)
echo "${kib}K" >"/sys/block/$dev/disksize" 2>/dev/null || undo "cannot size $dev"
mkswap "/dev/$dev" >/dev/null 2>&1 || undo "mkswap /dev/$dev failed"
swapon -p 100 "/dev/$dev" 2>/dev/null || undo "swapon /dev/$dev failed"
say "/dev/$dev, $((kib / 1024)) MiB of compressed swap in RAM"

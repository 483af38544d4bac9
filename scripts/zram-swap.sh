#!/bin/sh
# Gives a host without any swap a compressed swap device in RAM (zram),
# so that forkd serve's --idle-reclaim can page out the memory of frozen
# sandboxes (docs/controller.md). Does nothing where some swap is already
# on, without root, or where the kernel has no zram. Idempotent.
#
# The device holds up to a quarter of RAM, uncompressed; it uses RAM only
# for what is in it, compressed (lz4 where the kernel has it).
set -eu
[ "$(id -u)" = 0 ] || exit 0
[ "$(grep -c . /proc/swaps)" -le 1 ] || exit 0
[ -e /sys/class/zram-control ] || modprobe zram 2>/dev/null || true
if [ ! -e /sys/class/zram-control ]; then
	echo "zram-swap: this kernel has no zram; idle sandboxes' memory stays resident" >&2
	exit 0
fi
dev=""
for d in /sys/block/zram*; do
	if [ -e "$d/disksize" ] && [ "$(cat "$d/disksize")" = 0 ]; then
		dev=${d##*/}
		break
	fi
done
[ -n "$dev" ] || dev=zram$(cat /sys/class/zram-control/hot_add)
if grep -qw lz4 "/sys/block/$dev/comp_algorithm"; then
	echo lz4 >"/sys/block/$dev/comp_algorithm"
fi
kib=$(awk '/^MemTotal:/ {print int($2 / 4)}' /proc/meminfo)
echo "${kib}K" >"/sys/block/$dev/disksize"
mkswap "/dev/$dev" >/dev/null
swapon -p 100 "/dev/$dev"
echo "zram-swap: /dev/$dev, $((kib / 1024)) MiB of compressed swap in RAM" >&2

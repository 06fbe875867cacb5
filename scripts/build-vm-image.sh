#!/usr/bin/env bash
# Builds the bootable disk image the vm backend's tests import (docs/vm.md):
# Debian bookworm (debootstrap minbase + systemd-sysv, udev,
# qemu-guest-agent, linux-image-cloud-amd64 with its initramfs), one ext4
# file system over the whole disk (no partition table) with extlinux in its
# boot sector, so SeaBIOS boots it like any disk with a bootloader: nothing
# of dsec is inside, as with an ordinary cloud image. Root is logged in on
# tty1 (the VGA console) so that typed keys reach a shell.
#
# Cached as $CACHE/vm-debian.qcow2 and rebuilt only when missing; built in a
# temp dir and renamed into place (an interrupted run leaves only a .tmp.*).
#
# Usage: scripts/build-vm-image.sh [CACHE_DIR]
#   DSEC_DEBIAN_MIRROR overrides the mirror taken from the host's apt sources.
set -euo pipefail
exec </dev/null
export DEBIAN_FRONTEND=noninteractive

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache="${1:-${DSEC_IMAGE_CACHE:-/var/cache/dsec/test-images}}"
suite=bookworm
name=vm-debian.qcow2
disk_size=2G

log() { echo "build-vm-image: $*"; }
die() { echo "build-vm-image: error: $*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "must run as root (debootstrap, loop mount for extlinux)"
for tool in debootstrap mkfs.ext4 extlinux qemu-img; do
  command -v "$tool" >/dev/null || die "$tool not found (scripts/install-deps.sh installs it)"
done

mkdir -p "$cache"
cache="$(cd "$cache" && pwd)"
if [ -s "$cache/$name" ]; then
  log "$name: cached"
  exit 0
fi

exec 9>"$cache/.vm-lock"
if ! flock -n 9; then
  log "another build holds $cache/.vm-lock; waiting"
  flock 9
fi
[ -s "$cache/$name" ] && { log "$name: cached"; exit 0; }
rm -rf "$cache"/.tmp.vm.* 2>/dev/null || true

tmp="$(mktemp -d "$cache/.tmp.vm.XXXXXX")"
child=""
# cleanup, run_group, debian_mirror
. "$here/image-build-lib.sh"
trap cleanup EXIT
trap 'exit 130' INT TERM HUP

root="$tmp/rootfs"
mkdir -p "$root"
mirror="$(debian_mirror)"
log "debootstrap minbase + systemd, qemu-guest-agent, cloud kernel from $mirror (minutes)"
run_group debootstrap --variant=minbase \
  --include=systemd-sysv,udev,kmod,qemu-guest-agent,initramfs-tools,linux-image-cloud-amd64 \
  "$suite" "$root" "$mirror" ||
  { tail -n 30 "$root/debootstrap/debootstrap.log" 2>/dev/null >&2 || true; die "debootstrap failed"; }
awk -v p="$root/" 'index($2, p) == 1 {print $2}' /proc/self/mounts | sort -r | xargs -r -n1 umount -l

kernel="$(cd "$root/boot" && ls vmlinuz-* | sort -V | tail -n1)"
initrd="initrd.img-${kernel#vmlinuz-}"
[ -s "$root/boot/$kernel" ] || die "no kernel in the image"
[ -s "$root/boot/$initrd" ] || die "no initramfs in the image ($initrd)"

log "configuring: fstab, hostname, root on tty1, extlinux"
echo "LABEL=root / ext4 rw,noatime 0 1" >"$root/etc/fstab"
echo "dsec-vm" >"$root/etc/hostname"
printf '127.0.0.1 localhost dsec-vm\n' >"$root/etc/hosts"
# Root logs in on tty1 without a password: keys typed through QMP land in a
# shell whose output the screenshot shows (a test image, not a hardened one).
mkdir -p "$root/etc/systemd/system/getty@tty1.service.d"
cat >"$root/etc/systemd/system/getty@tty1.service.d/autologin.conf" <<'EOF'
[Service]
ExecStart=
ExecStart=-/sbin/agetty --autologin root --noclear %I $TERM
EOF
# Nothing that waits for a network or the clock at boot (TCG is slow enough).
for unit in apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer e2scrub_reap.service \
  fstrim.timer systemd-networkd-wait-online.service; do
  ln -sf /dev/null "$root/etc/systemd/system/$unit"
done
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/cache/apt/*.bin \
  "$root"/var/lib/apt/lists/* "$root"/var/log/*.log "$root"/tmp/* "$root"/var/tmp/*
mkdir -p "$root/boot/extlinux"
cat >"$root/boot/extlinux/extlinux.conf" <<EOF
DEFAULT linux
PROMPT 0
TIMEOUT 0
LABEL linux
  LINUX /boot/$kernel
  INITRD /boot/$initrd
  APPEND root=LABEL=root rw console=tty0 console=ttyS0,115200 net.ifnames=0 systemd.show_status=1
EOF

log "making the disk ($disk_size, ext4 without 64bit for extlinux)"
raw="$tmp/disk.raw"
truncate -s "$disk_size" "$raw"
mkfs.ext4 -q -F -L root -O ^64bit,^metadata_csum -E lazy_itable_init=1 -d "$root" "$raw"
mkdir -p "$tmp/mnt"
mount -o loop "$raw" "$tmp/mnt"
extlinux --install "$tmp/mnt/boot/extlinux" >/dev/null
umount "$tmp/mnt"
log "converting to qcow2"
qemu-img convert -O qcow2 "$raw" "$tmp/$name"
rm -f "$raw"
sync -f "$tmp/$name" 2>/dev/null || true
mv -f "$tmp/$name" "$cache/$name"
log "$name: done ($(du -h "$cache/$name" | cut -f1), kernel $kernel)"

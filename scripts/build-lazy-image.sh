#!/usr/bin/env bash
# Builds the three layers of bench/lazy's image and caches them under
# CACHE_DIR/lazy/ (rebuilt only when missing):
#   base      = CACHE_DIR/debian.tar as is (bookworm minbase + python3, made by
#               scripts/build-test-images.sh, which this runs first if needed)
#   toolkit   = lazy/toolkit.tar: what `apt-get install build-essential` adds to
#               that base (gcc, g++, make, binutils, libc6-dev, dpkg-dev, perl),
#               installed in a chroot of a copy of the base and taken as the
#               difference (new or changed entries; deletions are not carried)
#   workspace = lazy/workspace.tar: a repository-like tree under /workspace/repo
#               generated deterministically (seeded PRNG, fixed mtimes): source
#               files, binary assets and a git pack, sized so that the whole
#               image is over 1 GB
# Each tarball is built in a temp dir next to the cache and renamed into place.
#
# Usage: scripts/build-lazy-image.sh [CACHE_DIR]
#   CACHE_DIR defaults to $DSEC_IMAGE_CACHE, else /var/cache/dsec/test-images.
#   DSEC_LAZY_WORKSPACE_MB sets the workspace size (default 720).
set -euo pipefail
exec </dev/null
export DEBIAN_FRONTEND=noninteractive

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache="${1:-${DSEC_IMAGE_CACHE:-/var/cache/dsec/test-images}}"
ws_mb="${DSEC_LAZY_WORKSPACE_MB:-720}"

log() { echo "build-lazy-image: $*"; }
die() { echo "build-lazy-image: error: $*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "must run as root (chroot, ownership of rootfs files)"

if [ ! -s "$cache/debian.tar" ]; then
  DSEC_TEST_IMAGES=debian "$here/build-test-images.sh" "$cache"
fi
[ -s "$cache/debian.tar" ] || die "$cache/debian.tar missing"

out="$cache/lazy"
mkdir -p "$out"
exec 9>"$out/.lock"
if ! flock -n 9; then
  log "another build holds $out/.lock; waiting"
  flock 9
fi
rm -rf "$out"/.tmp.* 2>/dev/null || true

tmp=""
child=""
# cleanup (the chroot's mounts live in a private mount namespace and die with
# it; cleanup unmounts anything that leaked all the same)
. "$here/image-build-lib.sh"
trap cleanup EXIT
trap 'exit 130' INT TERM HUP

build_toolkit() {
  local base="$tmp/base" full="$tmp/full"
  mkdir -p "$base" "$full"
  log "toolkit.tar: unpacking debian.tar twice"
  tar --numeric-owner --xattrs --xattrs-include='*' -C "$base" -xf "$cache/debian.tar"
  tar --numeric-owner --xattrs --xattrs-include='*' -C "$full" -xf "$cache/debian.tar"
  cp -f /etc/resolv.conf "$full/etc/resolv.conf"
  log "toolkit.tar: apt-get install build-essential in a chroot (minutes)"
  # Private mount namespace: /proc and /dev of the chroot vanish with it.
  unshare -m --propagation private /bin/sh -ec '
    full="$1"
    mount -t proc proc "$full/proc"
    mount --rbind /dev "$full/dev"
    chroot "$full" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive \
      /bin/sh -ec "apt-get -o Acquire::Check-Valid-Until=false update -q
                   apt-get install -y -q --no-install-recommends build-essential
                   apt-get clean"
  ' sh "$full"
  rm -rf "$full"/var/lib/apt/lists/* "$full"/var/cache/apt/*.bin "$full"/var/log/apt/* \
    "$full"/var/log/*.log "$full"/tmp/* "$full"/var/tmp/* "$full"/var/cache/debconf/*-old \
    "$full"/var/lib/dpkg/*-old
  mkdir -p "$full/var/lib/apt/lists/partial"
  : >"$full/etc/resolv.conf"
  [ -x "$full/usr/bin/gcc" ] || die "gcc missing after apt-get install build-essential"
  log "toolkit.tar: taking the difference"
  python3 "$here/lazy_image.py" diff "$base" "$full" "$tmp/list"
  tar --numeric-owner --xattrs --xattrs-include='*' --acls -C "$full" --no-recursion \
    --null -T "$tmp/list" -cf "$tmp/toolkit.tar"
  mv -f "$tmp/toolkit.tar" "$out/toolkit.tar"
  log "toolkit.tar: done ($(du -h "$out/toolkit.tar" | cut -f1))"
}

build_workspace() {
  log "workspace.tar: generating ${ws_mb} MB"
  python3 "$here/lazy_image.py" workspace "$ws_mb" "$tmp/workspace.tar"
  mv -f "$tmp/workspace.tar" "$out/workspace.tar"
  log "workspace.tar: done ($(du -h "$out/workspace.tar" | cut -f1))"
}

for part in toolkit workspace; do
  if [ -s "$out/$part.tar" ]; then
    log "$part.tar: cached"
    continue
  fi
  tmp="$(mktemp -d "$out/.tmp.$part.XXXXXX")"
  "build_$part"
  cleanup
  tmp=""
done

log "layers in $out: $cache/debian.tar (base) $out/toolkit.tar $out/workspace.tar"

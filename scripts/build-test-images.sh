#!/usr/bin/env bash
# Builds the root filesystem tarballs the tests and benchmarks import, and caches
# them: busybox.tar (seconds) and debian.tar (debootstrap minbase + python3,
# minutes). Each is rebuilt only when missing. Each is built in a temp dir next
# to the cache and renamed into place, so an interrupted run leaves no partial
# tarball behind (only a stale .tmp.* dir that the next run removes).
#
# Usage: scripts/build-test-images.sh [CACHE_DIR]
#   CACHE_DIR defaults to $DSEC_IMAGE_CACHE, else /var/cache/dsec/test-images.
#   DSEC_DEBIAN_MIRROR overrides the mirror taken from the host's apt sources.
#   DSEC_TEST_IMAGES="busybox" builds only the named images (default: busybox debian).
set -euo pipefail
exec </dev/null
export DEBIAN_FRONTEND=noninteractive

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache="${1:-${DSEC_IMAGE_CACHE:-/var/cache/dsec/test-images}}"
images="${DSEC_TEST_IMAGES:-busybox debian}"
suite=bookworm

log() { echo "build-test-images: $*"; }
die() { echo "build-test-images: error: $*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "must run as root (debootstrap and ownership of rootfs files)"

"$here/install-deps.sh"
for tool in busybox debootstrap tar; do
  command -v "$tool" >/dev/null || die "$tool not found after install-deps.sh"
done

mkdir -p "$cache"
cache="$(cd "$cache" && pwd)"

# Stale temp dirs from an interrupted run. A concurrent run would hold the lock
# below, so only clean them once we own it.
exec 9>"$cache/.lock"
if ! flock -n 9; then
  log "another build holds $cache/.lock; waiting"
  flock 9
fi
rm -rf "$cache"/.tmp.* 2>/dev/null || true

tmp=""
child=""
# cleanup, run_group, debian_mirror
. "$here/image-build-lib.sh"
trap cleanup EXIT
trap 'exit 130' INT TERM HUP

# Tars directory $1 into $cache/$2 through a temp file, then renames.
pack() {
  local dir="$1" name="$2"
  log "$name: packing"
  tar --numeric-owner --xattrs --xattrs-include='*' --acls -C "$dir" -cf "$tmp/$name" .
  sync -f "$tmp/$name" 2>/dev/null || true
  mv -f "$tmp/$name" "$cache/$name"
  log "$name: done ($(du -h "$cache/$name" | cut -f1))"
}

build_busybox() {
  local root="$tmp/rootfs"
  log "busybox.tar: building"
  mkdir -p "$root"/{bin,sbin,usr/bin,usr/sbin,etc,root,proc,sys,dev,tmp,var/tmp,home}
  chmod 1777 "$root/tmp" "$root/var/tmp"
  chmod 0700 "$root/root"
  install -m 0755 "$(command -v busybox)" "$root/bin/busybox"
  # `busybox --list-full` gives install paths (bin/ls, usr/bin/env, ...).
  # Relative links, so they resolve the same inside the sandbox and from the host.
  local n=0 applet dir slashes up target i
  while read -r applet; do
    [ -n "$applet" ] || continue
    [ "$applet" = "bin/busybox" ] && continue
    dir="${applet%/*}"
    if [ "$dir" = bin ]; then
      target=busybox
    else
      slashes="${dir//[!\/]/}"
      up=""
      for ((i = 0; i <= ${#slashes}; i++)); do up="../$up"; done
      target="${up}bin/busybox"
    fi
    [ -e "$root/$applet" ] || [ -L "$root/$applet" ] || ln -s "$target" "$root/$applet"
    n=$((n + 1))
  done < <("$root/bin/busybox" --list-full)
  [ "$n" -gt 50 ] || die "busybox --list-full gave only $n applets"
  # Plain /bin/NAME links too, for callers that assume everything is in /bin.
  while read -r applet; do
    [ -e "$root/bin/$applet" ] || [ -L "$root/bin/$applet" ] || ln -s busybox "$root/bin/$applet"
  done < <("$root/bin/busybox" --list)
  cat >"$root/etc/passwd" <<'EOF'
root:x:0:0:root:/root:/bin/sh
nobody:x:65534:65534:nobody:/nonexistent:/bin/false
EOF
  cat >"$root/etc/group" <<'EOF'
root:x:0:
nogroup:x:65534:
EOF
  printf 'root:*:0:0:99999:7:::\nnobody:*:0:0:99999:7:::\n' >"$root/etc/shadow"
  chmod 0640 "$root/etc/shadow"
  printf 'hosts: files dns\n' >"$root/etc/nsswitch.conf"
  printf '127.0.0.1 localhost\n::1 localhost\n' >"$root/etc/hosts"
  : >"$root/etc/resolv.conf"
  chown -R 0:0 "$root"
  log "busybox.tar: $n applets linked"
  pack "$root" busybox.tar
}

build_debian() {
  local root="$tmp/rootfs" mirror
  mirror="$(debian_mirror)"
  log "debian.tar: debootstrap --variant=minbase --include=python3 $suite from $mirror (minutes)"
  mkdir -p "$root"
  # debootstrap prints its own progress lines (I: Retrieving ..., I: Unpacking ...).
  run_group debootstrap --variant=minbase --include=python3 \
    "$suite" "$root" "$mirror" ||
    { tail -n 30 "$root/debootstrap/debootstrap.log" 2>/dev/null >&2 || true; die "debootstrap failed"; }
  log "debian.tar: cleaning apt caches and lists"
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/cache/apt/*.bin \
    "$root"/var/lib/apt/lists/* "$root"/var/log/*.log "$root"/var/log/apt/* \
    "$root"/tmp/* "$root"/var/tmp/*
  mkdir -p "$root/var/lib/apt/lists/partial"
  : >"$root/etc/resolv.conf" 2>/dev/null || true
  # Nothing from debootstrap may stay mounted inside the tree we tar.
  awk -v p="$root/" 'index($2, p) == 1 {print $2}' /proc/self/mounts | sort -r |
    xargs -r -n1 umount -l
  [ -x "$root/usr/bin/python3" ] || die "python3 missing from the debian rootfs"
  pack "$root" debian.tar
}

for img in $images; do
  case "$img" in
    busybox | debian) ;;
    *) die "unknown image '$img' (known: busybox debian)" ;;
  esac
  if [ -s "$cache/$img.tar" ]; then
    log "$img.tar: cached"
    continue
  fi
  tmp="$(mktemp -d "$cache/.tmp.$img.XXXXXX")"
  "build_$img"
  cleanup
  tmp=""
done

log "images in $cache:"
for img in $images; do
  [ -s "$cache/$img.tar" ] && echo "  $cache/$img.tar"
done

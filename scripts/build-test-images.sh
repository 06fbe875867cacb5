#!/usr/bin/env bash
# Builds the root filesystem tarballs the tests and benchmarks import, and caches
# them: busybox.tar (seconds), debian.tar (debootstrap minbase + python3,
# minutes) and debian-pytest.tar (debian.tar plus CPython's regression test
# suite, libpython3.11-testsuite, for tests/test_workload_parity.py; seconds
# once debian.tar is there). Each is rebuilt only when missing. Each is built
# in a temp dir next to the cache and renamed into place, so an interrupted run
# leaves no partial tarball behind (only a stale .tmp.* dir that the next run
# removes).
#
# Usage: scripts/build-test-images.sh [CACHE_DIR]
#   CACHE_DIR defaults to $DSEC_IMAGE_CACHE, else /var/cache/dsec/test-images.
#   DSEC_DEBIAN_MIRROR overrides the mirror taken from the host's apt sources.
#   DSEC_TEST_IMAGES="busybox" builds only the named images (default: busybox
#   debian debian-pytest; debian-pytest needs debian, built first when missing).
set -euo pipefail
exec </dev/null
export DEBIAN_FRONTEND=noninteractive

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache="${1:-${DSEC_IMAGE_CACHE:-/var/cache/dsec/test-images}}"
images="${DSEC_TEST_IMAGES:-busybox debian debian-pytest}"
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

# debian.tar plus the files of libpython3.11-testsuite (CPython's regression
# tests, /usr/lib/python3.11/test/...), at exactly the version of the image's
# python3.11 so the tests match their interpreter, of net-tools, its one
# dependency the image lacks, and of netbase (/etc/services, /etc/protocols:
# without them the service and protocol name lookups of the socket tests fail
# the same everywhere and compare nothing). The .debs come from the host's apt
# (Debian 12 like the image) and are unpacked with dpkg-deb (their postinst
# only byte-compiles; python compiles on import instead) and merged over the
# rootfs without replacing its merged-/usr links (/bin -> usr/bin). Where the
# host's apt does not have that version (a point release since debian.tar was
# built), apt installs the package inside a chroot of the rootfs instead, which
# brings python3.11 up to the suite's version. /etc/dsec-test-image lists the
# versions. Remove debian-pytest.tar along with debian.tar to rebuild both.
build_debian_pytest() {
  local root="$tmp/rootfs" debs="$tmp/debs" stage="$tmp/stage" ver deb pkgs
  [ -s "$cache/debian.tar" ] || die "debian-pytest.tar needs $cache/debian.tar"
  log "debian-pytest.tar: unpacking debian.tar"
  mkdir -p "$root" "$debs"
  tar --numeric-owner --xattrs --xattrs-include='*' --acls -C "$root" -xpf "$cache/debian.tar"
  ver="$(dpkg-query --admindir="$root/var/lib/dpkg" -W -f='${Version}' python3.11 2>/dev/null)" ||
    die "no python3.11 in debian.tar's dpkg database"
  pkgs="libpython3.11-testsuite=$ver net-tools netbase"
  log "debian-pytest.tar: apt-get download $pkgs"
  # As root into a dir the _apt user may not write: no privilege drop.
  if fetch_debs "$debs" $pkgs || { apt-get -q update >&2 && fetch_debs "$debs" $pkgs; }; then
    for deb in "$debs"/*.deb; do
      log "debian-pytest.tar: unpacking $(basename "$deb")"
      rm -rf "$stage"
      mkdir "$stage"
      dpkg-deb -x "$deb" "$stage"
      tar -C "$stage" -cf - . | tar -C "$root" --keep-directory-symlink --no-overwrite-dir -xpf -
    done
    rm -rf "$stage"
  else
    log "debian-pytest.tar: the host's apt has no libpython3.11-testsuite $ver;" \
      "installing the suite with apt in a chroot of the rootfs"
    rm -f "$debs"/*.deb
    install_in_chroot "$root"
  fi
  [ -f "$root/usr/lib/python3.11/test/test_os.py" ] || die "test_os.py missing after the install"
  [ -L "$root/bin" ] || die "the rootfs's /bin link was replaced"
  {
    echo "debian-pytest (scripts/build-test-images.sh): debian.tar + libpython3.11-testsuite"
    dpkg-query --admindir="$root/var/lib/dpkg" -W -f='${Package} ${Version}\n' \
      python3.11 libpython3.11-testsuite 2>/dev/null || true
    for deb in "$debs"/*.deb; do
      [ -e "$deb" ] || continue
      echo "$(dpkg-deb -f "$deb" Package) $(dpkg-deb -f "$deb" Version) (unpacked)"
    done
  } >"$root/etc/dsec-test-image"
  pack "$root" debian-pytest.tar
}

# fetch_debs DIR PKG[=VERSION]...: apt-get download into DIR.
fetch_debs() {
  local dir="$1"
  shift
  (cd "$dir" && apt-get -q -o APT::Sandbox::User=root download "$@") >&2
}

# Fallback of build_debian_pytest: apt-get install inside a chroot of $1 (the
# host's resolver for the download), then its apt caches and lists removed.
install_in_chroot() {
  local root="$1"
  mount -t proc proc "$root/proc"
  cp -L /etc/resolv.conf "$root/etc/resolv.conf"
  run_group chroot "$root" apt-get -q update || die "apt-get update in the chroot failed"
  run_group chroot "$root" apt-get -q -y --no-install-recommends install \
    libpython3.11-testsuite netbase ||
    die "apt-get install libpython3.11-testsuite in the chroot failed"
  umount "$root/proc"
  : >"$root/etc/resolv.conf"
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/cache/apt/*.bin \
    "$root"/var/lib/apt/lists/* "$root"/var/log/*.log "$root"/var/log/apt/*
  mkdir -p "$root/var/lib/apt/lists/partial"
}

# debian-pytest is made from debian.tar: build debian first where it is asked
# for and debian.tar is missing.
wanted=""
for img in $images; do
  if [ "$img" = debian-pytest ] && [ ! -s "$cache/debian.tar" ]; then
    case " $wanted " in *" debian "*) ;; *) wanted="$wanted debian" ;; esac
  fi
  case " $wanted " in *" $img "*) ;; *) wanted="$wanted $img" ;; esac
done
images="${wanted# }"

for img in $images; do
  case "$img" in
    busybox | debian | debian-pytest) ;;
    *) die "unknown image '$img' (known: busybox debian debian-pytest)" ;;
  esac
  if [ -s "$cache/$img.tar" ]; then
    log "$img.tar: cached"
    continue
  fi
  tmp="$(mktemp -d "$cache/.tmp.$img.XXXXXX")"
  "build_${img//-/_}"
  cleanup
  tmp=""
done

log "images in $cache:"
for img in $images; do
  [ -s "$cache/$img.tar" ] && echo "  $cache/$img.tar"
done

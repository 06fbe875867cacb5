# Shell functions shared by the image builders (build-test-images.sh,
# build-vm-image.sh); sourced, not run. The caller sets $tmp (its temp dir, or
# empty) and $child (the running step's process group, or empty), and installs
#   trap cleanup EXIT; trap 'exit 130' INT TERM HUP

# Stops a running step's whole process group, unmounts what debootstrap left
# mounted inside $tmp (/proc, /sys of the target) and removes $tmp.
cleanup() {
  if [ -n "${child:-}" ]; then
    kill -TERM -- "-$child" 2>/dev/null || true
    wait "$child" 2>/dev/null || true
    child=""
  fi
  if [ -n "${tmp:-}" ] && [ -d "$tmp" ]; then
    local m
    while read -r m; do
      umount -l "$m" 2>/dev/null || true
    done < <(awk -v p="$tmp/" 'index($2, p) == 1 {print $2}' /proc/self/mounts | sort -r)
    rm -rf "$tmp"
  fi
  return 0
}

# Runs "$@" in its own session and waits in a way a signal interrupts (bash
# runs traps only between foreground commands), so SIGTERM to the script stops
# a debootstrap at once and the EXIT trap kills its whole process group.
run_group() {
  setsid "$@" &
  child=$!
  local rc=0
  wait "$child" || rc=$?
  child=""
  return "$rc"
}

# Mirror of the first non-security Debian source on the host
# (DSEC_DEBIAN_MIRROR overrides it).
debian_mirror() {
  if [ -n "${DSEC_DEBIAN_MIRROR:-}" ]; then echo "$DSEC_DEBIAN_MIRROR"; return; fi
  local m=""
  if [ -r /etc/apt/sources.list.d/debian.sources ]; then
    m="$(awk 'tolower($1)=="uris:" {for (i=2;i<=NF;i++) if ($i !~ /security/) {print $i; exit}}' \
      /etc/apt/sources.list.d/debian.sources)"
  fi
  if [ -z "$m" ] && [ -r /etc/apt/sources.list ]; then
    m="$(awk '$1=="deb" {for (i=2;i<=NF;i++) if ($i ~ /^[a-z]+:\/\//) { if ($i !~ /security/) {print $i; exit} else break }}' \
      /etc/apt/sources.list)"
  fi
  echo "${m:-http://deb.debian.org/debian}"
}

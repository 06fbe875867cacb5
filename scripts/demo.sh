#!/usr/bin/env bash
# The demo behind `make demo`: starts an embedded platform (`dsec up`) on a
# scratch data dir, imports the test images, drives sandboxes through the
# Python SDK (scripts/demo.py), then stops the platform and checks nothing of
# it is left behind.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${DSEC_IMAGE_CACHE:-/var/cache/dsec/test-images}
DATA=$(mktemp -d /var/tmp/dsec-demo.XXXXXX)
LOG=$DATA.log
PID=
cleanup() {
  if [ -n "$PID" ] && kill -0 "$PID" 2>/dev/null; then
    kill -TERM "$PID"
    for _ in $(seq 1 300); do kill -0 "$PID" 2>/dev/null || break; sleep 0.1; done
  fi
  rm -rf "$DATA"
}
trap cleanup EXIT

echo "== starting dsec up (data dir $DATA, log $LOG)"
build/bin/dsec up --data-dir "$DATA" --listen 127.0.0.1:0 >"$LOG" 2>&1 &
PID=$!
for _ in $(seq 1 100); do [ -f "$DATA/up.json" ] && break; sleep 0.1; done
[ -f "$DATA/up.json" ] || { cat "$LOG"; echo "dsec up did not start" >&2; exit 1; }
echo "   $(cat "$DATA/up.json")"

echo "== importing images"
for img in busybox debian; do
  printf '   %-8s ' "$img"
  build/bin/dsec image import --data-dir "$DATA" --name "$img:latest" "$CACHE/$img.tar" 2>/dev/null
done

PYTHONPATH=sdk/python ${PYTHON:-/usr/bin/python3} scripts/demo.py "$DATA"

echo "== stopping dsec up"
kill -TERM "$PID"
wait "$PID" || true
PID=
left=$(grep -c "$DATA" /proc/self/mountinfo || true)
procs=$(pgrep -c "dsec-aether" || true)
echo "   leftover mounts: $left, leftover sandbox agents: $procs"
[ "$left" = 0 ] && [ "$procs" = 0 ]
echo "== demo done"

#!/usr/bin/env bash
# Installs the Debian packages dsec needs to build, test and demo. Idempotent:
# asks apt only for what is missing, and runs `apt-get update` only then.
set -euo pipefail

PKGS=(
  # build
  build-essential cmake pkg-config
  libboost1.81-dev nlohmann-json3-dev libsqlite3-dev libssl-dev
  libgtest-dev libgmock-dev libcurl4-openssl-dev libfuse3-dev fuse3
  # HTTP/2, the peer bench/link measures the platform-edge link against
  libnghttp2-dev
  # registry pulls and the streaming layer converter: ISA-L's igzip for gzip
  # layers (about twice zlib's speed, src/image/tar_stream.cc), zstd, and
  # libarchive for tar (PAX, GNU long names, sparse files)
  libisal-dev libzstd-dev libarchive-dev zlib1g-dev
  # the PostgreSQL state store (libpq), and the server the tests run a
  # throwaway cluster of (initdb, pg_ctl; no system-wide service is used)
  libpq-dev postgresql
  # images and sandboxes
  erofs-utils busybox-static debootstrap e2fsprogs iproute2 util-linux
  # nft for sandbox egress (NAT and the host's input/forward filters)
  nftables
  # mkfs.btrfs for the sandbox disk-quota pool (made once per edge start)
  btrfs-progs
  # mkfs.xfs for the XFS project-quota pool (ENOSPC over disk_mb; preferred)
  xfsprogs
  # the eBPF egress filter (clang -target bpf, libbpf skeleton)
  clang libbpf-dev bpftool
  # the microvm backend: QEMU, the Debian cloud kernel as its guest kernel,
  # lz4 to unpack that kernel into a PVH vmlinux (scripts/microvm-guest.py)
  qemu-system-x86 linux-image-cloud-amd64 lz4
  # the vm backend: qemu-img (overlays, disk checks); extlinux boots its test image
  qemu-utils extlinux syslinux-common
  # tests, demo, benchmarks
  python3 python3-pytest python3-yaml crun procps strace nginx-light openssl
  # promtool, which checks the platform's /v1/metrics (tests/test_metrics.py);
  # the package also installs a prometheus service, which the tests never use
  prometheus
  # registry tests and bench/pull: the CNCF distribution server, skopeo to push
  # and to compare against, zstd layers, bcrypt for htpasswd, JWTs for the
  # token server the tests run
  docker-registry skopeo zstd python3-bcrypt python3-jwt python3-cryptography
  # the web console's browser tests (tests/console: playwright-core drives Debian's
  # chromium; fonts so pages and screenshots render text). The console itself is
  # built with node and npm (ui/, docs/console.md)
  chromium fonts-dejavu-core
)

missing=()
for p in "${PKGS[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PKGS[@]} packages present"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "install-deps: missing packages (${missing[*]}) and not root" >&2
  exit 1
fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" </dev/null

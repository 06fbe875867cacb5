#!/usr/bin/env python3
"""Builds what a dsec microvm boots (docs/microvm.md), from the installed
Debian cloud kernel package and the static dsec-aether:

  OUT/vmlinux         the kernel, decompressed from /boot/vmlinuz-* (an ELF
                      with a PVH entry point, which QEMU's microvm boots directly)
  OUT/initramfs.cpio  cpio newc: /init (dsec-aether), /modules/*.ko and
                      /modules/order (load order, dependencies first)
  OUT/kernel-version  the kernel release it was made from

Idempotent and cached: nothing is rewritten when the inputs did not change.
Exits 0 without output files (and says why) when no cloud kernel is installed.
"""
import argparse
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile

# What the guest needs beyond the built-in drivers, in the kernel's names.
# vmw_vsock_virtio_transport (with vsock) is loaded only when the host gives
# the guest a vhost-vsock device for the agent (dsec.vsock=PORT).
MODULES = ["virtio_mmio", "virtio_pci", "virtio_blk", "virtio_console", "virtio_net", "erofs",
           "overlay", "vmw_vsock_virtio_transport"]

MAGICS = [  # (magic, decompressor argv) as in the kernel's extract-vmlinux
    (b"\x02\x21\x4c\x18", ["lz4", "-dc"]),
    (b"\x28\xb5\x2f\xfd", ["zstd", "-dc"]),
    (b"\xfd7zXZ\x00", ["xz", "-dc"]),
    (b"\x1f\x8b\x08", ["gzip", "-dc"]),
    (b"\x5d\x00\x00\x00", ["xz", "-dc", "--format=lzma"]),
]


def find_kernel(release):
    if release:
        path = f"/boot/vmlinuz-{release}"
        return (path, release) if os.path.exists(path) else (None, None)
    found = sorted(glob.glob("/boot/vmlinuz-*-cloud-amd64"))
    if not found:
        return None, None
    path = found[-1]
    return path, os.path.basename(path)[len("vmlinuz-"):]


def extract_vmlinux(bz, out):
    data = open(bz, "rb").read()
    for magic, argv in MAGICS:
        start = 0
        while True:
            off = data.find(magic, start)
            if off < 0:
                break
            start = off + 1
            if shutil.which(argv[0]) is None:
                continue
            p = subprocess.run(argv, input=data[off:], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL)
            # Trailing bytes after the stream make some decompressors complain;
            # what counts is a whole ELF on stdout.
            if p.stdout[:4] == b"\x7fELF" and len(p.stdout) > 1 << 20:
                with open(out, "wb") as f:
                    f.write(p.stdout)
                return
    sys.exit(f"microvm-guest: no compressed vmlinux found in {bz} (need lz4/zstd/xz/gzip)")


def module_closure(moddir):
    deps = {}
    with open(os.path.join(moddir, "modules.dep")) as f:
        for line in f:
            mod, _, rest = line.partition(":")
            deps[mod.strip()] = rest.split()
    byname = {os.path.basename(m)[:-3].replace("-", "_"): m for m in deps}
    order, seen = [], set()

    def visit(m):
        if m in seen:
            return
        seen.add(m)
        for d in deps.get(m, []):
            visit(d)
        order.append(m)

    for name in MODULES:
        if name in byname:  # built in otherwise
            visit(byname[name])
    return order


def cpio_newc(entries):
    """entries: (name, mode, data). Returns the archive bytes."""
    out = bytearray()
    ino = 1

    def add(name, mode, data):
        nonlocal ino
        nb = name.encode() + b"\0"
        hdr = "070701" + "".join(f"{v:08x}" for v in (
            ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(nb), 0))
        out.extend(hdr.encode() + nb)
        out.extend(b"\0" * ((4 - len(out) % 4) % 4))
        out.extend(data)
        out.extend(b"\0" * ((4 - len(out) % 4) % 4))
        ino += 1

    for e in entries:
        add(*e)
    add("TRAILER!!!", 0, b"")
    return bytes(out)


def write_if_changed(path, data):
    if os.path.exists(path) and open(path, "rb").read() == data:
        return
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.rename(tmp, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--aether", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--kernel-release", default="")
    a = ap.parse_args()
    bz, release = find_kernel(a.kernel_release)
    if bz is None:
        print("microvm-guest: no /boot/vmlinuz-*-cloud-amd64 (install linux-image-cloud-amd64); "
              "the microvm backend stays unavailable")
        return
    os.makedirs(a.out, exist_ok=True)
    stamp = hashlib.sha256(open(bz, "rb").read()).hexdigest()
    vmlinux = os.path.join(a.out, "vmlinux")
    stampfile = os.path.join(a.out, "vmlinux.source")
    if not (os.path.exists(vmlinux) and os.path.exists(stampfile)
            and open(stampfile).read() == stamp):
        extract_vmlinux(bz, vmlinux + ".tmp")
        os.rename(vmlinux + ".tmp", vmlinux)
        write_if_changed(stampfile, stamp.encode())
    moddir = f"/lib/modules/{release}"
    mods = module_closure(moddir)
    # Without its debug info (RelWithDebInfo): every boot unpacks the initramfs.
    init = open(a.aether, "rb").read()
    if shutil.which("strip"):
        with tempfile.TemporaryDirectory() as tmp:
            stripped = os.path.join(tmp, "init")
            if subprocess.run(["strip", "--strip-debug", "-o", stripped, a.aether]).returncode == 0:
                init = open(stripped, "rb").read()
    entries = [("init", 0o100755, init), ("modules", 0o40755, b"")]
    for m in mods:
        entries.append(("modules/" + os.path.basename(m), 0o100644,
                        open(os.path.join(moddir, m), "rb").read()))
    entries.append(("modules/order", 0o100644,
                    "".join(os.path.basename(m) + "\n" for m in mods).encode()))
    for d in ("dev", "proc", "sys", "layers", "rw", "newroot"):
        entries.append((d, 0o40755, b""))
    write_if_changed(os.path.join(a.out, "initramfs.cpio"), cpio_newc(entries))
    write_if_changed(os.path.join(a.out, "kernel-version"), (release + "\n").encode())


if __name__ == "__main__":
    main()

"""backend="vm" (issue 8, docs/vm.md): each sandbox is a QEMU q35 machine
booting a disk image with its own kernel, bootloader and systemd; exec and
files go through qemu-guest-agent, computer use (screenshot, keyboard,
mouse) through QMP. Checked against real QEMU (TCG where the host has no
usable KVM: generous timeouts, no timing assertions) with the debootstrapped
test image of scripts/build-vm-image.sh (Debian, systemd, qemu-guest-agent,
extlinux; nothing of dsec inside).

One server and one VM serve most tests (a TCG boot of systemd takes tens of
seconds); the boot-timeout test uses a disk that never boots. Skips with the
reason printed when QEMU, qemu-img or the image is missing."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

import dsec
from conftest import Server, unavailable
from outside_host import ADDR, GREETING, OTHER_ADDR, OutsideHost
from helpers import (edge_cgroup, qemu_pids, require_backend, require_qemu, sandbox_cgroup_dirs,
                     start_vm_server, vm_dirs, wait_until)

CACHE = Path(os.environ.get("DSEC_IMAGE_CACHE", "/var/cache/dsec/test-images"))
VM_IMAGE = CACHE / "vm-debian.qcow2"
BUSYBOX_TAR = CACHE / "busybox.tar"
BOOT_S = 900  # create deadline for the client: two TCG boots of systemd on a loaded host


def _qemu_pids(data_dir: Path) -> set:
    return qemu_pids(data_dir, "vm")


def _vm_dirs(data_dir: Path) -> set:
    return vm_dirs(data_dir, "vm")


def _start(s: Server):
    start_vm_server(s, BOOT_S)


def _prereqs():
    require_qemu("qemu-system-x86_64", "qemu-img")
    if not VM_IMAGE.exists():
        unavailable(f"no {VM_IMAGE} (make vm-image, or scripts/build-vm-image.sh)")


def _import_disk(s: Server, name: str, path: Path) -> subprocess.CompletedProcess:
    return s.cli("image", "import", "--data-dir", s.data_dir, "--kind", "disk", "--name", name,
                 path, timeout=600)


@pytest.fixture(scope="module")
def vmserver(tmp_path_factory):
    _prereqs()
    s = Server(tmp_path_factory.mktemp("vm") / "data")
    s.data_dir.mkdir()
    _start(s)
    require_backend(s, "vm")
    r = _import_disk(s, "vmdeb:latest", VM_IMAGE)
    assert r.returncode == 0, r.stderr
    s.import_image("busybox:latest", BUSYBOX_TAR)
    yield s
    if s.proc.poll() is None:
        assert s.stop() == 0, s.log_tail()
    assert not _qemu_pids(s.data_dir), _qemu_pids(s.data_dir)
    assert not _vm_dirs(s.data_dir), _vm_dirs(s.data_dir)


@pytest.fixture(scope="module")
def vm(vmserver):
    t0 = time.monotonic()
    # disk_mb above the image's 2 GiB grows the disk the guest sees
    sb = vmserver.client.create("vmdeb:latest", backend="vm", cpu=2, memory_mb=512,
                                disk_mb=3072)
    print(f"vm create (boot to qemu-guest-agent answering): {time.monotonic() - t0:.1f} s")
    yield sb
    vmserver.client.get(sb.id).destroy()


def test_node_reports_the_backend_and_its_accelerator(vmserver):
    vm = vmserver.raw("GET", "/v1/node")[3]["backends"]["vm"]
    assert vm["available"] is True
    assert vm["accelerator"] in ("kvm", "tcg"), vm
    assert vm["reason"], vm
    print(f"vm accelerator: {vm['accelerator']} ({vm['reason']})")


def test_the_image_is_stored_as_a_disk(vmserver):
    img = vmserver.client.image("vmdeb:latest")
    assert img.kind == "disk" and len(img.layers) == 1, img


def test_exec_runs_in_the_guests_own_systemd(vm):
    assert vm.info["backend"] == "vm"
    r = vm.exec("cat /proc/1/comm; uname -r; echo err >&2; exit 3")
    lines = r.stdout.splitlines()
    assert lines[0] == "systemd", r.stdout
    assert "cloud-amd64" in lines[1] and lines[1] != os.uname().release, r.stdout
    assert r.stderr == "err\n" and r.exit_code == 3
    r = vm.exec(["/bin/sh", "-c", "pwd; id -u"], cwd="/tmp")
    assert r.stdout == "/tmp\n0\n", r.stdout
    assert vm.exec(["/nonexistent/prog"]).exit_code == 127
    r = vm.exec("cat", stdin=b"through stdin\n")
    assert r.stdout == "through stdin\n", r.stdout


def test_exec_timeout_kills_the_guest_process(vm):
    r = vm.exec("sleep 60; echo never", timeout=2)
    assert r.timed_out and r.exit_code == -1, r.raw
    assert "never" not in r.stdout
    # the wrapper killed it: no sleep left in the guest
    assert vm.exec("grep -lx sleep /proc/[0-9]*/comm").exit_code != 0


def test_output_is_capped(vm):
    r = vm.exec("head -c 3000000 /dev/zero | tr '\\0' x", max_output_bytes=100000)
    assert r.truncated and len(r.stdout) == 100000, (r.truncated, len(r.stdout))
    # exactly the cap is not truncated; a last line after a pause is not lost
    r = vm.exec("head -c 4096 /dev/zero | tr '\\0' y; sleep 0.5; echo; echo end >&2",
                max_output_bytes=4097)
    assert not r.truncated and r.stdout == "y" * 4096 + "\n" and r.stderr == "end\n", r.raw


def test_an_output_flood_stays_bounded_in_the_guest(vm):
    """`yes` writes as fast as it can for 20 s: the guest keeps at most the
    cap (plus one byte) of it per stream, and the rest is drained, not
    stored; the command is neither blocked nor failed by the cap (it runs
    until its timeout), as in a container."""
    import threading
    cap = 65536
    done = {}
    t = threading.Thread(target=lambda: done.setdefault(
        "r", vm.exec("yes flood", timeout=20, max_output_bytes=cap)))
    t.start()
    sizes = []
    try:
        # while it floods, the files it writes to hold no more than the cap
        assert wait_until(lambda: vm.exec("grep -lx yes /proc/[0-9]*/comm").exit_code == 0 or
                          not t.is_alive(), 120)
        for _ in range(5):
            if not t.is_alive():
                break
            out = vm.exec("stat -c %s /run/dsec-exec/*.out 2>/dev/null; "
                          "df -k --output=used /run | tail -1").stdout.split()
            sizes.append(out)
            for n in out[:-1]:
                assert int(n) <= cap + 1, out
            time.sleep(1)
    finally:
        t.join(120)
    r = done["r"]
    assert r.timed_out and r.truncated and r.stdout == "flood\n" * (cap // 6) + "flood\n"[:cap % 6], \
        (r.raw, len(r.stdout))
    assert sizes, "the flood ended before it could be measured"
    print(f"guest files during the flood (bytes..., /run used KiB): {sizes}")
    # and nothing of it is left in the guest (but the listing exec's own files)
    assert wait_until(lambda: vm.exec("ls /run/dsec-exec | sed 's/[.].*//' | sort -u | wc -l")
                      .stdout.strip() == "1", 30)
    assert vm.exec("grep -lx yes /proc/[0-9]*/comm").exit_code != 0


def test_files_through_the_guest_agent(vm):
    vm.write_file("/root/hello.txt", b"from the host\n")
    assert vm.read_file("/root/hello.txt") == b"from the host\n"
    assert vm.exec("cat /root/hello.txt").stdout == "from the host\n"
    big = os.urandom(3 << 20)
    vm.write_file("/tmp/big", big)
    assert vm.read_file("/tmp/big") == big
    vm.write_file("/root/script.sh", b"#!/bin/sh\necho ran\n", mode=0o755)
    assert vm.stat("/root/script.sh").mode == 0o755
    assert vm.exec("/root/script.sh").stdout == "ran\n"
    vm.mkdir("/root/d/e")
    names = {e.name for e in vm.list_dir("/root")}
    assert {"hello.txt", "script.sh", "d"} <= names, names
    assert vm.stat("/root/d").type == "dir"
    vm.remove("/root/d", recursive=True)
    assert not vm.exists("/root/d")
    with pytest.raises(dsec.DsecError) as e:
        vm.read_file("/no/such/file")
    assert e.value.code == "not_found", e.value


def test_resources_and_no_network(vm):
    assert vm.exec("nproc").stdout.strip() == "2"
    kb = int(vm.exec("awk '/MemTotal/ {print $2}' /proc/meminfo").stdout)
    assert 350 * 1024 < kb <= 512 * 1024, kb
    links = vm.exec("ls /sys/class/net").stdout.split()
    assert links in ([], ["lo"]), links
    # the disk is disk_mb, and the root file system was grown to it at boot
    # (resize2fs through qemu-guest-agent: the image has one ext4 on /dev/vda)
    sectors = int(vm.exec("cat /sys/block/vda/size").stdout)
    assert sectors * 512 == 3072 << 20, sectors
    size_kb = int(vm.exec("df -k --output=size / | tail -1").stdout)
    assert size_kb > 2900 << 10, size_kb


def test_qemu_runs_confined(vmserver, vm):
    (pid,) = _qemu_pids(vmserver.data_dir)
    for ns in ("net", "mnt", "ipc", "uts", "pid"):
        assert os.readlink(f"/proc/{pid}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}"), ns
    status = Path(f"/proc/{pid}/status").read_text()
    assert "Seccomp:\t2" in status, status  # -sandbox on
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert b"-nodefaults" in cmdline and b"-netdev" not in cmdline and b"-nic" not in cmdline
    cg = Path(f"/proc/{pid}/cgroup").read_text()
    assert vm.id in cg, cg
    rss = [l for l in status.splitlines() if l.startswith("VmRSS:")]
    print(f"QEMU of a booted vm with 512 MiB of guest RAM: {rss}")


def test_screenshot_and_typing_reach_the_console(vm):
    # root is logged in on tty1 (the VGA console) once getty ran
    assert wait_until(lambda: vm.exec("grep -lx bash /proc/[0-9]*/comm").exit_code == 0, 300)
    before = vm.screenshot()
    assert before[:8] == b"\x89PNG\r\n\x1a\n", before[:16]
    vm.type("echo typed-by-dsec > /tmp/typed\n")
    assert wait_until(lambda: vm.exec("cat /tmp/typed").stdout == "typed-by-dsec\n", 60), \
        vm.exec("cat /tmp/typed")
    after = vm.screenshot()
    assert after[:8] == b"\x89PNG\r\n\x1a\n" and after != before
    vm.key("ctrl+l")
    vm.key("Return")
    vm.mouse(10, 10, None)
    vm.mouse(100, 50, "left")


def test_bad_input_is_a_400_naming_the_field(vmserver, vm):
    for body, field in [({"type": "key", "key": "ctrl+hyper"}, "key"),
                        ({"type": "type", "text": "caf\u00e9"}, "text"),
                        ({"type": "mouse", "x": 100000, "y": 1}, "x"),
                        ({"type": "mouse", "x": 1, "y": 1, "button": "thumb"}, "button"),
                        ({"type": "dance"}, "type")]:
        status, _, _, doc = vmserver.raw("POST", f"/v1/sandboxes/{vm.id}/input", body, timeout=60)
        assert status == 400 and doc["error"]["field"] == field, (body, doc)


def test_images_and_backends_must_match(vmserver):
    s = vmserver
    status, _, _, doc = s.raw("POST", "/v1/sandboxes", {"image": "vmdeb:latest"})
    assert status == 409 and doc["error"]["field"] == "image", doc
    status, _, _, doc = s.raw("POST", "/v1/sandboxes", {"image": "busybox:latest", "backend": "vm"})
    assert status == 409 and doc["error"]["field"] == "image", doc
    status, _, _, doc = s.raw("POST", "/v1/sandboxes",
                              {"image": "vmdeb:latest", "backend": "vm", "memory_mb": 64})
    assert status == 400 and doc["error"]["field"] == "memory_mb", doc
    status, _, _, doc = s.raw("POST", "/v1/sandboxes",
                              {"image": "vmdeb:latest", "backend": "vm",
                               "toolkits": ["busybox:latest"]})
    assert status == 400 and doc["error"]["field"] == "toolkits", doc
    # a disk smaller than the image's (2 GiB) cannot hold it: refused before
    # anything boots, nothing left
    before = _vm_dirs(s.data_dir)
    status, _, _, doc = s.raw("POST", "/v1/sandboxes",
                              {"image": "vmdeb:latest", "backend": "vm", "disk_mb": 1024})
    assert status == 400 and doc["error"]["field"] == "disk_mb", doc
    assert "2048" in doc["error"]["message"], doc
    assert _vm_dirs(s.data_dir) == before


def test_exec_stream_delivers_output_while_the_command_runs(vmserver, vm):
    """The first line arrives while the command still runs: it waits for a
    file the test writes only after seeing that line (no timing involved;
    without streaming the command would give up waiting and say so)."""
    vm = vmserver.client.get(vm.id)  # the server may have been restarted meanwhile
    vm.exec("rm -f /tmp/go")
    script = ("echo first; i=0; while [ ! -e /tmp/go ]; do i=$((i+1)); "
              "[ $i -gt 600 ] && { echo gave up; exit 9; }; sleep 0.2; done; "
              "echo second >&2; echo third")
    seen = []
    # a second client: the first one's connection carries the stream
    other = dsec.Client.from_data_dir(str(vmserver.data_dir), timeout=120).get(vm.id)
    for ev in vm.exec_stream(["bash", "-c", script], timeout=300):
        if ev.type in ("stdout", "stderr"):
            seen.append((ev.type, ev.data))
            if ev.type == "stdout" and "first" in ev.data and len(seen) == 1:
                other.write_file("/tmp/go", b"")
        elif ev.type == "exit":
            assert ev.exit_code == 0, (ev.raw, seen)
        else:
            raise AssertionError(ev.raw)
    out = "".join(d for t, d in seen if t == "stdout")
    assert out == "first\nthird\n", seen
    assert "".join(d for t, d in seen if t == "stderr") == "second\n", seen
    # the output files of finished execs are gone from the guest (this ls's
    # own remain: its FIFOs and files)
    r = vm.exec("ls -A /run/dsec-exec")
    assert len({n.split(".")[0] for n in r.stdout.split()}) == 1, r.stdout


# One TCP connect from the guest (bash's /dev/tcp: the test image has no
# curl or python): the outside host's greeting, or the error.
TCP_PROBE = ('exec 3<>"/dev/tcp/$1/$2" || exit 7; IFS= read -r -t 20 line <&3; '
             'echo "got $line"')


def _tcp(sb, host, port):
    r = sb.exec(["timeout", "40", "bash", "-c", TCP_PROBE, "probe", host, str(port)], timeout=90)
    return r.exit_code, r.stdout + r.stderr


def test_egress_by_policy_in_a_vm(vmserver, vm):
    """As for containers and microvms: a vm created under a policy with an
    allow-list gets a NIC (QEMU user-mode networking in QEMU's netns, the
    edge's veth and eBPF filter); the guest (whose image has no network
    configuration) gets its address; only the list is reachable; a phase
    switch cuts it. The vm created without such a policy has no NIC."""
    s = vmserver
    if s.egress_unavailable:
        pytest.skip(f"this node gives no sandbox egress: {s.egress_unavailable}")
    vm = s.client.get(vm.id)  # the server may have been restarted meanwhile
    assert vm.exec("ls /sys/class/net").stdout.split() == ["lo"]
    h = OutsideHost()
    h.start()
    sb = None
    try:
        s.client.create_policy("vm-net-test", egress=[f"{ADDR}:8080"], dns=[ADDR])
        # no disk_mb: the image's own size (a second boot of this base: its
        # size comes from the node's record of it)
        sb = s.client.create("vmdeb:latest", backend="vm", memory_mb=512, policy="vm-net-test")
        assert int(sb.exec("cat /sys/block/vda/size").stdout) * 512 == 2048 << 20
        assert sb.exec("ls /sys/class/net").stdout.split() == ["eth0", "lo"]
        assert sb.read_file("/etc/resolv.conf").decode().splitlines()[1] == f"nameserver {ADDR}"
        greeting = "got " + GREETING.decode().strip()
        code, out = _tcp(sb, ADDR, 8080)
        assert (code, out.strip()) == (0, greeting), out
        for host, port in ((ADDR, 8081), (OTHER_ADDR, 8080)):
            code, out = _tcp(sb, host, port)
            assert code != 0 and "hello" not in out, (host, port, out)
        assert sb.audit()["egress_denied"] >= 2
        sb.set_phase("rollout")
        code, out = _tcp(sb, ADDR, 8080)
        assert code != 0 and "hello" not in out, out
        sb.set_phase("vm-net-test")
        code, out = _tcp(sb, ADDR, 8080)
        assert (code, out.strip()) == (0, greeting), out
    finally:
        if sb is not None:
            sb.destroy()
        h.stop()


def test_a_disk_with_a_backing_file_is_refused_at_import(vmserver, tmp_path):
    # An overlay whose backing file is any host path would read that file.
    base = tmp_path / "host-file.raw"
    with open(base, "wb") as f:
        f.truncate(1 << 20)
    bad = tmp_path / "overlay.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", base, "-F", "raw", bad],
                   check=True)
    r = _import_disk(vmserver, "bad:latest", bad)
    assert r.returncode != 0 and "backing file" in r.stderr, r.stderr


def test_screenshot_of_a_container_is_refused(vmserver):
    sb = vmserver.client.create("busybox:latest")
    try:
        status, _, _, doc = vmserver.raw("GET", f"/v1/sandboxes/{sb.id}/screenshot")
        assert status == 409 and "backend vm" in doc["error"]["message"], doc
    finally:
        sb.destroy()


def test_pause_and_resume(vm):
    vm.exec("echo before > /root/p")
    assert vm.pause().state == "paused"
    assert vm.resume().state == "running"
    assert vm.exec("cat /root/p").stdout == "before\n"


def test_pack_diff_is_a_disk_image_that_boots(vmserver, vm):
    """A vm's snapshot is its whole disk (guest file systems frozen through
    qga, vCPUs stopped, overlay and base flattened into one qcow2): an image
    of kind disk that boots like an imported one, with the writes in it."""
    c = vmserver.client
    # written just before: the freeze must put it on the disk
    vm.exec("echo snapshot-me > /root/snap.txt && rm -f /root/p")
    img = vm.pack_diff("vmsnap", "1")
    assert img.kind == "disk" and len(img.layers) == 1, img
    assert img.layers != c.image("vmdeb:latest").layers
    # the source runs on, thawed
    assert vm.exec("echo after > /root/after && cat /root/after").stdout == "after\n"
    again = c.create("vmsnap:1", backend="vm", cpu=2, memory_mb=512)
    try:
        assert again.exec("cat /root/snap.txt").stdout == "snapshot-me\n"
        assert again.exec("test -e /root/p").exit_code == 1
        assert again.exec("test -e /root/after").exit_code == 1
        # the disk is the snapshot's size (the source's disk_mb)
        assert int(again.exec("cat /sys/block/vda/size").stdout) * 512 == 3072 << 20
    finally:
        again.destroy()
        assert wait_until(lambda: len(_qemu_pids(vmserver.data_dir)) == 1, 60)


def test_edge_restart_readopts_the_vm(vmserver, vm):
    s = vmserver
    vm.exec("echo kept > /root/kept")
    pids = _qemu_pids(s.data_dir)
    assert pids
    os.kill(s.proc.pid, signal.SIGKILL)
    s.proc.wait(10)
    s._log.close()
    (s.data_dir / "up.json").unlink()
    assert pids <= _qemu_pids(s.data_dir), "QEMU died with the edge"
    _start(s)
    again = s.client.get(vm.id)
    assert again.state == "running", again.info
    assert again.exec("cat /root/kept").stdout == "kept\n"
    assert again.screenshot()[:4] == b"\x89PNG"
    assert _qemu_pids(s.data_dir) == pids


def test_zz_destroy_leaves_nothing(vmserver, vm):
    """Runs last: destroys the shared VM and checks that its QEMU, sockets,
    overlay disk and cgroup are gone."""
    s = vmserver
    mine = _qemu_pids(s.data_dir)
    assert len(mine) == 1 and (s.data_dir / "edge" / "vm" / vm.id / "disk.qcow2").exists()
    s.client.get(vm.id).destroy()
    assert wait_until(lambda: not (_qemu_pids(s.data_dir) & mine), 30)
    assert wait_until(lambda: vm.id not in _vm_dirs(s.data_dir), 30)
    assert wait_until(lambda: vm.id not in {os.path.basename(p) for p in
                                            sandbox_cgroup_dirs(edge_cgroup(s.data_dir))}, 30)


def test_a_disk_that_never_boots_is_retried_once_then_reported(tmp_path_factory):
    """A disk of zeros (no bootloader: SeaBIOS finds nothing to boot) stands
    in for a guest that hangs at boot: the VM is killed, booted once more, and
    the create fails saying so, with the console log kept and nothing else
    left."""
    _prereqs()
    tmp = tmp_path_factory.mktemp("vm-hang")
    s = Server(tmp / "data", ["--vm-boot-timeout-s", "4"])
    s.data_dir.mkdir()
    _start(s)
    try:
        require_backend(s, "vm")
        blank = tmp / "blank.raw"
        with open(blank, "wb") as f:
            f.truncate(16 << 20)
        r = _import_disk(s, "blank:latest", blank)
        assert r.returncode == 0, r.stderr
        status, _, _, doc = s.raw("POST", "/v1/sandboxes",
                                  {"image": "blank:latest", "backend": "vm"}, timeout=300)
        assert status == 503, doc
        msg = doc["error"]["message"]
        assert "did not boot within" in msg and "twice" in msg, msg
        log = msg.split("console log: ")[1].split(")")[0]
        assert Path(log).exists(), log
        assert "did not answer at boot, retrying" in s.log_tail(200)
        assert not _qemu_pids(s.data_dir)
        assert not _vm_dirs(s.data_dir)
    finally:
        assert s.stop() == 0

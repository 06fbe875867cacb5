"""backend="microvm" (issue 8, docs/microvm.md): each sandbox is a QEMU
microvm booting the node's guest kernel and the project's initramfs (init:
dsec-aether), with the image's EROFS layers as read-only disks. exec, files,
pause/resume, resources, a boot failure's diagnostics, re-adoption after an
edge crash and cleanup are checked against real QEMU (TCG where the host has
no usable KVM, hence generous timeouts and no timing assertions).

One server for the whole module and few VMs keep the run short. Skips with
the reason printed when QEMU or the guest kernel is missing."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from conftest import Server, _check_prerequisites, unavailable
from outside_host import ADDR, HOST_ADDR, NETNS, OTHER_ADDR, OutsideHost
from helpers import (edge_cgroup, qemu_pids, require_backend, require_qemu, sandbox_cgroup_dirs,
                     start_vm_server, vm_dirs, wait_until)

BUSYBOX_TAR = Path(os.environ.get("DSEC_IMAGE_CACHE", "/var/cache/dsec/test-images")) / "busybox.tar"
BOOT_S = 300  # create (boot) deadline for the client: TCG on a loaded host is slow


def _qemu_pids(data_dir: Path) -> set:
    return qemu_pids(data_dir, "microvm")


def _vm_dirs(data_dir: Path) -> set:
    return vm_dirs(data_dir, "microvm")


def _start(s: Server):
    start_vm_server(s, BOOT_S)


@pytest.fixture(scope="module")
def vmserver(tmp_path_factory):
    require_qemu()
    s = Server(tmp_path_factory.mktemp("microvm") / "data")
    s.data_dir.mkdir()
    _start(s)
    require_backend(s, "microvm")
    s.import_image("busybox:latest", BUSYBOX_TAR)
    yield s
    if s.proc.poll() is None:
        assert s.stop() == 0, s.log_tail()
    # nothing of any VM is left behind
    assert not _qemu_pids(s.data_dir), _qemu_pids(s.data_dir)
    assert not _vm_dirs(s.data_dir), _vm_dirs(s.data_dir)


@pytest.fixture(scope="module")
def vm(vmserver):
    sb = vmserver.client.create("busybox:latest", backend="microvm", cpu=2, memory_mb=256,
                                disk_mb=64)
    yield sb
    # the server may have been restarted meanwhile (new port, new client)
    vmserver.client.get(sb.id).destroy()


def test_node_reports_the_backend_and_its_accelerator(vmserver):
    status, _, _, node = vmserver.raw("GET", "/v1/node")
    assert status == 200
    vm = node["backends"]["microvm"]
    assert vm["available"] is True
    assert vm["accelerator"] in ("kvm", "tcg"), vm
    assert vm["reason"], vm
    assert vm["vhost_vsock"] is os.path.exists("/dev/vhost-vsock") or vm["vhost_vsock"] is False
    # vsock where vhost-vsock opened (auto), else virtio-serial
    assert vm["agent_channel"] == ("vsock" if vm["vhost_vsock"] else "virtio-serial"), vm
    print(f"microvm accelerator: {vm['accelerator']} ({vm['reason']}); "
          f"vhost-vsock: {vm['vhost_vsock']}")


def test_exec_files_and_isolation_in_the_guest(vmserver, vm):
    assert vm.info["backend"] == "microvm"
    r = vm.exec("hostname; uname -r; cat /proc/1/comm; echo err >&2; exit 3")
    lines = r.stdout.splitlines()
    assert lines[0] == vm.id and "cloud-amd64" in lines[1] and lines[2] == "dsec-aether", r.stdout
    assert r.stderr == "err\n" and r.exit_code == 3
    # a kernel of its own: not the host's
    assert lines[1] != os.uname().release
    vm.write_file("/root/hello.txt", b"from the host\n")
    assert vm.read_file("/root/hello.txt") == b"from the host\n"
    assert vm.exec("cat /root/hello.txt; ls /bin/busybox").exit_code == 0
    big = os.urandom(3 << 20)
    vm.write_file("/tmp/big", big)
    assert vm.read_file("/tmp/big") == big
    # the root is an overlay of the image's read-only layers and the writable disk
    mounts = vm.exec("cat /proc/mounts").stdout
    assert "overlay / overlay" in mounts, mounts
    # no network device but loopback
    links = vm.exec("ls /sys/class/net").stdout.split()
    assert links in ([], ["lo"]), links


def test_resources_match_the_request(vm):
    assert vm.exec("nproc").stdout.strip() == "2"
    kb = int(vm.exec("awk '/MemTotal/ {print $2}' /proc/meminfo").stdout)
    # 256 MiB of RAM minus what the kernel reserves for itself
    assert 160 * 1024 < kb <= 256 * 1024, kb
    # disk_mb bounds the writable disk
    r = vm.exec("dd if=/dev/zero of=/fill bs=1M count=100 2>&1; sync")
    assert r.exit_code != 0 or "No space" in r.stdout, r.stdout
    vm.exec("rm -f /fill")


def test_pause_and_resume(vm):
    vm.exec("echo before > /root/p")
    assert vm.pause().state == "paused"
    assert vm.resume().state == "running"
    assert vm.exec("cat /root/p").stdout == "before\n"


def test_pack_diff_of_a_guest_restores_exactly_its_writes(vmserver, vm):
    """The guest's upper dir (on its writable disk) becomes a diff layer as a
    container's does: files written, modified, deleted and renamed, owners,
    modes, links, an opaque dir. Restored in a container (no boot), changed
    and packed again there, then the chain restored on a microvm."""
    c = vmserver.client
    before = vm.exec("ls -A /usr/sbin").stdout.split()
    assert len(before) > 1, before
    setup = " && ".join([
        "mkdir -p /work/sub /work/gone-dir",
        "echo new > /work/sub/new.txt",
        "chown 123:456 /work/sub/new.txt",
        "echo data > /work/gone-dir/x",
        "printf 'binary\\000' > /work/bin.dat",
        "chmod 0600 /work/bin.dat",
        "echo edited >> /etc/passwd",          # a lower file, modified
        "rm /etc/group",                        # a lower file, deleted (whiteout)
        "mv /work/sub/new.txt /work/renamed.txt",
        "rm -r /work/gone-dir",
        "ln -s /work/renamed.txt /work/link",
        "ln /work/renamed.txt /work/hard",
        "rm -r /usr/sbin && mkdir /usr/sbin && echo fresh > /usr/sbin/only",  # opaque dir
        "head -c 3000000 /dev/urandom > /work/big && md5sum /work/big > /work/big.md5",
    ])
    r = vm.exec(setup)
    assert r.exit_code == 0, r.stderr
    img = vm.pack_diff("vmsnap", "1")
    assert img.kind == "diff" and len(img.layers) == 1
    # the guest's disk is thawed again: writes go on
    assert vm.exec("echo after > /root/after && cat /root/after").stdout == "after\n"

    def check(sb):
        sh = lambda cmd: sb.exec(cmd)  # noqa: E731
        assert sh("cat /work/renamed.txt").stdout == "new\n"
        assert sh("test -e /work/sub/new.txt").exit_code == 1
        assert sh("test -e /work/gone-dir").exit_code == 1
        assert sh("test -e /etc/group").exit_code == 1, "deletion of a lower file lost"
        assert sh("tail -n1 /etc/passwd").stdout == "edited\n"
        assert sb.read_file("/work/bin.dat") == b"binary\0"
        assert sb.stat("/work/bin.dat")["mode"] == 0o600
        st = sb.stat("/work/renamed.txt")
        assert (st["uid"], st["gid"]) == (123, 456)
        assert sh("readlink /work/link").stdout == "/work/renamed.txt\n"
        assert sh("stat -c %h /work/hard").stdout == "2\n"
        assert sh("ls -A /usr/sbin").stdout.split() == ["only"], before
        assert sh("cd /work && md5sum -c big.md5").exit_code == 0

    in_container = c.create(snapshot="vmsnap:1")
    try:
        assert in_container.info["layers"][-1:] == img.layers
        check(in_container)
        # a container's diff on top of the guest's, restored on a microvm
        assert in_container.exec("echo second > /work/second.txt && rm /work/bin.dat").exit_code == 0
        img2 = in_container.pack_diff("vmsnap", "2")
        assert img2.layers[:1] == img.layers and len(img2.layers) == 2
    finally:
        in_container.destroy()
    again = c.create(snapshot="vmsnap:2", backend="microvm", memory_mb=128, disk_mb=32)
    try:
        assert again.info["backend"] == "microvm"
        assert again.exec("cat /work/second.txt").stdout == "second\n"
        assert again.exec("test -e /work/bin.dat").exit_code == 1
        assert again.exec("cat /usr/sbin/only; tail -n1 /etc/passwd").stdout == "fresh\nedited\n"
    finally:
        again.destroy()


def test_unknown_backend_is_a_400_naming_the_field(vmserver):
    status, _, _, doc = vmserver.raw("POST", "/v1/sandboxes",
                                     {"image": "busybox:latest", "backend": "firecracker"})
    assert status == 400, doc
    assert doc["error"]["field"] == "backend", doc


def test_too_little_memory_is_refused(vmserver):
    status, _, _, doc = vmserver.raw("POST", "/v1/sandboxes",
                                     {"image": "busybox:latest", "backend": "microvm",
                                      "memory_mb": 64})
    assert status == 400, doc
    assert doc["error"]["field"] == "memory_mb", doc


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
    assert again.exec("cat /root/kept; hostname").stdout == f"kept\n{vm.id}\n"
    assert _qemu_pids(s.data_dir) == pids


def test_destroy_leaves_nothing(vmserver):
    s = vmserver
    before = _qemu_pids(s.data_dir)
    sb = s.client.create("busybox:latest", backend="microvm", memory_mb=128, disk_mb=32)
    assert sb.exec("echo up").stdout == "up\n"
    mine = _qemu_pids(s.data_dir) - before
    assert len(mine) == 1
    sb.destroy()
    assert wait_until(lambda: not (_qemu_pids(s.data_dir) & mine), 30)
    assert wait_until(lambda: sb.id not in _vm_dirs(s.data_dir), 30)
    assert wait_until(lambda: sb.id not in {os.path.basename(p) for p in
                                            sandbox_cgroup_dirs(edge_cgroup(s.data_dir))}, 30)


def test_boot_failure_is_clear_and_keeps_the_console_log(tmp_path_factory):
    """A guest kernel QEMU cannot boot: the create fails with QEMU's reason and
    the console log's path, and leaves no VM behind."""
    require_qemu()
    from conftest import aether_bin
    guest = tmp_path_factory.mktemp("badguest")
    (guest / "vmlinux").write_bytes(b"this is not a kernel\n" * 100)
    real = aether_bin().parent / "microvm-guest" / "initramfs.cpio"
    if not real.exists():
        unavailable(f"no {real} (install linux-image-cloud-amd64 and rebuild)")
    shutil.copy(real, guest / "initramfs.cpio")
    s = Server(tmp_path_factory.mktemp("microvm-bad") / "data",
               ["--microvm-guest-dir", guest, "--microvm-accel", "tcg"])
    s.data_dir.mkdir()
    _start(s)
    try:
        s.import_image("busybox:latest", BUSYBOX_TAR)
        status, _, _, doc = s.raw("POST", "/v1/sandboxes",
                                  {"image": "busybox:latest", "backend": "microvm"}, timeout=120)
        assert status >= 400, doc
        msg = doc["error"]["message"]
        assert "QEMU exited" in msg and "console log: " in msg, msg
        log = msg.split("console log: ")[1].split(")")[0]
        assert Path(log).exists(), log
        assert not _qemu_pids(s.data_dir)
        assert not _vm_dirs(s.data_dir)
    finally:
        s.stop()


def test_missing_qemu_makes_microvm_a_clear_409(tmp_path_factory):
    _check_prerequisites()
    s = Server(tmp_path_factory.mktemp("microvm-noqemu") / "data",
               ["--qemu", "/nonexistent/qemu-system-x86_64"])
    s.data_dir.mkdir()
    _start(s)
    try:
        status, _, _, node = s.raw("GET", "/v1/node")
        vm = node["backends"]["microvm"]
        assert vm["available"] is False and "not found" in vm["reason"], vm
        s.import_image("busybox:latest", BUSYBOX_TAR)
        status, _, _, doc = s.raw("POST", "/v1/sandboxes",
                                  {"image": "busybox:latest", "backend": "microvm"})
        assert status == 409, doc
        assert "not available" in doc["error"]["message"] and "not found" in doc["error"]["message"]
    finally:
        s.stop()


HTTP_PORT = 8082  # served from the outside host's netns by the test


@pytest.fixture(scope="module")
def http_outside(vmserver):
    """The egress tests' outside host (tests/outside_host.py: its own netns,
    reached only through the edge's egress path) plus an HTTP server on
    ADDR:HTTP_PORT that serves one file."""
    if vmserver.egress_unavailable:
        pytest.skip(f"this node gives no sandbox egress: {vmserver.egress_unavailable}")
    h = OutsideHost()
    h.start()
    root = vmserver.data_dir.parent / "http-root"
    root.mkdir(exist_ok=True)
    (root / "hello.txt").write_text("hello over http\n")
    srv = subprocess.Popen(["ip", "netns", "exec", NETNS, "python3", "-m", "http.server",
                            str(HTTP_PORT), "--bind", "0.0.0.0", "--directory", str(root)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: subprocess.run(["ip", "netns", "exec", NETNS, "python3", "-c",
                                           f"import socket; socket.create_connection(('{ADDR}', "
                                           f"{HTTP_PORT}), 1)"],
                                          capture_output=True).returncode == 0, timeout=20)
        yield h
    finally:
        srv.kill()
        srv.wait()
        h.stop()


def _fetch(sb, host, port, path="hello.txt"):
    """An HTTP/1.0 GET from the guest with busybox nc (the image's static
    busybox wget crashes): (exit code, body or error text)."""
    r = sb.exec(f"printf 'GET /{path} HTTP/1.0\\r\\n\\r\\n' | nc -w 10 {host} {port} 2>&1",
                timeout=60)
    head, sep, body = r.stdout.partition("\r\n\r\n")
    if r.exit_code == 0 and sep and head.startswith("HTTP/1.0 200"):
        return 0, body
    return r.exit_code or 1, r.stdout


def test_egress_by_policy_reaches_only_the_allow_list(vmserver, http_outside):
    """A microvm created under a policy with an allow-list gets a NIC (QEMU
    user-mode networking inside QEMU's own netns): what the list names is
    reachable, by address and by a name the policy's resolver answers;
    another port or address of the same host, the node itself and slirp's
    own services are not, and the refusals are the eBPF filter's (counted
    in the audit). A phase switch closes and reopens it on the running VM."""
    s = vmserver
    s.client.create_policy("vm-net-test", egress=[f"{ADDR}:{HTTP_PORT}"], dns=[ADDR])
    sb = s.client.create("busybox:latest", backend="microvm", memory_mb=256, disk_mb=64,
                         policy="vm-net-test")
    try:
        links = sb.exec("ls /sys/class/net").stdout.split()
        assert links == ["eth0", "lo"], links
        assert _fetch(sb, ADDR, HTTP_PORT) == (0, "hello over http\n")
        # the policy's resolver (the outside host answers every name with ADDR)
        assert sb.read_file("/etc/resolv.conf").decode().split("\n")[1] == f"nameserver {ADDR}"
        assert _fetch(sb, "mirror.example", HTTP_PORT) == (0, "hello over http\n")
        denied0 = sb.audit()["egress_denied"]
        for host, port in ((ADDR, 8080), (OTHER_ADDR, HTTP_PORT), (HOST_ADDR, HTTP_PORT),
                           (HOST_ADDR, s.port), ("10.0.2.2", s.port)):
            code, out = _fetch(sb, host, port)
            assert code != 0 and "hello" not in out, (host, port, out)
        audit = sb.audit()
        # four went to the filter (10.0.2.2 is QEMU's own netns loopback: nothing there)
        assert audit["egress_denied"] >= denied0 + 4, audit
        # a phase without egress cuts it on the running VM; granting again reopens it
        sb.set_phase("rollout")
        code, out = _fetch(sb, ADDR, HTTP_PORT)
        assert code != 0 and "hello" not in out, out
        sb.set_phase("vm-net-test")
        assert _fetch(sb, ADDR, HTTP_PORT) == (0, "hello over http\n")
    finally:
        sb.destroy()
    # its veth went with it
    assert not [l for l in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True)
                .stdout.splitlines() if sb.id in l and f"dsec {s.egress_tag} " in l]


def test_without_an_egress_policy_the_guest_has_no_network(vmserver, vm, http_outside):
    """No NIC at all, and none can be granted later (microvm has no hotplug):
    the phase switch is refused and changes nothing."""
    vm = vmserver.client.get(vm.id)  # the server may have been restarted meanwhile
    links = vm.exec("ls /sys/class/net").stdout.split()
    assert links in ([], ["lo"]), links
    code, out = _fetch(vm, ADDR, HTTP_PORT)
    assert code != 0 and "hello" not in out, out
    vmserver.client.create_policy("vm-net-late", egress=[f"{ADDR}:{HTTP_PORT}"])
    phases = len(vm.info["phases"])
    status, _, _, doc = vmserver.raw("POST", f"/v1/sandboxes/{vm.id}/phase",
                                     {"policy": "vm-net-late"})
    assert status == 409 and doc["error"]["field"] == "egress", doc
    assert "without a network device" in doc["error"]["message"], doc
    info = vmserver.client.get(vm.id).info
    assert info["policy"] != "vm-net-late" and len(info["phases"]) == phases, info
    assert vm.exec("ls /sys/class/net").stdout.split() in ([], ["lo"])


def test_a_guest_that_does_not_answer_is_retried_once_then_reported(tmp_path_factory):
    """A boot deadline no TCG boot can meet stands in for a hung guest: the VM
    is killed, booted once more, and the create fails saying so, with the
    console log kept and nothing else left."""
    require_qemu()
    s = Server(tmp_path_factory.mktemp("microvm-hang") / "data",
               ["--microvm-accel", "tcg", "--microvm-boot-timeout-s", "0.3"])
    s.data_dir.mkdir()
    _start(s)
    try:
        require_backend(s, "microvm")
        s.import_image("busybox:latest", BUSYBOX_TAR)
        status, _, _, doc = s.raw("POST", "/v1/sandboxes",
                                  {"image": "busybox:latest", "backend": "microvm"}, timeout=120)
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


def test_stopping_the_node_mid_boot_leaves_no_vm(tmp_path_factory):
    """`dsec up` stopped (SIGTERM) while a microvm still boots: the create in
    flight is stopped and undone, so no QEMU, VM directory or sandbox cgroup
    of it is left behind, and the client gets an error, not a sandbox."""
    import threading
    require_qemu()
    s = Server(tmp_path_factory.mktemp("microvm-stop") / "data", ["--microvm-accel", "tcg"])
    s.data_dir.mkdir()
    _start(s)
    require_backend(s, "microvm")
    s.import_image("busybox:latest", BUSYBOX_TAR)
    answer = {}

    def create():
        try:
            answer["r"] = s.raw("POST", "/v1/sandboxes",
                                {"image": "busybox:latest", "backend": "microvm",
                                 "memory_mb": 128, "disk_mb": 32}, timeout=BOOT_S)
        except Exception as e:  # the server went away mid-request
            answer["e"] = e

    t = threading.Thread(target=create, daemon=True)
    t.start()
    # Booting: its QEMU runs (a TCG boot takes seconds at least).
    assert wait_until(lambda: _qemu_pids(s.data_dir), 60), s.log_tail()
    cgroup = edge_cgroup(s.data_dir)
    assert s.stop() == 0, s.log_tail()
    t.join(30)
    status = answer.get("r", (None,))[0]
    assert "e" in answer or (status is not None and status >= 400), answer
    assert not _qemu_pids(s.data_dir)
    assert not _vm_dirs(s.data_dir)
    assert not sandbox_cgroup_dirs(cgroup), sandbox_cgroup_dirs(cgroup)


def test_vsock_agent_channel(vmserver):
    """Where the node has vhost-vsock the agent channel is vsock (auto): QEMU
    gets a vhost-vsock device with the guest's CID and no agent socket; the
    guest's init listens on vsock and the edge connects to it. exec and
    files, an edge crash (the new edge reconnects by the recorded CID) and
    pause to disk (the restored guest's listener takes the next host) work
    over it. Skips, saying so, where /dev/vhost-vsock is absent (this kind
    of host): the unit tests check the choice and the command line."""
    s = vmserver
    node = s.raw("GET", "/v1/node")[3]["backends"]["microvm"]
    if not node["vhost_vsock"]:
        pytest.skip("no usable /dev/vhost-vsock on this host: the vsock agent channel cannot "
                    "run here (virtio-serial is used; see microvm_backend_test.cc)")
    assert node["agent_channel"] == "vsock", node
    sb = s.client.create("busybox:latest", backend="microvm", cpu=1, memory_mb=128, disk_mb=64)
    try:
        vmdir = s.data_dir / "edge" / "microvm" / sb.id
        cid = int((vmdir / "vsock.cid").read_text())
        assert cid >= 3 and not (vmdir / "agent.sock").exists()
        (pid,) = [p for p in _qemu_pids(s.data_dir)
                  if os.readlink(f"/proc/{p}/cwd") == str(vmdir)]
        cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        assert f"vhost-vsock-device,guest-cid={cid}".encode() in cmdline, cmdline
        r = sb.exec("echo over vsock; cat /proc/cmdline")
        assert r.stdout.startswith("over vsock\n") and "dsec.vsock=" in r.stdout, r.stdout
        sb.write_file("/root/v.txt", b"vsock file\n")
        assert sb.read_file("/root/v.txt") == b"vsock file\n"
        sb.exec("sleep 100000 >/dev/null 2>&1 </dev/null & echo $! > /root/bg")
        bg = sb.exec("cat /root/bg").stdout.strip()
        # an edge crash: the next edge reconnects by the CID and reattaches
        os.kill(s.proc.pid, signal.SIGKILL)
        s.proc.wait(10)
        s._log.close()
        (s.data_dir / "up.json").unlink()
        _start(s)
        sb = s.client.get(sb.id)
        assert sb.exec(f"kill -0 {bg} && echo alive").stdout == "alive\n"
        # pause to disk and back over vsock
        sb.pause(memory="disk")
        assert not (vmdir / "qemu.pid").exists()
        sb.resume()
        assert sb.exec(f"kill -0 {bg} && cat /root/v.txt").stdout == "vsock file\n"
    finally:
        s.client.get(sb.id).destroy()
    assert wait_until(lambda: sb.id not in _vm_dirs(s.data_dir), 30)

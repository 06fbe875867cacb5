"""Network egress under policies: closed by default; a policy's allow-list
(eBPF cgroup connect/sendmsg filter) opens exactly what it lists, through a
veth with masquerade; DNS only via the policy's resolvers; a phase switch
applies to running processes at their next connect; the host, the platform
and other sandboxes are never reachable. Real veths, nftables and eBPF."""

from __future__ import annotations

import subprocess
import time

import pytest

import dsec
from helpers import expect_error, wait_until
from outside_host import ADDR, GREETING, OTHER_ADDR, OutsideHost

# One connect from inside the sandbox: "ok <greeting>", an errno name, or "timeout".
PROBE = r'''
import errno, socket, sys
host, port = sys.argv[1], int(sys.argv[2])
try:
    s = socket.create_connection((host, port), float(sys.argv[3]) if len(sys.argv) > 3 else 3)
    print("ok", s.recv(100).decode().strip())
except socket.timeout:
    print("timeout")
except OSError as e:
    print(errno.errorcode.get(e.errno, e.errno))
'''

# A raw DNS query over UDP to a resolver of our choice, bypassing resolv.conf.
DNS_QUERY = r'''
import errno, socket, struct, sys
q = struct.pack("!HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0) + b"\x07example\x03com\x00" + struct.pack("!HH", 1, 1)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(3)
try:
    s.sendto(q, (sys.argv[1], 53)); s.recvfrom(512); print("answered")
except socket.timeout:
    print("timeout")
except OSError as e:
    print(errno.errorcode.get(e.errno, e.errno))
'''


def probe(sb, host, port, timeout=3):
    r = sb.exec(["python3", "-c", PROBE, host, str(port), str(timeout)], timeout=30)
    assert r.exit_code == 0, r
    return r.stdout.strip()


def own_address(sb):
    """The sandbox's eth0 address (the source of a connected UDP socket)."""
    r = sb.exec(["python3", "-c", "import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM);"
                 f"s.connect(('{ADDR}', 53)); print(s.getsockname()[0])"])
    assert r.exit_code == 0, r
    return r.stdout.strip()


def gateway(sb):
    """The sandbox's default gateway (the host side of its veth), from /proc/net/route."""
    for line in sb.read_file("/proc/net/route").decode().splitlines()[1:]:
        f = line.split()
        if f[1] == "00000000":
            return ".".join(str(b) for b in reversed(bytes.fromhex(f[2])))
    return None


@pytest.fixture(scope="module")
def outside(server):
    if server.egress_unavailable:
        pytest.skip(f"this node gives no sandbox egress: {server.egress_unavailable}")
    h = OutsideHost()
    h.start()
    yield h
    h.stop()


def test_default_rollout_and_eval_have_no_egress(make_sandbox, debian, outside):
    for policy in ("default", "rollout", "eval"):
        sb = make_sandbox(debian, policy=policy)
        got = probe(sb, ADDR, 8080)
        assert got in ("EPERM", "ENETUNREACH"), (policy, got)
        # Not even a network device to try with: loopback only.
        assert sb.exec("ls /sys/class/net").stdout.split() == ["lo"], policy


def test_setup_reaches_only_its_allow_list(make_sandbox, debian, outside, server):
    sb = make_sandbox(debian, policy="setup")
    assert probe(sb, ADDR, 8080) == "ok " + GREETING.decode().strip()
    # The same host on a port, or under an address, the list does not name.
    assert probe(sb, ADDR, 8081) == "EPERM"
    assert probe(sb, OTHER_ADDR, 8080) == "EPERM"
    # The node itself: the sandbox's gateway, the host's other addresses.
    gw = gateway(sb)
    assert gw and gw.startswith("10.88."), gw
    for port in (22, 80, server.port):
        assert probe(sb, gw, port) == "EPERM", (gw, port)
    host_ip = subprocess.run(["ip", "-4", "route", "get", "1.1.1.1"], capture_output=True,
                             text=True).stdout.split("src ")[-1].split()[0] if subprocess.run(
        ["ip", "-4", "route", "get", "1.1.1.1"], capture_output=True).returncode == 0 else None
    if host_ip:
        assert probe(sb, host_ip, server.port) == "EPERM"
    # Its own loopback still works.
    r = sb.exec("python3 -c \"import socket; s=socket.socket(); s.bind(('127.0.0.1', 7000)); "
                "s.listen(); c=socket.create_connection(('127.0.0.1', 7000)); print('lo ok')\"")
    assert r.stdout == "lo ok\n", r
    audit = sb.audit()
    assert audit["egress_denied"] >= 5, audit
    assert audit["egress_last_denied"].endswith(":" + str(server.port)), audit
    text = server.raw("GET", "/v1/metrics")[2].decode()
    assert f'dsec_sandbox_egress_denied_total{{sandbox="{sb.id}"}} {audit["egress_denied"]}' in text


def test_sandboxes_never_reach_each_other(make_sandbox, debian, outside):
    a = make_sandbox(debian, policy="setup")
    b = make_sandbox(debian, policy="setup")
    b.exec("python3 -c \"import socket,time; s=socket.socket(); s.bind(('0.0.0.0', 9000)); "
           "s.listen(); time.sleep(60)\" >/dev/null 2>&1 & echo started")
    addr_b = own_address(b)
    assert addr_b.startswith("10.88.") and addr_b != own_address(a)
    assert probe(a, addr_b, 9000) == "EPERM"


def test_dns_only_through_the_policys_resolver(make_sandbox, debian, outside):
    sb = make_sandbox(debian, policy="setup")
    conf = sb.read_file("/etc/resolv.conf").decode()
    assert f"nameserver {ADDR}" in conf and conf.count("nameserver") == 1, conf
    # Names resolve through it (the test resolver answers every A query with ADDR)...
    r = sb.exec("getent ahostsv4 packages.example")
    assert r.exit_code == 0 and ADDR in r.stdout, r
    # ...and through nothing else: another resolver, asked directly, is refused.
    r = sb.exec(["python3", "-c", DNS_QUERY, ADDR])
    assert r.stdout.strip() == "answered", r
    r = sb.exec(["python3", "-c", DNS_QUERY, OTHER_ADDR])
    assert r.stdout.strip() == "EPERM", r
    r = sb.exec(["python3", "-c", DNS_QUERY, "8.8.8.8"])
    assert r.stdout.strip() == "EPERM", r


def test_setup_to_eval_cuts_a_running_process_at_its_next_connect(make_sandbox, debian, outside):
    sb = make_sandbox(debian, policy="setup")
    # A process that holds a connection open, echoes through it, and keeps
    # making new ones; each round's results go to /tmp/loop.out.
    loop = rf'''
import errno, socket, time
held = socket.create_connection(("{ADDR}", 8080), 3)
held.recv(100)
held.settimeout(1)
n = 0
while True:
    try:
        socket.create_connection(("{ADDR}", 8080), 3).close(); new = "ok"
    except OSError as e:
        new = errno.errorcode.get(e.errno, str(e))
    n += 1
    try:
        held.sendall(b"%d\n" % n); held_r = "ok" if held.recv(100) else "closed"
    except socket.timeout:
        held_r = "timeout"
    except OSError as e:
        held_r = errno.errorcode.get(e.errno, str(e))
    open("/tmp/loop.out", "w").write(new + " " + held_r + "\n")
    time.sleep(0.1)
'''
    sb.write_file("/tmp/loop.py", loop.encode())
    assert sb.exec("python3 /tmp/loop.py >/tmp/loop.err 2>&1 & echo bg").stdout == "bg\n"
    out = lambda: sb.exec("cat /tmp/loop.out").stdout
    assert wait_until(lambda: out() == "ok ok\n", 10), out()
    sb.set_phase("eval")
    assert [p["policy"] for p in sb.info["phases"]] == ["setup", "eval"]
    # New connects fail at once; the connection opened under setup carries
    # nothing more (its packets are dropped by the cgroup_skb program).
    assert wait_until(lambda: out() == "EPERM timeout\n", 8), \
        sb.exec("cat /tmp/loop.out /tmp/loop.err").stdout
    assert probe(sb, ADDR, 8080) == "EPERM"
    # And back: the sandbox keeps its path out, the filter opens it again.
    sb.set_phase("setup")
    assert wait_until(lambda: out().startswith("ok "), 5), out()


def test_user_policy_with_egress_and_a_host_name(client, make_sandbox, debian, outside):
    name = "egress-t-" + str(int(time.time() * 1000) % 100000)
    client.create_policy(name, description="mirror on 8081 only", egress=[f"{ADDR}:8081"])
    try:
        sb = make_sandbox(debian, policy=name)
        assert probe(sb, ADDR, 8081) == "ok " + GREETING.decode().strip()
        assert probe(sb, ADDR, 8080) == "EPERM"
        # In use: it cannot be deleted under the sandbox.
        expect_error(lambda: client.delete_policy(name), dsec.Conflict, field="name")
        sb.set_phase("rollout")
        assert probe(sb, ADDR, 8081) == "EPERM"
        sb.destroy()
    finally:
        client.delete_policy(name)
    expect_error(lambda: client.policy(name), dsec.NotFound)

    # Host names are resolved by the platform (here "localhost": loopback,
    # which a sandbox has anyway; what is checked is that it resolves).
    client.create_policy(name, egress=["localhost:80"])
    try:
        sb = make_sandbox(debian, policy=name)
        assert probe(sb, ADDR, 8080) == "EPERM"
    finally:
        sb.destroy()
        client.delete_policy(name)
    # A name that does not resolve fails the switch, naming the field.
    client.create_policy(name, egress=["no-such-host.invalid:80"])
    try:
        sb = make_sandbox(debian)
        expect_error(lambda: sb.set_phase(name), dsec.Conflict, field="egress")
        assert sb.refresh().info["policy"] == "default"
        expect_error(lambda: make_sandbox(debian, policy=name), dsec.Conflict, field="egress")
    finally:
        client.delete_policy(name)


def test_bad_policies_get_clear_errors(client):
    before = {p["name"] for p in client.policies()}
    for body, field in (
            (dict(name="x1", egress=["10.0.0.0/33"]), "egress"),
            (dict(name="x1", egress=["10.0.0.1:0"]), "egress"),
            (dict(name="x1", egress=["[::1"]), "egress"),
            (dict(name="x1", dns=["resolver.example"]), "dns"),
            (dict(name="x1", dns=["1.1.1.1", "1.0.0.1", "8.8.8.8", "8.8.4.4"]), "dns"),
            (dict(name="Bad Name"), "name"),
            (dict(name="x1", hidden_paths=["/proc/1"]), "hidden_paths")):
        expect_error(lambda: client.create_policy(**body), dsec.InvalidArgument, field=field,
                     status=400)
    expect_error(lambda: client.create_policy("eval"), dsec.Conflict, field="name", status=409)
    expect_error(lambda: client.delete_policy("default"), dsec.Conflict, field="name", status=409)
    expect_error(lambda: client.delete_policy("nope"), dsec.NotFound, status=404)
    assert {p["name"] for p in client.policies()} == before


def test_egress_leaves_nothing_behind(client, debian, outside, server):
    sb = client.create(debian, policy="setup")
    links = lambda: subprocess.run(["ip", "-o", "link", "show"], capture_output=True,
                                   text=True).stdout
    assert probe(sb, ADDR, 8080).startswith("ok")
    mine = [l for l in links().splitlines() if f"dsec {server.egress_tag} {sb.id}" in l]
    assert len(mine) == 1, links()
    sb.destroy()
    assert wait_until(lambda: f"dsec {server.egress_tag} {sb.id}" not in links(), 5), links()


def test_egress_is_kept_across_an_edge_crash(tmp_path_factory, outside, server):
    """A `dsec up` killed with SIGKILL leaves its sandboxes their egress (the
    filter's programs and the veths outlive it); the next start re-adopts them
    with their rules, a phase switch after that is recorded, and a second
    crash keeps it."""
    import os
    import signal
    from pathlib import Path

    from conftest import Server
    srv = Server(tmp_path_factory.mktemp("egress-crash") / "data",
                 ["--setup-egress", f"{ADDR}:8080", "--setup-dns", ADDR])
    srv.data_dir.mkdir()
    srv.start()

    def crash_and_restart():
        os.kill(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait(10)
        srv._log.close()
        (srv.data_dir / "up.json").unlink()
        srv.start()

    links = lambda: subprocess.run(["ip", "-o", "link", "show"], capture_output=True,
                                   text=True).stdout
    try:
        srv.import_image("debian:latest", Path(os.environ.get(
            "DSEC_IMAGE_CACHE", "/var/cache/dsec/test-images")) / "debian.tar")
        setup = srv.client.create("debian:latest", policy="setup")
        closed = srv.client.create("debian:latest")
        assert probe(setup, ADDR, 8080).startswith("ok")
        crash_and_restart()
        setup, closed = srv.client.get(setup.id), srv.client.get(closed.id)
        assert probe(setup, ADDR, 8080).startswith("ok")
        assert probe(setup, OTHER_ADDR, 8080) == "EPERM"
        assert probe(closed, ADDR, 8080) in ("ENETUNREACH", "EPERM")
        assert len([l for l in links().splitlines() if f"dsec {srv.egress_tag} " in l]) == 1
        # a phase switch after the restart sticks across the next crash
        setup.set_phase("rollout")
        assert probe(setup, ADDR, 8080) == "EPERM"
        crash_and_restart()
        setup = srv.client.get(setup.id)
        assert probe(setup, ADDR, 8080) == "EPERM"
        setup.set_phase("setup")
        assert probe(setup, ADDR, 8080).startswith("ok")
        assert srv.stop() == 0
        assert wait_until(lambda: f"dsec {srv.egress_tag} " not in links(), 10), links()
        tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
        assert f"dsec_{srv.egress_tag}" not in tables
    finally:
        if srv.proc.poll() is None:
            srv.stop()

def test_egress_leftovers_go_when_no_restarted_sandbox_needs_them(tmp_path_factory, server):
    """An edge killed with egress set up (nftables table, a veth), whose
    sandboxes do not survive it: the next start removes the table and the
    links at once. It used to keep them (it starts the path only for a
    sandbox that needs it), and no later stop removed them: one table was
    left on the host per such run."""
    import os
    import signal
    from pathlib import Path

    from conftest import Server
    from helpers import aether_pids, edge_cgroup
    srv = Server(tmp_path_factory.mktemp("egress-left") / "data",
                 ["--setup-egress", f"{ADDR}:8080"])
    srv.data_dir.mkdir()
    srv.start()
    tables = lambda: subprocess.run(["nft", "list", "tables"], capture_output=True,
                                    text=True).stdout
    links = lambda: [line for line in subprocess.run(
        ["ip", "-o", "link", "show"], capture_output=True, text=True).stdout.splitlines()
        if f"dsec {srv.egress_tag} " in line]
    try:
        srv.import_image("busybox:latest", Path(os.environ.get(
            "DSEC_IMAGE_CACHE", "/var/cache/dsec/test-images")) / "busybox.tar")
        sb = srv.client.create("busybox:latest", policy="setup")
        assert f"dsec_{srv.egress_tag}" in tables() and len(links()) == 1, (tables(), links())
        agents = aether_pids(edge_cgroup(srv.data_dir))
        os.kill(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait(10)
        for pid in agents:  # the sandbox dies with the node
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        srv._log.close()
        (srv.data_dir / "up.json").unlink()
        srv.start()
        assert srv.client.get(sb.id).state in ("lost", "failed", "stopped")
        assert f"dsec_{srv.egress_tag}" not in tables(), tables()
        assert wait_until(lambda: not links(), 10), links()
        assert srv.stop() == 0
        assert f"dsec_{srv.egress_tag}" not in tables(), tables()
    finally:
        if srv.proc.poll() is None:
            srv.stop()


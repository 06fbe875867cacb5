"""A host "outside" the node for egress tests: its own network namespace,
joined to the host by a veth (10.89.0.1 on the host, 10.89.0.2 and 10.89.0.3
inside), running a few servers (TCP 8080 and 8081 that greet and then echo, a
DNS responder on UDP 53 that answers every A query with 10.89.0.2).

Sandboxes reach it only through the edge's egress path (veth, masquerade,
forwarding) and only where their policy's allow-list says so. The addresses
are fixed so that `dsec up --setup-egress` can name them before it exists.
"""

from __future__ import annotations

import subprocess
import sys
import time

NETNS = "dsec-t-out"
HOST_IF = "dsec-t-o0"
HOST_ADDR = "10.89.0.1"
ADDR = "10.89.0.2"        # the allowed mirror and resolver
OTHER_ADDR = "10.89.0.3"  # the same host under an address no policy allows
GREETING = b"hello from outside\n"

SERVER = r'''
import socket, struct, threading

def tcp(port):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port)); s.listen(64)
    while True:
        c, _ = s.accept()
        threading.Thread(target=echo, args=(c,), daemon=True).start()

def echo(c):
    try:
        c.sendall(b"hello from outside\n")
        while True:
            d = c.recv(4096)
            if not d: break
            c.sendall(d)
    except OSError:
        pass
    c.close()

def dns():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("0.0.0.0", 53))
    while True:
        q, peer = s.recvfrom(512)
        if len(q) < 12: continue
        # Header: same id, response + recursion available, one question, one answer.
        qd = q[12:]
        end = qd.index(b"\0") + 5
        question = qd[:end]
        qtype = struct.unpack("!H", question[-4:-2])[0]
        answers = 1 if qtype == 1 else 0
        hdr = q[:2] + struct.pack("!HHHHH", 0x8180, 1, answers, 0, 0)
        ans = b""
        if answers:
            ans = b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 60, 4) + socket.inet_aton("10.89.0.2")
        s.sendto(hdr + question + ans, peer)

for p in (8080, 8081):
    threading.Thread(target=tcp, args=(p,), daemon=True).start()
threading.Thread(target=dns, daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
'''


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


class OutsideHost:
    def __init__(self):
        self.proc = None

    def start(self):
        self.stop()  # a crashed earlier run's leftovers
        _ip("netns", "add", NETNS)
        _ip("link", "add", HOST_IF, "type", "veth", "peer", "name", "eth0", "netns", NETNS)
        _ip("addr", "add", HOST_ADDR + "/24", "dev", HOST_IF)
        _ip("link", "set", HOST_IF, "up")
        for a in (ADDR, OTHER_ADDR):
            _ip("-n", NETNS, "addr", "add", a + "/24", "dev", "eth0")
        _ip("-n", NETNS, "link", "set", "eth0", "up")
        _ip("-n", NETNS, "link", "set", "lo", "up")
        _ip("-n", NETNS, "route", "add", "default", "via", HOST_ADDR)
        self.proc = subprocess.Popen(["ip", "netns", "exec", NETNS, sys.executable, "-c", SERVER],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        line = self.proc.stdout.readline()
        if line.strip() != b"ready":
            raise RuntimeError(f"outside host servers did not start: {line!r}")

    def stop(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
        # Deleting the netns takes its end of the veth, and with it ours.
        _ip("netns", "del", NETNS, check=False)
        _ip("link", "del", HOST_IF, check=False)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and _ip("link", "show", HOST_IF, check=False).returncode == 0:
            time.sleep(0.05)

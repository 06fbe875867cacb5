"""What `make demo` shows: real sandboxes driven through the Python SDK."""
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import dsec


def main(data_dir: str) -> None:
    client = dsec.Client.from_data_dir(data_dir)

    print("== a Debian sandbox")
    t0 = time.perf_counter()
    with client.create(image="debian", memory_mb=256, labels={"demo": "yes"}) as sb:
        print(f"   created {sb.id} in {(time.perf_counter() - t0) * 1e3:.1f} ms")
        for cmd in [
            "hostname",
            "head -2 /etc/os-release",
            "python3 -c 'import sys, platform; print(\"python\", sys.version.split()[0], platform.machine())'",
            "echo PID 1 is $(cat /proc/1/comm); ls /proc | grep -c '^[0-9]' | sed 's/^/processes visible: /'",
            "ls /sys/class/net | tr '\\n' ' '; echo '(network interfaces)'",
            "id",
        ]:
            r = sb.exec(cmd, timeout=30)
            out = (r.stdout + r.stderr).strip().replace("\n", "\n     ")
            print(f"   $ {cmd}\n     {out}   [exit {r.exit_code}, {r.duration_ms:.1f} ms]")
        sb.write_file("/root/notes.txt", "written through the SDK\n")
        print("   read back:", sb.read_file("/root/notes.txt").decode().strip())
        print("   /root holds:", [e["name"] for e in sb.list_dir("/root")])
        r = sb.exec("yes", timeout=2, max_output_bytes=1000)
        print(f"   `yes` for 2 s: {len(r.stdout)} bytes kept, truncated={r.truncated}, "
              f"timed_out={r.timed_out}")
        r = sb.exec(["python3", "-c", "x = bytearray(400 * 2**20)"], timeout=30)
        print(f"   400 MB allocation under a 256 MB limit: exit={r.exit_code} "
              f"signal={r.signal} oom_killed={r.oom_killed}")

    n = 20
    print(f"== {n} busybox sandboxes at once")
    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        boxes = list(pool.map(lambda i: client.create(image="busybox", labels={"demo": "burst"}),
                              range(n)))
    t1 = time.perf_counter()
    outs = list(ThreadPoolExecutor(8).map(lambda b: b.exec("echo $(hostname)").stdout.strip(),
                                          boxes))
    print(f"   created {n} in {(t1 - t0) * 1e3:.0f} ms; each sees its own hostname: "
          f"{len(set(outs)) == n}")
    print("   listed by label:", len(client.list(labels={"demo": "burst"})))
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda b: b.destroy(), boxes))
    print("   destroyed all; running now:", len(client.list(state="running")))


if __name__ == "__main__":
    main(sys.argv[1])

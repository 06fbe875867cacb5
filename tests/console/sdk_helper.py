"""SDK actions for the console's browser test (console.test.mjs calls it with
execFileSync while the browser is open; tests/test_console.py prepares the rest).

    python3 sdk_helper.py COMMAND JSON-ARGS

The platform and the key come from the environment: DSEC_URL and DSEC_KEY
(a tenant's key). Prints one JSON document on stdout. Commands:

  create      {image, labels}              -> {id}
  trajectory  {image, trajectory_id}       -> {trajectory_id, sandbox, steps, checkpoint_step,
                                               replays: {step: n}}
              a few exec steps, a checkpoint, more steps; the first steps asked
              again (replayed from the log, as a restarted trainer's are); then
              the sandbox is destroyed behind the trajectory's back
  serve       {id, ports, expose, script}  -> {url, path_url, port}
              writes SCRIPT (tests/port_server.py) to /tmp/port_server.py in the
              sandbox, starts it on each of PORTS, waits until they listen,
              exposes EXPOSE (the others are left for the console to expose)
  destroy     {id}                         -> {}
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import dsec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/
from listening import wait_listening  # noqa: E402


def client() -> dsec.Client:
    return dsec.Client(url=os.environ["DSEC_URL"], token=os.environ["DSEC_KEY"], timeout=60)


def create(c: dsec.Client, a: dict) -> dict:
    sb = c.create(a["image"], labels=a.get("labels") or None)
    return {"id": sb.id}


def trajectory(c: dsec.Client, a: dict) -> dict:
    sb = c.create(a["image"], labels={"console-test": "trajectory"})
    tid = a["trajectory_id"]
    t = sb.trajectory(tid)
    t.exec("mkdir -p /root/w && echo start >> /root/w/log")      # 0
    t.exec("echo one >> /root/w/log")                           # 1
    t.write_file("/root/w/data.txt", b"written before the checkpoint\n")  # 2
    # A user tenant's images are named "<tenant>/...": the SDK's default
    # checkpoint name (chronus/<id>) is refused for one (400, field name).
    tenant = c.whoami()["tenant"]
    ckpt = t.checkpoint(name=f"{tenant}/chronus-{tid}")          # 3
    t.exec("echo two >> /root/w/log")                           # 4
    t.exec("cat /root/w/log")                                   # 5
    steps = t.next_step
    # A trainer restarted from step 0: its first steps come back from the log.
    replays = {}
    for _ in range(2):
        again = sb.trajectory(tid)
        r0 = again.exec("mkdir -p /root/w && echo start >> /root/w/log")
        r1 = again.exec("echo one >> /root/w/log")
        assert r0.replayed and r1.replayed, (r0, r1)
        replays["0"] = replays.get("0", 0) + 1
        replays["1"] = replays.get("1", 0) + 1
    log = sb.exec("cat /root/w/log").stdout
    assert log == "start\none\ntwo\n", log  # nothing ran twice
    sb.destroy()  # lost behind the trajectory's back: recover rebuilds it
    return {"trajectory_id": tid, "sandbox": sb.id, "steps": steps, "checkpoint_step": 3,
            "checkpoint_image": ckpt.ref,
            "replays": replays}


def serve(c: dsec.Client, a: dict) -> dict:
    sb = c.get(a["id"])
    sb.write_file("/tmp/port_server.py", Path(a["script"]).read_bytes())
    for port in a["ports"]:
        sb.start_process(["python3", "/tmp/port_server.py", str(port)])
    for port in a["ports"]:
        wait_listening(sb, port)
    e = sb.expose(int(a["expose"]))
    return {"url": e.url, "path_url": e.path_url, "port": e.port}


def destroy(c: dsec.Client, a: dict) -> dict:
    try:
        c.destroy(a["id"])
    except dsec.NotFound:
        pass
    return {}


COMMANDS = {"create": create, "trajectory": trajectory, "serve": serve, "destroy": destroy}


def main() -> None:
    cmd = sys.argv[1]
    args = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    c = client()
    try:
        out = COMMANDS[cmd](c, args)
    finally:
        c.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()

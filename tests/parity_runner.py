"""Runs CPython regression test modules and records every test case's outcome.

Used by test_workload_parity.py, which copies this file into the debian-pytest
root filesystem and runs it with that root's python3 (3.11), once in a dsec
sandbox and once in a plain chroot on the host:

    python3 parity_runner.py --out DIR --jobs N --timeout S [--matchfile F]
                             [--ignore PATTERN]... [--use RESOURCES] MODULE...

Each module runs in a process of its own (`-m test`-style, through
test.libregrtest in that process, N at a time) with the unittest result class
patched to append one JSON line per outcome to DIR/<module>.jsonl as it
happens, so a module that hangs or crashes keeps what it reported before. At
the end DIR/summary.json holds, per module, its verdict (passed, skipped as a
whole, failed, env_changed, no_tests, timeout or "crashed rc=N"), exit status,
seconds, the tail of its output and the outcomes, each with its traceback or
skip reason:

    {"modules": {"test_os": {"status": "failed", "rc": 2, "seconds": 12.3,
                             "output_tail": "...",
                             "cases": {"test.test_os.FileTests.test_access":
                                       ["passed", ""], ...}}, ...}}

An outcome is passed, failed, error, skipped, xfail or xpass; a test whose
subtests differ gets the worst of them (error > failed > xpass > xfail >
passed > skipped). Errors raised outside a test (setUpClass, setUpModule)
count under `<module>.<Class>.setUpClass` and the like. Needs only the
standard library and test.support; written for python 3.11.
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

RANK = {"error": 5, "failed": 4, "xpass": 3, "xfail": 2, "passed": 1, "skipped": 0}
DETAIL_CHARS = 4000


def _child(out_jsonl, regrtest_args):
    """In the module's own process: patch the result class, run regrtest."""
    import traceback
    import unittest
    from test.support import testresult

    sink = open(out_jsonl, "a", buffering=1)

    def case_id(test):
        # An error outside a test comes as an _ErrorHolder described
        # "setUpClass (test.test_x.Cls)"; a subtest as the case it belongs to.
        case = getattr(test, "test_case", test)
        desc = case.id() if hasattr(case, "id") else str(case)
        m = re.fullmatch(r"(\w+) \(([\w.]+)\)", desc)
        if m:
            return f"{m.group(2)}.{m.group(1)}"
        return desc.split(" ", 1)[0]

    def record(test, outcome, detail=""):
        sub = ""
        if getattr(test, "test_case", None) is not None and hasattr(test, "_subDescription"):
            sub = test._subDescription() + "\n"
        sink.write(json.dumps({"id": case_id(test), "outcome": outcome,
                               "detail": (sub + detail)[-DETAIL_CHARS:]}) + "\n")

    def fmt(err):
        return "".join(traceback.format_exception(*err))

    cls = testresult.RegressionTestResult
    orig = {n: getattr(cls, n) for n in ("addSuccess", "addFailure", "addError", "addSkip",
                                          "addExpectedFailure", "addUnexpectedSuccess",
                                          "addSubTest")}

    def add_success(self, test):
        record(test, "passed")
        orig["addSuccess"](self, test)

    def add_failure(self, test, err):
        record(test, "failed", fmt(err))
        orig["addFailure"](self, test, err)

    def add_error(self, test, err):
        record(test, "error", fmt(err))
        orig["addError"](self, test, err)

    def add_skip(self, test, reason):
        record(test, "skipped", str(reason))
        orig["addSkip"](self, test, reason)

    def add_xfail(self, test, err):
        record(test, "xfail", fmt(err))
        orig["addExpectedFailure"](self, test, err)

    def add_xpass(self, test):
        record(test, "xpass")
        orig["addUnexpectedSuccess"](self, test)

    def add_subtest(self, test, subtest, err):
        if err is not None:
            kind = "failed" if issubclass(err[0], test.failureException) else "error"
            record(subtest, kind, fmt(err))
        orig["addSubTest"](self, test, subtest, err)

    cls.addSuccess, cls.addFailure, cls.addError = add_success, add_failure, add_error
    cls.addSkip, cls.addExpectedFailure = add_skip, add_xfail
    cls.addUnexpectedSuccess, cls.addSubTest = add_xpass, add_subtest
    del unittest  # only imported so that the result classes exist

    from test.libregrtest.main import main
    sys.argv = ["python3 -m test", *regrtest_args]
    main()


def _verdict(rc, output):
    """passed, skipped (the module as a whole), failed, env_changed, ..."""
    if rc == 0:
        if re.search(r"^1 test skipped", output, re.M) and not re.search(r"^1 test OK", output,
                                                                         re.M):
            return "skipped"
        return "passed"
    return {2: "failed", 3: "env_changed", 4: "no_tests"}.get(rc, f"crashed rc={rc}")


def _parent(args):
    os.makedirs(args.out, exist_ok=True)
    pending = list(args.modules)
    running = {}  # module -> (Popen, start, log file)
    results = {}
    me = os.path.abspath(__file__)
    while pending or running:
        while pending and len(running) < args.jobs:
            mod = pending.pop(0)
            jsonl = os.path.join(args.out, f"{mod}.jsonl")
            if os.path.exists(jsonl):
                os.unlink(jsonl)
            log = open(os.path.join(args.out, f"{mod}.log"), "w+")
            cmd = [sys.executable, "-X", "faulthandler", me, "--child", jsonl, "--",
                   "--timeout", str(args.timeout), "--fail-env-changed"]
            if args.matchfile:
                cmd += ["--matchfile", args.matchfile]
            for pattern in args.ignore:
                cmd += ["--ignore", pattern]
            if args.use:
                cmd += ["-u", args.use]
            cmd.append(mod)
            # A process group of its own, in the runner's session: under a
            # controlling terminal (`script`), tests of /dev/tty see it.
            p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                 stderr=subprocess.STDOUT, process_group=0)
            running[mod] = (p, time.monotonic(), log)
            print(f"parity_runner: {mod} started", flush=True)
        time.sleep(0.2)
        for mod, (p, start, log) in list(running.items()):
            took = time.monotonic() - start
            rc = p.poll()
            killed = False
            if rc is None and took > args.timeout + 60:
                # regrtest's own --timeout failed to end it: the whole group goes.
                os.killpg(p.pid, signal.SIGKILL)
                rc = p.wait()
                killed = True
            if rc is None:
                continue
            try:  # what it left behind in its process group
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            del running[mod]
            log.seek(0)
            output = log.read()
            log.close()
            cases = {}
            jsonl = os.path.join(args.out, f"{mod}.jsonl")
            if os.path.exists(jsonl):
                with open(jsonl) as f:
                    for line in f:
                        try:
                            r = json.loads(line)
                        except ValueError:
                            continue  # a line cut short by a crash
                        old = cases.get(r["id"])
                        if old is None or RANK[r["outcome"]] > RANK[old[0]]:
                            cases[r["id"]] = [r["outcome"], r["detail"]]
            status = "timeout" if killed or "Timeout (" in output else _verdict(rc, output)
            results[mod] = {"status": status, "rc": rc, "seconds": round(took, 1),
                            "cases": cases, "output_tail": output[-3000:]}
            print(f"parity_runner: {mod} {status} in {took:.1f} s, {len(cases)} cases",
                  flush=True)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"modules": results}, f)


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        jsonl, sep, *rest = sys.argv[2:]
        assert sep == "--"
        _child(jsonl, rest)
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--matchfile")
    ap.add_argument("--ignore", action="append", default=[])
    ap.add_argument("--use", help="regrtest -u: resources to enable")
    ap.add_argument("modules", nargs="+")
    _parent(ap.parse_args())


if __name__ == "__main__":
    main()

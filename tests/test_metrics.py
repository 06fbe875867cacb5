"""GET /v1/metrics (and /metrics) is one Prometheus exposition: every family
announced once, whoever in the platform writes to it, and valid for a scraper
(`promtool check metrics`)."""

import re
import shutil
import subprocess
import uuid

import pytest

from conftest import unavailable

TYPE_RE = re.compile(r"^# TYPE (\S+) (counter|gauge|histogram|summary|untyped)$")
SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})? (\S+)$")


def scrape(server, path="/v1/metrics") -> str:
    status, headers, body, _ = server.raw("GET", path)
    assert status == 200, body
    assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
    return body.decode()


def families(text: str) -> dict:
    """{family: (type, [sample lines])}, checking the exposition's shape on the
    way: each family has one HELP and one TYPE, its samples follow them, and
    no series appears twice."""
    out, current, helps, series = {}, None, set(), set()
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name = line.split(" ", 3)[2]
            assert name not in helps, f"second HELP for {name}"
            helps.add(name)
            continue
        m = TYPE_RE.match(line)
        if m:
            assert m.group(1) not in out, f"family {m.group(1)} announced twice"
            assert m.group(1) in helps, f"TYPE of {m.group(1)} without its HELP before"
            current = m.group(1)
            out[current] = (m.group(2), [])
            continue
        assert line and not line.startswith("#"), f"unexpected line {line!r}"
        m = SAMPLE_RE.match(line)
        assert m, f"not a sample: {line!r}"
        name = m.group(1)
        kind = out[current][0] if current else None
        suffixes = ("_bucket", "_sum", "_count") if kind == "histogram" else ()
        assert current and (name == current or any(name == current + s for s in suffixes)), \
            f"sample {line!r} outside its family (under {current})"
        key = (name, m.group(2) or "")
        assert key not in series, f"series {key} twice"
        series.add(key)
        out[current][1].append(line)
    assert helps == set(out), helps ^ set(out)
    return out


def value(text: str, series: str) -> float:
    m = re.search(r"^" + re.escape(series) + r" (\S+)$", text, re.M)
    assert m, f"{series} not in metrics"
    return float(m.group(1))


@pytest.fixture(scope="module")
def scraped(server, busybox, module_sandboxes):
    """(before, after): the exposition before and after API errors of two
    codes (3 not_found, 2 invalid_argument) and a sandbox created."""
    before = scrape(server)
    for _ in range(3):
        st, _, _, doc = server.raw("GET", f"/v1/sandboxes/sb-{uuid.uuid4().hex[:16]}")
        assert st == 404 and doc["error"]["code"] == "not_found", doc
    for _ in range(2):
        st, _, _, doc = server.raw("POST", "/v1/sandboxes", body={"image": 42})
        assert st == 400 and doc["error"]["code"] == "invalid_argument", doc
    module_sandboxes(busybox)
    return before, scrape(server)


def test_each_family_is_announced_once_with_its_samples(scraped, server):
    before, text = scraped
    fams = families(text)
    # Each error counted once (nothing else calls the API in between).
    for code, n in [("not_found", 3), ("invalid_argument", 2)]:
        series = f'dsec_api_errors_total{{code="{code}"}}'
        assert value(text, series) == value(before, series) + n, code
    # Every code listed, once: the family used to come twice (the cluster's
    # counter and the platform's second one each wrote it).
    assert fams["dsec_api_errors_total"][0] == "counter"
    codes = [re.search(r'code="([^"]+)"', l).group(1) for l in fams["dsec_api_errors_total"][1]]
    assert len(codes) == len(set(codes)) and {"rate_limited", "internal"} <= set(codes), codes
    assert value(text, 'dsec_sandboxes{state="running"}') >= 1
    assert value(text, "dsec_sandbox_creations_total") >= 1
    assert value(text, 'dsec_schedule_latency_seconds_bucket{le="+Inf"}') >= 1
    # A family of each part: cluster, records, in-process node, run pool.
    for name, kind in [("dsec_node_up", "gauge"), ("dsec_schedule_latency_seconds", "histogram"),
                       ("dsec_sandboxes", "gauge"), ("dsec_node_cache_bytes", "gauge"),
                       ("dsec_layer_bytes_fetched_total", "counter"),
                       ("dsec_sandbox_egress_denied_total", "counter"),
                       ("dsec_orphans_removed_total", "counter"),
                       ("dsec_fncall_calls_total", "counter")]:
        assert fams.get(name, (None,))[0] == kind, (name, fams.get(name))
    # /metrics is the same exposition.
    assert set(families(scrape(server, "/metrics"))) == set(fams)


def test_promtool_accepts_the_exposition(scraped):
    promtool = shutil.which("promtool")
    if not promtool:
        unavailable("promtool not installed (Debian package prometheus; scripts/install-deps.sh)")
    for text in scraped:
        r = subprocess.run([promtool, "check", "metrics"], input=text.encode(),
                           capture_output=True, timeout=60)
        assert r.returncode == 0, (r.stdout + r.stderr).decode()

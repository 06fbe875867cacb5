"""`dsec image build` / POST /v1/images/build: images built from Dockerfiles on
the real server. RUN runs in sandboxes of the image so far, COPY/ADD layers are
made from the uploaded context, steps come from the build cache when their
inputs did not change, and the result is checked through a sandbox of it."""

from __future__ import annotations

import io
import json
import os
import tarfile
import time
from pathlib import Path

import pytest

import dsec
from helpers import expect_error, unique
from oci_build import OciLayout, file
from oci_registry import Registry
from outside_host import ADDR, GREETING, OutsideHost

CACHE = Path(os.environ.get("DSEC_IMAGE_CACHE", "/var/cache/dsec/test-images"))


def write_tree(root: Path, files: dict) -> Path:
    """Writes {relative path: text or bytes} under root; returns root."""
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data if isinstance(data, bytes) else data.encode())
    return root


def build(client, ctx, tag, **kw):
    """build_image collecting its events; returns (image, events)."""
    events = []
    img = client.build_image(str(ctx) if ctx is not None else None, tag=tag,
                             progress=events.append, **kw)
    return img, events


def steps(events, keyword=None):
    """The step events (of RUN/COPY/ADD when keyword is None: those with `cached`)."""
    out = [e for e in events if e["type"] == "step"]
    if keyword is None:
        return [e for e in out if "cached" in e]
    return [e for e in out if e["instruction"].split()[0].upper() == keyword]


def run_in(client, ref, cmd, **kw):
    sb = client.create(image=ref, **kw)
    try:
        r = sb.exec(cmd, timeout=60)
        assert r.exit_code == 0, (r.stdout, r.stderr)
        return r.stdout
    finally:
        sb.destroy()


def build_sandboxes_left(client):
    return [s for s in client.list() if "dsec.build" in s.labels and s.state not in
            ("stopped", "failed")]


# ----- one stage: ENV, WORKDIR, USER, RUN, COPY -------------------------------------

def test_a_build_gives_an_image_whose_sandboxes_see_files_env_and_user(client, busybox, tmp_path):
    salt = unique("salt")
    ctx = write_tree(tmp_path / "ctx", {
        "Dockerfile": f"""
FROM {busybox}
ARG WHO=world
ENV GREETING=hello APP_HOME=/app
WORKDIR /app
COPY hello.txt ./
COPY --chown=1234:2345 --chmod=0640 owned.txt /app/owned.txt
COPY sub/ /app/sub/
RUN echo "$GREETING $WHO from run" > run.txt && echo {salt} > salt.txt && pwd > pwd.txt
USER 1234
LABEL org.example.title="built by dsec"
ENTRYPOINT ["/bin/sh", "-c"]
CMD ["echo hi"]
""",
        "hello.txt": "hello file\n",
        "owned.txt": "mine\n",
        "sub/a/b.txt": "deep\n",
    })
    ref = unique("built") + ":1"
    img, events = build(client, ctx, ref, build_args={"WHO": "dsec"})
    assert img.ref == ref and img.kind == "base"
    base = client.image(busybox)
    assert img.layers[:len(base.layers)] == base.layers
    assert len(img.layers) == len(base.layers) + 4  # 3 COPY + 1 RUN
    cfg = img.config
    assert cfg["user"] == "1234"
    assert cfg["working_dir"] == "/app"
    assert "GREETING=hello" in cfg["env"] and "APP_HOME=/app" in cfg["env"]
    assert not any(e.startswith("WHO=") for e in cfg["env"])  # ARG is build-time only
    assert cfg["labels"] == {"org.example.title": "built by dsec"}
    assert cfg["entrypoint"] == ["/bin/sh", "-c"] and cfg["cmd"] == ["echo hi"]
    # Every RUN/COPY step ran (a new salt: nothing cached) and made a layer.
    assert [s["cached"] for s in steps(events)] == [False] * 4
    assert len([e for e in events if e["type"] == "layer"]) == 4
    assert all(e["line"] > 0 for e in events if e["type"] == "step")
    out = run_in(client, ref, ["sh", "-c", "cat hello.txt run.txt salt.txt pwd.txt sub/a/b.txt; "
                                           "id -u; echo $GREETING; pwd; "
                                           "stat -c '%u:%g %a' owned.txt"])
    assert out.split("\n") == ["hello file", "hello dsec from run", salt, "/app", "deep", "1234",
                               "hello", "/app", "1234:2345 640", ""]
    assert not build_sandboxes_left(client)


def test_building_again_is_all_cache_hits(client, busybox, tmp_path):
    salt = unique("salt")
    ctx = write_tree(tmp_path / "ctx", {
        "Dockerfile": f"FROM {busybox}\nCOPY a.txt /a.txt\nRUN cat /a.txt > /b.txt\n"
                      f"COPY . /ctx/\nRUN ls /ctx > /ls.txt\n",
        "a.txt": salt,
    })
    ref = unique("again") + ":1"
    first, ev1 = build(client, ctx, ref)
    assert [s["cached"] for s in steps(ev1)] == [False] * 4
    t0 = time.monotonic()
    second, ev2 = build(client, ctx, ref)
    took = time.monotonic() - t0
    assert [s["cached"] for s in steps(ev2)] == [True] * 4
    assert not [e for e in ev2 if e["type"] == "output"]  # nothing ran
    assert second.layers == first.layers
    assert took < 30, took
    # --no-cache runs every step again (new layers for the RUNs).
    third, ev3 = build(client, ctx, ref, no_cache=True)
    assert [s["cached"] for s in steps(ev3)] == [False] * 4
    assert run_in(client, ref, ["cat", "/b.txt"]) == salt


def test_a_copied_file_another_layer_holds_is_stored_once(client, server, busybox, tmp_path):
    """COPY goes through the streaming converter with the chunk table: the
    same 2 MiB copied by a second build (to another path, so another layer)
    points into the first build's data blob instead of storing it again."""
    import hashlib
    payload = os.urandom(2 << 20)
    ctx1 = write_tree(tmp_path / "c1", {"Dockerfile": f"FROM {busybox}\nCOPY p.bin /one/p.bin\n",
                                        "p.bin": payload})
    ctx2 = write_tree(tmp_path / "c2", {"Dockerfile": f"FROM {busybox}\nCOPY p.bin /two/again.bin\n",
                                        "p.bin": payload})
    first, _ = build(client, ctx1, unique("dd1") + ":1")
    second, _ = build(client, ctx2, unique("dd2") + ":1")
    st, _, _, l1 = server.raw("GET", f"/v1/layers/{first.layers[-1]}")
    st2, _, _, l2 = server.raw("GET", f"/v1/layers/{second.layers[-1]}")
    assert st == 200 and st2 == 200, (l1, l2)
    assert [x["digest"] for x in l2["extra_data"]] == [l1["data"]["digest"]], l2
    assert l2["data"]["size"] < 64 << 10, l2
    out = run_in(client, second.raw["ref"], ["sha256sum", "/two/again.bin"])
    assert out.split()[0] == hashlib.sha256(payload).hexdigest()
    for img in (first, second):
        client.delete_image(img.raw["ref"])


def test_editing_one_copied_file_rebuilds_that_step_and_the_later_ones(client, busybox, tmp_path):
    salt = unique("salt")
    ctx = write_tree(tmp_path / "ctx", {
        "Dockerfile": f"FROM {busybox}\n"
                      "COPY a.txt /a.txt\n"
                      "RUN cat /a.txt > /a.copy\n"
                      "COPY b.txt /b.txt\n"
                      "RUN cat /a.txt /b.txt > /ab.copy\n",
        "a.txt": f"a {salt}\n",
        "b.txt": "b one\n",
    })
    ref = unique("edit") + ":1"
    first, _ = build(client, ctx, ref)
    (ctx / "b.txt").write_text("b two\n")
    second, ev = build(client, ctx, ref)
    assert [(s["line"], s["cached"]) for s in steps(ev)] == [
        (2, True), (3, True), (4, False), (5, False)]
    n = len(first.layers)
    assert second.layers[:n - 2] == first.layers[:n - 2]  # base, COPY a, RUN a: the same
    assert second.layers[n - 2:] != first.layers[n - 2:]
    assert run_in(client, ref, ["cat", "/ab.copy"]) == f"a {salt}\nb two\n"
    # Back to the first content: the old layers are found again.
    (ctx / "b.txt").write_text("b one\n")
    third, ev3 = build(client, ctx, ref)
    assert [s["cached"] for s in steps(ev3)] == [True] * 4
    assert third.layers == first.layers


def test_copy_goes_through_the_images_symlinks_and_looks_up_owner_names(client, debian,
                                                                       tmp_path):
    ctx = write_tree(tmp_path / "ctx", {
        "Dockerfile": f"FROM {debian}\n"
                      "COPY --chown=nobody:nogroup tool /bin/tool\n"      # /bin -> usr/bin
                      "COPY --chown=daemon conf/ /etc/app/\n"
                      "WORKDIR /srv/app\n"
                      "COPY tool rel/\n",
        "tool": unique("tool"),
        "conf/a.conf": "a\n",
    })
    ref = unique("deb") + ":1"
    build(client, ctx, ref)
    out = run_in(client, ref, ["sh", "-c",
                               "readlink /bin; stat -c '%U:%G' /usr/bin/tool; "
                               "stat -c '%U:%G' /etc/app /etc/app/a.conf; stat -c '%a %U' /etc; "
                               "cat /srv/app/rel/tool; echo; ls /usr/bin | wc -l"])
    lines = out.split("\n")
    assert lines[0] == "usr/bin"            # still a symlink
    assert lines[1] == "nobody:nogroup"
    assert lines[2] == "daemon:daemon" and lines[3] == "daemon:daemon"
    assert lines[4] == "755 root"           # /etc as it was
    assert lines[5].startswith("tool-")
    assert int(lines[6]) > 50               # /usr/bin kept its files


# ----- several stages ----------------------------------------------------------------

def test_multi_stage_copies_from_an_earlier_stage(client, busybox, tmp_path):
    salt = unique("salt")
    ctx = write_tree(tmp_path / "ctx", {
        "Dockerfile": f"""
FROM {busybox} AS builder
RUN mkdir -p /out/bin && echo built-{salt} > /out/artifact && ln -s artifact /out/link \\
    && echo tool > /out/bin/tool && chmod 755 /out/bin/tool && chown 7:8 /out/artifact

FROM {busybox} AS unused
RUN exit 1

FROM {busybox}
COPY --from=builder /out/ /dist/
COPY --from=0 /out/artifact /single
COPY --from=builder /out/bin/* /usr/local/bin/
COPY --from={busybox} /etc/passwd /from-image/
""",
    })
    ref = unique("multi") + ":1"
    img, events = build(client, ctx, ref)
    # The unused stage is not built.
    assert not [e for e in events if e["type"] == "step" and "exit 1" in e["instruction"]]
    out = run_in(client, ref, ["sh", "-c", "cat /dist/artifact /single; readlink /dist/link; "
                                           "stat -c '%u:%g' /dist/artifact; "
                                           "cat /usr/local/bin/tool; stat -c %a /usr/local/bin/tool; "
                                           "head -c 5 /from-image/passwd"])
    assert out.split("\n") == [f"built-{salt}", f"built-{salt}", "artifact",
                               "7:8",  # --from keeps owners
                               "tool", "755", "root:"]
    # Again: the copies from the (cached) stage are cached too.
    _, again = build(client, ctx, ref)
    assert all(s["cached"] for s in steps(again))
    # --target builds one stage.
    tgt, _ = build(client, ctx, unique("tgt") + ":1", target="builder")
    assert run_in(client, tgt.ref, ["cat", "/out/artifact"]) == f"built-{salt}\n"


# ----- the CLI ------------------------------------------------------------------------------

def test_the_cli_builds_and_shows_the_steps(server, client, busybox, tmp_path):
    salt = unique("salt")
    ctx = write_tree(tmp_path / "ctx", {
        "build.Dockerfile": f"FROM {busybox}\nARG MSG\nCOPY . /src/\nRUN echo $MSG {salt}\n",
        ".dockerignore": "junk/\n",
        "junk/big.bin": b"\0" * 4096,
        "app.txt": "app\n",
    })
    ref = unique("cli") + ":1"
    args = ["image", "build", "--data-dir", server.data_dir, "-f", ctx / "build.Dockerfile",
            "-t", ref, "--build-arg", "MSG=hello", "--no-cache", ctx]
    r = server.cli(*args, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout == ref + "\n"
    assert f"hello {salt}" in r.stderr and "#4 RUN echo $MSG" in r.stderr, r.stderr
    assert run_in(client, ref, ["ls", "/src"]).split() == ["app.txt", "build.Dockerfile"]
    # Again without --no-cache: every step from the cache, nothing run.
    r = server.cli(*[a for a in args if a != "--no-cache"], timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("(cached)") == 2 and f"hello {salt}" not in r.stderr, r.stderr
    # A failing step: its message, exit status 1, the tag untouched.
    (ctx / "build.Dockerfile").write_text(f"FROM {busybox}\nRUN false\n")
    layers = client.image(ref).layers
    r = server.cli(*args, timeout=300)
    assert r.returncode == 1
    assert "Dockerfile:2: RUN exited with status 1" in r.stderr, r.stderr
    assert "(field dockerfile)" in r.stderr
    assert client.image(ref).layers == layers


# ----- tenants --------------------------------------------------------------------------

def test_a_user_tenants_build_is_private_and_its_cache_its_own(server, client, busybox, tmp_path):
    tenants = []

    def tenant():
        tid = unique("bt")
        client.create_tenant(tid)
        key = client.create_key(tid, name="build")
        c = dsec.Client(url=server.url, token=key["key"], timeout=60)
        tenants.append((tid, c))
        return tid, c

    try:
        (a, ca), (b, cb) = tenant(), tenant()
        ctx = write_tree(tmp_path / "ctx", {
            "Dockerfile": f"FROM {busybox}\nCOPY f /f\nRUN cat /f > /g\n",
            "f": unique("f"),
        })
        # A user's images are named under its tenant.
        expect_error(lambda: ca.build_image(str(ctx), tag="plain:1"), dsec.InvalidArgument,
                     field="name")
        img, ev = build(ca, ctx, f"{a}/app:1")
        assert img.visibility == "private" and img.owner == a
        assert [s["cached"] for s in steps(ev)] == [False, False]
        expect_error(lambda: cb.image(f"{a}/app:1"), dsec.NotFound)
        # The same steps for another tenant: nothing from a's cache.
        _, ev = build(cb, ctx, f"{b}/app:1")
        assert [s["cached"] for s in steps(ev)] == [False, False]
        _, ev = build(ca, ctx, f"{a}/app:2")
        assert [s["cached"] for s in steps(ev)] == [True, True]
        # Its build sandboxes were its own, and are gone.
        assert not [s for s in client.list() if s.info.get("owner") in (a, b)
                    and s.state not in ("stopped", "failed")]
    finally:
        for tid, c in tenants:
            c.close()
            for ref in [i.ref for i in client.images() if i.owner == tid]:
                client.delete_image(ref)
            client.delete_tenant(tid)


# ----- failures -------------------------------------------------------------------------

def test_a_failing_run_reports_its_line_and_stores_nothing(client, busybox, tmp_path):
    salt = unique("salt")
    ref = unique("fail") + ":1"
    good = write_tree(tmp_path / "good", {"Dockerfile": f"FROM {busybox}\nRUN echo ok > /ok\n"})
    before, _ = build(client, good, ref)
    layers_before = {l["digest"] for l in client.layers()}
    bad = write_tree(tmp_path / "bad", {
        "Dockerfile": f"FROM {busybox}\nCOPY x.txt /x.txt\n\nRUN echo about to fail; "
                      f"echo {salt} >/y; exit 3\nRUN echo never\n",
        "x.txt": salt,
    })
    events = []
    e = expect_error(lambda: client.build_image(str(bad), tag=ref, progress=events.append),
                     dsec.InvalidArgument, field="dockerfile")
    assert e.line == 4, e
    assert "Dockerfile:4: RUN exited with status 3" in e.message, e
    assert any(ev["type"] == "output" and "about to fail" in ev["data"] for ev in events)
    assert not any(ev["type"] == "step" and "never" in ev["instruction"] for ev in events)
    # The tag is unchanged; the COPY's layer (it succeeded) is the only new one.
    assert client.image(ref).layers == before.layers
    copied = {ev["layer"] for ev in events if ev["type"] == "layer"}
    assert len(copied) == 1
    # Besides the COPY's layer, only the context's blob is new: no layer (a
    # metadata image with a data blob) of the failed RUN.
    new = [l for l in client.layers() if l["digest"] not in layers_before | copied]
    assert all(l["data"] is None for l in new), new
    assert not build_sandboxes_left(client)
    # A new name is not made at all; the COPY comes from the cache.
    other = unique("fail") + ":1"
    events.clear()
    expect_error(lambda: client.build_image(str(bad), tag=other, progress=events.append),
                 dsec.InvalidArgument, field="dockerfile")
    expect_error(lambda: client.image(other), dsec.NotFound)
    assert [s["cached"] for s in steps(events)] == [True, False]


def test_a_syntax_error_answers_400_with_the_line(server, client, busybox):
    status, _, _, doc = server.raw("POST", "/v1/images/build", {
        "dockerfile": f"FROM {busybox}\nRUN true\nRUNN oops\n", "name": unique("syn")})
    assert status == 400, doc
    assert doc["error"]["field"] == "dockerfile"
    assert doc["error"]["line"] == 3
    assert doc["error"]["message"].startswith("Dockerfile:3: ")
    e = expect_error(lambda: client.build_image(None, tag=unique("syn"),
                                                dockerfile_text="FROM busybox\nCOPY onlyone\n"),
                     dsec.InvalidArgument, field="dockerfile", status=400)
    assert e.line == 2
    for body, field in [({"name": "x"}, "dockerfile"),
                        ({"dockerfile": "FROM scratch\n"}, "name"),
                        ({"dockerfile": "FROM scratch\n", "name": "x", "context": "nope"},
                         "context"),
                        ({"dockerfile": "FROM scratch\n", "name": "x",
                          "context": "sha256:" + "0" * 64}, "context"),
                        ({"dockerfile": "FROM scratch\n", "name": "x", "target": "nope"},
                         "target"),
                        ({"dockerfile": "FROM scratch\n", "name": "x", "bogus": 1}, "bogus")]:
        status, _, _, doc = server.raw("POST", "/v1/images/build", body)
        assert status == 400 and doc["error"]["field"] == field, (body, doc)


def test_a_missing_base_image_or_source_names_its_line(client, busybox, tmp_path):
    ctx = write_tree(tmp_path / "ctx", {"Dockerfile": "", "here.txt": "x"})
    e = expect_error(lambda: client.build_image(
        str(ctx), tag=unique("m"), dockerfile_text=f"FROM {busybox}\nCOPY nothere.txt /x\n"),
        dsec.InvalidArgument, field="dockerfile")
    assert e.line == 2 and "nothere.txt" in e.message
    e = expect_error(lambda: client.build_image(
        None, tag=unique("m"), dockerfile_text="# base\nFROM nosuch-image:1\nRUN true\n"),
        dsec.NotFound, field="dockerfile")
    assert e.line == 2 and "nosuch-image:1 not found" in e.message, e
    e = expect_error(lambda: client.build_image(
        None, tag=unique("m"), dockerfile_text="FROM scratch\nRUN true\n"),
        dsec.InvalidArgument, field="dockerfile")
    assert e.line == 2
    e = expect_error(lambda: client.build_image(
        None, tag=unique("m"), dockerfile_text=f"FROM {busybox}\nADD https://example.com/x /x\n"),
        dsec.InvalidArgument, field="dockerfile")
    assert e.line == 2 and "not supported" in e.message


def test_gc_keeps_the_cached_layers_of_a_failed_build(client, busybox, tmp_path):
    salt = unique("salt")
    ctx = write_tree(tmp_path / "ctx", {
        "Dockerfile": f"FROM {busybox}\nCOPY a.txt /a.txt\nRUN test -e /go\n",
        "a.txt": salt,
    })
    events = []
    expect_error(lambda: client.build_image(str(ctx), tag=unique("gc"), progress=events.append),
                 dsec.InvalidArgument, field="dockerfile")
    (copied,) = [e["layer"] for e in events if e["type"] == "layer"]
    removed = client.gc(grace_s=0)
    assert copied not in removed
    assert client.layer(copied)["images"] == []  # no image names it: the cache keeps it
    (ctx / "Dockerfile").write_text(f"FROM {busybox}\nCOPY a.txt /a.txt\nRUN touch /go\n")
    img, ev = build(client, ctx, unique("gc") + ":1")
    assert [s["cached"] for s in steps(ev)] == [True, False]
    assert copied in img.layers


# ----- the context's .dockerignore -----------------------------------------------------

def test_dockerignore_excludes_a_file_and_its_changes_do_not_bust_the_cache(client, busybox,
                                                                             tmp_path):
    salt = unique("salt")
    ctx = write_tree(tmp_path / "ctx", {
        "Dockerfile": f"FROM {busybox}\nCOPY . /ctx/\nRUN ls -a /ctx > /listing\n",
        ".dockerignore": "ignored.txt\n*.log\n!keep.log\n",
        "kept.txt": salt,
        "ignored.txt": "one",
        "x.log": "log",
        "keep.log": "kept log",
    })
    ref = unique("ign") + ":1"
    build(client, ctx, ref)
    listing = run_in(client, ref, ["cat", "/listing"]).split()
    assert "kept.txt" in listing and "keep.log" in listing and ".dockerignore" in listing
    assert "ignored.txt" not in listing and "x.log" not in listing
    (ctx / "ignored.txt").write_text("two")
    (ctx / "x.log").write_text("more log")
    _, ev = build(client, ctx, ref)
    assert [s["cached"] for s in steps(ev)] == [True, True]
    (ctx / "kept.txt").write_text(salt + " changed")
    _, ev = build(client, ctx, ref)
    assert [s["cached"] for s in steps(ev)] == [False, False]


def test_the_server_applies_dockerignore_to_a_context_that_did_not(server, client, busybox):
    """A context tar holding an ignored file (sent by a client that does not
    apply .dockerignore): the server leaves it out all the same."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, data in [(".dockerignore", b"secret*\n"), ("secret.key", b"k"),
                           ("public.txt", unique("p").encode())]:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    digest = client.upload_blob(buf.getvalue())
    ref = unique("srv")
    status, _, data, _ = server.raw("POST", "/v1/images/build", {
        "dockerfile": f"FROM {busybox}\nCOPY . /c/\n", "context": digest, "name": ref},
        timeout=300)
    assert status == 200
    events = [json.loads(l) for l in data.decode().splitlines() if l.strip()]
    assert events[-1]["type"] == "done", events[-1]
    # Every event is what api/openapi.yaml says.
    contract = pytest.importorskip("test_contract")
    schema = contract.response_schema("/v1/images/build", "POST", 200, "application/x-ndjson")
    for ev in events:
        assert not contract.check(ev, schema), (ev, contract.check(ev, schema))
    out = run_in(client, ref + ":latest", ["ls", "/c"])
    assert out.split() == ["public.txt"]


# ----- ADD ----------------------------------------------------------------------------------

def test_add_unpacks_a_local_archive(client, busybox, tmp_path):
    arch = io.BytesIO()
    with tarfile.open(fileobj=arch, mode="w:gz") as tf:
        for name, data in [("pkg/one.txt", b"1\n"), ("pkg/two.txt", b"2\n")]:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            ti.uid = 42
            tf.addfile(ti, io.BytesIO(data))
    ctx = write_tree(tmp_path / "ctx", {
        "Dockerfile": f"FROM {busybox}\nADD pkg.tar.gz /opt/\nADD plain.txt /opt/plain.txt\n",
        "pkg.tar.gz": arch.getvalue(),
        "plain.txt": unique("plain"),
    })
    ref = unique("add") + ":1"
    build(client, ctx, ref)
    out = run_in(client, ref, ["sh", "-c", "cat /opt/pkg/one.txt /opt/pkg/two.txt; "
                                           "stat -c %u /opt/pkg/one.txt; ls /opt"])
    assert out.split("\n")[:3] == ["1", "2", "42"]
    assert "pkg.tar.gz" not in out and "plain.txt" in out


# ----- FROM a registry ---------------------------------------------------------------------

def test_from_a_registry_reference_pulls_it(client, tmp_path):
    src = CACHE / "busybox.tar"
    if not src.exists():
        pytest.skip(f"{src} missing (scripts/build-test-images.sh)")
    salt = unique("salt")
    lay = OciLayout(tmp_path / "oci")
    lay.add_layer(src.read_bytes(), compression="gzip")
    lay.add_layer([file("marker", salt.encode())], compression="gzip")
    lay.set_config(env=["PATH=/bin:/usr/bin", "FROMREG=yes"], workdir="/")
    lay.write("v1")
    repo = unique("base")
    with Registry(tmp_path) as reg:
        reg.push_oci(tmp_path / "oci", repo, "v1", src_tag="v1")
        base = f"{reg.host}/{repo}:v1"
        ref = unique("onreg") + ":1"
        img, events = build(client, None, ref, insecure_registry=True,
                            dockerfile_text=f"FROM {base}\nRUN cat /marker > /copied; "
                                            "echo $FROMREG > /env\n")
    assert any(e["type"] == "pull" for e in events)
    assert client.image(base).layers == img.layers[:2]
    assert run_in(client, ref, ["cat", "/copied", "/env"]) == f"{salt}yes\n"
    assert "FROMREG=yes" in img.config["env"]


# ----- network -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def outside(server):
    if server.egress_unavailable:
        pytest.skip(f"this node gives no sandbox egress: {server.egress_unavailable}")
    h = OutsideHost()
    h.start()
    yield h
    h.stop()


PROBE = ("import socket\n"
         "try:\n"
         f"    s = socket.create_connection(('{ADDR}', 8080), 3)\n"
         "    print(s.recv(100).decode().strip())\n"
         "except OSError as e:\n"
         "    print('blocked', e)\n")


def test_run_has_no_network_unless_the_build_asks(client, debian, outside, tmp_path):
    ctx = write_tree(tmp_path / "ctx", {
        "Dockerfile": f"FROM {debian}\nCOPY probe.py /probe.py\n"
                      f"RUN python3 /probe.py > /net.txt\n",
        "probe.py": PROBE + f"# {unique('salt')}\n",
    })
    closed, _ = build(client, ctx, unique("net") + ":closed")
    assert run_in(client, closed.ref, ["cat", "/net.txt"]).startswith("blocked")
    opened, ev = build(client, ctx, unique("net") + ":open", network=True)
    assert [s["cached"] for s in steps(ev)] == [True, False]  # network is part of the key
    assert run_in(client, opened.ref, ["cat", "/net.txt"]) == GREETING.decode()

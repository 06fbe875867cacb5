"""`dsec image pull` / POST /v1/images/pull against a real registry: Debian's
docker-registry (the CNCF distribution server) on loopback, images pushed with
skopeo from OCI layouts built here (tests/oci_build.py), faults injected by
tests/registry_proxy.py. Every pulled image is checked through a sandbox."""

from __future__ import annotations

import hashlib
import os
import re
import threading
import time
from pathlib import Path

import pytest

import dsec
from dedup_images import DedupPair, shas_in
from helpers import unique
from oci_build import (OciLayout, chardev, directory, file, hardlink, opaque, symlink,
                       whiteout)
from oci_registry import Registry
from registry_proxy import RegistryProxy

CACHE = Path(os.environ.get("DSEC_IMAGE_CACHE", "/var/cache/dsec/test-images"))


def busybox_tar() -> bytes:
    src = CACHE / "busybox.tar"
    if not src.exists():
        pytest.skip(f"{src} missing (scripts/build-test-images.sh)")
    return src.read_bytes()


def app_layout(d: Path, compression: str = "gzip", marker: str = "amd64",
               salt: str = "") -> OciLayout:
    """busybox, then two layers with every kind of entry and whiteouts; `salt`
    makes those two unlike any other test's (busybox's layer is shared)."""
    salt = salt or unique("salt")
    lay = OciLayout(d)
    lay.add_layer(busybox_tar(), compression="gzip")
    lay.add_layer([
        directory("data"),
        file("data/keep.txt", b"keep\n"),
        file("data/gone.txt", b"gone\n"),
        directory("opq"),
        file("opq/old.txt", b"old\n"),
        file("salt1", salt),
    ], compression=compression)
    lay.add_layer([
        whiteout("data/gone.txt"),
        opaque("opq"),
        file("opq/new.txt", b"new\n"),
        file("owned.txt", b"owned\n", mode=0o640, uid=1234, gid=5678),
        symlink("link", "data/keep.txt"),
        file("hard1", b"hardlinked\n"),
        hardlink("hard2", "hard1"),
        chardev("devnode", 1, 3),
        file("xattr.txt", b"x\n", xattrs={"user.dsec": "yes"}),
        file("h\u00e9llo-\u65e5\u672c.txt", "unicode\n".encode()),
        file("marker", marker.encode()),
        file("salt2", salt),
    ], compression=compression)
    lay.set_config(user="1000:1000", env=["PATH=/bin:/usr/bin", "APP=pulled"], workdir="/data")
    return lay


def check_app(client, image_ref: str, marker: str = "amd64"):
    sb = client.create(image=image_ref)
    try:
        r = sb.exec(["sh", "-c", "pwd; id -u; echo $APP; cat marker; echo; ls /data; ls /opq; "
                     "cat link; stat -c %h hard1; stat -c '%u:%g' owned.txt; "
                     "stat -c %t,%T devnode; cat /h\u00e9llo-\u65e5\u672c.txt"], cwd="/")
        assert r.exit_code == 0, r.stderr
        lines = r.stdout.split("\n")
        assert lines[0] == "/"
        assert lines[1] == "1000"
        assert lines[2] == "pulled"
        assert lines[3] == marker
        assert lines[4] == "keep.txt"          # gone.txt whited out
        assert lines[5] == "new.txt"           # old.txt hidden by the opaque dir
        assert lines[6] == "keep"
        assert lines[7] == "2"
        assert lines[8] == "1234:5678"
        assert lines[9] == "1,3"
        assert lines[10] == "unicode"
    finally:
        sb.destroy()


@pytest.fixture
def reg(tmp_path):
    with Registry(tmp_path) as r:
        yield r


def test_pull_converts_every_layer_and_a_repull_is_a_no_op(client, reg, tmp_path):
    lay = app_layout(tmp_path / "oci")
    lay.write("v1")
    repo = unique("app")
    reg.push_oci(tmp_path / "oci", repo, "v1", src_tag="v1")
    with RegistryProxy(reg) as proxy:
        ref = f"{proxy.host}/{repo}:v1"
        events = []
        img = client.pull_image(ref, insecure_registry=True, progress=events.append)
        assert img.name == f"{proxy.host}/{repo}" and img.tag == "v1"
        assert len(img.layers) == 3
        assert img.raw["source"]["manifest_digest"] == lay.manifest_digest
        assert img.config["user"] == "1000:1000"
        assert img.config["working_dir"] == "/data"
        types = [e["type"] for e in events]
        assert types[0] == "resolved" and types[-1] == "done"
        assert {e["status"] for e in events if e["type"] == "layer"} >= {"done"}
        blob_gets = proxy.count(re.compile(r"/blobs/sha256:"), "GET")
        assert blob_gets >= 3  # the two layers of its own and the config (busybox may be known)
        check_app(client, f"{ref}")
        got = client.image(ref).raw
        assert 0 < got["stored_bytes"] <= got["logical_bytes"]

        # The same tag again: the manifest is fetched, nothing else.
        proxy.reset()
        events.clear()
        again = client.pull_image(ref, insecure_registry=True, progress=events.append)
        assert again.layers == img.layers
        assert events[-1]["unchanged"] is True
        assert proxy.count(re.compile(r"/blobs/sha256:"), "GET") <= 1  # the config at most

        # Another name for the same image: its layers are known; none fetched.
        proxy.reset()
        other = client.pull_image(ref, insecure_registry=True, name=unique("copy"), tag="x")
        assert other.layers == img.layers
        layer_gets = [r for r in proxy.requests
                      if "/blobs/" in r["path"] and r["method"] == "GET"
                      and lay.config_digest not in r["path"]]
        assert layer_gets == []


def test_pull_by_digest_zstd_and_platform_from_an_index(client, reg, tmp_path):
    amd = app_layout(tmp_path / "amd", compression="zstd", marker="amd64")
    arm = app_layout(tmp_path / "arm", compression="gzip", marker="arm64")
    idx = OciLayout(tmp_path / "idx")
    index_digest = idx.write_multi_arch("multi", {"linux/amd64": amd, "linux/arm64": arm})
    repo = unique("multi")
    reg.push_oci(tmp_path / "idx", repo, "multi", all_platforms=True, src_tag="multi")
    ref = f"{reg.host}/{repo}"
    img = client.pull_image(f"{ref}@{index_digest}", insecure_registry=True)
    assert img.tag == "sha256-" + index_digest[7:]
    assert img.raw["source"]["index_digest"] == index_digest
    assert img.raw["source"]["platform"] == "linux/amd64"
    check_app(client, img.raw["ref"], marker="amd64")
    arm_img = client.pull_image(f"{ref}:multi", insecure_registry=True, platform="linux/arm64",
                                tag="arm")
    assert arm_img.raw["source"]["platform"].startswith("linux/arm64")
    check_app(client, arm_img.raw["ref"], marker="arm64")
    with pytest.raises(dsec.NotFound) as e:
        client.pull_image(f"{ref}:multi", insecure_registry=True, platform="linux/s390x")
    assert e.value.field == "platform"
    assert "linux/arm64" in str(e.value)


def test_bad_refs_missing_tags_and_credentials_are_clear_errors(client, tmp_path, server):
    before = {i.raw["ref"] for i in client.images()}
    for bad in ["", "UPPER/case", "a:b:c", "x@sha256:123"]:
        with pytest.raises(dsec.InvalidArgument) as e:
            client.pull_image(bad)
        assert e.value.field == "ref", bad
    with pytest.raises(dsec.InvalidArgument) as e:
        client.pull_image("127.0.0.1:1/x", platform="linux")
    assert e.value.field == "platform"
    with Registry(tmp_path, auth="htpasswd") as reg:
        lay = app_layout(tmp_path / "oci")
        lay.write("v1")
        reg.push_oci(tmp_path / "oci", "private", "v1", src_tag="v1")
        ref = f"{reg.host}/private:v1"
        with pytest.raises(dsec.Unauthenticated) as e:
            client.pull_image(ref, insecure_registry=True)
        assert e.value.field == "auth"
        with pytest.raises(dsec.Unauthenticated):
            client.pull_image(ref, insecure_registry=True, auth=("alice", "wrong"))
        with pytest.raises(dsec.NotFound) as e:
            client.pull_image(f"{reg.host}/private:nope", insecure_registry=True,
                              auth=("alice", "secret"))
        assert e.value.field == "ref"
        img = client.pull_image(ref, insecure_registry=True, auth=("alice", "secret"))
        assert len(img.layers) == 3
        client.delete_image(img.raw["ref"])
    # Nothing is left of the failed pulls.
    assert {i.raw["ref"] for i in client.images()} == before
    # No registry there at all.
    with pytest.raises(dsec.Unavailable):
        client.pull_image("127.0.0.1:9/nothing:1", insecure_registry=True)


def test_bearer_token_flow(client, tmp_path):
    with Registry(tmp_path, auth="token") as reg:
        lay = app_layout(tmp_path / "oci")
        lay.write("v1")
        for repo in ("tok", "denied"):
            reg.push_oci(tmp_path / "oci", repo, "v1", src_tag="v1", creds="alice:secret")
        reg.token_server.deny = {"denied"}
        img = client.pull_image(f"{reg.host}/tok:v1", insecure_registry=True,
                                auth=("alice", "secret"))
        assert len(img.layers) == 3
        assert reg.token_server.count >= 1
        with pytest.raises((dsec.PermissionDenied, dsec.Unauthenticated)) as e:
            client.pull_image(f"{reg.host}/denied:v1", insecure_registry=True,
                              auth=("alice", "secret"))
        assert e.value.field == "auth"
        with pytest.raises(dsec.Unauthenticated):
            client.pull_image(f"{reg.host}/tok:v1", insecure_registry=True, name=unique("n"),
                              auth=("alice", "bad"))
        client.delete_image(img.raw["ref"])


def test_corrupt_blob_is_data_loss_and_a_cut_transfer_resumes(client, reg, tmp_path):
    lay = app_layout(tmp_path / "oci")
    lay.write("v1")
    repo = unique("faulty")
    reg.push_oci(tmp_path / "oci", repo, "v1", src_tag="v1")
    top = lay.layers[-1]["digest"]
    before = {i.raw["ref"] for i in client.images()}
    with RegistryProxy(reg) as proxy:
        ref = f"{proxy.host}/{repo}:v1"
        proxy.corrupt(digest=top, times=10)
        with pytest.raises(dsec.DsecError) as e:
            client.pull_image(ref, insecure_registry=True)
        assert e.value.code == "data_loss"
        assert top in str(e.value)
        assert {i.raw["ref"] for i in client.images()} == before
        proxy.reset()
        proxy.cut(top, after=100, times=1)
        img = client.pull_image(ref, insecure_registry=True)
        assert any(r for r in proxy.ranges if r), "the cut transfer was resumed with a Range"
        check_app(client, img.raw["ref"])


def test_concurrent_pulls_fetch_each_blob_once(client, reg, tmp_path):
    lay = app_layout(tmp_path / "oci")
    lay.write("v1")
    repo = unique("shared")
    reg.push_oci(tmp_path / "oci", repo, "v1", src_tag="v1")
    with RegistryProxy(reg) as proxy:
        ref = f"{proxy.host}/{repo}:v1"
        # Slow the biggest layer so the pulls overlap.
        proxy.stall(1.0, digest=lay.layers[1]["digest"], after=100)
        out, errs = [], []

        def pull(i):
            try:
                out.append(client.pull_image(ref, insecure_registry=True, name=unique("c"),
                                             tag=str(i)))
            except Exception as e:  # noqa: BLE001
                errs.append(e)

        ts = [threading.Thread(target=pull, args=(i,)) for i in range(3)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errs, errs
        assert len({tuple(i.layers) for i in out}) == 1
        for layer in lay.layers:
            gets = [r for r in proxy.requests if r["method"] == "GET"
                    and r["path"].endswith(layer["digest"]) and r["status"] in (200, 206)]
            # busybox's layer may be known from an earlier test: fetched at most once
            assert len(gets) == (1 if layer is not lay.layers[0] else len(gets) and 1), \
                (layer["digest"], gets)


def test_cli_pull_shows_progress_and_names_the_image(server, reg, tmp_path):
    lay = app_layout(tmp_path / "oci")
    lay.write("v1")
    repo = unique("cli")
    reg.push_oci(tmp_path / "oci", repo, "v1", src_tag="v1")
    ref = f"{reg.host}/{repo}:v1"
    p = server.cli("image", "pull", "--data-dir", server.data_dir,
                   "--insecure-registry", reg.host, ref, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == ref
    assert "done" in p.stderr
    p = server.cli("image", "pull", "--data-dir", server.data_dir,
                   "--insecure-registry", reg.host, ref, timeout=300)
    assert p.returncode == 0 and "(up to date)" in p.stdout
    p = server.cli("image", "pull", "--data-dir", server.data_dir,
                   f"{reg.host}/{repo}:missing", timeout=60)
    assert p.returncode != 0
    assert "not_found" in p.stderr or "unavailable" in p.stderr


def test_cli_takes_credentials_from_a_docker_credential_helper(server, tmp_path):
    """config.json's credsStore names docker-credential-<name>, run as the
    Docker CLI runs it (`get`, the registry on stdin); a helper missing from
    PATH fails the pull naming it."""
    import subprocess
    from conftest import dsec_bin
    bindir = tmp_path / "bin"
    bindir.mkdir()
    asked = tmp_path / "asked"
    helper = bindir / "docker-credential-dsectest"
    helper.write_text("#!/bin/sh\nread s\necho \"$s\" >> %s\n"
                      "case \"$s\" in *127.0.0.1*) echo '{\"Username\":\"alice\",\"Secret\":\"secret\"}';;\n"
                      "*) echo 'credentials not found in native keychain'; exit 1;; esac\n" % asked)
    helper.chmod(0o755)
    cfg = tmp_path / "docker"
    cfg.mkdir()
    with Registry(tmp_path, auth="htpasswd") as reg:
        lay = app_layout(tmp_path / "oci")
        lay.write("v1")
        repo = unique("helper")
        reg.push_oci(tmp_path / "oci", repo, "v1", src_tag="v1")
        env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", DOCKER_CONFIG=str(cfg))

        def pull(store):
            (cfg / "config.json").write_text('{"credsStore": "%s"}' % store)
            return subprocess.run([str(dsec_bin()), "image", "pull", "--data-dir",
                                   str(server.data_dir), "--insecure-registry", reg.host,
                                   f"{reg.host}/{repo}:v1"],
                                  capture_output=True, text=True, timeout=300, env=env,
                                  stdin=subprocess.DEVNULL)
        p = pull("dsectest")
        assert p.returncode == 0, p.stderr
        assert asked.read_text().split() == [reg.host]
        p = pull("nosuchhelper")
        assert p.returncode != 0 and "docker-credential-nosuchhelper" in p.stderr, p.stderr
    server.client.delete_image(f"{reg.host}/{repo}:v1")


def test_a_registry_that_dies_mid_blob_then_a_pull_resumes_from_the_spool(client, reg, tmp_path):
    lay = OciLayout(tmp_path / "oci")
    lay.add_layer(busybox_tar(), compression="gzip")
    big = os.urandom(3 << 20)  # incompressible: the blob is ~3 MiB
    lay.add_layer([file("big.bin", big), file("salt", unique("s"))], compression="gzip")
    lay.write("v1")
    repo = unique("resume")
    reg.push_oci(tmp_path / "oci", repo, "v1", src_tag="v1")
    top = lay.layers[1]["digest"]
    before = {i.raw["ref"] for i in client.images()}
    with RegistryProxy(reg) as proxy:
        ref = f"{proxy.host}/{repo}:v1"
        # The big layer's transfer breaks after its first MiB and the registry
        # dies right then: the pull retries against a dead registry, gives up
        # with a clear error, and keeps the bytes it got.
        proxy.cut(top, after=1 << 20, times=1)

        def kill_mid_blob():
            deadline = time.time() + 60
            while time.time() < deadline and not any(
                    r["digest"] == top and r["sent"] >= 1 << 20 for r in list(proxy.requests)):
                time.sleep(0.002)
            reg.kill()

        t = threading.Thread(target=kill_mid_blob)
        t.start()
        with pytest.raises(dsec.Unavailable) as e:
            client.pull_image(ref, insecure_registry=True)
        t.join()
        assert top in str(e.value)
        assert {i.raw["ref"] for i in client.images()} == before
        reg.restart()
        proxy.reset()
        img = client.pull_image(ref, insecure_registry=True)
        ranged = [r for p, r in proxy.ranges if p.endswith(top)]
        assert ranged and ranged[0].startswith("bytes="), ranged
        assert int(ranged[0][6:].rstrip("-")) >= 1 << 20
    sb = client.create(image=img.raw["ref"])
    try:
        r = sb.exec(["sha256sum", "/big.bin"])
        import hashlib
        assert r.stdout.split()[0] == hashlib.sha256(big).hexdigest()
    finally:
        sb.destroy()


def test_tls_registry_with_the_platforms_ca(tmp_path, tmp_path_factory):
    from conftest import Server, _check_prerequisites
    _check_prerequisites()
    with Registry(tmp_path, tls=True) as reg:
        lay = app_layout(tmp_path / "oci")
        lay.write("v1")
        reg.push_oci(tmp_path / "oci", "secure", "v1", src_tag="v1")
        s = Server(tmp_path_factory.mktemp("tls") / "data",
                   extra_args=["--registry-ca", str(reg.ca_file)])
        s.data_dir.mkdir()
        s.start()
        try:
            img = s.client.pull_image(f"{reg.host}/secure:v1")
            assert len(img.layers) == 3
            assert img.raw["source"]["ref"] == f"{reg.host}/secure:v1"
            # A create naming an image by its registry pulls it first.
            reg.push_oci(tmp_path / "oci", "oncreate", "v2", src_tag="v1")
            check_app(s.client, f"{reg.host}/oncreate:v2")
            assert s.client.image(f"{reg.host}/oncreate:v2").raw["source"]["ref"] == \
                f"{reg.host}/oncreate:v2"
        finally:
            s.stop()


def test_tenants_cannot_make_the_platform_reach_its_own_network(client, server, reg, tmp_path):
    """A tenant's pull may not point the platform at loopback, private or
    link-local addresses (SSRF) unless the operator allowed the registry."""
    tid = unique("ssrf")
    client.create_tenant(tid, name="ssrf test")
    key = client.create_key(tid, name="k")
    tenant = dsec.Client(url=server.url, token=key["key"], timeout=60)
    try:
        lay = app_layout(tmp_path / "oci")
        lay.write("v1")
        reg.push_oci(tmp_path / "oci", "ssrf", "v1", src_tag="v1")
        with pytest.raises(dsec.PermissionDenied) as e:
            tenant.pull_image(f"{reg.host}/ssrf:v1", insecure_registry=True,
                              name=f"{tid}/ssrf", tag="v1", visibility="private")
        assert e.value.field == "ref"
        assert "registry-allow" in str(e.value)
        # The same through a create naming the registry.
        with pytest.raises((dsec.PermissionDenied, dsec.NotFound)):
            tenant.create(image=f"{reg.host}/ssrf:v1")
    finally:
        tenant.close()
        client.delete_tenant(tid)


def test_create_pulls_an_image_named_by_its_registry(client, reg, tmp_path):
    lay = app_layout(tmp_path / "oci")
    lay.write("v1")
    repo = unique("oncreate")
    reg.push_oci(tmp_path / "oci", repo, "v1", src_tag="v1")
    ref = f"{reg.host}/{repo}:v1"
    # The session server does not know this registry is plain http (dsec up
    # --insecure-registry would say so): the create tries https, fails, and
    # says which field; nothing is left.
    with pytest.raises(dsec.DsecError) as e:
        client.create(image=ref)
    assert e.value.field == "image"
    with pytest.raises(dsec.NotFound):
        client.image(ref)
    # A bare name missing locally is a plain 404 at once, no registry asked.
    with pytest.raises(dsec.NotFound):
        client.create(image=unique("nosuch"))


def test_gc_during_a_pull_keeps_the_layers_it_made(client, reg, tmp_path):
    lay = app_layout(tmp_path / "oci")
    lay.write("v1")
    repo = unique("gc")
    reg.push_oci(tmp_path / "oci", repo, "v1", src_tag="v1")
    top = lay.layers[2]["digest"]
    with RegistryProxy(reg) as proxy:
        ref = f"{proxy.host}/{repo}:v1"
        proxy.stall(3.0, digest=top, after=10)
        out, errs = [], []

        def pull():
            try:
                out.append(client.pull_image(ref, insecure_registry=True))
            except Exception as e:  # noqa: BLE001
                errs.append(e)

        t = threading.Thread(target=pull)
        t.start()
        deadline = time.time() + 30
        while proxy.count(blob=top) < 1 and time.time() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)  # the other layers are converted by now
        removed = client.gc(grace_s=0)
        t.join()
        assert not errs, errs
        assert not set(removed) & set(out[0].layers)
    check_app(client, ref)


def test_two_gib_files_sparse_and_streamed_zeros_take_no_space(client, reg, tmp_path):
    """A 2 GiB GNU-sparse member and a 2 GiB run of zeros streamed as a plain
    member: both read back whole in a sandbox, and the layers hold only the
    few non-zero blocks (all-zero chunks are holes)."""
    lay = OciLayout(tmp_path / "oci")
    lay.add_layer(busybox_tar(), compression="gzip")
    sparse = lay.add_sparse_layer(tmp_path / "work", compression="gzip")
    zeros = lay.add_zeros_layer(compression="zstd")
    lay.add_layer([file("salt", unique("s"))])
    lay.write("v1")
    repo = unique("big")
    reg.push_oci(tmp_path / "oci", repo, "v1", src_tag="v1")
    img = client.pull_image(f"{reg.host}/{repo}:v1", insecure_registry=True)
    info = client.image(img.raw["ref"]).raw
    assert info["stored_bytes"] < 64 << 20, info
    sb = client.create(image=img.raw["ref"])
    try:
        for lf in (sparse, zeros):
            path = "/" + lf.name
            r = sb.exec(["sh", "-c", f"stat -c %s {path}; head -c 4096 {path} | tail -c 5; "
                         f"tail -c 5 {path}; "
                         f"dd if={path} bs=4096 skip={(lf.size // 2) // 4096} count=1 "
                         f"2>/dev/null | tail -c 7"])
            assert r.exit_code == 0, r.stderr
            out = r.stdout
            assert out.startswith(f"{lf.size}\n"), out
            assert "head tail middle " in out.replace("\n", ""), out
    finally:
        sb.destroy()


def _metric(server, name) -> float:
    st, _, body, _ = server.raw("GET", "/v1/metrics")
    assert st == 200
    m = re.search(rb"^%s(?:\{[^}]*\})? ([0-9.e+-]+)$" % name.encode(), body, re.M)
    return float(m.group(1)) if m else 0.0


def test_identical_files_in_different_layers_are_stored_once(client, server, reg, tmp_path):
    """Two images whose top layers differ (names, times, compression) but hold
    the same 4 MiB of files: the second pull stores only its own MiB, its
    layer points into the first's data blob (an extra EROFS device), reads
    give exact bytes, and gc keeps that blob while the second layer needs
    it even after the first image is gone."""
    pair = DedupPair(tmp_path, busybox_tar(), unique("dedup"))
    repo = unique("dedup")
    pair.push(reg, repo)
    ref_a, ref_b = f"{reg.host}/{repo}-a:v1", f"{reg.host}/{repo}-b:v1"
    img_a = client.pull_image(ref_a, insecure_registry=True)
    before = _metric(server, "dsec_blobs_stored_bytes")
    img_b = client.pull_image(ref_b, insecure_registry=True)
    grown = _metric(server, "dsec_blobs_stored_bytes") - before
    assert pair.own_bytes <= grown < pair.own_bytes + (256 << 10), grown
    top_a, top_b = img_a.layers[-1], img_b.layers[-1]
    st, _, _, la = server.raw("GET", f"/v1/layers/{top_a}")
    assert st == 200, la
    st, _, _, lb = server.raw("GET", f"/v1/layers/{top_b}")
    assert st == 200, lb
    assert [x["digest"] for x in lb["extra_data"]] == [la["data"]["digest"]], lb
    assert lb["data"]["size"] < pair.own_bytes + (64 << 10), lb
    info = client.image(ref_b).raw
    assert info["stored_bytes"] <= info["logical_bytes"], info

    sb = client.create(image=ref_b)
    try:
        assert shas_in(sb, pair.files_b) == pair.files_b
    finally:
        sb.destroy()

    # A goes; its layer is collected, its data blob stays for B's layer.
    client.delete_image(ref_a)
    removed = client.gc(grace_s=0)
    assert top_a in removed and la["data"]["digest"] not in removed, removed
    sb = client.create(image=ref_b)
    try:
        assert shas_in(sb, pair.files_b) == pair.files_b
    finally:
        sb.destroy()
    client.delete_image(ref_b)
    removed = client.gc(grace_s=0)
    assert {top_b, la["data"]["digest"], lb["data"]["digest"]} <= set(removed), removed


def _allocated(path: Path) -> int:
    return path.stat().st_blocks * 512


def test_gc_removes_the_chunks_no_layer_reads_any_more(client, server, reg, tmp_path):
    """A's layer also holds 2 MiB B does not have. Once A is gone, gc keeps
    A's data blob for B but punches out the chunks no layer reads: the file
    shrinks on disk, the API says so, B still reads exact bytes from it on a
    cold node, and A pulled again reads its own bytes from a new blob. The
    blob uploaded whole again is whole in the record too."""
    pair = DedupPair(tmp_path, busybox_tar(), unique("reclaim"), a_own=2 * (1 << 20) + 777)
    repo = unique("reclaim")
    pair.push(reg, repo)
    ref_a, ref_b = f"{reg.host}/{repo}-a:v1", f"{reg.host}/{repo}-b:v1"
    img_a = client.pull_image(ref_a, insecure_registry=True)
    img_b = client.pull_image(ref_b, insecure_registry=True)
    top_a, top_b = img_a.layers[-1], img_b.layers[-1]
    st, _, _, la = server.raw("GET", f"/v1/layers/{top_a}")
    assert st == 200, la
    data_a = la["data"]["digest"]
    st, _, _, lb = server.raw("GET", f"/v1/layers/{top_b}")
    assert [x["digest"] for x in lb["extra_data"]] == [data_a], lb
    assert lb["extra_data"][0]["reclaimed_bytes"] == 0, lb
    path = server.data_dir / "blobs" / "sha256" / data_a[7:]
    whole = path.read_bytes()
    alloc_before = _allocated(path)
    stored_before = client.image(ref_b).raw["stored_bytes"]

    # Nothing to take while A's layer lives.
    st, _, _, gc = server.raw("POST", "/v1/gc", {"grace_s": 0})
    assert st == 200 and gc["reclaimed"] == [], gc

    client.delete_image(ref_a)
    st, _, _, gc = server.raw("POST", "/v1/gc", {"grace_s": 0})
    assert st == 200, gc
    assert top_a in gc["removed"] and data_a not in gc["removed"], gc
    [rec] = gc["reclaimed"]
    assert rec["digest"] == data_a, gc
    # All of A's own bytes but the 128 KiB chunk it shares with B's files.
    own = pair.a_own_bytes
    assert own - (256 << 10) <= rec["bytes"] <= own + (128 << 10), (rec, own)
    assert path.stat().st_size == len(whole)
    assert alloc_before - _allocated(path) >= rec["bytes"] - 4096, (alloc_before, _allocated(path))
    st, _, _, lb = server.raw("GET", f"/v1/layers/{top_b}")
    assert lb["extra_data"][0]["reclaimed_bytes"] >= rec["bytes"] - 4096, lb
    assert client.image(ref_b).raw["stored_bytes"] <= stored_before - rec["bytes"] + 4096
    # Once is enough: a second pass finds nothing more.
    st, _, _, gc = server.raw("POST", "/v1/gc", {"grace_s": 0})
    assert st == 200 and gc["reclaimed"] == [] and data_a not in gc["removed"], gc

    # B's first sandbox: its node fetches from the holed blob what B reads.
    sb = client.create(image=ref_b)
    try:
        assert shas_in(sb, pair.files_b) == pair.files_b
    finally:
        sb.destroy()

    # A again: its shared files point into the old blob (their chunks are
    # still found), its own bytes are stored anew.
    img_a2 = client.pull_image(ref_a, insecure_registry=True)
    st, _, _, la2 = server.raw("GET", f"/v1/layers/{img_a2.layers[-1]}")
    assert st == 200, la2
    assert la2["data"]["digest"] != data_a, la2
    sb = client.create(image=ref_a)
    try:
        assert shas_in(sb, pair.files_a) == pair.files_a
    finally:
        sb.destroy()

    # An uploader that skips what exists sends it again (HEAD: absent), and a
    # layer cannot be made on it as it is.
    st, _, _, _ = server.raw("HEAD", f"/v1/blobs/{data_a}")
    assert st == 404
    meta = b"not a layer " + data_a.encode()
    meta_digest = "sha256:" + hashlib.sha256(meta).hexdigest()
    st, _, _, err = server.raw("PUT", f"/v1/blobs/{meta_digest}?data={data_a}", meta,
                               headers={"Content-Type": "application/octet-stream"})
    assert st == 409 and err["error"]["code"] == "failed_precondition", (st, err)
    assert err["error"]["field"] == "data", err
    st, _, _, _ = server.raw("HEAD", f"/v1/blobs/{meta_digest}")
    assert st == 404
    assert not (server.data_dir / "blobs" / "sha256" / meta_digest[7:]).exists()

    # The blob's whole bytes uploaded again make it whole, in the record too.
    st, _, _, up = server.raw("PUT", f"/v1/blobs/{data_a}", whole,
                              headers={"Content-Type": "application/octet-stream"})
    assert st in (200, 201), up
    st, _, _, lb = server.raw("GET", f"/v1/layers/{top_b}")
    assert lb["extra_data"][0]["reclaimed_bytes"] == 0, lb
    assert path.read_bytes() == whole
    st, _, _, _ = server.raw("HEAD", f"/v1/blobs/{data_a}")
    assert st == 200

    client.delete_image(ref_a)
    client.delete_image(ref_b)
    removed = client.gc(grace_s=0)
    assert {top_b, data_a} <= set(removed), removed


def test_work_a_crash_left_is_swept_at_start_but_not_another_replicas(tmp_path):
    """Conversion and build-step directories in the (shared) blob directory
    carry their replica's tag: a platform starting removes its own that a
    crash left, and the build context spools of its data dir, never another
    replica's work in progress."""
    import hashlib
    from conftest import Server
    data = tmp_path / "data"
    (data / "blobs").mkdir(parents=True, mode=0o700)
    tag = hashlib.sha256(b"t1").hexdigest()[:8]
    other = hashlib.sha256(b"t2").hexdigest()[:8]
    for n in (f"pull-{tag}-dead", f"build-{tag}-b1-1", f"pull-{other}-live"):
        (data / "blobs" / n).mkdir()
        (data / "blobs" / n / "layer.data").write_bytes(b"x")
    (data / "build" / "ctx").mkdir(parents=True)
    srv = Server(data, ["--replica-id", "t1"])
    srv.start()
    try:
        left = sorted(p.name for p in (data / "blobs").iterdir()
                      if p.name.startswith(("pull-", "build-")))
        assert left == [f"pull-{other}-live"], left
        assert not (data / "build").exists()
    finally:
        srv.stop()

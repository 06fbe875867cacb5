"""The registry test harness itself, checked with skopeo only (no dsec):
oci_registry.py (a real distribution 2.8 registry: no auth, htpasswd, token,
TLS, redirects), oci_build.py (OCI layouts) and registry_proxy.py (faults).
Each test takes a second or two, but the one marked slow (2 GiB of zeros)."""

from __future__ import annotations

import base64
import gzip
import hashlib
import http.client
import io
import json
import os
import re
import subprocess
import tarfile
import time

import pytest

from oci_build import (MT_INDEX, MT_LAYER, MT_MANIFEST, OciLayout, chardev, directory, file,
                       fifo, hardlink, layer_tar, opaque, symlink, whiteout)
from oci_registry import (libtrust_key_id, make_registry, registry,  # noqa: F401  (fixtures)
                          token_registry)
from registry_proxy import RegistryProxy


def small_image(d, tag="v1", marker="one") -> OciLayout:
    img = OciLayout(d)
    img.add_layer([directory("etc"), file("etc/marker", marker + "\n"), symlink("lnk", "etc/marker")])
    img.add_layer({"z.txt": "zstd layer\n"}, compression="zstd")
    img.set_config(user="1000:1000", env={"PATH": "/bin", "A": "1"}, workdir="/w",
                   entrypoint=["/bin/sh", "-c"], cmd=["echo hi"], labels={"k": "v"})
    img.write(tag)
    return img


def layer_digests(manifest: dict) -> list:
    return [l["digest"] for l in manifest["layers"]]


# ----- push and inspect in every mode ----------------------------------------------

@pytest.mark.parametrize("auth,tls", [(None, False), ("htpasswd", False), ("token", False),
                                      (None, True), ("token", True)],
                         ids=["none", "htpasswd", "token", "tls", "token-tls"])
def test_push_and_inspect(make_registry, tmp_path, auth, tls):
    reg = make_registry(auth=auth, tls=tls)
    assert reg.start_seconds[0] < 5, reg.start_seconds
    img = small_image(tmp_path / "img")
    reg.push_oci(img.dir, "app", "v1")

    raw = reg.skopeo("inspect", "--raw", *reg._tls_args("", None, True),
                     *reg._creds_args("", reg.creds), f"docker://{reg.ref('app', 'v1')}",
                     check=True).stdout
    # skopeo pushed our manifest byte for byte (OCI source, OCI-capable registry)
    assert "sha256:" + hashlib.sha256(raw.encode()).hexdigest() == img.manifest_digest
    conf = reg.inspect("app", "v1", config=True)
    assert conf["config"]["User"] == "1000:1000"
    assert conf["config"]["Env"] == ["PATH=/bin", "A=1"]
    assert conf["config"]["Entrypoint"] == ["/bin/sh", "-c"] and conf["config"]["Labels"] == {"k": "v"}

    st, hdrs, body = reg.request("GET", "/v2/app/manifests/v1", headers={"Accept": MT_MANIFEST})
    if auth is None:
        assert st == 200 and hdrs["docker-content-digest"] == img.manifest_digest
    else:
        assert st == 401, (st, body)
        scheme = "Basic" if auth == "htpasswd" else "Bearer"
        assert hdrs["www-authenticate"].startswith(scheme + " realm="), hdrs
        assert json.loads(body)["errors"][0]["code"] == "UNAUTHORIZED"
        r = reg.skopeo("inspect", "--raw", *reg._tls_args("", None, True), "--no-creds",
                       f"docker://{reg.ref('app', 'v1')}")
        assert r.returncode != 0 and re.search("unauthorized|denied", r.stderr), r.stderr
    if tls:
        # the certificate is checked: without it, verification fails
        r = reg.skopeo("inspect", "--raw", "--tls-verify=true", *reg._creds_args("", reg.creds),
                       f"docker://{reg.ref('app', 'v1')}")
        assert r.returncode != 0 and "certificate" in r.stderr, r.stderr
    if auth == "token":
        ts = reg.token_server
        assert ts.count >= 2  # skopeo's push and inspects each asked
        assert any("repository:app:pull,push" in r["scopes"] for r in ts.requests), ts.requests
        assert all(c["aud"] == "dsec-test-registry" and c["iss"] == "dsec-test-issuer"
                   for c in ts.issued)


@pytest.mark.parametrize("auth", ["htpasswd", "token"])
def test_bad_credentials_are_refused(make_registry, tmp_path, auth):
    reg = make_registry(auth=auth, users={"alice": "secret", "bob": "hunter2"})
    img = small_image(tmp_path / "img")
    r = reg.push_oci(img.dir, "app", "v1", creds="alice:wrong", check=False)
    assert r.returncode != 0, r.stderr
    assert re.search(r"unauthorized|invalid username/password", r.stderr), r.stderr
    reg.push_oci(img.dir, "app", "v1", creds="bob:hunter2")
    r = reg.skopeo("inspect", "--raw", "--tls-verify=false", "--creds=mallory:secret",
                   f"docker://{reg.ref('app', 'v1')}")
    assert r.returncode != 0 and "unauthorized" in r.stderr, r.stderr
    assert reg.inspect("app", "v1", creds="alice:secret")["layers"] == img.manifest["layers"]
    if auth == "htpasswd":
        st, hdrs, _ = reg.request("GET", "/v2/", creds="alice:wrong")
        assert st == 401 and hdrs["www-authenticate"] == 'Basic realm="dsec-test-registry"'
        assert reg.request("GET", "/v2/", creds="alice:secret")[0] == 200
    else:
        bad = [x for x in reg.token_server.requests if x["user"] in ("alice", "mallory")
               and x["status"] == 401]
        assert bad, reg.token_server.requests


# ----- token auth details ----------------------------------------------------------

@pytest.mark.parametrize("header", ["x5c", "kid"])
def test_token_auth_scopes_denials_and_expiry(make_registry, tmp_path, header):
    reg = make_registry(auth="token", token_header=header, deny={"denied"}, public={"pub"})
    ts = reg.token_server
    img = small_image(tmp_path / "img")
    reg.push_oci(img.dir, "app", "v1")
    reg.push_oci(img.dir, "pub", "v1")
    acc = {"Accept": MT_MANIFEST}

    # the header distribution 2.8 accepts: both x5c and the libtrust kid
    tok = reg.token(["repository:app:pull"])
    hdr = json.loads(_b64url(tok.split(".")[0]))
    assert (("x5c" in hdr) if header == "x5c" else hdr["kid"] == ts.kid), hdr
    assert reg.request("GET", "/v2/app/manifests/v1", headers=acc, bearer=tok)[0] == 200

    # a scope the token server denies: 401 with error="insufficient_scope", never 403
    r = reg.push_oci(img.dir, "denied", "v1", check=False)
    assert r.returncode != 0 and "denied" in r.stderr, r.stderr
    st, hdrs, body = reg.request("GET", "/v2/denied/manifests/v1", headers=acc,
                                 bearer=reg.token(["repository:denied:pull"]))
    assert st == 401 and 'error="insufficient_scope"' in hdrs["www-authenticate"], (st, hdrs)
    assert 'scope="repository:denied:pull"' in hdrs["www-authenticate"]
    assert ts.issued[-1]["access"] == [{"type": "repository", "name": "denied", "actions": []}]

    # anonymous: a token with no access (401 insufficient_scope), but pull of `public`
    st, hdrs, _ = reg.request("GET", "/v2/app/manifests/v1", headers=acc,
                              bearer=reg.token(["repository:app:pull"], creds=None))
    assert st == 401 and "insufficient_scope" in hdrs["www-authenticate"]
    assert reg.request("GET", "/v2/pub/manifests/v1", headers=acc,
                       bearer=reg.token(["repository:pub:pull"], creds=None))[0] == 200
    assert reg.inspect("pub", "v1", creds=None)["layers"] == img.manifest["layers"]

    # several scopes in one request
    tok = reg.token(["repository:app:pull", "repository:pub:pull,push"])
    assert [a["name"] for a in ts.issued[-1]["access"]] == ["app", "pub"]
    assert reg.request("GET", "/v2/pub/manifests/v1", headers=acc, bearer=tok)[0] == 200

    # distribution allows 60 s of clock skew past exp
    stale = ts.make_token("alice", ["repository:app:pull"], expires_in=-30)
    assert reg.request("GET", "/v2/app/manifests/v1", headers=acc, bearer=stale)[0] == 200
    old = ts.make_token("alice", ["repository:app:pull"], expires_in=-120)
    assert reg.request("GET", "/v2/app/manifests/v1", headers=acc, bearer=old)[0] == 401

    # counting: the harness's own token requests are left out of `count`
    before = ts.count
    reg.token(["repository:app:pull"])
    assert ts.count == before
    reg.inspect("app", "v1")
    assert ts.count == before + 1
    # injected failures of the token endpoint
    ts.fail_next(1, 503)
    r = reg.skopeo("inspect", "--raw", "--tls-verify=false", f"--creds={reg.creds}",
                   f"docker://{reg.ref('app', 'v1')}")
    assert r.returncode != 0 and "503" in r.stderr, r.stderr


def _b64url(s: str) -> bytes:
    return base64.urlsafe_b64decode(s + "=" * (-len(s) % 4))


def test_libtrust_key_id_format():
    kid = libtrust_key_id(b"any der")
    assert re.fullmatch(r"([A-Z2-7]{4}:){11}[A-Z2-7]{4}", kid), kid


# ----- formats ---------------------------------------------------------------------

def test_multi_arch_index(make_registry, tmp_path):
    reg = make_registry()
    idx = OciLayout(tmp_path / "multi")
    amd, arm = OciLayout(idx.dir), OciLayout(tmp_path / "arm")  # shared dir, and copied
    amd.add_layer({"arch": "amd64\n"})
    arm.add_layer({"arch": "arm64\n"}, compression="zstd")
    index_digest = idx.write_multi_arch("latest", {"linux/amd64": amd, "linux/arm64/v8": arm})
    reg.push_oci(idx.dir, "multi", "latest", all_platforms=True)

    index = reg.inspect("multi", "latest")
    assert index["mediaType"] == MT_INDEX
    assert [m["platform"] for m in index["manifests"]] == [
        {"architecture": "amd64", "os": "linux"},
        {"architecture": "arm64", "os": "linux", "variant": "v8"}]
    st, hdrs, _ = reg.request("GET", "/v2/multi/manifests/latest", headers={"Accept": MT_INDEX})
    assert st == 200 and hdrs["docker-content-digest"] == index_digest
    # per platform, as skopeo chooses
    # (skopeo's "Digest" is the index's; "Layers" are the chosen image's)
    a = reg.inspect("multi", "latest", raw=False, arch="arm64")
    assert a["Architecture"] == "arm64" and a["Digest"] == index_digest
    assert a["Layers"] == layer_digests(arm.manifest)
    a = reg.inspect("multi", "latest", raw=False, arch="amd64")
    assert a["Architecture"] == "amd64" and a["Layers"] == layer_digests(amd.manifest)
    assert reg.inspect("multi", arm.manifest_digest)["layers"][0]["mediaType"] == MT_LAYER["zstd"]
    # pulling one platform gets that one only
    reg.pull_oci("multi", "latest", tmp_path / "pulled", override_arch="arm64")
    got = json.loads((tmp_path / "pulled" / "index.json").read_text())["manifests"]
    assert [m["digest"] for m in got] == [arm.manifest_digest]
    # without --all only the host's platform is pushed: the index is gone
    reg.push_oci(idx.dir, "single", "latest")
    assert reg.inspect("single", "latest")["mediaType"] == MT_MANIFEST


def test_zstd_and_uncompressed_layers(registry, tmp_path):
    """skopeo 1.9.3 keeps +zstd layers of an oci: source as they are, but
    gzips uncompressed layers on the way to a registry (new digests, OCI +gzip
    media type); push_raw keeps them. --format v2s2 refuses zstd."""
    reg = registry
    img = OciLayout(tmp_path / "img")
    img.add_layer({"g": "gzip\n"})
    img.add_layer({"z": "zstd\n"}, compression="zstd")
    img.add_layer({"n": "none\n"}, compression="none")
    img.write("v1")
    reg.push_oci(img.dir, "skopeo", "v1")
    m = reg.inspect("skopeo", "v1")
    assert [l["mediaType"] for l in m["layers"]] == [MT_LAYER["gzip"], MT_LAYER["zstd"],
                                                     MT_LAYER["gzip"]]
    assert layer_digests(m)[:2] == layer_digests(img.manifest)[:2]
    assert layer_digests(m)[2] != img.layers[2]["digest"]

    assert reg.push_raw(img.dir, "raw", "v1") == img.manifest_digest
    m = reg.inspect("raw", "v1")
    assert m == img.manifest
    st, _, body = reg.request("GET", f"/v2/raw/blobs/{img.layers[2]['digest']}")
    assert st == 200 and tarfile.open(fileobj=io.BytesIO(body)).getnames() == ["n"]

    r = reg.push_oci(img.dir, "v2s2", "v1", fmt="v2s2", check=False)
    assert r.returncode != 0 and "zstd compression is not supported" in r.stderr, r.stderr
    plain = OciLayout(tmp_path / "plain")
    plain.add_layer({"g": "gzip\n"})
    plain.write("v1")
    reg.push_oci(plain.dir, "v2s2", "v1", fmt="v2s2")
    m = reg.inspect("v2s2", "v1")
    assert m["mediaType"] == "application/vnd.docker.distribution.manifest.v2+json"
    assert m["layers"][0]["mediaType"] == "application/vnd.docker.image.rootfs.diff.tar.gzip"
    # distribution serves an OCI manifest only to a client that accepts one
    for accept in (None, "*/*", "application/vnd.docker.distribution.manifest.v2+json"):
        st, _, body = reg.request("GET", "/v2/raw/manifests/v1",
                                  headers={"Accept": accept} if accept else {})
        assert st == 404 and b"accept header does not support OCI manifests" in body, accept


def test_builders_are_deterministic_and_complete(tmp_path):
    def build(d):
        img = OciLayout(d)
        img.add_layer([directory("dir", mode=0o750, uid=5, gid=6), file("dir/f", b"\x00\xffdata"),
                       file("dir/exec", "#!/bin/sh\n", mode=0o755, mtime=1234567890),
                       symlink("dir/sym", "f"), hardlink("dir/hard", "dir/f"),
                       chardev("dev/null", 1, 3), fifo("dev/fifo"),
                       file("ünïcödé/日本.txt", "utf-8\n"),
                       file("x", "x", xattrs={"user.a": "1", "security.capability": b"\x01\x00"})])
        img.add_layer([whiteout("dir/f"), opaque("other/"), file("other/new", "n")],
                      compression="zstd")
        img.add_layer(layer_tar({"plain": "p"}), compression="none")
        img.set_config(cmd=["true"])
        return img.write("t"), img
    d1, a = build(tmp_path / "a")
    d2, b = build(tmp_path / "b")
    assert d1 == d2 and a.config_digest == b.config_digest
    for l in a.layers:
        blob = a.blob_path(l["digest"]).read_bytes()
        assert "sha256:" + hashlib.sha256(blob).hexdigest() == l["digest"] and len(blob) == l["size"]
    raw = gzip.decompress(a.blob_path(a.layers[0]["digest"]).read_bytes())
    assert "sha256:" + hashlib.sha256(raw).hexdigest() == a.diff_ids[0]
    tf = tarfile.open(fileobj=io.BytesIO(raw))
    m = {x.name: x for x in tf.getmembers()}
    assert m["dir"].isdir() and (m["dir"].mode, m["dir"].uid, m["dir"].gid) == (0o750, 5, 6)
    assert m["dir/exec"].mtime == 1234567890 and m["dir/f"].mtime == 1700000000
    assert m["dir/sym"].issym() and m["dir/sym"].linkname == "f"
    assert m["dir/hard"].islnk() and m["dir/hard"].linkname == "dir/f"
    assert m["dev/null"].ischr() and (m["dev/null"].devmajor, m["dev/null"].devminor) == (1, 3)
    assert m["dev/fifo"].isfifo() and "ünïcödé/日本.txt" in m
    assert m["x"].pax_headers["SCHILY.xattr.user.a"] == "1"
    assert m["x"].pax_headers["SCHILY.xattr.security.capability"].encode(
        "utf-8", "surrogateescape") == b"\x01\x00"
    top = subprocess.run(["zstd", "-dc", str(a.blob_path(a.layers[1]["digest"]))],
                         capture_output=True, check=True).stdout
    assert tarfile.open(fileobj=io.BytesIO(top)).getnames() == [
        "dir/.wh.f", "other/.wh..wh..opq", "other/new"]
    assert a.layers[2]["mediaType"] == MT_LAYER["none"]
    # the tar for `dsec image import`
    names = tarfile.open(a.to_tar(tmp_path / "a.tar")).getnames()
    assert names[:2] == ["oci-layout", "index.json"] and len(names) == 2 + 5


@pytest.mark.parametrize("kind", ["sparse", "zeros"])
def test_large_file_layers(make_registry, tmp_path, kind):
    """Small (64 MiB) versions of the 2 GiB builders, pushed and pulled back."""
    size = 64 << 20
    img = OciLayout(tmp_path / "img")
    if kind == "sparse":
        lf = img.add_sparse_layer(tmp_path / "work", size=size)
        again = OciLayout(tmp_path / "img2").add_sparse_layer(tmp_path / "work", size=size)
    else:
        lf = img.add_zeros_layer(size=size)
        again = OciLayout(tmp_path / "img2").add_zeros_layer(size=size)
    assert lf.descriptor == again.descriptor, "not deterministic"
    assert lf.descriptor["size"] < 200_000
    # GNU sparse: only the data blocks are in the tar; plain: all of it
    assert (img.uncompressed_sizes[0] < 100_000) if kind == "sparse" else \
        (img.uncompressed_sizes[0] > size)
    img.write("v1")
    raw = gzip.decompress(img.blob_path(img.layers[0]["digest"]).read_bytes())
    member = tarfile.open(fileobj=io.BytesIO(raw)).getmembers()[0]
    assert member.name == lf.name and member.size == size
    if kind == "sparse":
        assert member.sparse and member.pax_headers["GNU.sparse.major"] == "1"
        assert b"GNUSparseFile.1/" in raw[:2048]  # tar ran as pid 1: deterministic
    else:
        assert not member.sparse
    data = tarfile.open(fileobj=io.BytesIO(raw)).extractfile(member).read()
    assert hashlib.sha256(data).hexdigest() == lf.sha256()
    assert data[:5] == b"head " and data[-5:] == b"tail "
    reg = make_registry()
    reg.push_oci(img.dir, "big", "v1")
    reg.pull_oci("big", "v1", tmp_path / "pulled")
    assert (tmp_path / "pulled" / "blobs/sha256" / lf.descriptor["digest"][7:]).exists()


@pytest.mark.slow
def test_two_gib_layers(tmp_path):
    img = OciLayout(tmp_path / "img")
    t0 = time.monotonic()
    sp = img.add_sparse_layer(tmp_path / "work")
    t_sparse = time.monotonic() - t0
    zs = img.add_zeros_layer()
    assert sp.size == zs.size == 2 << 30
    assert sp.descriptor["size"] < 100_000 and zs.descriptor["size"] < 3_000_000, (sp, zs)
    assert t_sparse < 10
    img.write("big")
    assert not list((tmp_path / "work").iterdir())
    total = sum(p.stat().st_blocks * 512 for p in tmp_path.rglob("*") if p.is_file())
    assert total < 20 << 20, f"{total} bytes on disk"


# ----- the registry process --------------------------------------------------------

def test_restart_and_kill_keep_storage_and_port(token_registry, tmp_path):
    reg = token_registry
    img = small_image(tmp_path / "img")
    reg.push_oci(img.dir, "app", "v1")
    port = reg.port
    reg.kill()
    assert not reg.running
    with pytest.raises(OSError):
        reg.request("GET", "/v2/", timeout=2)
    reg.restart()
    assert reg.port == port and reg.inspect("app", "v1") == img.manifest
    reg.restart()  # while running
    assert reg.inspect("app", "v1") == img.manifest
    assert len(reg.start_seconds) == 3 and max(reg.start_seconds) < 5
    # a blob removed from the storage: distribution answers 404 BLOB_UNKNOWN
    d = img.layers[0]["digest"]
    reg.blob_path(d).unlink()
    st, _, body = reg.request("GET", f"/v2/app/blobs/{d}",
                              bearer=reg.token(["repository:app:pull"]))
    assert st == 404 and b"BLOB_UNKNOWN" in body, (st, body)


def test_redirect_to_storage(make_registry, tmp_path):
    reg = make_registry(auth="htpasswd", redirect=True)
    img = small_image(tmp_path / "img")
    reg.push_oci(img.dir, "app", "v1")
    d = img.layers[0]["digest"]
    for method in ("GET", "HEAD"):
        st, hdrs, _ = reg.request(method, f"/v2/app/blobs/{d}", creds=reg.creds)
        assert st == 307, (method, st)
        assert hdrs["location"] == (f"{reg.file_server.url}docker/registry/v2/blobs/sha256/"
                                    f"{d[7:9]}/{d[7:]}/data")
    reg.pull_oci("app", "v1", tmp_path / "pulled")
    path = f"/docker/registry/v2/blobs/sha256/{d[7:9]}/{d[7:]}/data"
    assert reg.file_server.hits.get(path, 0) >= 1, reg.file_server.hits
    # the redirect target does ranges
    c = http.client.HTTPConnection("127.0.0.1", reg.file_server.port, timeout=10)
    c.request("GET", path, headers={"Range": "bytes=2-5"})
    r = c.getresponse()
    assert r.status == 206 and r.read() == reg.blob_path(d).read_bytes()[2:6]
    c.close()


# ----- the proxy -------------------------------------------------------------------

def test_proxy_passes_through(make_registry, tmp_path):
    reg = make_registry(auth="token")
    img = small_image(tmp_path / "img")
    with RegistryProxy(reg) as px:
        # a push through the proxy: upload Locations point back at it
        reg.push_oci(img.dir, "app", "v1", host=px.host)
        assert px.count(method="PUT", path=re.compile(r"/blobs/uploads/")) == 3
        assert px.count(method="PUT", path="/v2/app/manifests/v1") == 1
        px.reset()
        reg.pull_oci("app", "v1", tmp_path / "pulled", host=px.host)
        assert px.hits["/v2/"] == 1
        assert px.requests[0]["status"] == 401  # the challenge went through
        for l in img.layers:
            assert px.count(f"/v2/app/blobs/{l['digest']}", method="GET") == 1
        d = img.layers[0]["digest"]
        tok = reg.token(["repository:app:pull"])
        c = http.client.HTTPConnection("127.0.0.1", px.port, timeout=10)
        c.request("HEAD", f"/v2/app/blobs/{d}", headers={"Authorization": "Bearer " + tok})
        r = c.getresponse()
        assert r.status == 200 and r.read() == b"" and r.getheader("Docker-Content-Digest") == d
        assert int(r.getheader("Content-Length")) == img.layers[0]["size"]
        c.request("GET", f"/v2/app/blobs/{d}", headers={"Authorization": "Bearer " + tok,
                                                       "Range": "bytes=3-9"})
        r = c.getresponse()
        assert r.status == 206 and len(r.read()) == 7
        assert r.getheader("Content-Range") == f"bytes 3-9/{img.layers[0]['size']}"
        c.close()
        assert px.ranges == [(f"/v2/app/blobs/{d}", "bytes=3-9")]


def test_proxy_faults_seen_by_skopeo(make_registry, tmp_path):
    """skopeo 1.9.3 neither retries nor resumes a blob: every fault fails its
    copy, and the next copy (fault spent) succeeds."""
    reg = make_registry()
    img = OciLayout(tmp_path / "img")
    img.add_layer({"big": os.urandom(1 << 20)}, compression="none")
    img.add_layer({"small": "s\n"})
    img.write("v1")
    reg.push_raw(img.dir, "app", "v1")
    big = img.layers[0]["digest"]
    n = [0]

    def pull():
        n[0] += 1
        return reg.pull_oci("app", "v1", tmp_path / f"p{n[0]}", host=px.host, check=False,
                            extra=["--dest-oci-accept-uncompressed-layers"])

    with RegistryProxy(reg) as px:
        f = px.corrupt(big, times=1)
        r = pull()
        assert r.returncode != 0 and "Digest did not match" in r.stderr, r.stderr
        assert f.applied == 1 and pull().returncode == 0

        px.reset()
        f = px.cut(big, after=100_000, times=2)
        for _ in range(2):
            r = pull()
            assert r.returncode != 0 and "unexpected EOF" in r.stderr, r.stderr
        assert pull().returncode == 0
        assert f.applied == 2 and px.count(blob=big, method="GET") == 3
        cut_sent = [x["sent"] for x in px.requests if x["faults"] == ["cut"]]
        assert cut_sent == [100_000, 100_000]
        assert px.ranges == []  # no resume with Range

        px.reset()
        px.refuse(2, status=500, path=big)  # (skopeo fetches blobs in parallel)
        r = pull()
        assert r.returncode != 0 and "500" in r.stderr, r.stderr
        assert pull().returncode != 0 and pull().returncode == 0
        assert [x["status"] for x in px.requests if x["faults"] == ["refuse"]] == [500, 500]

        px.reset()
        px.stall(1.0, big, after=50_000)
        t0 = time.monotonic()
        assert pull().returncode == 0
        assert time.monotonic() - t0 >= 1.0

        px.reset()
        px.corrupt(times=None)  # every blob
        r = pull()
        assert r.returncode != 0 and "Digest did not match" in r.stderr
        st, _, body = reg.request("GET", f"/v2/app/blobs/{big}")
        assert st == 200 and "sha256:" + hashlib.sha256(body).hexdigest() == big  # direct: fine

"""The layer model: base, workspace, toolkit and diff layers composed at create
time, tags, deletes refused while in use, and garbage collection."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import dsec
from helpers import expect_error, unique


def make_tree(root: Path, files: dict) -> Path:
    for rel, (content, mode) in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(content)
        os.chmod(p, mode)
    return root


def import_layer(server, tmp_path, name: str, kind: str, files: dict) -> str:
    tree = make_tree(tmp_path / unique("tree"), files)
    r = server.cli("image", "import", "--data-dir", server.data_dir, "--kind", kind,
                   "--name", name, tree, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_compose_base_workspace_toolkit_at_create(server, client, busybox, tmp_path,
                                                    make_sandbox):
    tk, ws = unique("tk"), unique("ws")
    tk_digest = import_layer(server, tmp_path, f"{tk}:1", "toolkit", {
        "opt/tk/bin/hello": ("#!/bin/sh\necho hello from toolkit v1\n", 0o755)})
    ws_digest = import_layer(server, tmp_path, f"{ws}:1", "workspace", {
        "workspace/README": ("task: fix the bug\n", 0o644)})
    base_layers = client.image(busybox).layers
    assert client.image(f"{tk}:1").kind == "toolkit"

    sb = make_sandbox(busybox, workspaces=[f"{ws}:1"], toolkits=[f"{tk}:1"])
    assert sb.info["layers"] == base_layers + [ws_digest, tk_digest]
    assert sb.info["toolkits"] == [f"{tk}:1"] and sb.info["workspaces"] == [f"{ws}:1"]
    assert sb.exec("/opt/tk/bin/hello").stdout == "hello from toolkit v1\n"
    assert sb.read_file("/workspace/README") == b"task: fix the bug\n"
    assert sb.exec("busybox echo base works").stdout == "base works\n"

    # a new toolkit version is one new layer; the base is untouched
    tk2 = import_layer(server, tmp_path, f"{tk}:2", "toolkit", {
        "opt/tk/bin/hello": ("#!/bin/sh\necho hello from toolkit v2\n", 0o755)})
    assert tk2 != tk_digest
    assert client.image(busybox).layers == base_layers
    sb2 = make_sandbox(busybox, toolkits=[f"{tk}:2"])
    assert sb2.exec("/opt/tk/bin/hello").stdout == "hello from toolkit v2\n"
    assert sb.exec("/opt/tk/bin/hello").stdout == "hello from toolkit v1\n"
    # by digest works too
    sb3 = make_sandbox(busybox, toolkits=[tk_digest])
    assert sb3.exec("/opt/tk/bin/hello").stdout == "hello from toolkit v1\n"


def test_kinds_are_checked(server, client, busybox, tmp_path):
    tk = unique("tk")
    tk_digest = import_layer(server, tmp_path, f"{tk}:1", "toolkit", {
        "opt/x": ("x\n", 0o644)})
    e = expect_error(lambda: client.create(busybox, toolkits=[busybox]), dsec.InvalidArgument,
                     status=400)
    assert e.field == "toolkits"
    e = expect_error(lambda: client.create(busybox, workspaces=[f"{tk}:1"]),
                     dsec.InvalidArgument, status=400)
    assert e.field == "workspaces"
    expect_error(lambda: client.create(busybox, toolkits=[f"{unique('nope')}:1"]), dsec.NotFound)
    # a layer keeps its kind
    expect_error(lambda: client.create_image(unique("as-base"), "1", [tk_digest], kind="base"),
                 dsec.Conflict, status=409)
    e = expect_error(lambda: client.create_image(unique("k"), "1", [tk_digest], kind="tool"),
                     dsec.InvalidArgument, status=400)
    assert e.field == "kind"
    e = expect_error(lambda: client.create(busybox, toolkits=[f"{tk}:1", f"{tk}:1"]),
                     dsec.InvalidArgument, status=400)


def test_tag_delete_in_use_and_gc(server, client, busybox, tmp_path):
    tk = unique("tk")
    digest = import_layer(server, tmp_path, f"{tk}:1", "toolkit", {"opt/y": ("y\n", 0o644)})
    alias = client.tag_image(f"{tk}:1", f"{tk}-alias", "x")
    assert alias.layers == [digest] and alias.kind == "toolkit"
    layer = client.layer(digest)
    assert layer["kind"] == "toolkit" and set(layer["images"]) == {f"{tk}:1", f"{tk}-alias:x"}

    sb = client.create(busybox, toolkits=[f"{tk}:1"])
    server.created.add(sb.id)
    try:
        assert client.layer(digest)["in_use"] is True
        expect_error(lambda: client.delete_image(f"{tk}:1"), dsec.Conflict, status=409)
        expect_error(lambda: client.delete_layer(digest), dsec.Conflict, status=409)
    finally:
        sb.destroy()
    client.delete_image(f"{tk}:1")
    # still named by the alias: neither deletable nor collected
    expect_error(lambda: client.delete_layer(digest), dsec.Conflict, status=409)
    assert digest not in client.gc(grace_s=0)
    client.delete_image(f"{tk}-alias:x")
    blob = Path(server.data_dir) / "blobs" / "sha256" / digest.split(":")[1]
    assert blob.exists()
    removed = client.gc(grace_s=0)
    assert digest in removed
    assert not blob.exists()
    expect_error(lambda: client.layer(digest), dsec.NotFound, status=404)
    # image layers in use by images are never collected
    for d in client.image(busybox).layers:
        assert d not in removed
        assert client.layer(d)["images"]


def test_unreferenced_upload_survives_the_grace_period(server, client, tmp_path):
    f = tmp_path / "blob"
    f.write_bytes(os.urandom(4096))
    digest = client.upload_blob(str(f))
    assert digest not in client.gc()  # the default grace is minutes
    client.delete_layer(digest)
    expect_error(lambda: client.layer(digest), dsec.NotFound)


def test_layers_are_metadata_plus_chunked_data(server, client, busybox, tmp_path,
                                              make_sandbox):
    """Each layer is a small EROFS metadata image plus a data blob read through
    it (mkfs.erofs --chunksize --blobdev); both go away together."""
    ws = unique("big")
    payload = os.urandom(3 << 20)
    tree = tmp_path / unique("tree")
    (tree / "data").mkdir(parents=True)
    (tree / "data" / "blob.bin").write_bytes(payload)
    r = server.cli("image", "import", "--data-dir", server.data_dir, "--kind", "workspace",
                   "--name", f"{ws}:1", tree, timeout=120)
    assert r.returncode == 0, r.stderr
    digest = r.stdout.strip()
    layer = client.layer(digest)
    assert layer["data"] and layer["data"]["digest"] != digest
    data_digest = layer["data"]["digest"]
    listed = {l["digest"]: l for l in client.layers()}
    assert data_digest not in listed, "data blobs are listed with their layer, not as layers"
    assert listed[digest]["data"]["size"] >= len(payload)
    assert listed[digest]["size"] < 64 << 10, "the metadata image should be small"

    sb = make_sandbox(busybox, workspaces=[f"{ws}:1"])
    assert sb.read_file("/data/blob.bin") == payload
    sb.destroy()
    client.delete_image(f"{ws}:1")
    removed = client.gc(grace_s=0)
    assert digest in removed and data_digest in removed
    blobs = Path(server.data_dir) / "blobs" / "sha256"
    assert not (blobs / digest.split(":")[1]).exists()
    assert not (blobs / data_digest.split(":")[1]).exists()


def test_blob_data_link_is_validated(server, client, tmp_path):
    f = tmp_path / "meta"
    f.write_bytes(os.urandom(64))
    import hashlib
    d = "sha256:" + hashlib.sha256(f.read_bytes()).hexdigest()
    missing = "sha256:" + "0" * 64
    st, _, _, doc = server.raw("PUT", f"/v1/blobs/{d}?data={missing}", body=f.read_bytes(),
                               headers={"Content-Type": "application/octet-stream"})
    assert st == 400 and doc["error"]["field"] == "data", doc
    st, _, _, doc = server.raw("PUT", f"/v1/blobs/{d}?data={d}", body=f.read_bytes(),
                               headers={"Content-Type": "application/octet-stream"})
    assert st == 400 and doc["error"]["field"] == "data", doc

"""The image config of an imported OCI / `docker save` image (User, Env,
WorkingDir) gives its sandboxes their defaults, as Docker runs a container:
commands run as the image's user, in its working dir, with its environment;
create's `user`/`env` and an exec's `user`/`cwd`/`env` override them."""

from __future__ import annotations

import io
import tarfile

import pytest

import dsec
from helpers import expect_error, unique
from test_oci_import import CACHE, _add, build_docker_save, build_oci

CONFIG = {"User": "1000:1000", "Env": ["FOO=bar", "PATH=/usr/local/bin:/usr/bin:/bin"],
          "WorkingDir": "/work", "Cmd": ["sh"]}
API_CONFIG = {"user": "1000:1000", "env": ["FOO=bar", "PATH=/usr/local/bin:/usr/bin:/bin"],
              "working_dir": "/work", "entrypoint": [], "cmd": ["sh"], "labels": {}}


def busybox_layer() -> bytes:
    src = CACHE / "busybox.tar"
    if not src.exists():
        pytest.skip(f"{src} missing (scripts/build-test-images.sh)")
    return src.read_bytes()


def app_layer() -> bytes:
    """/work for the app user, and a passwd/group that name it (so "app" resolves)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        _add(tf, "work", type=tarfile.DIRTYPE, mode=0o755, uid=1000, gid=1000)
        _add(tf, "work/hello.txt", b"hi\n", mode=0o644, uid=1000, gid=1000)
        _add(tf, "etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n"
             b"app:x:1000:1000:app:/work:/bin/sh\n"
             b"nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n", mode=0o644)
        _add(tf, "etc/group", b"root:x:0:\napp:x:1000:\nnogroup:x:65534:\n", mode=0o644)
    return buf.getvalue()


@pytest.fixture(scope="module", params=["oci", "docker"])
def app_image(request, server, tmp_path_factory) -> str:
    """Imports a two-layer image with CONFIG through the CLI; returns its ref."""
    fmt = request.param
    archive = tmp_path_factory.mktemp("cfg") / f"app-{fmt}.tar"
    (build_oci if fmt == "oci" else build_docker_save)(
        archive, [busybox_layer(), app_layer()], CONFIG)
    ref = unique(f"cfg-{fmt}") + ":1"
    r = server.cli("image", "import", "--data-dir", server.data_dir, "--name", ref, archive,
                   timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"from {fmt}" in r.stderr and "user 1000:1000" in r.stderr, r.stderr
    return ref


def test_the_image_shows_its_config(client, app_image):
    img = client.image(app_image)
    assert img.config == API_CONFIG
    assert [i for i in client.images() if i.ref == app_image][0].config == API_CONFIG
    # tagging keeps it
    other = unique("cfg-tag")
    assert client.tag_image(app_image, other, "2").config == API_CONFIG
    assert client.image(f"{other}:2").config == API_CONFIG
    client.delete_image(f"{other}:2")


def test_execs_run_as_the_images_user_in_its_dir_with_its_env(app_image, make_sandbox):
    sb = make_sandbox(app_image)
    assert (sb.user, sb.working_dir) == ("1000:1000", "/work")
    assert sb.env["FOO"] == "bar" and sb.env["PATH"] == "/usr/local/bin:/usr/bin:/bin"
    r = sb.exec("id -u; id -g; echo $FOO; pwd; cat hello.txt")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.split() == ["1000", "1000", "bar", "/work", "hi"]
    # per call: user, cwd and env win
    assert sb.exec("id -u", user="root").stdout == "0\n"
    assert sb.exec("id -u", user=0).stdout == "0\n"
    assert sb.exec("pwd", cwd="/").stdout == "/\n"
    assert sb.exec("echo $FOO", env={"FOO": "call"}).stdout == "call\n"
    # the user really is 1000: root's directories stay closed
    assert sb.exec("touch /etc/x").exit_code != 0


def test_create_user_and_env_override_the_image(app_image, make_sandbox):
    sb = make_sandbox(app_image, user="0", env={"FOO": "mine", "NEW": "1"})
    assert sb.user == "0"
    r = sb.exec("id -u; echo $FOO $NEW; echo $PATH; pwd")
    assert r.stdout.split("\n")[:4] == ["0", "mine 1", "/usr/local/bin:/usr/bin:/bin", "/work"]
    # a name from the image's own /etc/passwd
    named = make_sandbox(app_image, user="app")
    assert named.exec("id -u").stdout == "1000\n"
    # GET shows the same
    got = named.refresh()
    assert (got.user, got.working_dir) == ("app", "/work")


def test_a_working_dir_the_layers_lack_is_made(client, app_image, make_sandbox):
    img = client.image(app_image)
    ref = unique("cfg-mk")
    client.create_image(ref, "1", img.layers, config={"working_dir": "/made/here"})
    sb = make_sandbox(f"{ref}:1")
    assert sb.user == "" and sb.working_dir == "/made/here"
    r = sb.exec("id -u; pwd; stat -c %u:%a /made/here")
    assert r.stdout.split() == ["0", "/made/here", "0:755"], r


def test_a_working_dir_that_cannot_be_made_fails_the_create_cleanly(client, app_image):
    # Made by the agent at init, before the hello: its failure is the
    # create's, and nothing of the sandbox is left.
    img = client.image(app_image)
    ref = unique("cfg-bad")
    client.create_image(ref, "1", img.layers, config={"working_dir": "/etc/passwd/under"})
    before = {s.id for s in client.list()}
    with pytest.raises(dsec.DsecError) as e:
        client.create(image=f"{ref}:1")
    assert "working_dir /etc/passwd/under" in str(e.value), e.value
    assert {s.id for s in client.list()} == before


def test_a_snapshot_keeps_its_base_images_config(app_image, make_sandbox):
    sb = make_sandbox(app_image)
    assert sb.exec("echo kept > /work/state").exit_code == 0
    snap = unique("cfg-snap")
    sb.pack_diff(snap, "1")
    restored = make_sandbox(None, snapshot=f"{snap}:1")
    assert (restored.user, restored.working_dir) == ("1000:1000", "/work")
    assert restored.exec("id -u; cat state").stdout.split() == ["1000", "kept"]


def test_bad_configs_are_refused_naming_the_field(server, client, app_image):
    layers = client.image(app_image).layers
    cases = [
        ({"user": "a b"}, "config.user"),
        ({"user": "1:2:3"}, "config.user"),
        ({"user": "u" * 65}, "config.user"),
        ({"user": 1000}, "config.user"),
        ({"env": ["NOVALUE"]}, "config.env"),
        ({"env": ["=v"]}, "config.env"),
        ({"env": "FOO=bar"}, "config.env"),
        ({"env": [f"K{i}=v" for i in range(257)]}, "config.env"),
        ({"working_dir": "work"}, "config.working_dir"),
        ({"working_dir": "/a/../b"}, "config.working_dir"),
        ({"working_dir": "/a/"}, "config.working_dir"),
        ({"working_dir": "/" + "d" * 1024}, "config.working_dir"),
        ({"cmd": "sh"}, "config.cmd"),
        ({"entrypoint": [1]}, "config.entrypoint"),
        ({"labels": ["a"]}, "config.labels"),
        ({"labels": {"a": 1}}, "config.labels"),
        ({"stop_signal": "SIGINT"}, "config.stop_signal"),
        ("user=root", "config"),
    ]
    for config, field in cases:
        name = unique("cfg-bad")
        st, _, _, doc = server.raw("POST", "/v1/images",
                                   {"name": name, "layers": layers, "config": config})
        assert st == 400 and doc["error"]["field"] == field, (config, st, doc)
        st, _, _, _ = server.raw("GET", f"/v1/images/{name}:latest")
        assert st == 404, f"a refused image was stored: {config!r}"
    # config comes with layers, not with from
    st, _, _, doc = server.raw("POST", "/v1/images", {"name": unique("cfg-bad"),
                                                      "from": app_image, "config": {}})
    assert st == 400 and doc["error"]["field"] == "from", doc
    # the SDK raises with the field
    expect_error(lambda: client.create_image(unique("cfg-bad"), "1", layers,
                                             config={"working_dir": "."}),
                 dsec.InvalidArgument, field="config.working_dir", status=400)


def test_bad_create_users_are_refused(server, client, app_image):
    for user in ["a b", "", "x" * 65, ":1", "1:", 7]:
        st, _, _, doc = server.raw("POST", "/v1/sandboxes", {"image": app_image, "user": user})
        if user == "":  # empty means unset: the image's user
            assert st == 201, doc
            assert doc["user"] == "1000:1000"
            server.created.add(doc["id"])
            client.destroy(doc["id"])
            continue
        assert st == 400 and doc["error"]["field"] == "user", (user, st, doc)
    expect_error(lambda: client.create(app_image, user="a\tb"), dsec.InvalidArgument,
                 field="user", status=400)


def test_cli_create_user(server, app_image):
    r = server.cli("sandbox", "create", "--data-dir", server.data_dir, "--image", app_image,
                   "--user", "root")
    assert r.returncode == 0, r.stderr
    sid = r.stdout.strip()
    server.created.add(sid)
    try:
        r = server.cli("exec", "--data-dir", server.data_dir, sid, "--", "sh", "-c", "id -u; pwd")
        assert r.returncode == 0 and r.stdout.split() == ["0", "/work"], r
    finally:
        server.cli("sandbox", "rm", "--data-dir", server.data_dir, sid)

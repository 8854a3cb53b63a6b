"""A second reader's attacks on what root does with a tenant's image on a node, after the
build: making the replica's root file system (`images/image_roots.py`), by a tenant with
a deploy token of its own workspace and a registry image of its own. Each aims at files
the test made in its own tmp folder (never the node's real ones), each is checked on
the node.

The image's config (`WorkingDir`) is the registry's, taken as it is
(`registry_pull.pull`; the control plane only checks it starts with '/'). At a
replica's start the lazy root's mount process refuses a working folder with '..' in it
(`file_index.add_mount_points`: "leads out of the image"), and the agent falls back to
extracting the image whole (`LazyImageRoots.root_for`), where `prepare_mount_points`,
as root, on the node's copy of the image:

- makes the working folder with `mkdir(parents=True)` at `root / workdir`: a
  `WorkingDir` climbing out with '..' makes root create folders wherever the tenant
  chose;
- makes `etc/resolv.conf` and `etc/hosts` by path, following the image's `/etc` when it
  is a link to a node folder: root deletes a link of that name there (a node whose
  resolv.conf is systemd-resolved's link loses it) and creates root's files in it.

And where the build keeps a registry layer unpacked for the next steps
(`images/build/layers-userns/<layer>/`, `oci_layers.unpack_for_overlay`), root makes the
layer's device nodes as they are (`_root_fs_filter` keeps devices: "a root file system")
with the layer's modes, in folders every node user may pass (the work dir 0711, the rest
0755). The overlay a step runs on is `nodev`, but the node's copy is not: the tenant's
requirements build, which runs as its workspace's uid outside any sandbox, opens a block
device node 0666 of its layer there and reads the node's disk (here a loop device over a
file of the test's, holding a secret). The same folders hold every workspace's built
layers, readable there by any other workspace's requirements build.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from harness import EMBER, Platform, running_platform
from machine_needs import need
from oci_registry import check_tools, running_registry
from test_environment import TENANT_APP
from test_review_builds import Layer
from test_review_environments import _backend

import ember


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    with running_platform(tmp_path_factory.mktemp("platform")) as running:
        yield running


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    check_tools()
    with running_registry(tmp_path_factory.mktemp("registry")) as address:
        yield address


@pytest.fixture(scope="module")
def tenant(platform: Platform) -> str:
    """A deploy token of the workspace `mallory`."""
    platform.ember("workspace", "create", "mallory")
    made = platform.ember("token", "create", "--workspace", "mallory", "--scope", "deploy")
    return made.stdout.strip()


def push_with_config(
    registry: str, repository: str, layer: Path, config: dict[str, object]
) -> None:
    """An OCI image of one uncompressed layer whose config's `config` is the tenant's."""
    base = f"http://{registry}/v2/{repository}"
    with httpx.Client(timeout=120) as client:

        def blob(data: bytes) -> str:
            digest = "sha256:" + hashlib.sha256(data).hexdigest()
            start = client.post(f"{base}/blobs/uploads/")
            assert start.status_code == 202, start.text
            where = start.headers["location"]
            joiner = "&" if "?" in where else "?"
            put = client.put(f"{where}{joiner}digest={digest}", content=data)
            assert put.status_code == 201, put.text
            return digest

        data = layer.read_bytes()
        layer_digest = blob(data)
        body = json.dumps(
            {
                "architecture": "amd64",
                "os": "linux",
                "config": {"Env": ["PATH=/usr/local/bin:/usr/bin:/bin"], **config},
                "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
            }
        ).encode()
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": blob(body),
                "size": len(body),
            },
            "layers": [
                {
                    "mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": layer_digest,
                    "size": len(data),
                }
            ],
        }
        put = client.put(
            f"{base}/manifests/v1",
            content=json.dumps(manifest),
            headers={"Content-Type": "application/vnd.oci.image.manifest.v1+json"},
        )
        assert put.status_code == 201, put.text


def deploy_and_call(
    platform: Platform, token: str, folder: Path, name: str, image: str, *, must_deploy: bool = True
) -> str:
    """Deploy an endpoint on `image` and call it once (a replica starts: its image root
    is made); the deploy's and the call's output (a refused deploy's alone, where it
    need not deploy)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "app.py").write_text(
        f"import ember\n\nimage = {image}\n\n\n"
        "@ember.endpoint(image=image)\ndef boxed() -> str:\n    return 'ran'\n"
    )
    deployed = subprocess.run(
        [*EMBER, "deploy", str(folder / "app.py"), "--name", name],
        env=platform.tenant_env(token),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if deployed.returncode != 0:
        assert not must_deploy, deployed.stdout + deployed.stderr
        return deployed.stdout + deployed.stderr
    with platform.client(token, timeout=120) as client:
        answer = client.post(f"/mallory--{name}--boxed/", json={})
    return deployed.stdout + deployed.stderr + answer.text


def test_a_registry_working_dir_with_dots_makes_root_create_no_node_folder(
    platform: Platform, registry: str, tenant: str, tmp_path: Path
) -> None:
    """WorkingDir `/../../<node folder>/made-by-root`: the lazy mount refuses it, and the
    extraction's `prepare_mount_points` mkdirs `root / workdir` as root. Refused with
    a clear error, or made inside the image: either way nothing on the node."""
    node = tmp_path / "node-folder"
    node.mkdir(mode=0o700)  # root's alone: no tenant uid could make anything here
    target = node / "made-by-root"
    workdir = "/" + "../" * 40 + str(target).lstrip("/")
    layer = Layer(tmp_path / "layer.tar", with_etc=True)
    push_with_config(registry, "tools/workdir", layer.close(), {"WorkingDir": workdir})
    image = f"ember.Image.from_registry('{registry}/tools/workdir:v1')"
    output = deploy_and_call(
        platform, tenant, tmp_path / "app", "workdir", image, must_deploy=False
    )
    assert not target.exists(), (
        f"root created {target} (owner uid {target.stat().st_uid}) on the node, the "
        f"tenant's image's WorkingDir; the call said: {output[-400:]}"
    )


def test_a_registry_etc_link_makes_root_change_no_node_folder_at_a_replica_start(
    platform: Platform, registry: str, tenant: str, tmp_path: Path
) -> None:
    """The image's /etc is a link to a node folder holding a `resolv.conf` link (as
    systemd-resolved's node has); `prepare_mount_points`, where the agent extracts the
    image, unlinked and created `resolv.conf` and `hosts` through the link. (First seen
    with WorkingDir `/bin/..` to make the lazy mount refuse the image; a WorkingDir
    with '..' is now refused at the pull, so the image says `/`.)"""
    node = tmp_path / "node-etc"
    node.mkdir(mode=0o755)
    real = node / "stub-resolv.conf"
    real.write_text("nameserver 127.0.0.53\n")
    (node / "resolv.conf").symlink_to(real.name)
    layer = Layer(tmp_path / "layer.tar")  # no /etc folder: a link instead
    layer.add("etc", kind=tarfile.SYMTYPE, link=str(node))
    push_with_config(registry, "tools/etcroot", layer.close(), {"WorkingDir": "/"})
    image = f"ember.Image.from_registry('{registry}/tools/etcroot:v1')"
    output = deploy_and_call(platform, tenant, tmp_path / "app", "etcroot", image)
    changed = []
    if not (node / "resolv.conf").is_symlink():
        changed.append("its resolv.conf link was replaced by a file of root's")
    if os.path.lexists(node / "hosts"):
        changed.append(f"root made {node / 'hosts'}")
    assert not changed, f"through the image's /etc link: {changed}; the call said: {output[-400:]}"


SECRET_AT_START = "node-disk-secret-"

# The tenant's build backend, unsandboxed as its workspace's uid: opens TARGET (a path
# under the worker's folder) and fails the build with what it read.
READ_UNDER_WORK = """work = os.path.dirname(os.path.dirname(folder))
    with open(os.path.join(work, TARGET), "rb") as file:
        data = file.read(64).decode(errors="replace")
    raise RuntimeError("read-by-the-tenant:" + data)"""


@pytest.fixture
def loop_disk(tmp_path: Path) -> Iterator[tuple[str, tuple[int, int]]]:
    """A loop device over a file of root's (0600) holding a secret: a stand-in for the
    node's disk. Its secret and (major, minor)."""
    secret = SECRET_AT_START + os.urandom(8).hex()
    backing = tmp_path / "disk.img"
    backing.write_bytes(secret.encode().ljust(1 << 20, b"\0"))
    backing.chmod(0o600)
    made = subprocess.run(
        ["losetup", "--find", "--show", str(backing)], capture_output=True, text=True
    )
    if made.returncode != 0:
        need("node", f"no loop device for the test's disk: {made.stderr.strip()}")
    device = made.stdout.strip()
    try:
        rdev = os.stat(device).st_rdev
        yield secret, (os.major(rdev), os.minor(rdev))
    finally:
        subprocess.run(["losetup", "--detach", device], capture_output=True)


def test_a_registry_device_node_in_the_layer_cache_opens_no_node_disk_to_the_tenant(
    platform: Platform,
    registry: str,
    tenant: str,
    tmp_path: Path,
    loop_disk: tuple[str, tuple[int, int]],
) -> None:
    secret, (major, minor) = loop_disk
    layer = Layer(tmp_path / "layer.tar", with_etc=True)
    device = tarfile.TarInfo("disk")
    device.type, device.mode = tarfile.BLKTYPE, 0o666
    device.devmajor, device.devminor = major, minor
    layer.tar.addfile(device)
    push_with_config(registry, "tools/device", layer.close(), {"WorkingDir": "/"})
    reference = f"{registry}/tools/device:v1"
    # The build alone unpacks the layer into the node's cache.
    built = deploy_and_call(
        platform,
        tenant,
        tmp_path / "image-app",
        "device",
        f"ember.Image.from_registry({reference!r})",
    )
    hex_digest = ember.Image.from_registry(reference).layers[0].digest.removeprefix("sha256:")
    target = f"images/build/layers-userns/{hex_digest}/disk"
    # Then an app without image= whose requirement's build backend opens it.
    app = tmp_path / "reader" / "app.py"
    project = app.parent / "proj"
    project.mkdir(parents=True)
    (project / "pyproject.toml").write_text(
        '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n'
        '[project]\nname = "planted"\nversion = "1.0"\n'
    )
    (project / "backend.py").write_text(_backend(target, READ_UNDER_WORK))
    (app.parent / "requirements.txt").write_text("./proj\n")
    app.write_text(TENANT_APP)
    deployed = platform.ember_as(tenant, "deploy", str(app), "--name", "reader")
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    with platform.client(tenant, timeout=240) as client:
        answer = client.post("/mallory--reader--environ/", json={})
    assert "read-by-the-tenant" in answer.text or "Errno" in answer.text, (
        f"the backend did not run: {answer.text[-400:]}; the image build: {built[-300:]}"
    )
    assert secret not in answer.text, (
        f"the tenant's requirements build read the node's disk through the device node "
        f"its registry layer carried ({target} under the worker's folder): {answer.text[-300:]}"
    )


# Unsandboxed as mallory's uid: every file named secret.txt in the node's build cache.
READ_OTHERS_LAYERS = """work = os.path.dirname(os.path.dirname(folder))
    found = []
    for here, _, names in os.walk(os.path.join(work, TARGET)):
        for name in names:
            if name == "secret.txt":
                with open(os.path.join(here, name)) as file:
                    found.append(file.read().strip())
    raise RuntimeError("read-by-the-tenant:" + ",".join(found))"""


def test_another_workspaces_built_layers_are_not_readable_by_a_tenants_requirements_build(
    platform: Platform, registry: str, tenant: str, tmp_path: Path
) -> None:
    """Workspace `alice` builds an image whose step writes a secret into it; the node
    keeps the layer unpacked in `images/build/layers-userns/` (0755, under the work dir's
    0711), where mallory's requirements build (its uid, no sandbox) lists and reads it."""
    platform.ember("workspace", "create", "alice")
    alice = platform.ember("token", "create", "--workspace", "alice", "--scope", "deploy")
    secret = f"alice-secret-{os.urandom(8).hex()}"
    layer = Layer(tmp_path / "layer.tar", with_etc=True)
    push_with_config(registry, "alice/base", layer.close(), {"WorkingDir": "/"})
    step = f"echo {secret} > /secret.txt"
    image = f"ember.Image.from_registry('{registry}/alice/base:v1').run_commands({step!r})"
    folder = tmp_path / "alice"
    folder.mkdir()
    (folder / "app.py").write_text(
        f"import ember\n\nimage = {image}\n\n\n"
        "@ember.endpoint(image=image)\ndef boxed() -> str:\n    return 'ran'\n"
    )
    built = platform.ember_as(
        alice.stdout.strip(), "deploy", str(folder / "app.py"), "--name", "private"
    )
    assert built.returncode == 0, built.stdout + built.stderr
    app = tmp_path / "lister" / "app.py"
    project = app.parent / "proj"
    project.mkdir(parents=True)
    (project / "pyproject.toml").write_text(
        '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n'
        '[project]\nname = "planted"\nversion = "1.0"\n'
    )
    (project / "backend.py").write_text(_backend("images/build", READ_OTHERS_LAYERS))
    (app.parent / "requirements.txt").write_text("./proj\n")
    app.write_text(TENANT_APP)
    deployed = platform.ember_as(tenant, "deploy", str(app), "--name", "lister")
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    with platform.client(tenant, timeout=240) as client:
        answer = client.post("/mallory--lister--environ/", json={})
    assert "read-by-the-tenant" in answer.text, f"the backend did not run: {answer.text[-400:]}"
    assert secret not in answer.text, (
        "mallory's requirements build read a file of alice's image from the node's build "
        f"cache: {answer.text[answer.text.rfind('read-by-the-tenant') :][:120]}"
    )

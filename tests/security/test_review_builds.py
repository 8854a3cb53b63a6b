"""A second reader's attacks on the rootless image builds (issue 47, item 2), each by a
tenant with a deploy token of its own workspace, each aimed at files the test made in
its own tmp folder (never the node's real ones), each checked on the node:

- a registry layer with an absolute link and a hard link to it: tarfile's chown and
  chmod of the hard link (root, pulling) follow the link to the node's file;
- a registry layer with a folder and then a link of the same name: tarfile sets the
  folder's owner and mode last, through the link, on the node's file;
- a copy step's tar (uploaded with the deploy token) with a hard link whose target
  climbs out with '..': the 'tar' filter checks no hard link's target;
- a step that swaps /etc for a link: the agent's clean-up of the resolv.conf it made
  deletes a file of the node's;
- a registry layer whose /etc is a link to a node folder: build_step_init.py (root,
  before pivot_root) creates resolv.conf in that node folder;
- a registry layer's file owned by uid 2**32-1-300000, set-uid: shifted by 300000 for the
  overlay it is uid -1, which os.chown takes as "leave it": a set-uid root program of
  the tenant's in the node's layer cache;
- blocked: what a step tries against the root PID 1 of its namespace.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import EMBER, Platform, running_platform
from oci_registry import check_tools, push_layers, running_registry

STEP_TIMEOUT = 30


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    extra = ("--build-step-timeout", str(STEP_TIMEOUT))
    with running_platform(tmp_path_factory.mktemp("platform"), extra=extra) as running:
        yield running


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    check_tools()
    with running_registry(tmp_path_factory.mktemp("registry")) as address:
        yield address


@pytest.fixture(scope="module")
def tenant(platform: Platform) -> dict[str, str]:
    platform.ember("workspace", "create", "mallory")
    token = platform.ember("token", "create", "--workspace", "mallory", "--scope", "deploy")
    env = {**platform.env, "EMBER_TOKEN": token.stdout.strip(), "EMBER_SERVER_URL": platform.url}
    env["EMBER_CA_CERT"] = platform.ca
    env.pop("EMBER_WORKSPACE", None)
    return env


class Layer:
    """An OCI layer tar, entry by entry, busybox first."""

    def __init__(self, path: Path, with_etc: bool = False) -> None:
        self.path = path
        self.tar = tarfile.open(path, "w", format=tarfile.PAX_FORMAT)  # noqa: SIM115 (closed by close())
        self.add("bin", kind=tarfile.DIRTYPE)
        self.add("tmp", kind=tarfile.DIRTYPE, mode=0o1777)
        self.add("proc", kind=tarfile.DIRTYPE)
        self.add("dev", kind=tarfile.DIRTYPE)
        if with_etc:
            self.add("etc", kind=tarfile.DIRTYPE)
        self.add("bin/busybox", Path(shutil.which("busybox") or "busybox").read_bytes())
        for tool in ("sh", "cat", "ls", "ln", "mv", "kill", "echo", "mkdir", "stat", "id"):
            self.add(f"bin/{tool}", kind=tarfile.SYMTYPE, link="busybox")

    def add(
        self,
        name: str,
        data: bytes = b"",
        mode: int = 0o755,
        kind: bytes = tarfile.REGTYPE,
        link: str = "",
        uid: int = 0,
    ) -> None:
        info = tarfile.TarInfo(name)
        info.type, info.mode, info.size, info.linkname = kind, mode, len(data), link
        info.uid = info.gid = uid
        self.tar.addfile(info, io.BytesIO(data) if data else None)

    def close(self) -> Path:
        self.tar.close()
        return self.path


def _victim(folder: Path, name: str = "secret") -> Path:
    """A root-only file of 'the node's', made by the test."""
    folder.mkdir(parents=True, exist_ok=True)
    victim = folder / name
    victim.write_text(f"node-secret-{os.urandom(6).hex()}\n")
    os.chown(victim, 0, 0)
    victim.chmod(0o600)
    return victim


def _deploy(env: dict[str, str], folder: Path, name: str, image: str) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "app.py").write_text(
        f"import ember\n\nimage = {image}\n\n\n"
        "@ember.endpoint(image=image)\ndef boxed() -> str:\n    return 'never runs'\n"
    )
    done = subprocess.run(
        [*EMBER, "deploy", str(folder / "app.py"), "--name", name],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done.stdout + done.stderr


def _mode_owner(path: Path) -> tuple[int, int]:
    info = path.stat()
    return stat.S_IMODE(info.st_mode), info.st_uid


def test_a_registry_hard_link_to_an_absolute_link_changes_no_node_file(
    platform: Platform, registry: str, tenant: dict[str, str], tmp_path: Path
) -> None:
    """`_root_fs_filter` checks that a hard link's target *name* is inside the tree, but
    that name is a link to the node's file: link(2) hard-links the link itself, then
    tarfile's os.chown and os.chmod of the new name (not a symlink entry) follow it."""
    victim = _victim(tmp_path / "node")
    layer = Layer(tmp_path / "layer.tar")
    layer.add("way-out", kind=tarfile.SYMTYPE, link=str(victim))
    layer.add("stolen", kind=tarfile.LNKTYPE, link="way-out", mode=0o6777, uid=4242)
    push_layers(registry, "tools/hardlink", "v1", [layer.close()])
    image = f"ember.Image.from_registry('{registry}/tools/hardlink:v1').run_commands('echo ran')"
    _deploy(tenant, tmp_path / "app", "hardlink", image)
    mode, owner = _mode_owner(victim)
    assert (mode, owner) == (0o600, 0), (
        f"root set the node's {victim} to mode {mode:o}, owner {owner} through the layer"
    )


def test_a_registry_folder_then_link_of_its_name_sets_no_node_files_mode(
    platform: Platform, registry: str, tenant: dict[str, str], tmp_path: Path
) -> None:
    """tarfile (Python 3.11) sets folders' owners and modes after all entries, by path:
    a later entry has replaced the folder with a link to the node's file by then."""
    victim = _victim(tmp_path / "node")
    layer = Layer(tmp_path / "layer.tar")
    layer.add("swapped", kind=tarfile.DIRTYPE, mode=0o4777, uid=4343)
    layer.add("swapped", kind=tarfile.SYMTYPE, link=str(victim))
    push_layers(registry, "tools/swapped", "v1", [layer.close()])
    image = f"ember.Image.from_registry('{registry}/tools/swapped:v1').run_commands('echo ran')"
    _deploy(tenant, tmp_path / "app", "swapped", image)
    mode, owner = _mode_owner(victim)
    assert (mode, owner) == (0o600, 0), (
        f"root set the node's {victim} to mode {mode:o}, owner {owner} through the layer"
    )


def test_a_copy_steps_tar_with_a_hard_link_out_changes_no_node_file(
    platform: Platform, registry: str, tenant: dict[str, str], tmp_path: Path
) -> None:
    """node_builds.unpack_files extracts the uploaded tar as root with filter='tar',
    which checks no hard link's target: '../../..' leads to any file of the node."""
    import ember

    victim = _victim(tmp_path / "node")
    layer = Layer(tmp_path / "layer.tar")
    push_layers(registry, "tools/copy", "v1", [layer.close()])
    local = tmp_path / "local"
    local.mkdir()
    (local / "x").write_text("x\n")
    image = ember.Image.from_registry(f"{registry}/tools/copy:v1").add_local_dir(local, "/data")
    evil = io.BytesIO()
    with tarfile.open(fileobj=evil, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("x")
        info.type, info.mode, info.uid, info.gid = tarfile.LNKTYPE, 0o755, 4444, 4444
        info.linkname = "../" * 40 + str(victim).lstrip("/")
        tar.addfile(info)
    data = evil.getvalue()
    sha = hashlib.sha256(data).hexdigest()
    with platform.client(token=tenant["EMBER_TOKEN"], timeout=300) as client:
        put = client.put(f"/v1/image-files/sha256:{sha}", content=data)
        assert put.status_code == 201, put.text
        body = {"image": image.to_dict(), "files": {image.layers[1].digest: sha}}
        answer = client.post("/v1/image-builds", json=body)
    lines = [json.loads(line) for line in answer.text.splitlines() if line.strip()]
    assert lines and lines[-1].get("done"), answer.text  # the build ran (and failed, as it may)
    mode, owner = _mode_owner(victim)
    assert (mode, owner) == (0o600, 0), (
        f"root set the node's {victim} to mode {mode:o}, owner {owner} from the uploaded tar"
    )


def test_a_step_that_swaps_etc_for_a_link_deletes_no_node_file(
    platform: Platform, registry: str, tenant: dict[str, str], tmp_path: Path
) -> None:
    """The image has no /etc/resolv.conf: one is made for the node's to be bound over,
    and `run_in_layers` unlinks upper/etc/resolv.conf after the step, following the link
    to the node's folder the step left at /etc."""
    node = tmp_path / "node-etc"
    victim = _victim(node, "resolv.conf")
    layer = Layer(tmp_path / "layer.tar")  # no /etc
    push_layers(registry, "tools/etcswap", "v1", [layer.close()])
    step = f"mv /etc /etc.moved && ln -s {node} /etc && echo swapped"
    image = f"ember.Image.from_registry('{registry}/tools/etcswap:v1').run_commands({step!r})"
    output = _deploy(tenant, tmp_path / "app", "etcswap", image)
    assert "swapped" in output, output
    assert victim.exists(), f"root deleted the node's {victim} after the step"


def test_a_registry_etc_link_makes_root_create_no_node_file(
    platform: Platform, registry: str, tenant: dict[str, str], tmp_path: Path
) -> None:
    """build_step_init.py, root before pivot_root, resolves root + '/etc/resolv.conf'
    through the image's /etc, a link to a node folder, and creates the file there."""
    node = tmp_path / "node-folder"
    node.mkdir()
    layer = Layer(tmp_path / "layer.tar")
    layer.add("etc", kind=tarfile.SYMTYPE, link=str(node))
    push_layers(registry, "tools/etclink", "v1", [layer.close()])
    image = f"ember.Image.from_registry('{registry}/tools/etclink:v1').run_commands('echo ran')"
    output = _deploy(tenant, tmp_path / "app", "etclink", image)
    assert "ran" in output, output
    made = node / "resolv.conf"
    assert not made.exists(), f"root created {made} (uid {made.stat().st_uid}) on the node"


def test_a_step_cannot_reach_its_root_pid_1(
    platform: Platform, registry: str, tenant: dict[str, str], tmp_path: Path
) -> None:
    """PID 1 of the step's PID namespace is build_step_init.py, the node's root, outside
    the step's user namespace: its environment, root and life are not the step's."""
    layer = Layer(tmp_path / "layer.tar", with_etc=True)
    push_layers(registry, "tools/init", "v1", [layer.close()])
    step = (
        "id; cat /proc/1/environ && echo READ-ENVIRON; ls /proc/1/root/ && echo READ-ROOT; "
        "ls /proc/1/cwd/ && echo READ-CWD; kill -9 1 && echo KILLED-INIT; echo done-trying"
    )
    image = f"ember.Image.from_registry('{registry}/tools/init:v1').run_commands({step!r})"
    output = _deploy(tenant, tmp_path / "app", "init", image)
    assert "done-trying" in output, output
    for said in ("READ-ENVIRON", "READ-ROOT", "READ-CWD", "KILLED-INIT"):
        assert said not in output, output


def test_no_layer_cache_file_of_a_tenants_is_a_set_uid_root_program(
    platform: Platform, registry: str, tenant: dict[str, str], tmp_path: Path
) -> None:
    """unpack_for_overlay adds 300000 to each owner: 4294667295 + 300000 is 2**32 - 1,
    chown's "unchanged", so the file stays root's (the unpacker's), set-uid kept."""
    wrap = 2**32 - 1 - 300_000
    layer = Layer(tmp_path / "layer.tar")
    layer.add("bin/rootshell", b"#!/bin/sh\nid\n", mode=0o4755, uid=wrap)
    push_layers(registry, "tools/wrap", "v1", [layer.close()])
    image = f"ember.Image.from_registry('{registry}/tools/wrap:v1').run_commands('echo ran')"
    output = _deploy(tenant, tmp_path / "app", "wrap", image)
    assert "ran" in output, output
    found = []
    for cache in platform.root.rglob("layers-userns"):
        for path in cache.rglob("rootshell"):
            info = path.lstat()
            if info.st_uid == 0 and info.st_mode & stat.S_ISUID:
                found.append(f"{path} (mode {stat.S_IMODE(info.st_mode):o}, uid 0)")
    assert not found, f"set-uid root programs of the tenant's on the node: {found}"

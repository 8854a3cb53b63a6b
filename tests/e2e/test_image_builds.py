"""Images built on a node (issue 38), against a real `ember server`'s store: a Debian
base made by mmdebstrap from the node's mirror (once for the module, shared by every
test), steps that apt-install a package and pip-install one (pip itself added) and one
that uses both, a file copied in with env and workdir that later steps see, deletions
carried as OCI whiteouts, an unchanged image that builds nothing, a failing step
reported with its command and output. Images from a real registry on loopback
(oci_registry.py), with and without credentials, by tag and by digest, and the clear
errors of a missing tag, a wrong digest and missing or wrong credentials. And deploys
with image=: built on the platform's worker with its output streamed to `ember
deploy`, replicas running on the image (its Debian packages, pip packages, env, workdir
and copied file), an unchanged redeploy building nothing, a broken step failing the
deploy, a registry image running beside another without seeing its files, a
restored replica of an image serving, a stopped app's image leaving the node (and a
build's uploaded files the store), a registry's credentials from the secret a
deploy names, and an image without the worker's Python failing to start saying so."""

from __future__ import annotations

import io
import os
import shutil
import tarfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from harness import Platform, replicas_ready, wait_for
from machine_needs import need
from oci_registry import check_tools, push_layers, push_small_image, running_registry

import ember
from ember_worker.images.builder import ImageBuilder, ImageBuildError
from ember_worker.images.layer_store import LayerStore

BASE = ember.Image.debian_slim(python="3.11")


@pytest.fixture(scope="module")
def store(platform: Platform) -> Iterator[LayerStore]:
    token = platform.ember("token", "create", "--scope", "worker").stdout.strip()
    layer_store = LayerStore(platform.url, token, platform.ca)
    yield layer_store
    layer_store.close()


@pytest.fixture(scope="module")
def builder(store: LayerStore, tmp_path_factory: pytest.TempPathFactory) -> ImageBuilder:
    """A node's builder with the Debian base built once, for every test of the module."""
    if os.geteuid() != 0:
        need("root", "image builds mount overlays in namespaces of their own")
    if shutil.which("mmdebstrap") is None:
        need("packages", "mmdebstrap is not installed (bash infra/install.sh)")
    node = ImageBuilder(store, tmp_path_factory.mktemp("image-cache"))
    lines: list[str] = []
    result = node.build(BASE, lines.append)
    assert result.built == [BASE.digest]
    assert lines[0] == "[1/1] debian_slim: Debian bookworm, python 3.11"
    # Rootless: the packages' scripts ran as root of the build account's user namespace.
    assert lines[1] == "    mmdebstrap as ember-build, in its unshare mode (no root)"
    return node


def test_apt_install_then_a_command_that_uses_the_package(
    builder: ImageBuilder, store: LayerStore
) -> None:
    image = (
        BASE.apt_install("cowsay")
        .pip_install("six==1.16.0")  # the worker's Python has no six; the image lacks pip
        .run_commands(
            "/usr/games/cowsay moo > /moo.txt",
            "python3 -c 'import six; print(six.__version__)' > /six.txt",
        )
    )
    lines: list[str] = []
    result = builder.build(image, lines.append)
    assert result.built == [layer.digest for layer in image.layers[1:]]
    assert "[1/4] debian_slim: Debian bookworm, python 3.11 (built already)" in lines
    assert "[2/4] apt_install: cowsay" in lines and "[3/4] pip_install: six==1.16.0" in lines
    assert any("Setting up cowsay" in line for line in lines)  # apt's output, streamed
    apt_layer = builder.local(image.layers[1])
    assert (apt_layer / "usr/games/cowsay").is_file()
    assert not (apt_layer / "etc/resolv.conf").exists()  # the node's, bound for the step
    assert not (apt_layer / "etc/ssl/certs/ca-certificates.crt").exists()  # likewise
    pip_layer = builder.local(image.layers[2])
    assert (pip_layer / "usr/local/lib/python3.11/dist-packages/six.py").is_file()
    assert (pip_layer / "usr/lib/python3/dist-packages/pip").is_dir()  # Debian's, added
    run_layer = builder.local(image.layers[3])
    assert "moo" in (run_layer / "moo.txt").read_text()
    assert (run_layer / "six.txt").read_text() == "1.16.0\n"
    record = store.record(image.digest)
    assert record is not None and [layer["kind"] for layer in record["layers"]] == [
        "debian_slim",
        "apt",
        "pip",
        "run",
    ]

    # Unchanged: nothing is built, and saying so takes one request.
    began = time.monotonic()
    again: list[str] = []
    unchanged = builder.build(image, again.append)
    assert unchanged.built == [] and time.monotonic() - began < 1.0
    assert again == [f"image {image.digest[7:19]}: built already, nothing to build"]


def test_env_workdir_and_a_copied_file_reach_later_steps(
    builder: ImageBuilder, tmp_path: Path
) -> None:
    local = tmp_path / "greeting.txt"
    local.write_text("hello from the deploying machine\n")
    image = (
        BASE.env({"GREETING": "hi"})
        .workdir("/srv/app")
        .add_local_file(local, "/srv/app/")
        .run_commands(
            'test "$GREETING" = hi && test "$(pwd)" = /srv/app',
            "cp greeting.txt copy.txt",
            "rm /etc/debian_version && rm -r /var/log && mkdir /var/log && touch /var/log/fresh",
        )
        .run_commands("test ! -e /etc/debian_version && test -e /srv/app/copy.txt")
    )
    result = builder.build(image, lambda line: None)
    assert len(result.built) == 5
    run_layer = builder.local(image.layers[4])
    assert (run_layer / "srv/app/copy.txt").read_text() == local.read_text()
    # Deleted and replaced files as overlayfs keeps them, and in the stored tar as OCI
    # whiteouts: the last step saw the file gone.
    assert (run_layer / "etc/debian_version").is_char_device()
    assert os.getxattr(run_layer / "var/log", "trusted.overlay.opaque") == b"y"
    entry = builder.store.layer(image.layers[4].digest)
    assert entry is not None
    archive = tmp_path / "layer.tar"
    builder.store.fetch_tar(entry["sha256"], archive)
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    assert {"etc/.wh.debian_version", "var/log/.wh..wh..opq", "var/log/fresh"} <= names
    assert "srv/app/greeting.txt" not in names  # the copy step's, not this one's


def test_a_failing_step_names_itself_its_command_and_its_last_lines(
    builder: ImageBuilder, store: LayerStore
) -> None:
    image = BASE.run_commands("true", "echo first; echo 'no such thing' >&2; exit 3")
    lines: list[str] = []
    with pytest.raises(ImageBuildError) as failed:
        builder.build(image, lines.append)
    message = str(failed.value)
    assert message.startswith("image step 2/2 (run) failed: it exited with 3")
    assert "command: echo first; echo 'no such thing' >&2; exit 3" in message
    assert "    first\n    no such thing" in message
    assert "    no such thing" in lines  # streamed as it came
    assert store.layer(image.digest) is None and store.record(image.digest) is None


def test_image_ls_and_rm_show_and_drop_built_images(
    platform: Platform, builder: ImageBuilder, store: LayerStore
) -> None:
    kept = BASE.run_commands("touch /kept")
    dropped = BASE.run_commands("touch /dropped").run_commands("touch /dropped-too")
    for image in (kept, dropped):
        builder.build(image, lambda line: None)
    listing = platform.ember("image", "ls").stdout
    assert dropped.digest[7:19] in listing and "debian_slim run run" in listing
    assert "IMAGE" in listing.splitlines()[0]
    done = platform.ember("image", "rm", dropped.digest[7:17]).stdout
    # Its two run layers go; the base, which other images share, stays.
    assert done.strip() == (
        f"dropped image {dropped.digest[7:19]} and 2 layers no other image shares"
    )
    assert store.record(dropped.digest) is None and store.layer(dropped.digest) is None
    assert store.layer(BASE.digest) is not None and store.record(kept.digest) is not None
    assert dropped.digest[7:19] not in platform.ember("image", "ls").stdout
    missing = platform.ember("image", "rm", "abcdef", check=False)
    assert missing.returncode == 1 and "no built image abcdef" in missing.stderr


USER = ("ann", "s3cret")


@pytest.fixture(scope="module")
def registries(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, str]]:
    """(open registry, one that wants USER's password, the pushed image's digest)."""
    check_tools()
    root = tmp_path_factory.mktemp("registries")
    with (
        running_registry(root / "open") as open_registry,
        running_registry(root / "locked", USER) as locked,
    ):
        digest = push_small_image(
            root / "image",
            [(f"{open_registry}/team/base:v1", None), (f"{locked}/team/base:v1", USER)],
        )
        yield open_registry, locked, digest


@pytest.fixture
def puller(store: LayerStore, tmp_path: Path) -> ImageBuilder:
    if os.geteuid() != 0:
        need("root", "image builds mount overlays in namespaces of their own")
    return ImageBuilder(
        store,
        tmp_path / "cache",
        secrets={"registry": dict(REGISTRY_USERNAME=USER[0], REGISTRY_PASSWORD=USER[1])},
    )


def test_a_registry_image_is_flattened_into_a_base_that_later_steps_run_on(
    puller: ImageBuilder, registries: tuple[str, str, str]
) -> None:
    open_registry, _, digest = registries
    image = ember.Image.from_registry(f"{open_registry}/team/base:v1").run_commands(
        'test "$GREETING" = from-registry && test "$(pwd)" = /work && test ! -e /etc/gone.txt'
        " && cat /hello.txt > /seen"
    )
    lines: list[str] = []
    puller.build(image, lines.append)
    assert lines[0] == f"[1/2] from_registry: {open_registry}/team/base:v1"
    assert lines[1].startswith("    layer 1/2: ")
    base = puller.local(image.layers[0])
    assert (base / "bin/busybox").is_file() and not (base / "etc/gone.txt").exists()
    assert (puller.local(image.layers[1]) / "seen").read_text() == "hello from the registry\n"
    # Pinned by the right digest it is pulled again as such; a wrong one is refused.
    puller.build(ember.Image.from_registry(f"{open_registry}/team/base@{digest}"), lines.append)
    wrong = "sha256:" + "0" * 64
    with pytest.raises(ImageBuildError, match="the registry has no such manifest"):
        puller.build(ember.Image.from_registry(f"{open_registry}/team/base@{wrong}"), print)
    with pytest.raises(ImageBuildError, match="the registry has no tag 'v2'") as missing:
        puller.build(ember.Image.from_registry(f"{open_registry}/team/base:v2"), print)
    assert str(missing.value).startswith("image step 1/1 (registry) failed:")
    assert f"command: pull {open_registry}/team/base:v2" in str(missing.value)


def test_a_registry_that_wants_a_password_gets_the_secrets(
    puller: ImageBuilder, registries: tuple[str, str, str]
) -> None:
    _, locked, digest = registries
    reference = f"{locked}/team/base:v1"
    with pytest.raises(ImageBuildError, match="wants a username and password"):
        puller.build(ember.Image.from_registry(reference), print)
    with pytest.raises(ImageBuildError, match="'elsewhere' with REGISTRY_USERNAME"):
        puller.build(ember.Image.from_registry(reference, secret="elsewhere"), print)
    wrong = ImageBuilder(
        puller.store,
        puller.folder,
        secrets={"registry": dict(REGISTRY_USERNAME="ann", REGISTRY_PASSWORD="guess")},
    )
    with pytest.raises(ImageBuildError, match="the registry refused the credentials"):
        wrong.build(ember.Image.from_registry(reference, secret="registry"), print)
    image = ember.Image.from_registry(reference, secret="registry")
    assert puller.build(image, print).built == [image.digest]
    assert (puller.local(image.layers[0]) / "hello.txt").exists()
    # Stored, it is reused with credentials the registry takes for the manifest pulled
    # (another workspace's build: issue 47), whether the image is whole or a step on it.
    entry = puller.store.layer(image.digest)
    assert entry is not None and entry["manifest"] == digest
    above = image.run_commands("cat /hello.txt")
    for built in (image, above):
        with pytest.raises(ImageBuildError, match=r"refused the credentials \(with the secret"):
            wrong.build(built, print, verify_registry=True)
    lines: list[str] = []
    puller.build(above, lines.append, verify_registry=True)
    assert lines[0] == (
        f"from_registry: {reference}: the registry accepted this workspace's credentials "
        f"for {digest}"
    )
    assert lines[1] == f"[1/2] from_registry: {reference} (built already)"


def test_the_store_keeps_layer_tars_by_their_content_and_records_only_whole_images(
    platform: Platform, store: LayerStore
) -> None:
    wrong = "sha256:" + "1" * 64
    refused = store.client.put(f"/v1/image-blobs/{wrong}", content=b"not those bytes")
    assert refused.status_code == 400 and "do not have its sha256" in refused.text
    assert store.client.get(f"/v1/image-blobs/{wrong}").status_code == 404
    entry = {"sha256": "1" * 64, "size": 15, "kind": "run"}
    assert store.client.put(f"/v1/image-layers/{wrong}", json=entry).status_code == 409
    record = {"layers": [{"digest": wrong, **entry}]}
    assert store.client.put(f"/v1/images/{wrong}", json=record).status_code == 409
    with platform.client() as admin:  # operators list images (ember image ls)
        assert admin.get("/v1/images").status_code == 200
    with platform.client(token="emb_not_a_token") as stranger:
        assert stranger.get(f"/v1/image-blobs/{wrong}").status_code == 401


# ---- Deploys with image=: built on a worker, replicas running on the image ----------

MOO_APP = """
import os
import subprocess
import sys

import ember

HERE = os.path.dirname(os.path.abspath(__file__))
image = (
    ember.Image.debian_slim(python="3.11")
    .apt_install("cowsay")
    .pip_install("six==1.16.0")
    .env({"GREETING": "from-the-image"})
    .workdir("/srv/app")
    .add_local_file(os.path.join(HERE, "data.txt"), "/srv/app/")
)


@ember.endpoint(image=image, max_replicas=2, concurrency=1, scaledown_window=60)
class Moo:
    @ember.enter(snap=True)
    def load(self) -> None:
        import six

        self.six = six.__file__
        self.loaded_pid = int(os.environ.get("EMBER_REPLICA_PID") or 0)

    @ember.method
    def say(self, text: str, seconds: float = 0.0) -> dict:
        import time

        time.sleep(seconds)
        cow = subprocess.run(["/usr/games/cowsay", text], capture_output=True, text=True)
        return {
            "cow": cow.stdout,
            "six": self.six,
            "greeting": os.environ.get("GREETING"),
            "cwd": os.getcwd(),
            "data": open("data.txt").read(),
            "executable": sys.executable,
            "debian": open("/etc/debian_version").read().strip(),
            "sees_registry_image": os.path.exists("/from-registry.txt"),
            "pid": int(os.environ.get("EMBER_REPLICA_PID") or 0),
            "loaded_pid": self.loaded_pid,
        }
"""

REGISTRY_APP = """
import os
import sys

import ember


@ember.endpoint(image=ember.Image.from_registry("{reference}"))
def where() -> dict:
    return {{
        "marker": open("/from-registry.txt").read(),
        "sees_moo_image": os.path.exists("/srv/app/data.txt"),
        "executable": sys.executable,
    }}
"""


@pytest.fixture(scope="module")
def moo_app(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("moo")
    (folder / "data.txt").write_text("copied from the deploying machine\n")
    (folder / "app.py").write_text(MOO_APP)
    return folder / "app.py"


def _deploy(platform: Platform, app: Path, name: str) -> str:
    """`ember deploy --wait`'s standard error: the build's output."""
    return platform.ember("deploy", str(app), "--name", name, "--wait", timeout=600).stderr


def test_a_deploy_builds_its_image_on_a_worker_and_its_replicas_run_on_it(
    platform: Platform, builder: ImageBuilder, moo_app: Path
) -> None:
    output = _deploy(platform, moo_app, "moo")
    lines = output.splitlines()
    assert lines[0].startswith("building image ") and "on worker " in lines[0]
    # Steps built by the builder fixture's tests are reused; the rest is built now.
    assert "[1/6] debian_slim: Debian bookworm, python 3.11 (built already)" in lines
    assert any(line.startswith("[6/6] add_local_file: ") for line in lines)
    moo = ember.Endpoint.lookup("moo", "moo", config=platform.config())
    said = moo.say.call(text="hello image")
    assert "hello image" in said["cow"] and "(oo)" in said["cow"]  # Debian's cowsay
    assert said["six"] == "/usr/local/lib/python3.11/dist-packages/six.py"  # the image's
    assert said["greeting"] == "from-the-image" and said["cwd"] == "/srv/app"
    assert said["data"] == "copied from the deploying machine\n"
    assert said["executable"] == "/usr/bin/python3.11"  # Debian's, not the worker's
    assert said["debian"].startswith("12.")

    # Unchanged: nothing is built, in one request.
    again = _deploy(platform, moo_app, "moo")
    assert "built already, nothing to build" in again and "[1/" not in again
    assert moo.say.call(text="again")["greeting"] == "from-the-image"


def test_a_failing_step_fails_the_deploy_with_its_output(
    platform: Platform, builder: ImageBuilder, tmp_path: Path
) -> None:
    app = tmp_path / "broken" / "app.py"
    app.parent.mkdir()
    app.write_text(
        "import ember\n\n"
        "image = ember.Image.debian_slim().run_commands("
        "\"echo the-step-said-this; echo 'and this' >&2; exit 7\")\n\n"
        "@ember.endpoint(image=image)\n"
        "def broken() -> str:\n    return 'never'\n"
    )
    failed = platform.ember("deploy", str(app), "--wait", check=False, timeout=600)
    assert failed.returncode == 1
    assert "endpoint broken: image " in failed.stderr and " did not build:" in failed.stderr
    assert "image step 2/2 (run) failed: it exited with 7" in failed.stderr
    assert "command: echo the-step-said-this; echo 'and this' >&2; exit 7" in failed.stderr
    assert "    the-step-said-this\n    and this" in failed.stderr  # its last lines
    assert "broken" not in platform.ember("ls").stdout  # nothing was deployed


LIBRARIES = f"usr/lib/{os.uname().machine}-linux-gnu/"


def _python_needs(member: tarfile.TarInfo) -> bool:
    """Whether a file of the Debian base is one python3.11 (and Ember in it) needs."""
    name = member.name.removeprefix("./")
    if member.isdir() or (member.issym() and "/" not in name):
        return True
    if name.startswith((LIBRARIES + "perl", LIBRARIES + "gconv", LIBRARIES + "libperl")):
        return False
    return name.startswith(
        ("etc/", "usr/bin/python3", "usr/lib/python3.11/", LIBRARIES, "usr/lib64/", "usr/lib/ssl/")
    )


def test_a_registry_image_runs_and_two_images_do_not_see_each_other(
    platform: Platform,
    builder: ImageBuilder,
    store: LayerStore,
    registries: tuple[str, str, str],
    moo_app: Path,
    tmp_path: Path,
) -> None:
    open_registry = registries[0]
    # The registry's image: Python and what it needs of the Debian base built above
    # (a fifth of its files: quicker to push, pull and unpack), and a layer of its own.
    entry = store.layer(BASE.digest)
    assert entry is not None
    debian = tmp_path / "debian.tar"
    store.fetch_tar(entry["sha256"], debian)
    base_tar = tmp_path / "base.tar"
    with tarfile.open(debian) as whole, tarfile.open(base_tar, "w") as python_only:
        for member in whole:
            if _python_needs(member):
                python_only.addfile(member, whole.extractfile(member) if member.isreg() else None)
    debian.unlink()
    marker = tmp_path / "marker.tar"
    with tarfile.open(marker, "w") as tar:
        data = b"from the registry\n"
        info = tarfile.TarInfo("from-registry.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    push_layers(open_registry, "team/python", "3.11", [base_tar, marker])
    app = tmp_path / "fromreg" / "app.py"
    app.parent.mkdir()
    app.write_text(REGISTRY_APP.format(reference=f"{open_registry}/team/python:3.11"))
    output = _deploy(platform, app, "fromreg")
    assert f"[1/1] from_registry: {open_registry}/team/python:3.11" in output
    where = ember.Endpoint.lookup("fromreg", "where", config=platform.config()).call()
    assert where["marker"] == "from the registry\n"
    assert where["executable"] == "/usr/bin/python3.11"
    # Two apps on one node, each on its own image: neither sees the other's files.
    assert where["sees_moo_image"] is False
    moo = ember.Endpoint.lookup("moo", "moo", config=platform.config())
    assert moo.say.call(text="x")["sees_registry_image"] is False


def test_a_restored_replica_of_an_image_serves(platform: Platform, moo_app: Path) -> None:
    problem = platform.status()["workers"][0]["snapshots"].get("problem")
    if problem:
        need("criu", f"snapshots are off on this machine: {problem}")
    moo = ember.Endpoint.lookup("moo", "moo", config=platform.config())
    first = moo.say.call(text="first")
    wait_for(lambda: platform.endpoint_status("moo--moo")["snapshots"], 60)
    with replicas_ready(platform, moo, 2), ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda _: moo.say.call(text="both", seconds=1.0), range(2)))
    restored = [r for r in results if r["pid"] != r["loaded_pid"]]
    assert restored, f"no restored replica among {results}"
    assert restored[0]["loaded_pid"] == first["loaded_pid"]  # its state, the snapshot's
    assert restored[0]["executable"] == "/usr/bin/python3.11"
    assert "both" in restored[0]["cow"] and restored[0]["data"] == first["data"]
    assert platform.endpoint_status("moo--moo")["last_start"]["kind"] == "restore"


def _roots(images: Path) -> set[str]:
    """The images this node has a root of: mounted lazily, or extracted."""
    folders = [images / "image-mounts", images / "roots"]
    return {p.name for f in folders if f.is_dir() for p in f.iterdir() if len(p.name) == 64}


def test_a_stopped_apps_image_leaves_the_node_and_a_builds_files_the_store(
    platform: Platform, registries: tuple[str, str, str]
) -> None:
    """Collection: the node drops its root of an image no deployment runs on once its
    replica is gone (moo's image, deployed, stays); moo's uploaded file went from the
    store when its build ended."""
    images = platform.state_dir / "worker" / "images"
    reference = f"{registries[0]}/team/python:3.11"
    fromreg = ember.Image.from_registry(reference).digest.removeprefix("sha256:")
    before = _roots(images)
    assert fromreg in before and before - {fromreg}  # moo's too
    lazy = (images / "image-mounts" / fromreg).exists()
    indexes = set(os.listdir(images / "image-indexes")) if lazy else set()
    platform.ember("stop", "fromreg")
    wait_for(lambda: fromreg not in _roots(images), 60)
    assert before - {fromreg} <= _roots(images)
    assert not (images / "image-mounts" / fromreg).exists()  # unmounted, then removed
    if lazy:  # its file index went with its mount; moo's stays
        assert len(set(os.listdir(images / "image-indexes"))) == len(indexes) - 1
    uploads = platform.state_dir / "blobs" / "image-files"
    assert not uploads.is_dir() or os.listdir(uploads) == []


def test_a_deploy_pulls_with_the_secret_it_names_and_an_image_without_python_fails_to_start(
    platform: Platform, registries: tuple[str, str, str], tmp_path: Path
) -> None:
    _, locked, digest = registries
    # Pinned by digest: an image no other test built (a built one pulls nothing).
    reference = f"{locked}/team/base@{digest}"
    app = tmp_path / "locked" / "app.py"
    app.parent.mkdir()
    app.write_text(
        "import ember\n\n"
        f"image = ember.Image.from_registry('{reference}', secret='locked-registry')\n\n"
        "@ember.endpoint(image=image, min_replicas=1)\n"
        "def busy() -> str:\n    return 'never'\n"
    )
    missing = platform.ember("deploy", str(app), check=False)
    assert missing.returncode == 1
    assert "from_registry names secret locked-registry, which does not exist" in missing.stderr
    platform.ember(
        "secret",
        "set",
        "locked-registry",
        f"REGISTRY_USERNAME={USER[0]}",
        f"REGISTRY_PASSWORD={USER[1]}",
    )
    # Pulled with the secret's credentials; busybox has no Python to run replicas with.
    failed = platform.ember("deploy", str(app), "--wait", "--timeout", "60", check=False)
    assert f"[1/1] from_registry: {reference}" in failed.stderr
    assert failed.returncode == 1
    assert "fails to start" in failed.stderr and "has no python" in failed.stderr.lower()
    platform.ember("stop", "locked")

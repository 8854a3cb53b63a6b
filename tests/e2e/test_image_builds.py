"""Images built on a node (issue 38, items 1-2), against a real `ember server`'s store:
a Debian base made by mmdebstrap from the node's mirror (once for the module), steps
that apt-install a package and pip-install one (pip itself added) and one that uses
both, a file copied in with env and workdir that later steps see, deletions carried as
OCI whiteouts, an unchanged image that builds nothing, a failing step reported with its
command and output; and a deploy with image= refused (replicas cannot run on an image
yet). And images from a real registry on loopback (oci_registry.py), with and without
credentials, by tag and by digest, and the clear errors of a missing tag, a wrong
digest and missing or wrong credentials."""

from __future__ import annotations

import os
import shutil
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import Platform
from machine_needs import need
from oci_registry import check_tools, push_small_image, running_registry

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


def test_a_deploy_with_an_image_is_refused_until_replicas_can_run_on_it(
    platform: Platform, tmp_path: Path
) -> None:
    app = tmp_path / "imaged" / "app.py"
    app.parent.mkdir()
    app.write_text(
        "import ember\n\n"
        "@ember.endpoint(image=ember.Image.debian_slim().apt_install('cowsay'))\n"
        "def moo() -> str:\n    return 'moo'\n"
    )
    refused = platform.ember("deploy", str(app), check=False)
    assert refused.returncode == 1
    assert "images are declared and built, but replicas cannot run on them yet" in (
        refused.stderr + refused.stdout
    )


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
    _, locked, _ = registries
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

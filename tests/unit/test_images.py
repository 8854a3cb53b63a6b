"""`ember.Image`: immutable steps, layer digests that change with what a layer holds and
everything below it, clear refusals of bad steps, the manifest round trip, and the
image's digest in the snapshot key."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import ember
from ember.declarations.settings import EndpointSettings
from ember.errors import InvalidError
from ember.images.references import parse_reference
from ember.wire.spec import AppManifest
from ember_platform.snapshots.registry import snapshot_key

BASE = ember.Image.debian_slim(python="3.11")


def test_steps_return_new_images_and_leave_the_base_alone() -> None:
    with_apt = BASE.apt_install("cowsay")
    assert len(BASE.layers) == 1 and len(with_apt.layers) == 2
    assert with_apt.layers[0] == BASE.layers[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(with_apt, "layers", ())  # noqa: B010
    # Two branches of one base share its layer, not each other's.
    other = BASE.pip_install("requests==2.32.3")
    assert other.layers[0].digest == with_apt.layers[0].digest
    assert other.digest != with_apt.digest


def test_a_layer_digest_depends_on_its_step_and_every_step_below() -> None:
    one = BASE.apt_install("cowsay").run_commands("echo hi")
    assert one.digest == BASE.apt_install("cowsay").run_commands("echo hi").digest
    assert one.digest != BASE.apt_install("sox").run_commands("echo hi").digest
    assert (
        one.digest
        != ember.Image.debian_slim("3.13").apt_install("cowsay").run_commands("echo hi").digest
    )
    assert BASE.env({"A": "1"}).digest != BASE.env({"A": "2"}).digest
    # A list and separate arguments are the same step.
    assert BASE.apt_install("a1", ["b1", "c1"]).digest == BASE.apt_install("a1", "b1", "c1").digest
    assert (
        BASE.pip_install("x").digest != BASE.pip_install("x", index_url="https://i.test/s").digest
    )


def test_local_files_count_by_contents_not_by_where_they_are(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    for folder in (first, second):
        (folder / "sub").mkdir(parents=True)
        (folder / "sub" / "x.txt").write_text("one")
    assert BASE.add_local_dir(first, "/app").digest == BASE.add_local_dir(second, "/app").digest
    (second / "sub" / "x.txt").write_text("two")
    assert BASE.add_local_dir(first, "/app").digest != BASE.add_local_dir(second, "/app").digest
    assert BASE.add_local_dir(first, "/app").digest != BASE.add_local_dir(first, "/srv").digest
    one_file = BASE.add_local_file(first / "sub" / "x.txt", "/etc/")
    assert one_file.layers[-1].step["remote"] == "/etc/x.txt"
    before = one_file.digest
    (first / "sub" / "x.txt").chmod(0o755)  # the executable bit is part of it
    assert BASE.add_local_file(first / "sub" / "x.txt", "/etc/x.txt").digest != before


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: BASE.apt_install("Bad Name"), "is not a Debian package name"),
        (lambda: BASE.apt_install(), r"apt_install\(\) needs at least one argument"),
        (lambda: BASE.apt_install("ok", 3), "3 is not a string"),  # type: ignore[arg-type]
        (lambda: BASE.pip_install("--index-url=https://x"), "is an option, not a requirement"),
        (lambda: BASE.pip_install("numpy\nscipy"), "must be one line"),
        (lambda: BASE.pip_install("x", index_url="ftp://h/"), "use an http:// or https:// URL"),
        (lambda: BASE.run_commands(""), "must be a shell command"),
        (lambda: BASE.env({"1A": "x"}), "is not an environment variable name"),
        (lambda: BASE.env({"EMBER_X": "x"}), "are Ember's"),
        (lambda: BASE.env({"A": 1}), "must be text"),  # type: ignore[dict-item]
        (lambda: BASE.workdir("app"), "must be an absolute path"),
        (lambda: BASE.workdir("/app/../etc"), "may not contain '..'"),
        (lambda: BASE.add_local_dir("/no/such/folder", "/app"), "is not a folder"),
        (lambda: BASE.add_local_file("/no/such/file", "/app/f"), "is not a file"),
        (lambda: ember.Image.debian_slim(python="2.7"), "choose one of 3.11, 3.13"),
        (lambda: ember.Image.from_registry("Bad:ref:x"), "is not"),
        (lambda: ember.Image.from_registry("x@sha256:12"), "is not a digest"),
        (lambda: ember.Image.from_registry("python", secret=""), "must be a secret's name"),
        (lambda: ember.Image.from_registry("python", secret="Hub Creds"), "must be a secret's"),
        (lambda: ember.Image(), "make an image with ember.Image.debian_slim()"),
    ],
)
def test_bad_steps_are_refused_where_they_are_declared(make: Any, message: str) -> None:
    with pytest.raises(InvalidError, match=message):
        make()


def test_references_as_docker_writes_them() -> None:
    hub = parse_reference("python:3.11-slim")
    assert (hub.registry, hub.repository, hub.tag) == (
        "registry-1.docker.io",
        "library/python",
        "3.11-slim",
    )
    local = parse_reference("localhost:5000/team/base@sha256:" + "a" * 64)
    assert (local.registry, local.repository, local.tag) == ("localhost:5000", "team/base", None)
    assert local.wanted == "sha256:" + "a" * 64
    assert parse_reference("ghcr.io/org/app").tag == "latest"


def test_the_image_travels_in_the_manifest_and_is_checked_again() -> None:
    image = BASE.apt_install("cowsay").env({"A": "1"}).workdir("/srv")

    @ember.endpoint(image=image)
    def echo() -> int:
        return 1

    spec = echo.spec("echo")
    manifest = AppManifest.from_dict({"app": "a", "entry": "app.py", "endpoints": [spec.to_dict()]})
    settings = manifest.endpoints[0].settings
    assert settings.image_digest == image.digest
    assert ember.Image.from_dict(settings.image) == image
    tampered = image.to_dict()
    tampered["steps"][1]["packages"] = ["sox"]  # its recorded digest no longer matches
    with pytest.raises(InvalidError, match="its digest is"):
        EndpointSettings(image=tampered)
    later_base = image.to_dict()
    later_base["steps"].append({"kind": "debian_slim", "python": "3.11", "suite": "bookworm"})
    with pytest.raises(InvalidError, match="only its first step may"):
        EndpointSettings(image=later_base)
    with pytest.raises(InvalidError, match=r"use an ember\.Image"):
        ember.endpoint(image="debian")  # type: ignore[arg-type]


def test_without_image_nothing_changes_and_with_one_its_digest_joins_the_snapshot_key() -> None:
    def runtime(settings: EndpointSettings) -> Any:
        return SimpleNamespace(
            bundle_digest="sha256:aa",
            entry="app.py",
            spec=SimpleNamespace(attribute="echo"),
            label="demo--echo",
            settings=settings,
        )

    plain = EndpointSettings()
    assert plain.image is None and "image" in plain.to_dict()
    # The key of an endpoint without image= is what it was before images existed.
    assert snapshot_key(runtime(plain), "env") == "852f4e88c7daa53541455f7acd6493db"
    one = snapshot_key(runtime(EndpointSettings(image=BASE.to_dict())), "env")
    two = snapshot_key(runtime(EndpointSettings(image=BASE.apt_install("x1").to_dict())), "env")
    assert len({snapshot_key(runtime(plain), "env"), one, two}) == 3

"""`ember.Image`: the root file system an endpoint's replicas are to run on, built in
layers on a worker node. Immutable: each method returns a new image with one more step,
so one base can be shared by several endpoints.

    image = (
        ember.Image.debian_slim(python="3.11")
        .apt_install("ffmpeg")
        .pip_install("soundfile==0.12.1")
        .env({"HF_HOME": "/cache"})
    )

    @ember.endpoint(image=image)
    def transcribe(...): ...
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ember.errors import InvalidError
from ember.images import checks
from ember.images.local_files import one_file_digest, tree_digest
from ember.images.references import parse_reference
from ember.images.steps import (
    DIGEST,
    MAX_STEPS,
    check_step,
    layer_digest,
    suite_for,
)


@dataclass(frozen=True)
class Layer:
    step: dict[str, Any]
    digest: str  # of the step and its parent's digest


@dataclass(frozen=True, init=False)
class Image:
    layers: tuple[Layer, ...]

    def __init__(self, layers: tuple[Layer, ...] = ()) -> None:
        if not layers:
            raise InvalidError(
                "make an image with ember.Image.debian_slim() or ember.Image.from_registry()"
            )
        object.__setattr__(self, "layers", layers)

    # The first step.

    @classmethod
    def debian_slim(cls, python: str = "3.11") -> Image:
        """A minimal Debian made with mmdebstrap from the node's Debian mirror, with
        Debian's own python3 of the release that ships `python` and pip."""
        return cls._first({"kind": "debian_slim", "python": python, "suite": suite_for(python)})

    @classmethod
    def from_registry(cls, reference: str, secret: str | None = None) -> Image:
        """An OCI image from a registry ("python:3.11-slim", "ghcr.io/org/app:v2",
        "host:5000/base@sha256:..."); `secret` names a secret (`ember secret set`) that
        holds REGISTRY_USERNAME and REGISTRY_PASSWORD for it."""
        parse_reference(reference)
        secret = checks.check_secret_name(secret)
        return cls._first({"kind": "registry", "reference": reference, "secret": secret})

    @classmethod
    def _first(cls, step: dict[str, Any]) -> Image:
        return cls((Layer(step, layer_digest(None, step)),))

    # Later steps: each a layer on the image so far.

    def apt_install(self, *packages: str | list[str]) -> Image:
        """Debian packages, with apt-get from the image's sources."""
        return self._then({"kind": "apt", "packages": checks.check_apt_packages(packages)})

    def pip_install(self, *packages: str | list[str], index_url: str | None = None) -> Image:
        """Python packages, with pip into the image's Python."""
        return self._then(
            {
                "kind": "pip",
                "packages": checks.check_pip_packages(packages),
                "index_url": checks.check_index_url(index_url),
            }
        )

    def run_commands(self, *commands: str | list[str]) -> Image:
        """Shell commands, one after another (`sh -c`), as root in the image; the first
        that fails fails the build."""
        return self._then({"kind": "run", "commands": checks.check_commands(commands)})

    def env(self, values: dict[str, str]) -> Image:
        """Environment variables of later steps and of the replicas."""
        return self._then({"kind": "env", "env": checks.check_env(values)})

    def workdir(self, path: str) -> Image:
        """The working folder of later steps and of the replicas (made if missing)."""
        return self._then({"kind": "workdir", "path": checks.check_remote_path("workdir", path)})

    def add_local_dir(self, local: str | os.PathLike[str], remote: str) -> Image:
        """A folder of this machine, copied into the image at `remote` (its contents
        are hashed now: the layer changes when they do). A relative `local` is taken from
        the working folder of the process that builds the image (`ember deploy`'s), as
        Python's own `open()` takes it, not from the app's file."""
        contents, _ = tree_digest(local)
        return self._then(
            {
                "kind": "local_dir",
                "local": str(Path(local).resolve()),
                "remote": checks.check_remote_path("add_local_dir", remote),
                "contents": contents,
            }
        )

    def add_local_file(self, local: str | os.PathLike[str], remote: str) -> Image:
        """A file of this machine, copied to `remote` (into it, when it ends in '/'); a
        relative `local` is taken from the working folder, as for `add_local_dir`."""
        contents = one_file_digest(local)
        if isinstance(remote, str) and remote.endswith("/"):
            remote = remote + Path(local).name
        return self._then(
            {
                "kind": "local_file",
                "local": str(Path(local).resolve()),
                "remote": checks.check_remote_path("add_local_file", remote),
                "contents": contents,
            }
        )

    def _then(self, step: dict[str, Any]) -> Image:
        if len(self.layers) >= MAX_STEPS:
            raise InvalidError(f"an image has at most {MAX_STEPS} steps")
        return Image((*self.layers, Layer(step, layer_digest(self.digest, step))))

    # What it is.

    @property
    def digest(self) -> str:
        """The top layer's digest: it names the whole image."""
        return self.layers[-1].digest

    def to_dict(self) -> dict[str, Any]:
        return {
            "digest": self.digest,
            "steps": [{**layer.step, "digest": layer.digest} for layer in self.layers],
        }

    @classmethod
    def from_dict(cls, data: Any) -> Image:
        """An image read back from a manifest, every step checked and every digest
        computed again (a digest that does not match is refused)."""
        steps = data.get("steps") if isinstance(data, dict) else None
        if not isinstance(steps, list) or not steps or len(steps) > MAX_STEPS:
            raise InvalidError(f"image={data!r} is not an image's definition")
        layers: list[Layer] = []
        parent: str | None = None
        for index, raw in enumerate(steps):
            step = check_step(raw, first=index == 0)
            digest = layer_digest(parent, step)
            if raw.get("digest") not in (None, digest):
                raise InvalidError(
                    f"image step {index} ({step['kind']}): its digest is {raw.get('digest')}, "
                    f"not {digest}"
                )
            layers.append(Layer(step, digest))
            parent = digest
        image = cls(tuple(layers))
        claimed = data.get("digest")
        if claimed is not None and (
            not isinstance(claimed, str) or not DIGEST.match(claimed) or claimed != image.digest
        ):
            raise InvalidError(f"image digest {claimed!r} is not its top layer's {image.digest}")
        return image

    def __repr__(self) -> str:
        kinds = ", ".join(layer.step["kind"] for layer in self.layers)
        return f"Image({self.digest[7:19]}: {kinds})"

"""Builds an `ember.Image` on this node, step by step: a layer whose entry the control
plane's store already holds is not built again (an unchanged image builds nothing); a
layer to build runs on the layers below it, unpacked in the node's cache, and its tar
goes to the store before the next step. The image's record is written last: it is what
says the image is built.

Cache layout, under the builder's folder: `layers-userns/<hex>/` a layer unpacked as an
overlay lower folder, its owners shifted into the build steps' uid range
(build_steps.BUILD_UIDS), `layers-userns/<hex>.json` its entry (written once it is
whole; its time is the layer's last use), `locks/` a lock per layer, `work/` scratch.
`trim` keeps the unpacked layers within a budget, the least recently used going first
(fetched again from the store when next needed).

Builds run side by side, several at once on a node: each layer is built (or unpacked)
under a lock of its own, so that two builds of one image never build it twice and a
build stuck in a step (until its timeout) holds up only the builds that need that very
layer; `trim` runs only while no build does."""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import shutil
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from ember.images.image import Image, Layer
from ember.images.local_files import one_file_digest, tree_digest
from ember_worker.images.build_steps import BUILD_UIDS, StepLimits, run_in_layers
from ember_worker.images.debian_base import BaseImageError, make_base
from ember_worker.images.layer_store import LayerStore
from ember_worker.images.oci_layers import pack_upper, unpack_for_overlay
from ember_worker.images.registry_pull import PulledConfig, RegistryError, check_access, pull

APT = (
    "apt-get update -q && apt-get install -y -q --no-install-recommends {packages} "
    "&& apt-get clean && rm -rf /var/lib/apt/lists/*"
)
# Debian's pip, in the first pip step's layer when the image has none (debian_base.py).
PIP = (
    "{{ python3 -m pip --version >/dev/null 2>&1 || {{ apt-get update -q && "
    "apt-get install -y -q --no-install-recommends python3-pip && apt-get clean && "
    "rm -rf /var/lib/apt/lists/*; }}; }} && "
    "python3 -m pip install --no-cache-dir --break-system-packages --root-user-action=ignore "
    "--disable-pip-version-check {options}{packages}"
)


class ImageBuildError(Exception):
    """A step failed: which one, its command, and the last lines of its output."""

    def __init__(self, index: int, count: int, kind: str, command: str, why: str, tail: list[str]):
        lines = "\n".join(f"    {line}" for line in tail)
        super().__init__(
            f"image step {index}/{count} ({kind}) failed: {why}\n  command: {command}"
            + (f"\n  its last lines:\n{lines}" if tail else "")
        )
        self.index = index
        self.kind = kind
        self.command = command
        self.tail = tail


@dataclass
class BuildResult:
    digest: str
    built: list[str] = field(default_factory=list)  # digests of the layers built now
    reused: int = 0  # layers the store held already
    seconds: float = 0.0


def _hex(digest: str) -> str:
    return digest.removeprefix("sha256:")


def step_commands(step: dict[str, Any]) -> list[str]:
    """The shell commands a step runs in the chroot."""
    kind = step["kind"]
    if kind == "apt":
        return [APT.format(packages=shlex.join(step["packages"]))]
    if kind == "pip":
        index = step.get("index_url")
        options = f"--index-url {shlex.quote(index)} " if index else ""
        return [PIP.format(options=options, packages=shlex.join(step["packages"]))]
    if kind == "run":
        return list(step["commands"])
    return []


def _refusal(error: Exception, step: dict[str, Any]) -> str:
    """A failed pull's reason, naming the secret whose credentials it tried."""
    secret = step.get("secret")
    return f"{error} (with the secret {secret!r})" if secret else str(error)


def describe(step: dict[str, Any]) -> str:
    kind = step["kind"]
    if kind == "debian_slim":
        return f"debian_slim: Debian {step['suite']}, python {step['python']}"
    if kind in ("apt", "pip"):
        return f"{kind}_install: {' '.join(step['packages'])}"
    if kind == "run":
        return f"run_commands: {len(step['commands'])} command(s)"
    if kind == "env":
        return f"env: {', '.join(step['env'])}"
    if kind == "workdir":
        return f"workdir: {step['path']}"
    if kind in ("local_dir", "local_file"):
        return f"add_{kind}: {step['local']} -> {step['remote']}"
    return f"from_registry: {step['reference']}"


class ImageBuilder:
    def __init__(
        self,
        store: LayerStore,
        folder: Path,
        mirror: str | None = None,
        secrets: dict[str, dict[str, str]] | None = None,
        limits: StepLimits | None = None,
    ) -> None:
        self.store = store
        # Secrets' values by name, for steps that name one (from_registry's credentials).
        self.secrets = secrets or {}
        self.folder = folder
        self.layers = folder / "layers-userns"
        self.locks = folder / "locks"
        self.mirror = mirror
        self.limits = limits or StepLimits()
        for path in (self.layers, self.locks, folder / "work"):
            path.mkdir(parents=True, exist_ok=True)
        # Unpacked with root's own owners, before build steps ran in user namespaces.
        shutil.rmtree(folder / "layers", ignore_errors=True)

    @contextmanager
    def _building(self) -> Iterator[None]:
        """A build under way (shared: any number at once); `trim` waits for none."""
        with (self.folder / ".build-lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)
            yield

    @contextmanager
    def _layer_locked(self, digest: str) -> Iterator[None]:
        """One builder at a time for this layer (built or unpacked), across builds."""
        with (self.locks / f"{_hex(digest)}.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def build(
        self,
        image: Image | dict[str, Any],
        on_line: Callable[[str], None],
        verify_registry: bool = False,
    ) -> BuildResult:
        """Build what the store lacks of `image`; its output goes to `on_line`, a line
        per step and the steps' own lines. A failed step raises ImageBuildError. With
        `verify_registry`, a stored registry layer is reused only once the registry
        accepts this build's credentials for the manifest it was pulled from."""
        image = image if isinstance(image, Image) else Image.from_dict(image)
        began = time.monotonic()
        result = BuildResult(image.digest)
        count = len(image.layers)
        if self.store.record(image.digest) is not None:
            if verify_registry:
                self._check_registry(image.layers[0], count, on_line)
            on_line(f"image {image.digest[7:19]}: built already, nothing to build")
            result.reused = count
            return result
        with self._building():
            entries: list[dict[str, Any]] = []
            env: dict[str, str] = {}
            workdir = "/"
            for index, layer in enumerate(image.layers, start=1):
                step = layer.step
                if step["kind"] == "env":
                    env.update(step["env"])
                elif step["kind"] == "workdir":
                    workdir = step["path"]
                with self._layer_locked(layer.digest):  # another build may store it now
                    entry = self.store.layer(layer.digest)
                    if entry is not None and step["kind"] == "registry":
                        if verify_registry:  # here, under the lock: it may be stored just now
                            self._check_registry(layer, count, on_line, entry)
                        env.update(entry.get("env") or {})
                        workdir = entry.get("workdir") or workdir
                    if entry is not None:
                        on_line(f"[{index}/{count}] {describe(step)} (built already)")
                        result.reused += 1
                    else:
                        on_line(f"[{index}/{count}] {describe(step)}")
                        below = image.layers[: index - 1]
                        entry = self._build_layer(index, count, layer, below, env, workdir, on_line)
                        result.built.append(layer.digest)
                        if step["kind"] == "registry":
                            env.update(entry.get("env") or {})
                            workdir = entry.get("workdir") or workdir
                entries.append({"digest": layer.digest, **entry})
            self.store.put_record(
                image.digest,
                {
                    "digest": image.digest,
                    "layers": entries,
                    "env": env,
                    "workdir": workdir,
                    "steps": image.to_dict()["steps"],
                },
            )
        result.seconds = time.monotonic() - began
        on_line(
            f"image {image.digest[7:19]}: {len(result.built)} layer(s) built, "
            f"{result.reused} reused, in {result.seconds:.1f} s"
        )
        return result

    def local(self, layer: Layer) -> Path:
        """The layer unpacked in this node's cache, fetched from the store if missing."""
        folder = self.layers / _hex(layer.digest)
        marker = folder.with_suffix(".json")
        if marker.exists():
            now = time.time()
            os.utime(marker, (now, now))  # used now: the last to go past the budget
            return folder
        with self._layer_locked(layer.digest):  # another build may be unpacking it
            if marker.exists():
                return folder
            entry = self.store.layer(layer.digest)
            if entry is None:
                raise FileNotFoundError(f"layer {layer.digest} is not built")
            with tempfile.TemporaryDirectory(dir=self.folder / "work") as scratch:
                archive = Path(scratch) / "layer.tar"
                self.store.fetch_tar(entry["sha256"], archive)
                self._unpack(archive, folder, entry)
        return folder

    def trim(self, budget_bytes: int) -> list[str]:
        """Past `budget_bytes` (by their tars' sizes), remove the least recently used
        layers unpacked here, and folders an unpacking cut short left (blocking). Only
        while no build runs: with one under way it leaves them all for the next time.
        The removed layers' digests (hex)."""
        with (self.folder / ".build-lock").open("w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return []
            entries = []
            for folder in self.layers.iterdir():
                if not folder.is_dir():
                    continue
                marker = folder.with_suffix(".json")
                try:
                    size = int(json.loads(marker.read_text()).get("size") or 0)
                    used_at = marker.stat().st_mtime
                except (OSError, ValueError, AttributeError):
                    shutil.rmtree(folder, ignore_errors=True)  # never whole
                    continue
                entries.append((used_at, folder.name, size))
            total = sum(size for _, _, size in entries)
            removed = []
            for _, name, size in sorted(entries):
                if total <= budget_bytes:
                    break
                (self.layers / f"{name}.json").unlink(missing_ok=True)  # first: not whole
                shutil.rmtree(self.layers / name, ignore_errors=True)
                total -= size
                removed.append(name)
            return removed

    def _unpack(self, archive: Path, folder: Path, entry: dict[str, Any]) -> None:
        shutil.rmtree(folder, ignore_errors=True)
        unpack_for_overlay(archive, folder, shift=BUILD_UIDS.first, span=BUILD_UIDS.count)
        folder.with_suffix(".json").write_text(json.dumps(entry))

    def _build_layer(
        self,
        index: int,
        count: int,
        layer: Layer,
        below: tuple[Layer, ...],
        env: dict[str, str],
        workdir: str,
        on_line: Callable[[str], None],
    ) -> dict[str, Any]:
        step = layer.step
        kind = step["kind"]

        def say(line: str) -> None:
            on_line(f"    {line}")

        extra: dict[str, Any] = {}
        with tempfile.TemporaryDirectory(dir=self.folder / "work") as scratch_name:
            scratch = Path(scratch_name)
            archive = scratch / "layer.tar"
            if kind == "debian_slim":
                try:
                    make_base(step["suite"], archive, say, self.mirror)
                except BaseImageError as exc:
                    raise ImageBuildError(
                        index, count, kind, f"mmdebstrap {step['suite']}", str(exc), exc.tail
                    ) from None
            elif kind == "registry":
                config = self._pull(index, count, step, scratch, say)
                extra = {"env": config.env, "workdir": config.workdir}
                if config.manifest:
                    extra["manifest"] = config.manifest
            else:
                upper = scratch / "upper"
                upper.mkdir(mode=0o755)
                lowers = [self.local(lower) for lower in reversed(below)]
                if kind in ("local_dir", "local_file"):
                    self._copy_in(index, count, step, lowers, upper)
                for command in step_commands(step):
                    ran = run_in_layers(
                        lowers, upper, scratch, command, env, workdir, say, self.limits
                    )
                    if ran.returncode != 0:
                        why = f"it exited with {ran.returncode}"
                        if ran.timed_out:
                            why = f"it ran past its timeout of {self.limits.timeout:g} s"
                        raise ImageBuildError(index, count, kind, command, why, list(ran.tail))
                pack_upper(upper, archive, BUILD_UIDS.inside)
            entry = self.store.put_layer(layer.digest, kind, archive, extra)
            # Kept unpacked here: the next step, and later builds on this node, use it.
            self._unpack(archive, self.layers / _hex(layer.digest), entry)
        return entry

    def _pull(
        self,
        index: int,
        count: int,
        step: dict[str, Any],
        scratch: Path,
        say: Callable[[str], None],
    ) -> PulledConfig:
        """The registry's image, its layers flattened into one tree, packed as this
        step's layer (in `scratch`/layer.tar)."""
        reference = step["reference"]
        credentials = self._credentials(index, count, step)
        tree = scratch / "tree"
        try:
            config = pull(reference, credentials, tree, scratch, say)
        except (RegistryError, OSError, tarfile.TarError, ValueError) as exc:
            raise ImageBuildError(
                index, count, "registry", f"pull {reference}", _refusal(exc, step), []
            ) from None
        pack_upper(tree, scratch / "layer.tar")
        shutil.rmtree(tree, ignore_errors=True)
        return config

    def _credentials(self, index: int, count: int, step: dict[str, Any]) -> tuple[str, str] | None:
        """The username and password of the secret a registry step names (None: none)."""
        secret = step.get("secret")
        if secret is None:
            return None
        values = self.secrets.get(secret)
        if values is None or not {"REGISTRY_USERNAME", "REGISTRY_PASSWORD"} <= set(values):
            raise ImageBuildError(
                index,
                count,
                "registry",
                f"pull {step['reference']}",
                f"the secret {secret!r} with REGISTRY_USERNAME and REGISTRY_PASSWORD "
                "was not given to the build",
                [],
            )
        return (values["REGISTRY_USERNAME"], values["REGISTRY_PASSWORD"])

    def _check_registry(
        self,
        first: Layer,
        count: int,
        on_line: Callable[[str], None],
        entry: dict[str, Any] | None = None,
    ) -> None:
        """A stored registry layer pulled with credentials that may be another
        workspace's: the registry serves its manifest to this build's credentials, or the
        step fails as the pull would have (a layer not stored is pulled with them)."""
        step = first.step
        if step["kind"] != "registry":
            return
        entry = entry or self.store.layer(first.digest) or {}
        reference = step["reference"]
        credentials = self._credentials(1, count, step)
        try:
            served = check_access(reference, credentials, str(entry.get("manifest") or ""))
        except (RegistryError, ValueError) as exc:
            raise ImageBuildError(
                1, count, "registry", f"pull {reference}", _refusal(exc, step), []
            ) from None
        on_line(
            f"from_registry: {reference}: the registry accepted this workspace's "
            f"credentials for {served}"
        )

    def _copy_in(
        self, index: int, count: int, step: dict[str, Any], lowers: list[Path], upper: Path
    ) -> None:
        """A local file or folder into the new layer, checked against the contents its
        step was declared with (what the digest counted is what is copied)."""
        kind, local, remote = step["kind"], Path(step["local"]), PurePosixPath(step["remote"])
        command = f"copy {local} to {remote}"
        try:
            found = tree_digest(local)[0] if kind == "local_dir" else one_file_digest(local)
        except Exception as exc:  # InvalidError: gone, or not a folder any more
            raise ImageBuildError(index, count, kind, command, str(exc), []) from None
        if found != step["contents"]:
            raise ImageBuildError(
                index, count, kind, command, "its contents changed since it was declared", []
            )
        # A folder on the way that is a symbolic link in the image (/lib -> usr/lib)
        # would be hidden by a real folder of the same name in this layer.
        for depth in range(1, len(remote.parts)):
            part = PurePosixPath(*remote.parts[1 : depth + 1])
            for lower in lowers:
                path = lower / part
                if path.is_symlink():
                    raise ImageBuildError(
                        index,
                        count,
                        kind,
                        command,
                        f"/{part} is a symbolic link in the image; copy to the path it leads to",
                        [],
                    )
                if os.path.lexists(path):
                    break
        target = upper / remote.relative_to("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if kind == "local_dir":
            shutil.copytree(local, target, symlinks=True, dirs_exist_ok=True)
        else:
            shutil.copy2(local, target)

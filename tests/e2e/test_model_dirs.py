"""Folders of the node that every replica may read (`--model-dir`): weights opened by a
file:// URL in one of them load in a sandboxed replica, which cannot write there; a
file:// URL elsewhere on the node fails with an error that says how to show it; and
`ember server` refuses a folder that is not one, or that holds its state dir."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import Platform, running_platform

import ember

APP = """
import ember

@ember.endpoint(name="w", snapshot=False, weights={{"m": "file://{folder}/m.safetensors"}})
class W:
    @ember.method
    def total(self) -> float:
        return float(self.weights["m"]["w"].sum())

    @ember.method
    def plant(self) -> str:
        try:
            with open("{folder}/planted", "w") as handle:
                handle.write("x")
        except OSError as error:
            return f"refused: errno {{error.errno}}"
        return "written"
"""


def weights_folder() -> Path:
    """A folder of the node's (not under pytest's root-only folders: a folder shown
    as it is keeps its modes) with one small safetensors file, readable by others."""
    import torch
    from safetensors.torch import save_file

    folder = Path(tempfile.mkdtemp(prefix="ember-model-dir-"))
    folder.chmod(0o755)
    save_file({"w": torch.arange(6.0).reshape(2, 3)}, folder / "m.safetensors")
    (folder / "m.safetensors").chmod(0o644)
    return folder


@pytest.fixture(scope="module")
def folders() -> Iterator[tuple[Path, Path]]:
    shown, hidden = weights_folder(), weights_folder()
    try:
        yield shown, hidden
    finally:
        for folder in (shown, hidden):
            for path in folder.iterdir():
                path.unlink()
            folder.rmdir()


@pytest.fixture(scope="module")
def platform(
    folders: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Platform]:
    root = tmp_path_factory.mktemp("model-dirs")
    with running_platform(root, extra=("--model-dir", str(folders[0]))) as platform:
        yield platform


def deploy(platform: Platform, name: str, folder: Path) -> ember.Endpoint:
    app = platform.root / f"{name}.py"
    app.write_text(APP.format(folder=folder))
    platform.deploy(app, name)
    return ember.Endpoint.lookup(name, "w", config=platform.config())


def test_weights_in_a_shown_folder_load_and_the_folder_is_read_only(
    platform: Platform, folders: tuple[Path, Path]
) -> None:
    endpoint = deploy(platform, "shown", folders[0])
    assert endpoint.total.call() == 15.0
    assert endpoint.plant.call() == f"refused: errno {30}"  # EROFS: shown read-only
    assert not (folders[0] / "planted").exists()


def test_weights_in_a_folder_not_shown_fail_saying_how_to_show_it(
    platform: Platform, folders: tuple[Path, Path]
) -> None:
    endpoint = deploy(platform, "hidden", folders[1])
    with pytest.raises(ember.EmberError) as raised:
        endpoint.total.call()
    message = str(raised.value)
    assert "no such file" in message and "--model-dir" in message, message


@pytest.mark.parametrize("which", ["missing", "state"])
def test_the_server_refuses_a_folder_it_cannot_show(tmp_path: Path, which: str) -> None:
    state = tmp_path / "state"
    folder = tmp_path / "nothing-here" if which == "missing" else tmp_path
    env = {**os.environ, "HOME": str(tmp_path), "EMBER_CONFIG": str(tmp_path / "c.json")}
    command = [sys.executable, "-m", "ember.cli.main", "server", "--state-dir", str(state)]
    result = subprocess.run(
        [*command, "--port", "0", "--model-dir", str(folder)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    expected = "not a folder" if which == "missing" else "which replicas must not read"
    assert expected in result.stderr, result.stderr
    assert not state.exists()  # refused before anything was written

"""The folders of a node that every replica may read (`--model-dir`), such as weights
opened by file:// URL: checked before the worker shows them, read-only, in every sandbox
(agent/replicas/sandboxes.py)."""

from __future__ import annotations

from pathlib import Path


def model_dir(text: str) -> str:
    """The folder `text` names, resolved; ValueError when it cannot be one."""
    path = Path(text).expanduser().resolve()
    if not path.is_dir():
        raise ValueError(f"{text}: not a folder")
    if path == Path("/"):
        raise ValueError("/ would show replicas the whole node")
    return str(path)


def overlap_problem(model_dirs: list[str], private: Path) -> str | None:
    """Why these folders cannot be shown to replicas, if they cannot: one that holds
    `private` (the worker's folder, or a server's state dir), or lies in it, would show
    them records, keys and snapshot images."""
    private = private.expanduser().resolve()
    for folder in map(Path, model_dirs):
        if private.is_relative_to(folder) or folder.is_relative_to(private):
            return f"--model-dir {folder} overlaps {private}, which replicas must not read"
    return None

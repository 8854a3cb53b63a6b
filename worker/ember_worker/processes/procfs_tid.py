"""The library replicas in their own PID namespace preload, so that /proc paths naming
their own threads resolve (see native/procfs_tid.c: CUDA's cuInit fails without it)."""

from __future__ import annotations

import os
from pathlib import Path

LIBRARY = Path(__file__).parent.parent / "native" / "libprocfs_tid.so"
PRELOAD_ENV = "LD_PRELOAD"


def library() -> Path | None:
    """The built library (infra/native.sh builds it), or None where it is not built."""
    return LIBRARY if LIBRARY.is_file() else None


def with_preload(env: dict[str, str]) -> dict[str, str]:
    """`env` with the library first in LD_PRELOAD, where it is built; others stay."""
    found = library()
    if found is None:
        return env
    preloaded = [entry for entry in env.get(PRELOAD_ENV, "").split(":") if entry]
    if str(found) in preloaded:
        return env
    return {**env, PRELOAD_ENV: os.pathsep.join([str(found), *preloaded])}


def missing_problem() -> str | None:
    """Why GPU replicas in PID namespaces would fail to init CUDA here, or None."""
    if library() is not None:
        return None
    return (
        f"{LIBRARY.name} is not built (infra/native.sh builds it), so CUDA cannot start "
        "in replicas run in their own PID namespace (cuInit fails with error 304)"
    )

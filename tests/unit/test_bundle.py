"""Building app bundles on the client and extracting them safely on the worker."""

from __future__ import annotations

import gzip
import io
import os
import random
import re
import tarfile
from pathlib import Path

import pytest

from ember.bundle import build_bundle
from ember.errors import BundleError
from ember_worker.agent.bundle_extract import extract_bundle


def _write(path: Path, data: bytes | str = b"x", mode: int = 0o644) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    path.chmod(mode)
    return path


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under root (without following links), relative POSIX path -> content."""
    out: dict[str, bytes] = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = Path(dirpath, name)
            out[path.relative_to(root).as_posix()] = (
                b"<link>" if path.is_symlink() else path.read_bytes()
            )
    return out


def _snapshot(root: Path) -> set[str]:
    """Every path under root, folders and links included."""
    paths: set[str] = set()
    for dirpath, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            paths.add(Path(dirpath, name).relative_to(root).as_posix())
    return paths


@pytest.fixture
def app(tmp_path: Path) -> Path:
    root = tmp_path / "app"
    _write(root / "app.py", "print('hi')\n")
    _write(root / "pkg" / "__init__.py", "")
    _write(root / "pkg" / "mod.py", "X = 1\n", mode=0o600)
    _write(root / "run.sh", "#!/bin/sh\necho hi\n", mode=0o755)
    _write(root / "data" / "weights.bin", bytes(range(256)) * 10)
    # Everything below must be left out.
    _write(root / ".git" / "config", "[core]\n")
    _write(root / "__pycache__" / "app.cpython-311.pyc", b"\0")
    _write(root / "pkg" / "__pycache__" / "mod.cpython-311.pyc", b"\0")
    _write(root / "stray.pyc", b"\0")
    _write(root / ".venv" / "bin" / "python", b"\0", mode=0o755)
    _write(root / "sub" / "venv" / "lib.py", "")
    _write(root / "node_modules" / "left-pad" / "index.js", "")
    _write(root / ".ember" / "state.json", "{}")
    _write(root / ".pytest_cache" / "v", "")
    _write(root / ".ruff_cache" / "v", "")
    _write(root / ".mypy_cache" / "v", "")
    return root


EXPECTED = {"app.py", "pkg/__init__.py", "pkg/mod.py", "run.sh", "data/weights.bin"}


# -- building --------------------------------------------------------------------------


def test_round_trip(app: Path, tmp_path: Path) -> None:
    bundle = build_bundle(app)
    assert bundle.file_count == len(EXPECTED)
    assert bundle.size == sum(len((app / name).read_bytes()) for name in EXPECTED)
    assert bundle.digest.startswith("sha256:") and len(bundle.digest) == 7 + 64

    dest = extract_bundle(bundle.data, tmp_path / "out" / "app")
    assert dest == tmp_path / "out" / "app"
    files = _tree(dest)
    assert set(files) == EXPECTED
    for name in EXPECTED:
        assert files[name] == (app / name).read_bytes()
    assert (dest / "run.sh").stat().st_mode & 0o777 == 0o755
    assert (dest / "app.py").stat().st_mode & 0o777 == 0o644
    assert (dest / "pkg" / "mod.py").stat().st_mode & 0o777 == 0o644
    assert (dest / "pkg").stat().st_mode & 0o777 == 0o755
    assert dest.stat().st_mode & 0o777 == 0o755
    assert os.listdir(tmp_path / "out") == ["app"]


def test_deterministic(app: Path) -> None:
    first = build_bundle(app)
    assert build_bundle(app).digest == first.digest
    for path in app.rglob("*"):
        os.utime(path, (1_000_000, 1_000_000))
    assert build_bundle(app) == first

    assert first.data[4:8] == b"\0\0\0\0"  # gzip header mtime
    with tarfile.open(fileobj=io.BytesIO(first.data), mode="r:gz") as tar:
        members = tar.getmembers()
    assert [m.name for m in members] == sorted(EXPECTED)
    for m in members:
        assert (m.mtime, m.uid, m.gid, m.uname, m.gname) == (0, 0, 0, "", "")
        assert m.isreg() and m.mode in (0o644, 0o755)


def test_links(tmp_path: Path) -> None:
    root = tmp_path / "app"
    _write(root / "real.py", "REAL = 1\n", mode=0o755)
    (root / "alias.py").symlink_to("real.py")
    outside = _write(tmp_path / "secret.txt", "secret")
    (root / "secret.txt").symlink_to(outside)
    (root / "dangling").symlink_to(root / "missing")
    (root / "loop").symlink_to(".")
    (root / "escape").symlink_to("../app/../secret.txt")

    bundle = build_bundle(root)
    assert bundle.file_count == 2
    with tarfile.open(fileobj=io.BytesIO(bundle.data), mode="r:gz") as tar:
        alias = tar.getmember("alias.py")
        assert alias.isreg() and alias.mode == 0o755
        assert sorted(tar.getnames()) == ["alias.py", "real.py"]
    dest = extract_bundle(bundle.data, tmp_path / "out")
    assert _tree(dest) == {"alias.py": b"REAL = 1\n", "real.py": b"REAL = 1\n"}


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match="does not exist"):
        build_bundle(tmp_path / "nope")
    _write(tmp_path / "file.py")
    with pytest.raises(BundleError, match="not a folder"):
        build_bundle(tmp_path / "file.py")


def test_build_limits(app: Path) -> None:
    with pytest.raises(BundleError, match=r"more than 4 files.*outside the app folder") as err:
        build_bundle(app, max_files=4)
    assert str(app) in str(err.value)
    assert build_bundle(app, max_files=5).file_count == 5

    size = build_bundle(app).size
    with pytest.raises(BundleError, match=rf"more than {size - 1} bytes"):
        build_bundle(app, max_bytes=size - 1)
    assert build_bundle(app, max_bytes=size).size == size


# -- extracting ------------------------------------------------------------------------


def _member(name: str, data: bytes = b"", **attrs: object) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    for key, value in attrs.items():
        setattr(info, key, value)
    return info, data


def _archive(*members: tuple[tarfile.TarInfo, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return buf.getvalue()


def _reject(data: bytes, tmp_path: Path, match: str, **limits: int) -> None:
    """Extraction must fail and leave tmp_path exactly as it was (bar an empty out/)."""
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    before = _snapshot(tmp_path) - {"out"}
    dest = tmp_path / "out" / "app"
    with pytest.raises(BundleError, match=re.escape(match)):
        extract_bundle(data, dest, **limits)
    assert not os.path.lexists(dest)
    assert os.listdir(tmp_path / "out") == []
    assert _snapshot(tmp_path) - {"out"} == before


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("../evil", "'../evil' escapes the bundle folder"),
        ("a/../../evil", "'a/../../evil' escapes the bundle folder"),
        ("ok/../evil", "escapes the bundle folder"),
        ("/etc/evil", "'/etc/evil' is an absolute path"),
    ],
)
def test_reject_bad_paths(tmp_path: Path, name: str, match: str) -> None:
    data = _archive(_member("fine.txt", b"ok"), _member(name, b"evil"))
    _reject(data, tmp_path, match)
    assert not os.path.lexists("/etc/evil")


def test_reject_symlink(tmp_path: Path) -> None:
    link = _member("passwd", type=tarfile.SYMTYPE, linkname="/etc/passwd")
    _reject(_archive(link), tmp_path, "'passwd' is a symbolic link to '/etc/passwd'")


def test_reject_write_through_symlink(tmp_path: Path) -> None:
    target = tmp_path / "outside"
    data = _archive(
        _member("link", type=tarfile.SYMTYPE, linkname=str(target)),
        _member("link/evil", b"evil"),
    )
    _reject(data, tmp_path, "'link' is a symbolic link")
    assert not (target / "evil").exists()


def test_reject_hard_link(tmp_path: Path) -> None:
    data = _archive(
        _member("a.txt", b"a"), _member("b.txt", type=tarfile.LNKTYPE, linkname="a.txt")
    )
    _reject(data, tmp_path, "'b.txt' is a hard link")


@pytest.mark.parametrize(
    ("kind", "match"),
    [
        (tarfile.CHRTYPE, "'node' is a device file"),
        (tarfile.BLKTYPE, "'node' is a device file"),
        (tarfile.FIFOTYPE, "'node' is a FIFO"),
        (tarfile.CONTTYPE, None),  # contiguous file: a plain file, accepted
    ],
)
def test_special_members(tmp_path: Path, kind: bytes, match: str | None) -> None:
    data = _archive(_member("node", type=kind, devmajor=1, devminor=3))
    if match is None:
        assert _tree(extract_bundle(data, tmp_path / "ok")) == {"node": b""}
    else:
        _reject(data, tmp_path, match)


def test_reject_too_many_members(tmp_path: Path) -> None:
    data = _archive(*(_member(f"f{i}.txt", b"x") for i in range(6)))
    _reject(data, tmp_path, "more than 5 members", max_files=5)
    assert len(_tree(extract_bundle(data, tmp_path / "ok", max_files=6))) == 6


def test_reject_declared_size_over_budget(tmp_path: Path) -> None:
    data = _archive(_member("a.bin", b"a" * 60), _member("b.bin", b"b" * 60))
    _reject(data, tmp_path, "'b.bin' takes the bundle over 100 bytes", max_bytes=100)
    assert len(_tree(extract_bundle(data, tmp_path / "ok", max_bytes=120))) == 2


def test_reject_lying_size_header(tmp_path: Path) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info, data = _member("big.bin", b"z" * 5000)
        tar.addfile(info, io.BytesIO(data))
    # Keep the header but only part of the data it announces.
    truncated = gzip.compress(buf.getvalue()[: 512 + 1000], mtime=0)
    _reject(truncated, tmp_path, "not a valid gzip tar archive")


def test_reject_truncated_gzip(app: Path, tmp_path: Path) -> None:
    data = build_bundle(app).data
    _reject(data[: len(data) // 2], tmp_path, "not a valid gzip tar archive")


_RNG = random.Random(1234)


@pytest.mark.parametrize(
    "blob",
    [
        b"",
        b"PK\x03\x04 this is a zip file, not a tar",
        _RNG.randbytes(4096),
        gzip.compress(_RNG.randbytes(4096)),  # valid gzip, not a tar
        b"\x1f\x8b" + _RNG.randbytes(200),  # gzip magic, garbage after
    ],
    ids=["empty", "not-gzip", "random", "gzip-of-random", "gzip-magic-garbage"],
)
def test_reject_invalid_archives(tmp_path: Path, blob: bytes) -> None:
    _reject(blob, tmp_path, "bundle is not a valid gzip tar archive")


@pytest.mark.parametrize(
    "members",
    [
        [("a.txt", b"1"), ("a.txt", b"2")],
        [("a.txt", b"1"), ("./a.txt", b"2")],
        [("d/a.txt", b"1"), ("d//a.txt", b"2")],
    ],
    ids=["same", "dot-prefix", "double-slash"],
)
def test_reject_duplicates(tmp_path: Path, members: list[tuple[str, bytes]]) -> None:
    data = _archive(*(_member(name, content) for name, content in members))
    _reject(data, tmp_path, "appears more than once")


def test_reject_file_folder_clash(tmp_path: Path) -> None:
    data = _archive(_member("a", b"file"), _member("a/b.txt", b"inside a file"))
    _reject(data, tmp_path, "'a/b.txt' is inside 'a', which is a file")
    data = _archive(_member("a/b.txt", b"1"), _member("a", b"file"))
    _reject(data, tmp_path, "'a' is a file but also a folder")


def test_explicit_folders_and_modes(tmp_path: Path) -> None:
    data = _archive(
        _member("./", type=tarfile.DIRTYPE, mode=0o700),
        _member("bin/tool", b"#!/bin/sh\n", mode=0o4777),
        _member("bin", type=tarfile.DIRTYPE, mode=0o777),
        _member("empty", type=tarfile.DIRTYPE, mode=0o700),
    )
    dest = extract_bundle(data, tmp_path / "out")
    assert (dest / "bin" / "tool").stat().st_mode & 0o7777 == 0o755
    assert (dest / "bin").stat().st_mode & 0o7777 == 0o755
    assert (dest / "empty").is_dir()


def test_dest_already_exists(app: Path, tmp_path: Path) -> None:
    data = build_bundle(app).data
    dest = tmp_path / "out" / "app"
    _write(dest / "theirs.txt", "keep")
    with pytest.raises(BundleError, match="already exists"):
        extract_bundle(data, dest)
    assert _tree(dest) == {"theirs.txt": b"keep"}
    assert os.listdir(tmp_path / "out") == ["app"]


def test_lost_race_keeps_theirs(app: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = build_bundle(app).data
    dest = tmp_path / "out" / "app"
    real_replace = os.replace

    def other_process_wins(src: str | Path, dst: str | Path) -> None:
        _write(Path(dst) / "theirs.txt", "theirs")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", other_process_wins)
    assert extract_bundle(data, dest) == dest
    assert _tree(dest) == {"theirs.txt": b"theirs"}
    assert os.listdir(tmp_path / "out") == ["app"]

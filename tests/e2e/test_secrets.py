"""Secrets: `ember secret set/ls/rm`, and endpoints whose replicas get their variables."""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness import EMBER, Platform, replicas_ready, wait_for
from machine_needs import snapshots_on

import ember

APP = "secretive"


def _loaded(platform: Platform) -> dict:
    return ember.Endpoint.lookup(APP, "loaded", config=platform.config()).info.call()


def _redeploy(platform: Platform, apps_dir: Path) -> None:
    """A new version of the same code: no replica of the old one serves."""
    platform.ember("stop", APP)
    wait_for(
        lambda: not any(e["label"].startswith(APP) for e in platform.status()["endpoints"]), 30
    )
    platform.deploy(apps_dir / "secretive.py", APP)


def test_replicas_get_their_secrets_and_new_values_after_a_change(
    platform: Platform, apps_dir: Path
) -> None:
    missing = platform.ember("deploy", str(apps_dir / "secretive.py"), "--name", APP, check=False)
    assert missing.returncode == 1
    assert "asks for secret greeting, which does not exist" in missing.stderr
    assert "ember secret set greeting KEY=VALUE" in missing.stderr

    # A value from standard input stays out of the shell's history; one only, so that a
    # second KEY=- is not silently empty.
    twice = platform.ember("secret", "set", "greeting", "A=-", "B=-", check=False)
    assert twice.returncode == 1 and "only one value can come from standard input" in twice.stderr
    made = subprocess.run(
        [*EMBER, "secret", "set", "greeting", "GREETING=hello", "API_TOKEN=-"],
        input="s3cr3t\n",
        env=platform.env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert made.stdout.strip() == "created secret greeting (API_TOKEN, GREETING)"
    platform.deploy(apps_dir / "secretive.py", APP)
    plain = ember.Endpoint.lookup(APP, "plain", config=platform.config())
    assert plain.call() == {"greeting": "hello", "token": "s3cr3t", "mode": "fast"}
    first = _loaded(platform)
    assert first == {"at_load": "hello", "now": "hello", "restored": False}

    # (Left out only where EMBER_TEST_ALLOW_SKIP names criu; else no snapshots fail the test.)
    if snapshots_on(platform.status()["workers"][0]["snapshots"].get("problem")):
        # A second replica, restored, has the same values
        wait_for(lambda: platform.endpoint_status(f"{APP}--loaded")["snapshots"], 60)
        loaded = ember.Endpoint.lookup(APP, "loaded", config=platform.config())
        # The restored replica is ready before two calls at once take one replica each.
        with replicas_ready(platform, loaded, 2), ThreadPoolExecutor(max_workers=2) as pool:
            both = list(pool.map(lambda _: loaded.info.call(seconds=2.0), range(2)))
        assert {"at_load": "hello", "now": "hello", "restored": True} in both

    # New values: replicas started from now on get them, and no image holds the old ones.
    # A bare KEY takes its value from this shell's environment.
    changed = subprocess.run(
        [*EMBER, "secret", "set", "greeting", "GREETING=bonjour", "API_TOKEN"],
        env={**platform.env, "API_TOKEN": "t2"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert changed.stdout.startswith("updated secret greeting (API_TOKEN, GREETING)")
    assert platform.endpoint_status(f"{APP}--loaded")["snapshots"] == []
    _redeploy(platform, apps_dir)
    assert plain.call() == {"greeting": "bonjour", "token": "t2", "mode": "fast"}
    assert _loaded(platform) == {"at_load": "bonjour", "now": "bonjour", "restored": False}

    # Names and keys are shown, values never.
    listing = platform.ember("secret", "ls").stdout
    assert "greeting" in listing and "API_TOKEN, GREETING" in listing
    assert f"{APP}--loaded" in listing and f"{APP}--plain" in listing
    shown = listing + platform.ember("ls").stdout + platform.ember("logs", APP, "-n", "500").stdout
    assert "s3cr3t" not in shown and "bonjour" not in shown and "t2" not in listing

    # A secret in use stays; once its users are stopped it can go.
    used = platform.ember("secret", "rm", "greeting", check=False)
    assert used.returncode == 1 and f"is used by {APP}--loaded, {APP}--plain" in used.stderr
    platform.ember("stop", APP)
    wait_for(
        lambda: not any(e["label"].startswith(APP) for e in platform.status()["endpoints"]), 30
    )
    assert platform.ember("secret", "rm", "greeting").stdout.strip() == "deleted secret greeting"
    assert "no secrets" in platform.ember("secret", "ls").stdout


def test_bad_secrets_get_clear_errors(platform: Platform) -> None:
    for args, message in [
        (["bad", "NOEQUALS"], "environment has no NOEQUALS to take its value from"),
        (["bad", "EMBER_TOKEN=x"], "names starting with EMBER_ are Ember's own"),
        (["bad", "1X=y"], "is not an environment variable name"),
        (["../apps", "A=1"], "secret name '../apps' is not allowed"),
        (["bad"], "give at least one KEY=VALUE"),
    ]:
        result = platform.ember("secret", "set", *args, check=False)
        assert result.returncode == 1 and message in result.stderr, result.stderr
    gone = platform.ember("secret", "rm", "nothing-here", check=False)
    assert gone.returncode == 1 and "no secret nothing-here" in gone.stderr

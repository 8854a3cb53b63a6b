"""Canary deploys through the CLI and HTTPS: a share of the calls to the new version,
sticky by affinity key, compared, aborted, promoted without a cold start."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness import Platform, wait_for

import ember

APP_SOURCE = """
import ember

VERSION = 1


@ember.endpoint(min_replicas=1, concurrency=8, scaledown_window=60)
def which(x: int = 0) -> dict:
    return {"version": VERSION}
"""


def _versions(which: ember.Endpoint, calls: int, **kwargs: object) -> Counter[int]:
    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(lambda _: which.call(**kwargs)["version"], range(calls)))
    return Counter(answers)


def test_a_canary_takes_its_share_then_is_aborted_or_promoted(
    platform: Platform, tmp_path: Path
) -> None:
    app_file = tmp_path / "canaried" / "app.py"
    app_file.parent.mkdir()
    app_file.write_text(APP_SOURCE)
    platform.deploy(app_file, "canaried")
    which = ember.Endpoint.lookup("canaried", "which", config=platform.config())
    assert which.call() == {"version": 1}

    app_file.write_text(APP_SOURCE.replace("VERSION = 1", "VERSION = 2"))
    out = platform.ember("deploy", str(app_file), "--name", "canaried", "--canary", "30", "--wait")
    assert "version 2 as a canary: it takes 30% of the calls beside version 1" in out.stdout
    assert "canary version 2 serves 30% of calls" in out.stdout
    shares = _versions(which, 200)
    assert set(shares) == {1, 2} and 0.15 < shares[2] / 200 < 0.45, shares

    def by_role() -> dict[str, float] | None:
        with platform.client() as client:
            text = client.get("/metrics").text
        prefix = 'ember:version_requests_total{app="canaried",endpoint="which",role="'
        counts = {
            line[len(prefix) :].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(prefix) and 'status="200"' in line
        }
        return counts if sum(counts.values()) == 200 else None

    assert wait_for(by_role, 10) == {"canary": shares[2], "serving": shares[1]}
    # A key keeps its version: a user sees one behaviour, not both by turns.
    for n in range(12):
        assert len(_versions(which, 4, _affinity=f"user-{n}")) == 1
    compared = platform.ember("canary", "canaried").stdout
    assert "canary version 2 takes 30% of the calls" in compared
    assert "canary   v2" in compared and "serving  v1" in compared
    assert "canary v2 30%: 1 ready" in platform.ember("ls").stdout

    # What a canary cannot be is refused, and the one running is left as it was.
    refused = platform.ember("deploy", str(app_file), "--name", "canaried", "--canary", "0",
                             check=False)  # fmt: skip
    assert refused.returncode != 0 and "1 to 99 percent" in refused.stderr
    grown = app_file.parent / "grown.py"
    grown.write_text(APP_SOURCE + "\n\n@ember.endpoint()\ndef extra() -> int:\n    return 1\n")
    refused = platform.ember("deploy", str(grown), "--name", "canaried", "--canary", "10",
                             check=False)  # fmt: skip
    assert refused.returncode != 0 and "a canary has the serving version's endpoints" in (
        refused.stderr
    )
    assert platform.endpoint_status("canaried--which")["canary"]["version"] == 2

    aborted = platform.ember("canary", "canaried", "--abort").stdout
    assert "canary version 2 of canaried is withdrawn" in aborted
    assert _versions(which, 40) == {1: 40}
    assert "withdrawn canary" in platform.ember("history", "canaried").stdout

    app_file.write_text(APP_SOURCE.replace("VERSION = 1", "VERSION = 3"))
    platform.ember("deploy", str(app_file), "--name", "canaried", "--canary", "50", "--wait")
    promoted = platform.ember("canary", "canaried", "--promote").stdout
    assert "version 3 of canaried serves every call" in promoted
    assert _versions(which, 40) == {3: 40}  # at once: the canary's replica serves
    label = "canaried--which"
    wait_for(lambda: platform.endpoint_status(label)["replicas"] == {"ready": 1}, 30)
    assert platform.endpoint_status(label)["canary"] is None
    missing = platform.ember("canary", "canaried", check=False)
    assert missing.returncode != 0 and "has no canary" in missing.stderr
    # A rollback goes back past the withdrawn canary, to what served before.
    assert "back to the code and settings of v1" in platform.ember("rollback", "canaried").stdout
    wait_for(lambda: which.call() == {"version": 1}, 60, interval=0.2)
    platform.ember("stop", "canaried")


def test_a_rate_limited_token_pays_once_for_a_call_a_canary_takes(
    platform: Platform, tmp_path: Path
) -> None:
    """A token's rate limit counts calls, whichever version takes them: a call the
    canary takes is charged once, not again when the canary's own access is checked,
    and no 429 is counted that no caller received."""
    app_file = tmp_path / "limitedcanary" / "app.py"
    app_file.parent.mkdir()
    app_file.write_text(APP_SOURCE)
    platform.deploy(app_file, "limitedcanary")
    app_file.write_text(APP_SOURCE.replace("VERSION = 1", "VERSION = 2"))
    platform.ember("deploy", str(app_file), "--name", "limitedcanary", "--canary", "50", "--wait")
    token = platform.ember("token", "create", "--rate-limit", "12/min").stdout.strip()
    with platform.client(token=token) as client:
        answers = [client.post("/limitedcanary--which/", json={}) for _ in range(12)]
    statuses = Counter(a.status_code for a in answers)
    assert statuses == {200: 12}, [a.text for a in answers if a.status_code != 200]
    versions = Counter(a.json()["version"] for a in answers)
    assert versions[2] > 0, versions  # the canary took some of them
    with platform.client() as client:
        metrics = client.get("/metrics").text
    turned_away = [
        line
        for line in metrics.splitlines()
        if line.startswith('ember:requests_total{app="limitedcanary"') and 'status="429"' in line
    ]
    assert not turned_away, turned_away

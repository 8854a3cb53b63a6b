"""An endpoint whose function is `round_trip` is deployed as `round-trip`; looked up or
called by its Python name, it is found, and `ember call` says which label it took."""

from __future__ import annotations

import json
import textwrap

import pytest
from harness import Platform

import ember

APP = "spelt"
SOURCE = textwrap.dedent(
    """
    import ember


    @ember.endpoint()
    def round_trip(x: int = 1) -> dict:
        return {"x": x}
    """
)


@pytest.fixture(scope="module")
def deployed(platform: Platform, tmp_path_factory: pytest.TempPathFactory) -> Platform:
    source = tmp_path_factory.mktemp("spelt") / "spelt.py"
    source.write_text(SOURCE)
    assert f"{APP}--round-trip" in platform.deploy(source, APP)
    return platform


def test_lookup_by_the_functions_name(deployed: Platform) -> None:
    config = deployed.config()
    for name in ("round_trip", "round-trip", "Round_Trip"):
        endpoint = ember.Endpoint.lookup(APP, name, config=config)
        assert endpoint.label == f"{APP}--round-trip"
        assert endpoint.call(x=3) == {"x": 3}
    with pytest.raises(ember.NotFoundError, match=f"did you mean {APP}--round-trip"):
        ember.Endpoint.lookup(APP, "round_trips", config=config)
    with pytest.raises(ember.NotFoundError) as far:
        ember.Endpoint.lookup(APP, "nothing-like-it", config=config)
    assert "did you mean" not in str(far.value)


def test_ember_call_says_which_label_it_means(deployed: Platform) -> None:
    result = deployed.ember("call", f"{APP}--round_trip", '{"x": 5}')
    assert json.loads(result.stdout) == {"x": 5}
    assert f"{APP}--round_trip is labelled {APP}--round-trip" in result.stderr
    plain = deployed.ember("call", f"{APP}--round-trip", '{"x": 6}')
    assert json.loads(plain.stdout) == {"x": 6} and plain.stderr == ""


def test_a_url_with_the_functions_name_answers(deployed: Platform) -> None:
    with deployed.client() as client:
        answer = client.post(f"/{APP}--round_trip/", json={"x": 7})
    assert answer.status_code == 200 and answer.json() == {"x": 7}


def test_a_404_names_the_nearest_label(deployed: Platform) -> None:
    with deployed.client() as client:
        answer = client.post(f"/{APP}--round-trips/", json={})
    assert answer.status_code == 404
    assert answer.json()["error"]["message"].endswith(f"did you mean {APP}--round-trip?")
    result = deployed.ember("call", f"{APP}--roundtrip", check=False)
    assert result.returncode != 0 and f"did you mean {APP}--round-trip?" in result.stderr
    # The commands that take a label name it too: a new user's typo is not a dead end.
    for command in (
        ("scale", f"{APP}--round-trips", "--min", "0"),
        ("replica", "exec", f"{APP}--round-trips", "--", "true"),
        ("profile", f"{APP}--roundtrip", "--dump"),
    ):
        typed = deployed.ember(*command, check=False)
        assert typed.returncode == 1 and f"did you mean {APP}--round-trip?" in typed.stderr, (
            command,
            typed.stderr,
        )

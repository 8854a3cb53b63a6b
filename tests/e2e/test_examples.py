"""The README's first command: the server with the hello example, and the printed curl line;
then the classifier, web app and audio examples, deployed side by side on one platform.
Each example's documented calls (its app.py docstring's `ember call` and `curl` lines) run
as written against the test's server (documented_commands.py)."""

from __future__ import annotations

import ast
import json
import shlex
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from documented_commands import (
    EXAMPLES,
    NOT_RUN,
    RUN_BY,
    documented_commands,
    examples,
    run_documented,
    running_reader_platform,
)
from harness import Platform

import ember


def test_every_examples_documented_commands_are_run_or_say_why_not() -> None:
    """Each example's documented calls are run by the test RUN_BY names, or NOT_RUN says
    why not; each NOT_RUN entry still names a documented command."""
    for example in examples():
        commands = documented_commands(example)
        if any(command.not_run is None for command in commands):
            assert example in RUN_BY, f"no test runs examples/{example}'s commands: add one"
    for example, test in RUN_BY.items():
        assert example in runs_documented(test), f"{test} runs no run_documented({example!r})"
    for (example, start), why in NOT_RUN.items():
        lines = [command.line for command in documented_commands(example)]
        assert any(line.startswith(start) for line in lines), (example, start, why)


def runs_documented(test: str) -> set[str]:
    """The examples whose commands the test `file::name` runs: run_documented("example"...)."""
    file, _, name = test.partition("::")
    module = ast.parse((Path(__file__).parent / file).read_text())
    function = next(
        node for node in module.body if isinstance(node, ast.FunctionDef) and node.name == name
    )
    return {
        node.args[0].value
        for node in ast.walk(function)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "run_documented"
        and isinstance(node.args[0], ast.Constant)
    }


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    """One platform as `ember server` starts with no options, for the examples after the
    first (each its own app, so they share it)."""
    with running_reader_platform(tmp_path_factory.mktemp("examples")) as running:
        yield running


def test_server_deploys_example_and_prints_a_working_curl_line(tmp_path: Path) -> None:
    hello = EXAMPLES / "hello" / "app.py"
    with running_reader_platform(tmp_path, extra=("--deploy", str(hello))) as platform:
        curl_lines = [line.split("try: ", 1)[1] for line in platform.output if "try: curl" in line]
        assert len(curl_lines) == 2
        greet = next(line for line in curl_lines if "hello--greet" in line)
        result = subprocess.run(shlex.split(greet), capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout) == {"greeting": "Hello, world."}
        count = next(line for line in curl_lines if "hello--count" in line)
        result = subprocess.run(shlex.split(count), capture_output=True, text=True, timeout=60)
        numbers = [json.loads(x[6:]) for x in result.stdout.splitlines() if x.startswith("data:")]
        assert numbers == [{"number": n} for n in range(1, 6)]
        # The example's documented calls, its app deployed by the server's --deploy.
        checks = {
            "ember call hello--greet ": printed({"greeting": "Hello, Ada."}),
            "ember call hello--count ": printed_lines([{"number": n} for n in (1, 2, 3)]),
        }
        run_documented("hello", platform, checks, tmp_path)


def printed(expected: object) -> Callable[[str], None]:
    def check(out: str) -> None:
        assert json.loads(out) == expected, out

    return check


def printed_lines(expected: list[object]) -> Callable[[str], None]:
    def check(out: str) -> None:
        assert [json.loads(line) for line in out.splitlines()] == expected, out

    return check


def labelled(label: str) -> Callable[[str], None]:
    def check(out: str) -> None:
        assert json.loads(out)["label"] == label, out

    return check


def test_classifier_example(platform: Platform, tmp_path: Path) -> None:
    platform.deploy(EXAMPLES / "classifier" / "app.py", "classifier")
    checks = {"ember call classifier--sentiment/predict ": labelled("positive")}
    run_documented("classifier", platform, checks, tmp_path)
    sentiment = ember.Endpoint.lookup("classifier", "sentiment", config=platform.config())
    assert sentiment.predict.call(text="what a lovely day")["label"] == "positive"
    assert sentiment.predict.call(text="this is awful and horrible")["label"] == "negative"
    many = sentiment.predict_many.call(texts=["i love it", "bad result"])
    assert [m["label"] for m in many] == ["positive", "negative"]
    platform.ember("stop", "classifier")
    logs = platform.ember("logs", "classifier").stdout
    assert "model ready" in logs


def test_webapp_example(platform: Platform, tmp_path: Path) -> None:
    platform.deploy(EXAMPLES / "webapp" / "app.py", "webapp")
    # The documented curl line sends no token: the site is public.
    run_documented("webapp", platform, {"curl ": labelled("positive")}, tmp_path)
    with platform.client() as client:
        page = client.get("/webapp--site/")
        assert page.status_code == 200 and "<h1>Mood</h1>" in page.text
        assert 'action="https://127.0.0.1' in page.text  # its own URL, under its root path
        answered = client.post("/webapp--site/", data={"text": "a lovely day"})
        assert "a lovely day: positive" in answered.text
        api = client.post("/webapp--site/api/mood", json={"text": "awful and sad"})
        assert api.json()["label"] == "negative"
        assert client.post("/webapp--site/api/mood", content=b"{").status_code == 400
        events = client.get("/webapp--site/api/words", params={"text": "good bad"}).text
        labels = [json.loads(line[6:])["label"] for line in events.splitlines() if line]
        assert labels == ["positive", "negative"]


def test_audio_example(platform: Platform, tmp_path: Path) -> None:
    platform.deploy(EXAMPLES / "audio" / "app.py", "audio")
    auth = ("-H", f"Authorization: Bearer {platform.token}")
    wav = tmp_path / "tone.wav"
    tone_url = f"{platform.url}/audio--tone/?frequency=440&seconds=3"
    made = platform.curl(*auth, "-o", str(wav), "-D", "-", tone_url)
    assert made.returncode == 0, made.stderr
    assert "content-type: audio/wav" in made.stdout.lower()
    assert wav.stat().st_size == 44 + 3 * 16_000 * 2
    measured = platform.curl(*auth, "-F", f"audio=@{wav}", f"{platform.url}/audio--analyse/")
    analysis = json.loads(measured.stdout)
    assert analysis["seconds"] == 3.0 and abs(analysis["pitch_hz"] - 440) < 2
    trip = ember.Endpoint.lookup("audio", "round-trip", config=platform.config())
    result = trip.call(frequency=1000)
    assert result["bytes"] == 44 + 16_000 * 2 and abs(result["pitch_hz"] - 1000) < 2
    with platform.client() as client:
        bad = client.post(
            "/audio--analyse/", content=b"RIFFnope", headers={"Content-Type": "audio/wav"}
        )
        assert bad.status_code == 400 and "not a WAV file" in bad.json()["error"]["message"]

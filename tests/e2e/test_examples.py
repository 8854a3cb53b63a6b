"""The README's first command: the server with the hello example, and the printed curl line;
then the classifier, web app and audio examples, deployed side by side on one platform."""

from __future__ import annotations

import json
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import Platform, running_platform

import ember

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    """One platform as `ember server` starts with no options, for the examples after the
    first (each its own app, so they share it)."""
    with running_platform(tmp_path_factory.mktemp("examples")) as running:
        yield running


def test_server_deploys_example_and_prints_a_working_curl_line(tmp_path: Path) -> None:
    hello = EXAMPLES / "hello" / "app.py"
    with running_platform(tmp_path, extra=("--deploy", str(hello))) as platform:
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


def test_classifier_example(platform: Platform) -> None:
    platform.deploy(EXAMPLES / "classifier" / "app.py", "classifier")
    sentiment = ember.Endpoint.lookup("classifier", "sentiment", config=platform.config())
    assert sentiment.predict.call(text="what a lovely day")["label"] == "positive"
    assert sentiment.predict.call(text="this is awful and horrible")["label"] == "negative"
    many = sentiment.predict_many.call(texts=["i love it", "bad result"])
    assert [m["label"] for m in many] == ["positive", "negative"]
    platform.ember("stop", "classifier")
    logs = platform.ember("logs", "classifier").stdout
    assert "model ready" in logs


def test_webapp_example(platform: Platform) -> None:
    platform.deploy(EXAMPLES / "webapp" / "app.py", "webapp")
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

"""Files as arguments: `bytes` parameters fed from multipart forms (`curl -F`), raw bodies
(`curl --data-binary` with the file's media type), base64 in JSON and `bytes` in the SDK;
query strings and form text converted by the parameters' hints. Files as results: `bytes`
and `ember.File` answer with the bytes themselves, of their media type."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import Platform, wait_for

import ember

APP = "files"


@pytest.fixture(scope="module")
def deployed(platform: Platform, apps_dir: Path) -> dict[str, str]:
    return platform.deploy(apps_dir / "files.py", APP)


@pytest.fixture(scope="module")
def photo() -> bytes:
    # Binary content with CR LF and dashes in it, as a multipart parser must not trip on.
    return os.urandom(200_000) + b"\r\n--boundary\r\n\r\n" + os.urandom(1000)


def _curl(platform: Platform, *args: str) -> str:
    result = platform.curl("-sS", "-H", f"Authorization: Bearer {platform.token}", *args)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture
def photo_path(photo: bytes, tmp_path: Path) -> Path:
    path = tmp_path / "photo.jpg"
    path.write_bytes(photo)
    return path


def test_curl_uploads_a_file_with_form_fields(
    platform: Platform, deployed: dict[str, str], photo: bytes, photo_path: Path
) -> None:
    out = _curl(
        platform,
        "-F",
        f"image=@{photo_path}",
        "-F",
        "caption=a photo",
        "-F",
        'tags=["sea", "sky"];type=application/json',
        "-F",
        "flip=true",
        f"{platform.url}/{APP}--images/describe",
    )
    assert json.loads(out) == {
        "size": len(photo),
        "caption": "a photo",
        "tags": ["sea", "sky"],
        "flip": True,
    }


def test_a_raw_body_with_query_arguments(
    platform: Platform, deployed: dict[str, str], photo: bytes, photo_path: Path
) -> None:
    out = _curl(
        platform,
        "-H",
        "Content-Type: image/jpeg",
        "--data-binary",
        f"@{photo_path}",
        f"{platform.url}/{APP}--digest/?algorithm=md5&times=2",
    )
    assert json.loads(out) == {"size": len(photo), "hex": hashlib.md5(photo * 2).hexdigest()}


def test_the_sdk_and_json_callers_send_bytes(
    platform: Platform, deployed: dict[str, str], photo: bytes
) -> None:
    config = platform.config()
    digest = ember.Endpoint.lookup(APP, "digest", config=config)
    assert digest.call(data=photo) == {"size": len(photo), "hex": hashlib.sha256(photo).hexdigest()}
    images = ember.Endpoint.lookup(APP, "images", config=config)
    assert images.same.call(a=photo, b=bytearray(photo)) is True
    assert list(digest.map([{"data": b"x"}, {"data": b"yy"}])) == [
        {"size": 1, "hex": hashlib.sha256(b"x").hexdigest()},
        {"size": 2, "hex": hashlib.sha256(b"yy").hexdigest()},
    ]
    with platform.client() as client:
        answer = client.post(f"/{APP}--digest/", json={"data": base64.b64encode(b"abc").decode()})
        assert answer.json() == {"size": 3, "hex": hashlib.sha256(b"abc").hexdigest()}


def test_query_strings_are_read_by_the_hints(platform: Platform, deployed: dict[str, str]) -> None:
    with platform.client() as client:
        assert client.get(f"/{APP}--images/add", params={"x": "2", "y": "0.25"}).json() == 2.25
        bad = client.get(f"/{APP}--images/add", params={"x": "two"})
        assert bad.status_code == 400
        assert bad.json()["error"]["message"] == "x: expected int, got 'two'"


def test_wrong_files_get_clear_errors(platform: Platform, deployed: dict[str, str]) -> None:
    with platform.client() as client:
        not_base64 = client.post(f"/{APP}--digest/", json={"data": "%%%"})
        assert not_base64.status_code == 400
        assert "data: expected bytes, as a base64 string" in not_base64.json()["error"]["message"]
        two = client.post(
            f"/{APP}--images/same", content=b"\x00", headers={"Content-Type": "image/png"}
        )
        assert two.status_code == 415
        assert "bytes parameters ['a', 'b']" in two.json()["error"]["message"]
        cut = client.post(
            f"/{APP}--images/describe",
            content=b"--x\r\nContent-Disposition: form-data; name=caption\r\n\r\nhi",
            headers={"Content-Type": "multipart/form-data; boundary=x"},
        )
        assert cut.status_code == 400 and "cut short" in cut.json()["error"]["message"]
        missing = client.post(f"/{APP}--images/describe", files={"image": b"\x01"})
        assert missing.status_code == 400
        assert "caption" in missing.json()["error"]["message"]


def test_a_file_result_is_the_response_body(
    platform: Platform, deployed: dict[str, str], photo: bytes
) -> None:
    with platform.client() as client:
        answer = client.post(f"/{APP}--reverse/", json={"data": base64.b64encode(photo).decode()})
        assert answer.status_code == 200 and answer.content == photo[::-1]
        assert answer.headers["content-type"] == "image/x-reversed"
        assert "content-disposition" not in answer.headers
        named = client.get(f"/{APP}--reverse/", params={"data": "abc", "name": "çà.bin"})
        assert named.content == b"cba"
        assert named.headers["content-disposition"] == (
            "attachment; filename=\"??.bin\"; filename*=UTF-8''%C3%A7%C3%A0.bin"
        )
        plain = client.get(f"/{APP}--counting/", params={"n": "300"})
        assert plain.headers["content-type"] == "application/octet-stream"
        assert plain.content == bytes(i % 256 for i in range(300))
    counting = ember.Endpoint.lookup(APP, "counting", config=platform.config())
    assert counting.call(n=3) == b"\x00\x01\x02"
    # The SDK's bytes know what the answer said of them.
    reverse = ember.Endpoint.lookup(APP, "reverse", config=platform.config())
    received = reverse.call(data=b"abc", name="çà.bin")
    assert received == b"cba" and isinstance(received, ember.ReceivedFile)
    assert (received.media_type, received.filename) == ("image/x-reversed", "çà.bin")
    assert list(counting.map([{"n": 1}, {"n": 2}])) == [b"\x00", b"\x00\x01"]
    # A spawned call's file result is kept as a file.
    handle = counting.spawn(n=5)
    assert handle.get(timeout=60) == bytes(range(5))
    with platform.client() as client:
        kept = client.get(f"/v1/calls/{handle.call_id}")
        assert kept.headers["content-type"] == "application/octet-stream"
        assert kept.content == bytes(range(5))


def test_ember_call_sends_and_writes_files(
    platform: Platform, deployed: dict[str, str], photo: bytes, tmp_path: Path
) -> None:
    source, target = tmp_path / "in.bin", tmp_path / "out.bin"
    source.write_bytes(photo)
    done = platform.ember(
        "call", f"{APP}--reverse", '{"name": "out.bin"}', "-f", f"data={source}", "-o", str(target)
    )
    assert target.read_bytes() == photo[::-1] and f"({len(photo)} bytes)" in done.stderr
    piped = platform.ember("call", f"{APP}--digest", "-f", f"data={source}")
    assert json.loads(piped.stdout)["hex"] == hashlib.sha256(photo).hexdigest()
    missing = platform.ember("call", f"{APP}--digest", "-f", "data=/nonexistent", check=False)
    assert missing.returncode == 2 and "cannot read /nonexistent" in missing.stderr


def _tone(chunks: int, size: int = 1000) -> bytes:
    return b"".join(bytes([i % 256]) * size for i in range(chunks))


def test_a_generator_of_bytes_streams_a_file(platform: Platform, deployed: dict[str, str]) -> None:
    with (
        platform.client() as client,
        client.stream("POST", f"/{APP}--tone/", json={"chunks": 50, "size": 20_000}) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"] == "audio/x-tone"
        assert response.headers["content-disposition"] == 'attachment; filename="tone.raw"'
        assert b"".join(response.iter_bytes()) == _tone(50, 20_000)
    tone = ember.Endpoint.lookup(APP, "tone", config=platform.config())
    assert b"".join(tone.stream(chunks=3)) == _tone(3)
    assert tone.call(chunks=4) == _tone(4)  # the whole file
    handle = tone.spawn(chunks=5)  # kept as one file
    assert handle.get(timeout=60) == _tone(5)
    with platform.client() as client:
        kept = client.get(f"/v1/calls/{handle.call_id}")
        assert kept.headers["content-type"] == "audio/x-tone" and kept.content == _tone(5)


def test_a_caller_that_reads_slowly_holds_the_generator_back(
    platform: Platform, deployed: dict[str, str], replica_writable: Path
) -> None:
    """The replica makes a stream only a window ahead of its caller, so one that stops
    reading keeps the stream where it is instead of in the control plane's memory."""
    progress = replica_writable / "made"
    chunks, size = 128, 1 << 20
    arguments = {"chunks": chunks, "size": size, "progress": str(progress)}
    with (
        platform.client() as client,
        client.stream("POST", f"/{APP}--firehose/", json=arguments) as response,
    ):
        assert response.status_code == 200
        made = _steady(lambda: int(progress.read_text() or 0) if progress.exists() else 0)
        # An 8 MiB window plus what sockets buffer on the way, not the whole 128 MiB.
        assert 0 < made < 48, f"{made} chunks of 1 MiB made for a caller that read none"
        body = b"".join(response.iter_bytes())
    assert len(body) == chunks * size
    assert all(body[i * size] == i % 256 for i in range(chunks))
    assert int(progress.read_text()) == chunks


def _steady(read: Any, settled: float = 2.0, timeout: float = 60) -> int:
    """A value once it has not changed for `settled` seconds."""
    deadline, last, since = time.monotonic() + timeout, -1, time.monotonic()
    while time.monotonic() < deadline:
        value = read()
        if value != last:
            last, since = value, time.monotonic()
        elif time.monotonic() - since >= settled:
            return int(value)
        time.sleep(0.1)
    raise AssertionError(f"still changing after {timeout} s: {last}")


def test_a_file_stream_that_fails_is_cut_short(
    platform: Platform, deployed: dict[str, str]
) -> None:
    with platform.client() as client:
        for arguments, said in (
            ({"chunks": 6, "fail_after": 3}, "the tone broke after 3 chunks"),
            ({"chunks": 2, "mixed": True}, "a stream is all bytes (a file) or all JSON values"),
        ):
            with (
                pytest.raises(httpx.HTTPError),  # the body ends without its last chunk
                client.stream("POST", f"/{APP}--tone/", json=arguments) as response,
            ):
                assert response.status_code == 200
                response.read()
            wait_for(lambda said=said: said in platform.ember("logs", APP).stdout, 10)
        # The SDK says the stream was cut short, not that the connection failed.
        tone = ember.Endpoint.lookup(APP, "tone", config=platform.config())
        with pytest.raises(ember.RemoteError, match="ended before it was whole") as caught:
            list(tone.stream(chunks=6, fail_after=3))
        assert caught.value.error_type == "stream_cut_short"
        # Failing before its first chunk, it gets an honest status.
        early = client.post(f"/{APP}--tone/", json={"chunks": 3, "fail_after": 0})
        assert early.status_code == 500 and early.json()["error"]["type"] == "ValueError"


def test_ember_call_streams_a_file_to_a_path(
    platform: Platform, deployed: dict[str, str], tmp_path: Path
) -> None:
    target = tmp_path / "tone.raw"
    platform.ember("call", f"{APP}--tone", '{"chunks": 7}', "--stream", "-o", str(target))
    assert target.read_bytes() == _tone(7)


def test_an_endpoint_for_uploads_takes_bodies_over_the_server_s_limit(
    platform: Platform, deployed: dict[str, str]
) -> None:
    big = os.urandom(10 * 1024 * 1024)  # over the server's 8 MiB, under digest's 16
    raw = {"Content-Type": "application/octet-stream"}
    with platform.client(timeout=120) as client:
        answer = client.post(f"/{APP}--digest/", content=big, headers=raw)
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"size": len(big), "hex": hashlib.sha256(big).hexdigest()}
        refused = client.post(f"/{APP}--images/same", content=big, headers=raw)
        assert refused.status_code == 413
        too_big = client.post(f"/{APP}--digest/", content=big + big, headers=raw)
        assert too_big.status_code == 413
        assert "over the limit of 16777216 bytes" in too_big.json()["error"]["message"]

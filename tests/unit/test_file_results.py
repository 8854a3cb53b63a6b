"""`ember.File` and bytes results: what the replica sends, what the caller gets."""

from __future__ import annotations

import pickle

import httpx
import pytest

import ember
from ember.calling.call_bodies import answer_value
from ember.files import as_file, content_disposition, result_header
from ember_platform.runtime.inputs import Outcome


def test_a_file_checks_what_it_is_given() -> None:
    file = ember.File(bytearray(b"abc"), media_type="text/csv; charset=utf-8", filename="a.csv")
    assert file.data == b"abc" and isinstance(file.data, bytes)
    for bad in (
        lambda: ember.File("text"),  # type: ignore[arg-type]
        lambda: ember.File(b"", media_type="png"),
        lambda: ember.File(b"", media_type="image/png\r\nX-Injected: 1"),
        lambda: ember.File(b"", filename="../etc/passwd"),
        lambda: ember.File(b"", filename='say "hi".txt'),
        lambda: ember.File(b"", filename=""),
    ):
        with pytest.raises(ember.InvalidError):
            bad()


def test_bytes_and_files_are_file_results_and_nothing_else_is() -> None:
    assert as_file(b"x") == ember.File(b"x")
    assert as_file(memoryview(b"x")) == ember.File(b"x")
    named = ember.File(b"x", "image/png", "x.png")
    assert as_file(named) is named
    assert as_file({"bytes": 1}) is None and as_file("text") is None
    assert result_header(named) == {"media_type": "image/png", "filename": "x.png"}
    assert result_header(ember.File(b"")) == {"media_type": "application/octet-stream"}


def test_the_response_says_what_the_body_is() -> None:
    assert Outcome(200, b"{}").headers() == {"Content-Type": "application/json"}
    assert Outcome(200, b"", "image/png", "cat.png").headers() == {
        "Content-Type": "image/png",
        "Content-Disposition": 'attachment; filename="cat.png"',
    }
    assert content_disposition("été.png") == (
        "attachment; filename=\"?t?.png\"; filename*=UTF-8''%C3%A9t%C3%A9.png"
    )


def test_the_sdk_gives_json_as_values_and_files_as_bytes() -> None:
    def answer(content_type: str | None, body: bytes) -> object:
        headers = {"content-type": content_type} if content_type else {}
        return answer_value(httpx.Response(200, headers=headers, content=body))

    assert answer("application/json", b'{"a": 1}') == {"a": 1}
    assert answer("application/problem+json; charset=utf-8", b"[1]") == [1]
    assert answer(None, b"2") == 2
    assert answer("image/png", b"\x89PNG") == b"\x89PNG"
    assert answer("text/csv", b"a,b") == b"a,b"


def test_a_received_file_knows_its_media_type_and_name() -> None:
    def answer(headers: dict[str, str]) -> ember.ReceivedFile:
        received = answer_value(httpx.Response(200, headers=headers, content=b"\x89PNG"))
        assert isinstance(received, ember.ReceivedFile)
        return received

    png = answer({"content-type": "image/png"})
    assert png == b"\x89PNG" and (png.media_type, png.filename) == ("image/png", None)
    named = answer(
        {
            "content-type": "text/csv; charset=utf-8",
            "content-disposition": content_disposition("é.csv"),
        }
    )
    assert (named.media_type, named.filename) == ("text/csv; charset=utf-8", "é.csv")
    odd_name = {"content-type": "image/png", "content-disposition": 'attachment; filename="../x"'}
    assert answer(odd_name).filename is None
    assert pickle.loads(pickle.dumps(named)).filename == "é.csv"


def test_what_a_replica_says_of_a_file_is_checked_again() -> None:
    from ember.files import received_file_header

    assert received_file_header({"media_type": "image/png", "filename": "a.png"}) == (
        "image/png",
        "a.png",
    )
    for header in (
        {"media_type": "image/png\r\nSet-Cookie: x=1", "filename": "a\r\nb"},
        {"media_type": "image/png\n", "filename": "../a"},
        {"media_type": 7, "filename": ""},
        {},
    ):
        assert received_file_header(header) == ("application/octet-stream", None)
    with pytest.raises(ember.InvalidError):
        ember.File(b"", media_type="image/png\n")

"""A call's arguments from JSON, query strings, forms and raw bodies, converted by the
kinds of the method's parameters (read from its type hints at deploy time)."""

from __future__ import annotations

import base64
import json
import os
import re
from typing import Any, Literal

import pytest

import ember
from ember.calling.call_bodies import call_body
from ember.declarations.argcheck import ArgumentTypeError
from ember.declarations.parameters import (
    decode_bytes,
    from_text,
    json_default,
    parameter_kind,
    parameter_kinds,
)
from ember.wire.spec import MethodSpec
from ember_platform.edge.errors import HttpError
from ember_platform.http.call_arguments import form_fields, parse_arguments


def describe(
    image: bytes,
    caption: str,
    scale: float = 1.0,
    times: int = 1,
    flip: bool = False,
    tags: list[str] | None = None,
    mode: Literal["fast", "slow"] = "fast",
    anything: Any = None,
    *rest: int,
    **extra: str,
) -> dict:
    return {}


SPEC = MethodSpec("__call__", False, False, parameters=parameter_kinds(describe))


def test_kinds_come_from_the_hints() -> None:
    assert parameter_kinds(describe) == {
        "image": "bytes",
        "caption": "str",
        "scale": "float",
        "times": "int",
        "flip": "bool",
        "tags": "json",
        "mode": "str",
    }
    assert parameter_kind(int | None) == "int"
    assert parameter_kind(int | str) is None  # text may do: it stays text
    assert parameter_kind(int | list[int]) == "json"
    assert parameter_kind(Literal[1, 2]) == "int"
    assert parameter_kind(dict[str, int]) == "json"

    def unresolvable(x: NoSuchName) -> None:  # type: ignore[name-defined]  # noqa: F821
        pass

    assert parameter_kinds(unresolvable) == {}


def test_a_method_spec_keeps_its_kinds_through_the_manifest() -> None:
    again = MethodSpec.from_dict(json.loads(json.dumps(SPEC.to_dict())))
    assert again == SPEC and again.bytes_parameters() == ["image"]
    old = MethodSpec.from_dict({"name": "f", "streaming": False, "is_async": False})
    assert old.parameters == {} and "parameters" not in old.to_dict()


def test_text_is_converted_by_kind() -> None:
    assert from_text("int", "n", "42") == 42
    assert from_text("float", "x", "2.5") == 2.5
    assert [from_text("bool", "b", t) for t in ("true", "0", "Yes", "off")] == [
        True,
        False,
        True,
        False,
    ]
    assert from_text("json", "tags", '["a"]') == ["a"]
    assert from_text(None, "any", "42") == "42" and from_text("str", "s", "42") == "42"
    assert base64.b64decode(from_text("bytes", "data", "héllo")) == "héllo".encode()
    for kind, text, said in (
        ("int", "4.5", "n: expected int, got '4.5'"),
        ("bool", "maybe", "n: expected true or false"),
        ("json", "[1,", "n: expected JSON"),
    ):
        with pytest.raises(ArgumentTypeError, match=said):
            from_text(kind, "n", text)


def test_bytes_travel_as_base64() -> None:
    data = bytes(range(256))
    body = call_body({"image": data, "n": 1}, {"Prefer": "respond-async"})
    sent = json.loads(body["content"])
    assert decode_bytes("image", sent["image"]) == data and sent["n"] == 1
    assert body["headers"] == {"Content-Type": "application/json", "Prefer": "respond-async"}
    assert json.loads(json.dumps([memoryview(b"ab")], default=json_default)) == ["YWI="]
    with pytest.raises(ArgumentTypeError, match="image: expected bytes, as a base64 string"):
        decode_bytes("image", "not base64!")
    with pytest.raises(ember.InvalidError, match="cannot be sent as JSON"):
        call_body({"when": object()})
    with pytest.raises(ember.InvalidError, match="cannot be sent as JSON"):
        call_body({"score": float("nan")})  # refused by the platform: said before sending


def _multipart(parts: list[tuple[str, bytes]], boundary: str = "b0und") -> tuple[str, bytes]:
    body = b"".join(
        f"--{boundary}\r\n{head}\r\n\r\n".encode() + data + b"\r\n" for head, data in parts
    )
    return f"multipart/form-data; boundary={boundary}", body + f"--{boundary}--\r\n".encode()


def _parsed(content_type: str, body: bytes, query: bytes = b"") -> dict[str, Any]:
    return json.loads(parse_arguments(SPEC, "POST", content_type, body, query))


def test_a_form_gives_files_as_bytes_and_text_by_kind() -> None:
    image = os.urandom(3000) + b"\r\n--b0und\r\n" + b"\r\n\r\n"  # looks like a boundary
    content_type, body = _multipart(
        [
            (
                'Content-Disposition: form-data; name="image"; filename="cat.png"\r\n'
                "Content-Type: image/png",
                image,
            ),
            ('Content-Disposition: form-data; name="caption"', b'a cat; "ok"'),
            ("Content-Disposition: form-data; name=times", b"3"),
            (
                'Content-Disposition: form-data; name="tags"\r\nContent-Type: application/json',
                b'["pet", "cat"]',
            ),
            ('Content-Disposition: form-data; name="flip"', b"true"),
        ],
        boundary="b0und-x",
    )
    arguments = _parsed(content_type, body, b"scale=0.5")
    assert base64.b64decode(arguments.pop("image")) == image
    assert arguments == {
        "caption": 'a cat; "ok"',
        "times": 3,
        "tags": ["pet", "cat"],
        "flip": True,
        "scale": 0.5,
    }
    fields = form_fields(content_type, body)
    assert [(f.name, f.filename, f.is_text()) for f in fields][:2] == [
        ("image", "cat.png", False),
        ("caption", None, True),
    ]
    # An empty field, and an RFC 2231 file name.
    content_type, body = _multipart(
        [
            ('Content-Disposition: form-data; name="caption"', b""),
            (
                "Content-Disposition: form-data; name=\"image\"; filename*=UTF-8''ch%C3%A2t.png",
                b"\x00",
            ),
        ]
    )
    fields = form_fields(content_type, body)
    assert [(f.name, f.filename, f.data) for f in fields] == [
        ("caption", None, b""),
        ("image", "chât.png", b"\x00"),
    ]


def test_a_raw_body_goes_to_the_one_bytes_parameter() -> None:
    data = os.urandom(100)
    arguments = _parsed("image/jpeg", data, b"caption=hi&times=2")
    assert base64.b64decode(arguments["image"]) == data
    assert (arguments["caption"], arguments["times"]) == ("hi", 2)
    none = MethodSpec("f", False, False, parameters={"n": "int"})
    two = MethodSpec("f", False, False, parameters={"a": "bytes", "b": "bytes"})
    for spec, said in (
        (none, "has no bytes parameter"),
        (two, re.escape("bytes parameters ['a', 'b']")),
    ):
        with pytest.raises(HttpError, match=said) as caught:
            parse_arguments(spec, "POST", "application/octet-stream", data, b"")
        assert caught.value.status == 415
    with pytest.raises(HttpError, match="given twice"):
        _parsed("image/jpeg", data, b"image=x")


def test_json_bodies_and_query_strings_read_as_before() -> None:
    for content_type in ("", "application/json", "application/x-www-form-urlencoded"):
        assert _parsed(content_type, b'{"caption": "x"}') == {"caption": "x"}
    assert _parsed("application/json", b"  ") == {}
    got = parse_arguments(SPEC, "GET", "", b"", b"times=3&caption=7&other=x&flip=1")
    assert json.loads(got) == {"times": 3, "caption": "7", "other": "x", "flip": True}
    for content_type, body, query, said in (
        ("application/json", b"[1]", b"", "must be a JSON object"),
        ("application/json", b"{", b"", "not valid JSON"),
        ("multipart/form-data", b"--x\r\n", b"", "needs a boundary"),
        ("multipart/form-data; boundary=x", b"nothing", b"", "has no part"),
        ("multipart/form-data; boundary=x", b"--x\r\nhead-without-end", b"", "cut short"),
        ("multipart/form-data; boundary=x", b"--x\r\n\r\ndata\r\n--x--", b"", "form-data; name"),
        ("multipart/form-data; boundary=x", b"--xjunk", b"", "delimiter without CRLF"),
        ("image/png", b"x", b"times=many", "times: expected int, got 'many'"),
    ):
        with pytest.raises(HttpError, match=said) as caught:
            _parsed(content_type, body, query)
        assert caught.value.status == 400


def test_a_json_body_takes_the_query_strings_arguments_too() -> None:
    assert _parsed("application/json", b'{"caption": "x"}', b"times=3") == {
        "caption": "x",
        "times": 3,
    }
    assert _parsed("", b"", b"caption=y") == {"caption": "y"}  # `curl -X POST URL?caption=y`
    # An empty value is an empty string, not a missing argument.
    assert _parsed("application/json", b"{}", b"caption=") == {"caption": ""}
    got = parse_arguments(SPEC, "GET", "", b"", b"caption=&other=")
    assert json.loads(got) == {"caption": "", "other": ""}
    with pytest.raises(HttpError, match="'times' is given twice") as caught:
        _parsed("application/json", b'{"times": 1}', b"times=2")
    assert caught.value.status == 400


@pytest.mark.parametrize(
    ("body", "said"),
    [
        (b'{"x": NaN}', "NaN is not a JSON number"),
        (b'{"x": -Infinity}', "-Infinity is not a JSON number"),
        (b'{"x": 1e999}', "1e999 is too large"),
        (b"[" * 100_000 + b"]" * 100_000, "must be a JSON object|nested too deeply"),
        (b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    ],
)
def test_json_that_is_not_json_gets_a_400(body: bytes, said: str) -> None:
    with pytest.raises(HttpError, match=said) as caught:
        _parsed("application/json", body)
    assert (caught.value.status, caught.value.error_type) == (400, "invalid_json")


def test_query_and_form_values_must_be_json_too() -> None:
    for text in ("nan", "inf", "-Infinity"):
        with pytest.raises(ArgumentTypeError, match="a finite number"):
            from_text("float", "scale", text)
    with pytest.raises(ArgumentTypeError, match="expected JSON"):
        from_text("json", "tags", "[NaN]")
    content_type, body = _multipart(
        [
            (
                'Content-Disposition: form-data; name="anything"\r\nContent-Type: application/json',
                b"[NaN]",
            )
        ]
    )
    with pytest.raises(HttpError, match="NaN and Infinity are not JSON") as caught:
        _parsed(content_type, body)
    assert caught.value.status == 400


def test_a_boundary_beyond_latin_1_gets_a_400() -> None:
    with pytest.raises(HttpError, match="boundary must be ASCII") as caught:
        _parsed("multipart/form-data; boundary*=utf-8''%E2%82%AC", b"--\xe2\x82\xac\r\n")
    assert caught.value.status == 400


def test_base64_inside_lists_and_dicts_is_decoded_where_the_hint_says_bytes() -> None:
    from ember.declarations.parameters import decode_nested_bytes, holds_bytes

    assert holds_bytes(list[bytes]) and holds_bytes(dict[str, bytes] | None)
    assert holds_bytes(tuple[int, bytes]) and not holds_bytes(list[str])
    hi = "aGk="
    assert decode_nested_bytes(list[bytes], [hi, hi], "b") == [b"hi", b"hi"]
    assert decode_nested_bytes(dict[str, bytes] | None, {"k": hi}, "d") == {"k": b"hi"}
    assert decode_nested_bytes(dict[str, bytes] | None, None, "d") is None
    assert decode_nested_bytes(tuple[int, bytes], [1, hi], "t") == [1, b"hi"]
    assert decode_nested_bytes(tuple[bytes, ...], [hi], "t") == [b"hi"]
    assert decode_nested_bytes(list[list[bytes]], [[hi]], "n") == [[b"hi"]]
    # Left for the argument check to judge: a union of bytes and text, a value of
    # another shape.
    assert decode_nested_bytes(list[bytes | str], [hi], "u") == [hi]
    assert decode_nested_bytes(list[bytes], "not a list", "b") == "not a list"
    with pytest.raises(ArgumentTypeError, match=r"b\[1\]: expected bytes"):
        decode_nested_bytes(list[bytes], [hi, "%%%"], "b")

"""JSON Schemas from type hints, and the OpenAPI documents built of them: valid OpenAPI
3.1 for every kind of method, and for manifests deployed before documents existed."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

import pytest
from openapi_spec_validator import validate

import ember
from ember.schemas import FILE_RESULT, arguments_schema, hint_schema, result_schema
from ember.spec import FUNCTION_METHOD, EndpointSpec, MethodSpec
from ember_platform.openapi import endpoint_document


class Opaque:
    """A class the gateway does not check: any value."""


@pytest.mark.parametrize(
    ("hint", "schema"),
    [
        (int, {"type": "integer"}),
        (float, {"type": "number"}),
        (bool, {"type": "boolean"}),
        (None, {"type": "null"}),
        (bytes, {"type": "string", "contentEncoding": "base64"}),
        (Any, {}),
        (Opaque, {}),
        (list, {"type": "array"}),
        (list[int], {"type": "array", "items": {"type": "integer"}}),
        (tuple[int, ...], {"type": "array", "items": {"type": "integer"}}),
        (
            tuple[int, str],
            {
                "type": "array",
                "prefixItems": [{"type": "integer"}, {"type": "string"}],
                "minItems": 2,
                "maxItems": 2,
            },
        ),
        (
            dict[str, list[float]],
            {
                "type": "object",
                "additionalProperties": {"type": "array", "items": {"type": "number"}},
            },
        ),
        (dict[str, Any], {"type": "object"}),
        (int | None, {"anyOf": [{"type": "integer"}, {"type": "null"}]}),
        (int | Opaque, {}),  # one option takes anything, so the union does
        (Literal["a", 1, None], {"enum": ["a", 1, None]}),
    ],
)
def test_hints_become_json_schemas(hint: Any, schema: dict[str, Any]) -> None:
    assert hint_schema(hint) == schema


def test_a_deeply_nested_hint_stops_being_described() -> None:
    hint: Any = int
    for _ in range(30):
        hint = list[hint]
    depth, schema = 0, hint_schema(hint)
    while "items" in schema:
        depth, schema = depth + 1, schema["items"]
    assert 10 <= depth <= 13 and schema in ({}, {"type": "array"})


def test_arguments_keep_json_defaults_and_say_what_is_required() -> None:
    # `maybe: int = None`: what users write, and what the gateway lets pass as null.
    def f(text: str, n: int = 2, when: object = object(), maybe: int = None) -> None:  # noqa: RUF013
        pass

    schema = arguments_schema(f)
    assert schema["required"] == ["text"]
    assert schema["properties"]["n"] == {"type": "integer", "default": 2}
    assert "default" not in schema["properties"]["when"]  # not a JSON value
    assert schema["properties"]["maybe"] == {
        "anyOf": [{"type": "integer"}, {"type": "null"}],
        "default": None,
    }
    assert schema["additionalProperties"] is False


def test_keyword_catchalls_batches_and_instances() -> None:
    def open_ended(a: int, **rest: Any) -> None:
        pass

    assert "additionalProperties" not in arguments_schema(open_ended)

    def batch(texts: list[str]) -> list[list[float]]:
        return []

    assert arguments_schema(batch, batched=True)["properties"] == {"texts": {"type": "string"}}
    assert result_schema(batch, batched=True) == {"type": "array", "items": {"type": "number"}}

    def method(self: Any, x: int) -> None:
        pass

    assert list(arguments_schema(method, takes_instance=True)["properties"]) == ["x"]


def test_results_of_generators_and_files() -> None:
    def items() -> Iterator[dict[str, int]]:
        yield {}

    async def async_items() -> AsyncIterator[str]:
        yield ""

    def file() -> ember.File:
        return ember.File(b"")

    def raw() -> bytes:
        return b""

    def unknown():  # type: ignore[no-untyped-def]
        return 1

    assert result_schema(items) == {"type": "object", "additionalProperties": {"type": "integer"}}
    assert result_schema(async_items) == {"type": "string"}
    assert result_schema(file) == result_schema(raw) == FILE_RESULT
    assert result_schema(unknown) == {}


def test_the_decorator_records_schemas_and_docstrings_and_they_travel() -> None:
    @ember.endpoint()
    def shout(text: str) -> str:
        """Shout it.

        In capitals."""
        return text.upper()

    method = shout.spec("shout").methods[FUNCTION_METHOD]  # read at deploy time
    assert (method.summary, method.description) == ("Shout it.", "In capitals.")
    assert method.result_schema == {"type": "string"}
    travelled = MethodSpec.from_dict(method.to_dict())
    assert travelled == method
    for part in ("arguments_schema", "result_schema", "summary", "description"):
        assert getattr(travelled, part) == getattr(method, part)


def _spec(methods: list[MethodSpec], kind: str = "class", public: bool = False) -> EndpointSpec:
    settings = ember.endpoint(public=public)(lambda: None).settings
    return EndpointSpec("thing", "thing", kind, settings, {m.name: m for m in methods})


def test_a_manifest_from_before_documents_still_gets_a_valid_one() -> None:
    old = MethodSpec.from_dict({"name": FUNCTION_METHOD, "streaming": False, "is_async": False})
    document = endpoint_document("app", _spec([old], "function"), 4, "https://h/app--thing")
    validate(document)
    post = document["paths"]["/"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"] == {"type": "object"}
    assert document["info"]["version"] == "v4"


def test_every_kind_of_method_makes_a_valid_document() -> None:
    @ember.endpoint(public=True, concurrency=4)
    class Everything:
        @ember.method
        def plain(self, x: int, tags: list[str] | None = None) -> dict[str, Any]:
            return {}

        @ember.method
        def events(self, n: int) -> Iterator[int]:
            yield n

        @ember.method
        def chunks(self) -> Iterator[bytes]:
            yield b""

        @ember.method(path="v1/chat/completions", stream_flag="stream")
        def chat(self, messages: list[dict[str, str]], stream: bool = False) -> Any:
            return {}

        @ember.method
        def upload(self, a: bytes, b: bytes) -> ember.File:
            return ember.File(a + b)

        @ember.method
        @ember.batched(max_batch_size=4, wait_ms=1)
        def embed(self, texts: list[str]) -> list[list[float]]:
            return []

    spec = Everything.spec("Everything")
    document = endpoint_document("app", spec, 1, "https://h/app--everything")
    validate(document)
    paths = document["paths"]
    assert set(paths) == {
        "/plain",
        "/events",
        "/chunks",
        "/chat",
        "/v1/chat/completions",
        "/upload",
        "/embed",
    }
    assert "security" not in document
    chunks = paths["/chunks"]["post"]["responses"]["200"]["content"]
    assert list(chunks) == ["application/octet-stream"]
    chat = paths["/chat"]["post"]["responses"]["200"]["content"]
    assert set(chat) == {"text/event-stream", "application/json"}
    upload = paths["/upload"]["post"]["requestBody"]["content"]
    assert set(upload) == {"application/json", "multipart/form-data"}  # two files: no raw body
    embed = paths["/embed"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert embed["properties"] == {"texts": {"type": "string"}}  # what one caller sends

"""JSON Schemas from type hints, and the OpenAPI documents built of them: valid OpenAPI
3.1 for every kind of method, and for manifests deployed before documents existed."""

from __future__ import annotations

import enum
import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import pytest
from openapi_spec_validator import validate
from pydantic import BaseModel

import ember
from ember.endpoints.schemas import FILE_RESULT, arguments_schema, hint_schema, result_schema
from ember.wire.spec import FUNCTION_METHOD, EndpointSpec, MethodSpec
from ember_platform.http.openapi import endpoint_document


class Opaque:
    """A class the gateway does not check: any value."""


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Shapeless(enum.Enum):
    POINT = (0, 0)  # not a JSON scalar: any value


@dataclass
class Expr:
    """A tree whose every node may hold seven more: inlined, 7**12 nodes."""

    op: str
    a: Expr | None = None
    b: Expr | None = None
    c: Expr | None = None
    d: Expr | None = None
    e: Expr | None = None
    f: Expr | None = None
    g: Expr | None = None


@dataclass
class NamedItem:
    name: str


@dataclass
class CountedItem:
    count: int


@dataclass
class Failure:
    code: int


# As two modules' classes of one name would be, and one named like the document's own.
NamedItem.__name__ = CountedItem.__name__ = "Item"
Failure.__name__ = "Error"


class Node(BaseModel):
    label: str
    children: list[Node] = []
    left: Node | None = None
    right: Node | None = None


class Wrapper(BaseModel):
    node: Node


@dataclass
class Forest:
    trees: list[Tree]


@dataclass
class Tree:
    forest: Forest | None
    color: Color = Color.RED


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
        (Color, {"title": "Color", "enum": ["red", "green"]}),
        (Level | None, {"anyOf": [{"title": "Level", "enum": [1, 2]}, {"type": "null"}]}),
        (Shapeless, {}),
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


def _expr_field() -> dict[str, Any]:
    return {"anyOf": [{"$ref": "#/$defs/Expr"}, {"type": "null"}], "default": None}


def test_a_dataclass_that_holds_itself_is_defined_once_and_referred_to() -> None:
    started = time.perf_counter()
    schema = hint_schema(Expr)
    # Was half a minute (and 43 MB): a margin that holds on a loaded 2-core machine.
    assert time.perf_counter() - started < 10
    assert schema == {
        "$ref": "#/$defs/Expr",
        "$defs": {
            "Expr": {
                "type": "object",
                "title": "Expr",
                "properties": {"op": {"type": "string"}}
                | {name: _expr_field() for name in "abcdefg"},
                "required": ["op"],
                "additionalProperties": False,
            }
        },
    }


def test_classes_that_hold_each_other_and_enums_inside_them() -> None:
    schema = hint_schema(list[Tree])
    assert schema["items"] == {"$ref": "#/$defs/Tree"}
    tree, forest = schema["$defs"]["Tree"], schema["$defs"]["Forest"]
    assert tree["properties"]["forest"]["anyOf"][0] == {"$ref": "#/$defs/Forest"}
    assert tree["properties"]["color"] == {"title": "Color", "enum": ["red", "green"]}
    assert forest["properties"]["trees"] == {"type": "array", "items": {"$ref": "#/$defs/Tree"}}


def _evaluate(expr: Expr, other: Expr | None = None) -> Expr:
    return expr


def test_the_arguments_of_a_recursive_dataclass_stay_small_in_the_manifest() -> None:
    method = ember.endpoint()(_evaluate).spec("evaluate").methods[FUNCTION_METHOD]
    arguments = method.arguments_schema or {}
    assert arguments["properties"]["expr"] == {"$ref": "#/$defs/Expr"}
    assert arguments["properties"]["other"]["default"] is None
    assert list(arguments["$defs"]) == ["Expr"]  # one definition for both parameters
    assert method.result_schema == {"$ref": "#/$defs/Expr", "$defs": arguments["$defs"]}
    assert len(json.dumps(method.to_dict())) < 3000


def _references(node: Any) -> list[str]:
    if isinstance(node, list):
        return [ref for item in node for ref in _references(item)]
    if not isinstance(node, dict):
        return []
    found = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
    return found + [ref for value in node.values() for ref in _references(value)]


def test_the_document_of_a_recursive_dataclass_names_it_once_in_components() -> None:
    spec = ember.endpoint()(_evaluate).spec("evaluate")
    started = time.perf_counter()
    document = endpoint_document("app", spec, 1, "https://h/app--evaluate")
    text = json.dumps(document)
    assert time.perf_counter() - started < 10  # was 20 s, for 86 MB (a loaded machine's margin)
    assert len(text) < 20_000 and "$defs" not in text
    validate(document)
    schemas = document["components"]["schemas"]
    assert set(schemas) == {"Error", "Accepted", "Expr"}
    post = document["paths"]["/"]["post"]
    arguments = post["requestBody"]["content"]["application/json"]["schema"]
    assert arguments["properties"]["expr"] == {"$ref": "#/components/schemas/Expr"}
    result = post["responses"]["200"]["content"]["application/json"]["schema"]
    assert result == {"$ref": "#/components/schemas/Expr"}
    assert schemas["Expr"]["properties"]["a"]["anyOf"][0] == {"$ref": "#/components/schemas/Expr"}
    for reference in _references(document):
        assert reference.removeprefix("#/components/schemas/") in schemas


class Shop:
    """Methods that take two different classes named Item, and return one named like the
    document's own Error."""

    @ember.method
    def buy(self, item: NamedItem) -> Failure:
        return Failure(0)

    @ember.method
    def count(self, item: CountedItem, again: NamedItem) -> int:
        return 0

    @ember.method
    def name(self, item: NamedItem) -> str:
        return ""


def test_classes_of_one_name_in_different_methods_each_keep_their_own() -> None:
    spec = ember.endpoint()(Shop).spec("shop")
    document = endpoint_document("app", spec, 1, "https://h/app--shop")
    validate(document)
    schemas = document["components"]["schemas"]
    assert schemas["Error"]["required"] == ["error"]  # the platform's, not the class's
    paths = document["paths"]

    def argument(method: str, name: str) -> dict[str, Any]:
        body = paths[f"/{method}"]["post"]["requestBody"]["content"]["application/json"]
        reference: str = body["schema"]["properties"][name]["$ref"]
        return schemas[reference.removeprefix("#/components/schemas/")]

    for method, name in (("buy", "item"), ("count", "again"), ("name", "item")):
        assert list(argument(method, name)["properties"]) == ["name"]
    assert list(argument("count", "item")["properties"]) == ["count"]
    result = paths["/buy"]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert schemas[result["$ref"].removeprefix("#/components/schemas/")]["required"] == ["code"]
    # Item once for buy and name; count's two, whose names clash, under new ones.
    assert set(schemas) == {"Error", "Accepted", "Item", "Error2", "Item2", "Item22"}


def test_a_pydantic_model_that_holds_itself_is_defined_once() -> None:
    def grow(node: Node, wrapped: Wrapper) -> Node:
        return node

    method = ember.endpoint()(grow).spec("grow").methods[FUNCTION_METHOD]
    arguments = method.arguments_schema or {}
    assert len(json.dumps(arguments)) < 2000
    assert arguments["properties"]["node"] == {"$ref": "#/$defs/Node"}
    assert arguments["properties"]["wrapped"] == {"$ref": "#/$defs/Wrapper"}
    node = arguments["$defs"]["Node"]
    assert node["properties"]["children"]["items"] == {"$ref": "#/$defs/Node"}
    assert arguments["$defs"]["Wrapper"]["properties"]["node"] == {"$ref": "#/$defs/Node"}
    document = endpoint_document("app", ember.endpoint()(grow).spec("grow"), 1, "https://h/x")
    validate(document)
    assert {"Node", "Wrapper"} <= set(document["components"]["schemas"])


def test_operation_ids_are_unique_whatever_the_methods_are_called() -> None:
    @ember.endpoint()
    class Clash:
        @ember.method
        def a(self, x: int) -> int:  # GET: once api_a_get, like the POST of a_get
            return x

        @ember.method
        def a_get(self, x: int) -> int:
            return x

        @ember.method(path="b")  # its other path: once api_a_at_path
        def a_at_path(self, x: int) -> int:
            return x

        @ember.method(path="a/get")
        def c(self, x: int) -> int:
            return x

    document = endpoint_document("app", Clash.spec("api"), 1, "https://h/app--api")
    validate(document)
    ids = [op["operationId"] for item in document["paths"].values() for op in item.values()]
    assert len(ids) == 12 and len(set(ids)) == len(ids), ids
    assert document["paths"]["/a"]["get"]["operationId"] == "get_clash_a"
    assert document["paths"]["/a_get"]["post"]["operationId"] == "post_clash_a_get"

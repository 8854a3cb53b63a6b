"""Pydantic models and dataclasses as arguments (built from JSON, fields checked) and as
results (their JSON form), and their JSON Schemas for the OpenAPI document."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
from pydantic import BaseModel, Field

from ember.calling.call_bodies import call_body
from ember.declarations.argcheck import ArgumentTypeError
from ember.declarations.structured import convert, has_structured, to_json
from ember.endpoints.schemas import hint_schema


class Review(BaseModel):
    text: str
    stars: int = Field(ge=1, le=5)


class Batch(BaseModel):
    reviews: list[Review]
    source: str | None = None


@dataclass
class Point:
    x: float
    y: float = 0.0


@dataclass
class Path:
    points: list[Point]
    name: str = "path"
    tags: list[str] = field(default_factory=list)


def test_a_model_is_built_and_validated_by_pydantic() -> None:
    review = convert({"text": "good", "stars": 4}, Review, "review")
    assert review == Review(text="good", stars=4)
    with pytest.raises(ArgumentTypeError, match=r"review\.stars: Input should be less than or"):
        convert({"text": "good", "stars": 9}, Review, "review")
    batch = convert({"reviews": [{"text": "a", "stars": 1}]}, Batch, "batch")
    assert batch.reviews[0].stars == 1
    with pytest.raises(ArgumentTypeError, match=r"batch\.reviews\.0\.text"):
        convert({"reviews": [{"stars": 1}]}, Batch, "batch")


def test_a_dataclass_is_built_with_its_fields_checked() -> None:
    path = convert({"points": [{"x": 1, "y": 2.5}, {"x": 3}]}, Path, "path")
    assert path == Path([Point(1, 2.5), Point(3)])
    for value, message in [
        ({"points": [{"x": "1"}]}, r"path\.points\[0\]\.x: expected float, got str"),
        ({"points": [{"y": 1}]}, r"path\.points\[0\]\.x: missing"),
        ({"points": [], "colour": "red"}, "Path has no field 'colour'"),
        ([1, 2], r"path: expected an object \(Path\)"),
    ]:
        with pytest.raises(ArgumentTypeError, match=message):
            convert(value, Path, "path")


def test_unions_and_lists_of_them_are_built_too() -> None:
    assert convert(None, Point | None, "p") is None
    assert convert({"x": 1}, Point | None, "p") == Point(1)
    assert convert([{"x": 1}], list[Point], "ps") == [Point(1)]
    assert has_structured(list[Point] | None) and not has_structured(list[int])
    assert convert([1, 2], list[int], "ns") == [1, 2]


def test_models_and_dataclasses_go_as_their_json() -> None:
    value = {"review": Review(text="x", stars=2), "path": Path([Point(1)])}
    assert json.loads(json.dumps(value, default=to_json)) == {
        "review": {"text": "x", "stars": 2},
        "path": {"points": [{"x": 1, "y": 0.0}], "name": "path", "tags": []},
    }
    assert json.loads(call_body({"review": Review(text="x", stars=2)})["content"]) == {
        "review": {"text": "x", "stars": 2}
    }
    with pytest.raises(TypeError, match="not JSON serializable"):
        to_json(object())


def _resolved(schema: dict, node: dict) -> dict:
    """`node`, or the definition its `$ref` names in `schema`'s `$defs`."""
    ref = node.get("$ref")
    return schema["$defs"][ref.removeprefix("#/$defs/")] if ref else node


def test_schemas_of_models_and_dataclasses_define_each_class_once() -> None:
    batch = hint_schema(Batch)
    assert batch["$ref"] == "#/$defs/Batch" and set(batch["$defs"]) == {"Batch", "Review"}
    review = _resolved(batch, _resolved(batch, batch)["properties"]["reviews"]["items"])
    assert review["properties"]["stars"] == {"maximum": 5, "minimum": 1, "title": "Stars",
                                              "type": "integer"}  # fmt: skip
    whole = hint_schema(Path)
    path = _resolved(whole, whole)
    assert path["required"] == ["points"] and path["additionalProperties"] is False
    point = _resolved(whole, path["properties"]["points"]["items"])
    assert point["properties"]["x"] == {"type": "number"}
    assert path["properties"]["name"] == {"type": "string", "default": "path"}

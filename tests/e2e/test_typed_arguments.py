"""Pydantic models and dataclasses as an endpoint's arguments and results, over HTTPS
and the SDK, with their schemas in the OpenAPI document."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from harness import Platform
from openapi_spec_validator import validate

import ember

APP = "typed"


@pytest.fixture(scope="module")
def deployed(platform: Platform, apps_dir: Path) -> dict[str, str]:
    return platform.deploy(apps_dir / "typed.py", APP)


def test_models_and_dataclasses_are_built_checked_and_answered_as_json(
    platform: Platform, deployed: dict[str, str]
) -> None:
    with platform.client() as client:
        answer = client.post(f"/{APP}--judge/", json={"review": {"text": "fine", "stars": 5}})
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"positive": True, "stars": 5}
        bad = client.post(f"/{APP}--judge/", json={"review": {"text": "fine", "stars": 9}})
        assert bad.status_code == 400
        assert bad.json()["error"]["type"] == "invalid_arguments"
        assert "review.stars: Input should be less than or equal to 5" in bad.text
        centre = client.post(f"/{APP}--centre/", json={"points": [{"x": 0}, {"x": 2, "y": 4}]})
        assert centre.json() == {"x": 1.0, "y": 2.0}
        wrong = client.post(f"/{APP}--centre/", json={"points": [{"x": "0"}]})
        assert wrong.status_code == 400 and "points[0].x: expected float, got str" in wrong.text


def test_the_sdk_sends_models_and_the_document_describes_them(
    platform: Platform, deployed: dict[str, str], apps_dir: Path
) -> None:
    sys.path.insert(0, str(apps_dir))
    try:
        from typed import Review  # the caller's own copy of the model
    finally:
        sys.path.remove(str(apps_dir))
    judge = ember.Endpoint.lookup(APP, "judge", config=platform.config())
    assert judge.call(review=Review(text="meh", stars=2)) == {"positive": False, "stars": 2}
    with platform.client() as client:
        document = client.get(f"/{APP}--judge/openapi.json").json()
    validate(document)  # a model's own schema, references put in place, is valid there
    components = document["components"]["schemas"]

    def resolved(node: dict) -> dict:  # a class is one component, named by its $ref
        ref = node.get("$ref")
        return components[ref.removeprefix("#/components/schemas/")] if ref else node

    post = document["paths"]["/"]["post"]
    arguments = resolved(post["requestBody"]["content"]["application/json"]["schema"])
    stars = resolved(arguments["properties"]["review"])["properties"]["stars"]
    assert (stars["minimum"], stars["maximum"]) == (1, 5)
    result = resolved(post["responses"]["200"]["content"]["application/json"]["schema"])
    assert result["properties"]["positive"]["type"] == "boolean"


def test_bytes_inside_lists_and_dicts_arrive_as_bytes(
    platform: Platform, deployed: dict[str, str]
) -> None:
    sizes = ember.Endpoint.lookup(APP, "sizes", config=platform.config())
    assert sizes.call(blobs=[b"hi", b"\x00" * 5], named={"a": b"x"}) == {
        "blobs": [2, 5],
        "named": {"a": "x"},
    }
    with platform.client() as client:
        answer = client.post(f"/{APP}--sizes/", json={"blobs": ["aGk="]})
        assert answer.json() == {"blobs": [2], "named": {}}
        bad = client.post(f"/{APP}--sizes/", json={"blobs": ["aGk=", "not base64!"]})
        assert bad.status_code == 400 and "blobs[1]: expected bytes" in bad.text


def test_enum_parameters_get_their_members_and_other_values_a_400(
    platform: Platform, deployed: dict[str, str]
) -> None:
    with platform.client() as client:
        answer = client.post(f"/{APP}--paint/", json={"colour": "red", "shades": ["green"]})
        assert answer.json() == {"colour": "red", "shades": ["GREEN"]}, answer.text
        bad = client.post(f"/{APP}--paint/", json={"colour": "blue"})
        assert bad.status_code == 400
        assert "colour: expected one of ['red', 'green'] (Colour), got str 'blue'" in bad.text

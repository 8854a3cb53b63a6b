"""Each function or class endpoint serves its OpenAPI document at `{URL}/openapi.json`:
valid OpenAPI 3.1, describing its methods from the code's hints and docstrings, behind
the same token as its calls, with the URL the caller used as its server."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import Platform
from openapi_spec_validator import validate

from ember.calling.tlsclient import client_context

APP = "documented"


@pytest.fixture(scope="module")
def deployed(platform: Platform, apps_dir: Path) -> dict[str, str]:
    return platform.deploy(apps_dir / "documented.py", APP)


SHAPES = "shapes"
# A dataclass that holds itself, seven times over: its schema once inlined every level
# down to the depth limit (43 MB in the manifest, an 86 MB document that took 20 s to
# build while the gateway served nothing else); and a web app, which the platform makes
# no document for.
SHAPES_SOURCE = """
from __future__ import annotations

from dataclasses import dataclass

import ember


@dataclass
class Expr:
    op: str
    a: Expr | None = None
    b: Expr | None = None
    c: Expr | None = None
    d: Expr | None = None
    e: Expr | None = None
    f: Expr | None = None
    g: Expr | None = None


def size(expr: Expr) -> int:
    children = [expr.a, expr.b, expr.c, expr.d, expr.e, expr.f, expr.g]
    return 1 + sum(size(child) for child in children if child is not None)


@ember.endpoint(scaledown_window=30)
def evaluate(expr: Expr) -> int:
    return size(expr)


@ember.endpoint(scaledown_window=30)
@ember.asgi_app()
def web():
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    async def hello(request):
        return PlainTextResponse("hello")

    return Starlette(routes=[Route("/hello", hello)])
"""


@pytest.fixture(scope="module")
def shapes(platform: Platform, apps_dir: Path) -> float:
    """Deploys the app; the seconds `ember deploy` took."""
    source = apps_dir / "shapes.py"
    source.write_text(SHAPES_SOURCE)
    started = time.monotonic()
    platform.deploy(source, SHAPES)
    return time.monotonic() - started


def _document(platform: Platform, label: str) -> dict[str, Any]:
    with platform.client() as client:
        response = client.get(f"/{label}/openapi.json")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/json")
    document = response.json()
    validate(document)  # raises, saying where, when it is not valid OpenAPI
    return document


def _without_token(platform: Platform, path: str) -> httpx.Response:
    return httpx.get(platform.url + path, verify=client_context(platform.ca))


def test_a_function_endpoint_is_described_from_its_hints_and_docstring(
    platform: Platform, deployed: dict[str, str]
) -> None:
    label = f"{APP}--translate"
    document = _document(platform, label)
    assert document["openapi"] == "3.1.0"
    assert document["info"]["title"] == label and document["info"]["version"] == "v1"
    assert document["servers"] == [{"url": f"{platform.url}/{label}"}]
    assert document["security"] == [{"bearer": []}]
    post = document["paths"]["/"]["post"]
    assert post["summary"] == "Translate a text."
    assert "`times` times" in post["description"]
    arguments = post["requestBody"]["content"]["application/json"]["schema"]
    assert arguments == {
        "type": "object",
        "properties": {
            "text": {"type": "string"},
            "target": {"enum": ["fr", "de"], "default": "fr"},
            "times": {"type": "integer", "default": 1},
        },
        "required": ["text"],
        "additionalProperties": False,
    }
    assert post["responses"]["200"]["content"]["application/json"]["schema"] == {
        "type": "object",
        "additionalProperties": {"type": "string"},
    }
    assert {"202", "400", "401", "403", "429", "500", "504"} <= set(post["responses"])
    # Scalar arguments: a GET with a query string calls it too, as the document says.
    get = document["paths"]["/"]["get"]
    assert [(p["name"], p["required"]) for p in get["parameters"]] == [
        ("text", True),
        ("target", False),
        ("times", False),
        ("X-Ember-Priority", False),
        ("X-Ember-Affinity", False),
        ("X-Ember-Timeout", False),
    ]
    with platform.client() as client:
        answer = client.get(f"/{label}/", params={"text": "hi", "target": "de", "times": 2})
    assert answer.json() == {"text": "[de] hi[de] hi"}


def test_the_wildcard_host_is_the_server_when_the_caller_used_it(
    platform: Platform, deployed: dict[str, str]
) -> None:
    label = f"{APP}--translate"
    host = f"{label}.ember.localhost:{platform.url.rsplit(':', 1)[1]}"
    with platform.client() as client:
        response = client.get("/openapi.json", headers={"Host": host})
    assert response.status_code == 200, response.text
    assert response.json()["servers"] == [{"url": f"https://{host}"}]


def test_a_class_endpoint_lists_each_method_streams_files_and_paths(
    platform: Platform, deployed: dict[str, str]
) -> None:
    document = _document(platform, f"{APP}--tokens")
    paths = document["paths"]
    assert set(paths) == {"/count", "/stream", "/thumbnail", "/v1/thumb"}
    count = paths["/count"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert count["properties"]["words"] == {"type": "array", "items": {"type": "string"}}
    assert count["properties"]["sizes"]["anyOf"][1] == {"type": "null"}
    assert "get" in paths["/count"]  # a list goes in a query string as JSON text
    events = paths["/stream"]["post"]["responses"]["200"]["content"]["text/event-stream"]
    assert events["x-ember-event-data"] == {
        "type": "object",
        "additionalProperties": {"type": "integer"},
    }
    assert paths["/stream"]["post"]["summary"] == "Count up to n, one event each."
    for path in ("/thumbnail", "/v1/thumb"):
        success = paths[path]["post"]["responses"]["200"]["content"]
        assert list(success) == ["application/octet-stream"]
    ids = [op["operationId"] for item in paths.values() for op in item.values()]
    assert len(ids) == len(set(ids))


def test_a_public_upload_endpoint_takes_forms_and_raw_bodies_and_needs_no_token(
    platform: Platform, deployed: dict[str, str]
) -> None:
    label = f"{APP}--upload"
    response = _without_token(platform, f"/{label}/openapi.json")
    assert response.status_code == 200, response.text
    document = response.json()
    validate(document)
    assert "security" not in document and "securitySchemes" not in document["components"]
    post = document["paths"]["/"]["post"]
    content = post["requestBody"]["content"]
    assert set(content) == {"application/json", "multipart/form-data", "application/octet-stream"}
    assert content["multipart/form-data"]["schema"]["properties"]["data"] == {
        "type": "string",
        "contentMediaType": "application/octet-stream",
    }
    assert content["application/json"]["schema"]["properties"]["data"] == {
        "type": "string",
        "contentEncoding": "base64",
    }
    assert "get" not in document["paths"]["/"]  # a file cannot go in a query string
    assert "401" not in post["responses"] and "415" in post["responses"]


def test_the_document_is_behind_the_endpoints_token_and_only_read(
    platform: Platform, deployed: dict[str, str]
) -> None:
    label = f"{APP}--translate"
    anonymous = _without_token(platform, f"/{label}/openapi.json")
    assert anonymous.status_code == 401
    assert anonymous.json()["error"]["type"] == "unauthorized"
    with platform.client() as client:
        posted = client.post(f"/{label}/openapi.json", json={})
        assert posted.status_code == 405 and "GET openapi.json" in posted.text
        missing = client.get("/documented--nope/openapi.json")
        assert missing.status_code == 404


def test_ember_openapi_prints_or_writes_it(
    platform: Platform, deployed: dict[str, str], tmp_path: Path
) -> None:
    printed = json.loads(platform.ember("openapi", f"{APP}--tokens").stdout)
    assert printed["info"]["title"] == f"{APP}--tokens"
    target = tmp_path / "tokens.json"
    platform.ember("openapi", f"{APP}--tokens", "-o", str(target))
    assert json.loads(target.read_text()) == printed
    unknown = platform.ember("openapi", f"{APP}--nope", check=False)
    assert unknown.returncode == 1 and "no endpoint named documented--nope" in unknown.stderr
    bad = platform.ember("openapi", "nolabel", check=False)
    assert bad.returncode == 1 and "labels look like APP--ENDPOINT" in bad.stderr


def test_a_recursive_dataclass_is_one_component_and_the_document_stays_small(
    platform: Platform, shapes: float
) -> None:
    # Was 32 s, 25 of them building the schema (the document's size below is the real
    # check; a loaded 2-core machine's margin here).
    assert shapes < 60
    label = f"{SHAPES}--evaluate"
    started = time.monotonic()
    with platform.client() as client:
        response = client.get(f"/{label}/openapi.json")
    assert response.status_code == 200, response.text
    assert time.monotonic() - started < 10 and len(response.content) < 20_000  # was 20 s, 86 MB
    document = response.json()
    validate(document)
    post = document["paths"]["/"]["post"]
    arguments = post["requestBody"]["content"]["application/json"]["schema"]
    assert arguments["properties"]["expr"] == {"$ref": "#/components/schemas/Expr"}
    expr = document["components"]["schemas"]["Expr"]
    assert expr["properties"]["g"]["anyOf"][0] == {"$ref": "#/components/schemas/Expr"}
    with platform.client() as client:  # the replica still builds and checks the tree
        tree = {"op": "+", "a": {"op": "1"}, "g": {"op": "-", "b": {"op": "2"}}}
        assert client.post(f"/{label}/", json={"expr": tree}).json() == 4
        wrong = client.post(f"/{label}/", json={"expr": {"op": "+", "a": {"op": 3}}})
        assert wrong.status_code == 400 and "op" in wrong.text


def test_ember_openapi_of_a_web_app_says_the_app_describes_itself(
    platform: Platform, shapes: float
) -> None:
    answer = platform.ember("openapi", f"{SHAPES}--web", check=False)
    assert answer.returncode == 1 and answer.stdout == ""
    assert "is a web app, which serves its own API description" in answer.stderr
    assert "http_error" not in answer.stderr

"""Each function or class endpoint serves its OpenAPI document at `{URL}/openapi.json`:
valid OpenAPI 3.1, describing its methods from the code's hints and docstrings, behind
the same token as its calls, with the URL the caller used as its server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import Platform
from openapi_spec_validator import validate

from ember.tlsclient import client_context

APP = "documented"


@pytest.fixture(scope="module")
def deployed(platform: Platform, apps_dir: Path) -> dict[str, str]:
    return platform.deploy(apps_dir / "documented.py", APP)


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

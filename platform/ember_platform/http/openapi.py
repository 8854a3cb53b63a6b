"""The OpenAPI 3.1 document of one function or class endpoint, served at
`{endpoint URL}/openapi.json`: its methods' arguments and results as JSON Schemas (read
from the code's type hints at deploy time), how to call them (JSON, forms, files, GET
with a query string, async calls) and the errors the platform answers with, so that
client generators, API explorers and HTTP tools can call it without reading its code.

The classes a method's schemas define in their `$defs` (`ember.endpoints.schemas`) become the
document's `components.schemas`, each once. Each method's schemas are rewritten once and
shared by its operations (POST, GET, its other path): the document is as large as the
manifest's schemas, times a small constant, and is only read (serialized) once built."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ember.calling.affinity import AFFINITY_HEADER, MAX_AFFINITY_KEY
from ember.calling.call_timeouts import CALL_TIMEOUT_HEADER, MAX_CALL_TIMEOUT
from ember.calling.priority import PRIORITIES, PRIORITY_HEADER
from ember.declarations.parameters import BYTES, JSON
from ember.endpoints.schemas import merge_definitions, pointed
from ember.wire.labels import Route, make_label
from ember.wire.spec import FUNCTION_METHOD, EndpointSpec, MethodSpec
from ember_platform.edge.asgi_types import Send
from ember_platform.edge.errors import HttpError
from ember_platform.http.call_responses import send_json
from ember_platform.runtime.cluster_model import EndpointRuntime

OPENAPI_PATH = "openapi.json"
OPENAPI_VERSION = "3.1.0"

Schema = dict[str, Any]

ERROR_SCHEMA: Schema = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        }
    },
}
ACCEPTED_SCHEMA: Schema = {
    "type": "object",
    "required": ["call_id", "status_url"],
    "properties": {
        "call_id": {"type": "string"},
        "status_url": {
            "type": "string",
            "description": "where to ask for the result (GET) or cancel the call "
            "(DELETE): a path on the host the call was made at",
        },
    },
}
ANY_FILE: Schema = {"type": "string", "contentMediaType": "application/octet-stream"}

# Status codes every call may meet, and what each means here.
ERRORS = {
    "400": "the arguments are not valid: not JSON, not an object, or of the wrong type",
    "404": "no such endpoint or method",
    "413": "the body is larger than the endpoint accepts",
    "429": "the endpoint's queue is full, or the token is past its rate limit; retry "
    "after the Retry-After header's seconds",
    "500": "the endpoint's code raised; the message says what",
    "502": "the replica running the call was lost",
    "503": "no worker can ever serve this endpoint (such as a GPU type no node has)",
    "504": "the call ran past the endpoint's timeout, waited past its queue_timeout, or "
    "went past its own X-Ember-Timeout",
}
AUTH_ERRORS = {
    "401": "no token, or one that is not valid",
    "403": "the token may not call this endpoint",
}


def _error(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }


def _is_file(schema: Schema | None) -> bool:
    if not schema:
        return False
    return schema.get("format") == "binary"


COMPONENTS_PREFIX = "#/components/schemas/"


class _Components:
    """The document's components.schemas, gathered from the methods' `$defs`: a class
    several methods use is defined once; one whose name is taken by something else (a
    class of the same name, the document's own Error) gets a name of its own."""

    def __init__(self) -> None:
        self.schemas: dict[str, Schema] = {"Error": ERROR_SCHEMA, "Accepted": ACCEPTED_SCHEMA}

    def place(self, schema: Schema | None) -> Schema | None:
        """`schema` (a method's, from the manifest) as a new tree for the document: its
        definitions put in the components and its references pointing there."""
        if not isinstance(schema, dict):
            return schema
        definitions = schema.get("$defs")
        if not isinstance(definitions, dict):
            definitions = {}
        objects = {name: d for name, d in definitions.items() if isinstance(d, dict)}
        names = merge_definitions(self.schemas, objects, COMPONENTS_PREFIX)
        return pointed({k: v for k, v in schema.items() if k != "$defs"}, names, COMPONENTS_PREFIX)


@dataclass(frozen=True)
class _Method:
    """A method with its schemas as they are in the document (shared by its operations,
    so never changed once made)."""

    spec: MethodSpec
    arguments: Schema
    result: Schema

    @classmethod
    def placed(cls, method: MethodSpec, components: _Components) -> _Method:
        arguments = components.place(method.arguments_schema) or {"type": "object"}
        return cls(method, arguments, components.place(method.result_schema) or {})


def _operation_id(spec: EndpointSpec, verb: str, path: str) -> str:
    """`post_thing` for `/`, `get_thing_v1/chat` for `/v1/chat`: unique, as each path is
    once in the document and the verbs differ in their first letter."""
    name = spec.name.replace("-", "_")
    return f"{verb}_{name}" if path == "/" else f"{verb}_{name}_{path.removeprefix('/')}"


def _form_schema(method: _Method) -> Schema:
    """The arguments as multipart/form-data fields: bytes parameters as files."""
    properties = dict(method.arguments.get("properties", {}))
    for name in method.spec.bytes_parameters():
        if name in properties:
            properties[name] = dict(ANY_FILE)
    return {**method.arguments, "properties": properties}


def _request_body(method: _Method) -> dict[str, Any]:
    arguments = method.arguments
    content: dict[str, Any] = {"application/json": {"schema": arguments}}
    description = "the keyword arguments, as a JSON object"
    files = method.spec.bytes_parameters()
    if files:
        content["multipart/form-data"] = {"schema": _form_schema(method)}
        description += (
            "; or a form with a field per argument, files for "
            + ", ".join(files)
            + " (bytes go in JSON as base64 strings)"
        )
    if len(files) == 1:
        content["application/octet-stream"] = {"schema": dict(ANY_FILE)}
        description += (
            f"; or a body of any other media type, which becomes {files[0]} (the query "
            "string gives the other arguments)"
        )
    return {
        "required": bool(arguments.get("required")),
        "description": description,
        "content": content,
    }


def _success(described: _Method) -> dict[str, Any]:
    method, result = described.spec, described.result
    content: dict[str, Any] = {}
    if method.streaming and _is_file(result):
        content["application/octet-stream"] = {"schema": dict(ANY_FILE)}
        description = "the file's bytes as the code makes them (of the media type it names)"
    elif method.streaming or method.stream_flag is not None:
        content["text/event-stream"] = {
            "schema": {"type": "string"},
            "x-ember-event-data": result,  # each event's data, as JSON
        }
        description = (
            "server-sent events, one per item the code yields, each item's JSON as the "
            "event's data; an `error` event ends a stream that failed"
        )
        if method.stream_flag is not None:
            content["application/json"] = {"schema": {}}
            description = (
                f"with `{method.stream_flag}` true: {description}; otherwise the result as JSON"
            )
    elif _is_file(result):
        content["application/octet-stream"] = {"schema": dict(ANY_FILE)}
        description = "the file the code returned, of the media type it names"
    else:
        content["application/json"] = {"schema": result}
        description = "the result, as JSON"
    return {"description": description, "content": content}


def _query_parameters(method: _Method) -> list[dict[str, Any]] | None:
    """A GET's arguments as query parameters; None when one of them cannot be text."""
    arguments = method.arguments
    kinds = method.spec.parameters
    parameters = []
    required = set(arguments.get("required", []))
    for name, schema in arguments.get("properties", {}).items():
        kind = kinds.get(name)
        if kind == BYTES:
            return None
        parameter: dict[str, Any] = {"name": name, "in": "query", "required": name in required}
        if kind == JSON:  # a list or an object, as JSON text
            parameter["content"] = {"application/json": {"schema": schema}}
        else:
            parameter["schema"] = schema
        parameters.append(parameter)
    return parameters


def _operation(
    spec: EndpointSpec,
    path: str,
    described: _Method,
    public: bool,
    query: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A POST at `path`, or with `query` (its arguments as query parameters) a GET."""
    method = described.spec
    verb = "post" if query is None else "get"
    operation: dict[str, Any] = {"operationId": _operation_id(spec, verb, path)}
    if method.summary:
        operation["summary"] = method.summary
    if method.description:
        operation["description"] = method.description
    responses: dict[str, Any] = {"200": _success(described)}
    priority = {
        "name": PRIORITY_HEADER,
        "in": "header",
        "required": False,
        "description": "the call's place in the endpoint's queue: high calls are taken "
        "before normal ones (the default), low ones after",
        "schema": {"type": "string", "enum": list(PRIORITIES)},
    }
    affinity = {
        "name": AFFINITY_HEADER,
        "in": "header",
        "required": False,
        "description": "calls with the same key (a session, a user, a model's name) go to "
        "the same replica while it has room, so that what it cached for them is reused",
        "schema": {"type": "string", "minLength": 1, "maxLength": MAX_AFFINITY_KEY},
    }
    timeout = {
        "name": CALL_TIMEOUT_HEADER,
        "in": "header",
        "required": False,
        "description": "the call's own limit in seconds, waiting and running: past it the "
        "call is stopped and answers 504 (deadline_exceeded)",
        "schema": {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_CALL_TIMEOUT},
    }
    if query is not None:
        operation["parameters"] = [*query, priority, affinity, timeout]
    else:
        operation["parameters"] = [
            priority,
            affinity,
            timeout,
            {
                "name": "Prefer",
                "in": "header",
                "required": False,
                "description": "`respond-async`: answer 202 with a call id at once and run "
                "the call in the background (its result is kept for a day)",
                "schema": {"type": "string", "enum": ["respond-async"]},
            },
            {
                "name": "Idempotency-Key",
                "in": "header",
                "required": False,
                "description": "with `Prefer: respond-async`: a retried request with the "
                "same key gets the same call, not a second run",
                "schema": {"type": "string", "maxLength": 255},
            },
        ]
        operation["requestBody"] = _request_body(described)
        responses["202"] = {
            "description": "accepted (with `Prefer: respond-async`)",
            "headers": {"Location": {"schema": {"type": "string"}}},
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Accepted"}}},
        }
        if method.bytes_parameters():
            responses["415"] = _error("a raw body, but the method has no single bytes parameter")
    errors = ERRORS if public else {**ERRORS, **AUTH_ERRORS}
    responses.update({status: _error(text) for status, text in errors.items()})
    operation["responses"] = dict(sorted(responses.items()))
    return operation


def _path_item(spec: EndpointSpec, path: str, method: _Method, public: bool) -> dict[str, Any]:
    item = {"post": _operation(spec, path, method, public)}
    query = _query_parameters(method)
    if query is not None:
        item["get"] = _operation(spec, path, method, public, query)
    return item


def endpoint_document(
    app: str, spec: EndpointSpec, version: int, server_url: str
) -> dict[str, Any]:
    """The document of `spec`, deployed as `version` of `app`, reached at `server_url`.
    Its parts are shared among operations: serialize it, do not change it."""
    public = spec.settings.public
    components = _Components()
    paths: dict[str, Any] = {}
    for method in sorted(spec.methods.values(), key=lambda m: m.name):
        described = _Method.placed(method, components)
        if method.name == FUNCTION_METHOD:
            paths["/"] = _path_item(spec, "/", described, public)
            continue
        paths[f"/{method.name}"] = _path_item(spec, f"/{method.name}", described, public)
        if method.path is not None:  # the same method at its own path too
            paths[f"/{method.path}"] = _path_item(spec, f"/{method.path}", described, public)
    document: dict[str, Any] = {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": make_label(app, spec.name),
            "version": f"v{version}",
            "description": f"Endpoint {spec.name} of the Ember app {app}, as deployed in "
            f"version {version}.",
        },
        "servers": [{"url": server_url}],
        "paths": paths,
        "components": {"schemas": components.schemas},
    }
    if not public:
        document["components"]["securitySchemes"] = {
            "bearer": {
                "type": "http",
                "scheme": "bearer",
                "description": "a token that may call endpoints (`ember token create`)",
            }
        }
        document["security"] = [{"bearer": []}]
    return document


async def send_openapi(
    scope: dict[str, Any], send: Send, route: Route, runtime: EndpointRuntime
) -> None:
    """The endpoint's OpenAPI document, its server the URL this request came by."""
    if scope["method"] != "GET":
        raise HttpError(405, "method_not_allowed", f"GET {OPENAPI_PATH}")
    host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
    server = f"{scope.get('scheme', 'https')}://{host}{route.root_path}"
    document = endpoint_document(runtime.app, runtime.spec, runtime.version, server)
    await send_json(send, 200, json.dumps(document).encode())

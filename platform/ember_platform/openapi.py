"""The OpenAPI 3.1 document of one function or class endpoint, served at
`{endpoint URL}/openapi.json`: its methods' arguments and results as JSON Schemas (read
from the code's type hints at deploy time), how to call them (JSON, forms, files, GET
with a query string, async calls) and the errors the platform answers with, so that
client generators, API explorers and HTTP tools can call it without reading its code."""

from __future__ import annotations

import copy
from typing import Any

from ember.affinity import AFFINITY_HEADER, MAX_AFFINITY_KEY
from ember.call_timeouts import CALL_TIMEOUT_HEADER, MAX_CALL_TIMEOUT
from ember.labels import make_label
from ember.parameters import BYTES, JSON
from ember.priority import PRIORITIES, PRIORITY_HEADER
from ember.spec import FUNCTION_METHOD, EndpointSpec, MethodSpec

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
            "description": "where to ask for the result, on the platform's address",
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


def _operation_id(spec: EndpointSpec, method: MethodSpec) -> str:
    name = spec.name.replace("-", "_")
    return name if method.name == FUNCTION_METHOD else f"{name}_{method.name}"


def _arguments(method: MethodSpec) -> Schema:
    return copy.deepcopy(method.arguments_schema) or {"type": "object"}


def _form_schema(method: MethodSpec) -> Schema:
    """The arguments as multipart/form-data fields: bytes parameters as files."""
    schema = _arguments(method)
    for name in method.bytes_parameters():
        if name in schema.get("properties", {}):
            schema["properties"][name] = dict(ANY_FILE)
    return schema


def _request_body(method: MethodSpec) -> dict[str, Any]:
    arguments = _arguments(method)
    content: dict[str, Any] = {"application/json": {"schema": arguments}}
    description = "the keyword arguments, as a JSON object"
    files = method.bytes_parameters()
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


def _success(method: MethodSpec) -> dict[str, Any]:
    result = copy.deepcopy(method.result_schema) or {}
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


def _query_parameters(method: MethodSpec) -> list[dict[str, Any]] | None:
    """A GET's arguments as query parameters; None when one of them cannot be text."""
    arguments = _arguments(method)
    kinds = method.parameters
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
    method: MethodSpec,
    public: bool,
    query: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A POST, or with `query` (its arguments as query parameters) a GET."""
    get = query is not None
    operation: dict[str, Any] = {"operationId": _operation_id(spec, method)}
    if get:
        operation["operationId"] += "_get"
    if method.summary:
        operation["summary"] = method.summary
    if method.description:
        operation["description"] = method.description
    responses: dict[str, Any] = {"200": _success(method)}
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
        operation["requestBody"] = _request_body(method)
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


def _path_item(spec: EndpointSpec, method: MethodSpec, public: bool) -> dict[str, Any]:
    item = {"post": _operation(spec, method, public)}
    query = _query_parameters(method)
    if query is not None:
        item["get"] = _operation(spec, method, public, query)
    return item


def endpoint_document(
    app: str, spec: EndpointSpec, version: int, server_url: str
) -> dict[str, Any]:
    """The document of `spec`, deployed as `version` of `app`, reached at `server_url`."""
    public = spec.settings.public
    paths: dict[str, Any] = {}
    for method in sorted(spec.methods.values(), key=lambda m: m.name):
        if method.name == FUNCTION_METHOD:
            paths["/"] = _path_item(spec, method, public)
            continue
        paths[f"/{method.name}"] = _path_item(spec, method, public)
        if method.path is not None:  # the same method at its own path too
            alias = _path_item(spec, method, public)
            for operation in alias.values():
                operation["operationId"] += "_at_path"
            paths[f"/{method.path}"] = alias
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
        "components": {"schemas": {"Error": ERROR_SCHEMA, "Accepted": ACCEPTED_SCHEMA}},
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

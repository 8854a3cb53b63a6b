"""Wire types shared by the CLI, the control plane and the replica runtime."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ember.declarations.settings import EndpointSettings
from ember.errors import InvalidError
from ember.wire.bundle_rules import check_entry

# The method name a function endpoint is registered under; its URL is `/{label}/`.
FUNCTION_METHOD = "__call__"


# The data of the event that ends an OpenAI stream (`@ember.method(stream_done=True)`):
# no item is ever sent as it, since items are JSON and it is not.
STREAM_DONE = "[DONE]"


@dataclass(frozen=True)
class MethodSpec:
    name: str
    streaming: bool  # a generator: served as text/event-stream
    is_async: bool
    # Another URL path under the endpoint's where the method answers too, such as
    # "v1/chat/completions" for OpenAI clients; None for `/{label}/{name}` only.
    path: str | None = None
    # The boolean argument that makes one call stream (OpenAI's "stream"): such a method
    # returns an iterator when it is true and a JSON value otherwise.
    stream_flag: str | None = None
    # The argument whose value is the call's affinity key when no X-Ember-Affinity header
    # gives one (OpenAI's "prompt_cache_key"): the gateway reads it from the JSON body.
    affinity_field: str | None = None
    # Its streams end with OpenAI's `data: [DONE]` event after the last item (STREAM_DONE):
    # clients of OpenAI's API wait for it.
    stream_done: bool = False
    # Parameter name -> kind (`ember.declarations.parameters`), from the hints at deploy
    # time: how the gateway reads text and files for it. Parameters without a useful hint
    # are absent.
    parameters: dict[str, str] = field(default_factory=dict, hash=False)
    # For the endpoint's OpenAPI document (`ember.endpoints.schemas`): JSON Schemas of the
    # arguments object and of one result (or streamed item), and the docstring's parts.
    # They describe the method; how it is called and routed does not depend on them.
    arguments_schema: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    result_schema: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    summary: str = field(default="", compare=False)
    description: str = field(default="", compare=False)

    def bytes_parameters(self) -> list[str]:
        return [name for name, kind in self.parameters.items() if kind == "bytes"]

    def streams(self, arguments: dict[str, Any]) -> bool:
        """Whether a call with these keyword arguments is answered as a stream."""
        if self.stream_flag is not None:
            return arguments.get(self.stream_flag) is True
        return self.streaming

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "name": self.name,
            "streaming": self.streaming,
            "is_async": self.is_async,
        }
        if self.path is not None:
            data["path"] = self.path
        if self.stream_flag is not None:
            data["stream_flag"] = self.stream_flag
        if self.affinity_field is not None:
            data["affinity_field"] = self.affinity_field
        if self.stream_done:
            data["stream_done"] = True
        if self.parameters:
            data["parameters"] = dict(self.parameters)
        for key in ("arguments_schema", "result_schema", "summary", "description"):
            if getattr(self, key):
                data[key] = getattr(self, key)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MethodSpec:
        return cls(
            name=data["name"],
            streaming=bool(data["streaming"]),
            is_async=bool(data["is_async"]),
            path=data.get("path"),
            stream_flag=data.get("stream_flag"),
            affinity_field=data.get("affinity_field"),
            stream_done=data.get("stream_done") is True,
            parameters={str(k): str(v) for k, v in (data.get("parameters") or {}).items()},
            arguments_schema=_schema(data.get("arguments_schema")),
            result_schema=_schema(data.get("result_schema")),
            summary=str(data.get("summary") or ""),
            description=str(data.get("description") or ""),
        )


def _schema(value: Any) -> dict[str, Any] | None:
    """A schema from a manifest (made by the SDK; an older one has none)."""
    return value if isinstance(value, dict) else None


def method_at(methods: Mapping[str, MethodSpec], name_or_path: str) -> MethodSpec | None:
    """Of `methods` (by name), the one called `name_or_path`, else the one at that path."""
    found = methods.get(name_or_path)
    if found is None:
        found = next((m for m in methods.values() if m.path == name_or_path), None)
    return found


def check_gang_inputs(name: str, kind: str, settings: EndpointSettings) -> None:
    """A web app's requests go to rank 0 of its gang alone: InvalidError otherwise."""
    if settings.gang_inputs == "every_rank" and kind == "asgi":
        raise InvalidError(
            f"{name}: a web app's requests go to rank 0 of its gang, which answers them; "
            "drop gang_inputs='every_rank'"
        )


@dataclass(frozen=True)
class EndpointSpec:
    """What the platform needs to know about one endpoint of a deployed app."""

    name: str  # label-safe name, unique within the app
    attribute: str  # the module-level attribute that holds the endpoint
    kind: str  # "function" or "class"
    settings: EndpointSettings
    methods: dict[str, MethodSpec] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_gang_inputs(self.name, self.kind, self.settings)

    def method_at(self, name_or_path: str) -> MethodSpec | None:
        """The method a URL names after the endpoint's: by its name, else by its path."""
        return method_at(self.methods, name_or_path)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "attribute": self.attribute,
            "kind": self.kind,
            "settings": self.settings.to_dict(),
            "methods": [m.to_dict() for m in self.methods.values()],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EndpointSpec:
        methods = [MethodSpec.from_dict(m) for m in data["methods"]]
        return cls(
            name=data["name"],
            attribute=data["attribute"],
            kind=data["kind"],
            settings=EndpointSettings.from_dict(data["settings"]),
            methods={m.name: m for m in methods},
        )


@dataclass(frozen=True)
class AppManifest:
    """An app as `ember deploy` describes it: its entry file inside the bundle and endpoints."""

    app: str
    entry: str  # path of the user's file inside the bundle, POSIX separators
    endpoints: list[EndpointSpec]

    def to_dict(self) -> dict[str, Any]:
        return {
            "app": self.app,
            "entry": self.entry,
            "endpoints": [e.to_dict() for e in self.endpoints],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AppManifest:
        return cls(
            app=data["app"],
            entry=check_entry(data["entry"]),
            endpoints=[EndpointSpec.from_dict(e) for e in data["endpoints"]],
        )

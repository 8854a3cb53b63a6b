"""Wire types shared by the CLI, the control plane and the replica runtime."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ember.settings import EndpointSettings

# The method name a function endpoint is registered under; its URL is `/{label}/`.
FUNCTION_METHOD = "__call__"


@dataclass(frozen=True)
class MethodSpec:
    name: str
    streaming: bool  # a generator: served as text/event-stream
    is_async: bool

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "streaming": self.streaming, "is_async": self.is_async}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MethodSpec:
        return cls(
            name=data["name"], streaming=bool(data["streaming"]), is_async=bool(data["is_async"])
        )


@dataclass(frozen=True)
class EndpointSpec:
    """What the platform needs to know about one endpoint of a deployed app."""

    name: str  # label-safe name, unique within the app
    attribute: str  # the module-level attribute that holds the endpoint
    kind: str  # "function" or "class"
    settings: EndpointSettings
    methods: dict[str, MethodSpec] = field(default_factory=dict)

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
            entry=data["entry"],
            endpoints=[EndpointSpec.from_dict(e) for e in data["endpoints"]],
        )

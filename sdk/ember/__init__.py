"""Ember: serverless model endpoints. `import ember` and decorate a function or class."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ember import weights
    from ember.calling.affinity import current_affinity_key
    from ember.calling.client import CallHandle, Endpoint
    from ember.calling.priority import current_priority
    from ember.calling.tracing import current_trace_id
    from ember.calling.webhooks import verify_webhook
    from ember.cancellation import cancelled, current_call_id
    from ember.declarations.engine_metrics import MetricTarget
    from ember.declarations.retries import Retries
    from ember.declarations.schedules import Cron, Period
    from ember.declarations.settings import EndpointSettings
    from ember.endpoints.asgi import asgi_app, wsgi_app
    from ember.endpoints.batching import batched
    from ember.endpoints.decorators import EndpointDefinition, endpoint, enter, exit, method
    from ember.endpoints.health import health_check
    from ember.endpoints.multiplexing import multiplexed
    from ember.errors import (
        AuthError,
        BundleError,
        CallCancelledError,
        CallTimeoutError,
        ConfigError,
        ConnectionCutError,
        EmberError,
        InputError,
        InvalidError,
        NotFoundError,
        RemoteError,
        ServerUnreachableError,
        UserCodeError,
        WebhookVerificationError,
    )
    from ember.files import File, ReceivedFile
    from ember.images.image import Image
    from ember.state.shared_state import Dict, Queue
    from ember.state.volumes import Volume, VolumeConflictError
    from ember.user_metrics import Counter, Gauge, Histogram
    from ember.wire.labels import current_app

# Where each name below lives, imported on first use: a process pays only for what it
# touches (a replica whose code calls no other endpoint never loads the HTTP client).
_WHERE = {
    "asgi_app": "ember.endpoints.asgi",
    "AuthError": "ember.errors",
    "batched": "ember.endpoints.batching",
    "BundleError": "ember.errors",
    "CallCancelledError": "ember.errors",
    "CallHandle": "ember.calling.client",
    "CallTimeoutError": "ember.errors",
    "cancelled": "ember.cancellation",
    "ConfigError": "ember.errors",
    "ConnectionCutError": "ember.errors",
    "Counter": "ember.user_metrics",
    "Cron": "ember.declarations.schedules",
    "current_affinity_key": "ember.calling.affinity",
    "current_app": "ember.wire.labels",
    "current_call_id": "ember.cancellation",
    "current_priority": "ember.calling.priority",
    "current_trace_id": "ember.calling.tracing",
    "Dict": "ember.state.shared_state",
    "EmberError": "ember.errors",
    "Endpoint": "ember.calling.client",
    "endpoint": "ember.endpoints.decorators",
    "EndpointDefinition": "ember.endpoints.decorators",
    "EndpointSettings": "ember.declarations.settings",
    "enter": "ember.endpoints.decorators",
    "exit": "ember.endpoints.decorators",
    "File": "ember.files",
    "Gauge": "ember.user_metrics",
    "health_check": "ember.endpoints.health",
    "Histogram": "ember.user_metrics",
    "Image": "ember.images.image",
    "InputError": "ember.errors",
    "InvalidError": "ember.errors",
    "method": "ember.endpoints.decorators",
    "MetricTarget": "ember.declarations.engine_metrics",
    "multiplexed": "ember.endpoints.multiplexing",
    "NotFoundError": "ember.errors",
    "Period": "ember.declarations.schedules",
    "Queue": "ember.state.shared_state",
    "ReceivedFile": "ember.files",
    "RemoteError": "ember.errors",
    "Retries": "ember.declarations.retries",
    "ServerUnreachableError": "ember.errors",
    "UserCodeError": "ember.errors",
    "verify_webhook": "ember.calling.webhooks",
    "Volume": "ember.state.volumes",
    "VolumeConflictError": "ember.state.volumes",
    "WebhookVerificationError": "ember.errors",
    "weights": "ember.weights",
    "wsgi_app": "ember.endpoints.asgi",
}

__all__ = [
    "AuthError",
    "BundleError",
    "CallCancelledError",
    "CallHandle",
    "CallTimeoutError",
    "ConfigError",
    "ConnectionCutError",
    "Counter",
    "Cron",
    "Dict",
    "EmberError",
    "Endpoint",
    "EndpointDefinition",
    "EndpointSettings",
    "File",
    "Gauge",
    "Histogram",
    "Image",
    "InputError",
    "InvalidError",
    "MetricTarget",
    "NotFoundError",
    "Period",
    "Queue",
    "ReceivedFile",
    "RemoteError",
    "Retries",
    "ServerUnreachableError",
    "UserCodeError",
    "Volume",
    "VolumeConflictError",
    "WebhookVerificationError",
    "asgi_app",
    "batched",
    "cancelled",
    "current_affinity_key",
    "current_app",
    "current_call_id",
    "current_priority",
    "current_trace_id",
    "endpoint",
    "enter",
    "exit",
    "health_check",
    "method",
    "multiplexed",
    "verify_webhook",
    "weights",
    "wsgi_app",
]


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'ember' has no attribute {name!r}")
    if where == f"{__name__}.{name}":  # a module of its own (ember.weights)
        value: Any = importlib.import_module(where)
    else:
        value = getattr(importlib.import_module(where), name)
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

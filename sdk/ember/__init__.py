"""Ember: serverless model endpoints. `import ember` and decorate a function or class."""

from ember import weights
from ember.affinity import current_affinity_key
from ember.asgi import asgi_app, wsgi_app
from ember.batching import batched
from ember.cancellation import cancelled, current_call_id
from ember.client import CallHandle, Endpoint
from ember.decorators import EndpointDefinition, endpoint, enter, exit, method
from ember.errors import (
    AuthError,
    BundleError,
    CallCancelledError,
    CallTimeoutError,
    ConfigError,
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
from ember.health import health_check
from ember.labels import current_app
from ember.multiplexing import multiplexed
from ember.retries import Retries
from ember.schedules import Cron, Period
from ember.settings import EndpointSettings
from ember.shared_state import Dict, Queue
from ember.tracing import current_trace_id
from ember.user_metrics import Counter, Gauge, Histogram
from ember.volumes import Volume, VolumeConflictError
from ember.webhooks import verify_webhook

__all__ = [
    "AuthError",
    "BundleError",
    "CallCancelledError",
    "CallHandle",
    "CallTimeoutError",
    "ConfigError",
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
    "InputError",
    "InvalidError",
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

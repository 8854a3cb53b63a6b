"""Ember: serverless model endpoints. `import ember` and decorate a function or class."""

from ember import weights
from ember.calling.affinity import current_affinity_key
from ember.calling.client import CallHandle, Endpoint
from ember.calling.tracing import current_trace_id
from ember.calling.webhooks import verify_webhook
from ember.cancellation import cancelled, current_call_id
from ember.endpoints.asgi import asgi_app, wsgi_app
from ember.endpoints.batching import batched
from ember.endpoints.decorators import EndpointDefinition, endpoint, enter, exit, method
from ember.endpoints.engine_metrics import MetricTarget
from ember.endpoints.health import health_check
from ember.endpoints.multiplexing import multiplexed
from ember.endpoints.retries import Retries
from ember.endpoints.schedules import Cron, Period
from ember.endpoints.settings import EndpointSettings
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

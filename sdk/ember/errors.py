"""One exception hierarchy for everything Ember raises to its users."""

from __future__ import annotations


class EmberError(Exception):
    """Base class of every error Ember raises."""


class InvalidError(EmberError):
    """The user's code or settings are wrong; the message says how to fix it."""


class BundleError(EmberError):
    """An app bundle could not be built or is unsafe or malformed."""


class BundleTooLargeError(BundleError):
    """An app bundle holds more than a size cap allows once expanded."""


class ConfigError(EmberError):
    """The client is not configured (no server URL or token) or the config is unreadable."""


class ServerUnreachableError(EmberError):
    """No connection to the Ember server: it is not running, or not where the config says."""


class ConnectionCutError(ServerUnreachableError):
    """The connection closed before the answer (the server stopped or died meanwhile): the
    call may or may not have run. Retryable; the client does it by itself for requests
    that may run twice (an idempotency key, a GET)."""


class RemoteError(EmberError):
    """A call to the platform failed; carries the HTTP status and the error's type."""

    def __init__(self, status: int, error_type: str, message: str) -> None:
        super().__init__(f"{error_type} ({status}): {message}")
        self.status = status
        self.error_type = error_type
        self.message = message


class AuthError(RemoteError):
    """The token is missing, unknown (401) or not allowed to do this (403)."""


class NotFoundError(RemoteError):
    """The app, endpoint, method or call does not exist (404)."""


class UserCodeError(RemoteError):
    """The endpoint's own code raised; `error_type` is the Python exception's name."""


class CallTimeoutError(RemoteError):
    """The input ran past its endpoint's timeout (504), or `get(timeout=)` expired."""


class CallCancelledError(RemoteError):
    """The call was cancelled (`CallHandle.cancel()`, `ember calls cancel`) before it ended."""


class InputError(EmberError):
    """Raise it in endpoint code to reject the caller's input: the caller gets a 400
    (`invalid_input`) with this message instead of a 500 for a bug in the endpoint.

    An API of another shape may say more, as OpenAI's errors do: `status` (a 4xx, such as
    404 for a model it does not serve), `error_type` for the error's `type`, and `param`
    and `code`, which then join the error object (`{"error": {"type", "message", "param",
    "code"}}`)."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        error_type: str = "invalid_input",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        # Only client errors: a 5xx would say the endpoint failed, which it did not.
        self.status = status if isinstance(status, int) and 400 <= status <= 499 else 400
        self.error_type = (
            error_type if isinstance(error_type, str) and error_type else "invalid_input"
        )
        self.param = param
        self.code = code


class WebhookVerificationError(EmberError):
    """A webhook delivery whose signature or timestamp does not check out."""


class WeightsError(EmberError):
    """Weights could not be read; the message names the URL. Subclasses say why."""

    def __init__(self, url: str, problem: str) -> None:
        super().__init__(f"{url}: {problem}")
        self.url = url
        self.problem = problem


class WeightsNotFoundError(WeightsError):
    """The object (or a shard its index names) does not exist at the origin."""


class WeightsAccessDeniedError(WeightsError):
    """The origin refused the credentials (or their absence)."""


class WeightsFormatError(WeightsError):
    """Not a safetensors file, or its header lies (offsets, sizes, dtypes, a bad index)."""


class WeightsChangedError(WeightsError):
    """The object changed at the origin while being read: its size or version differs
    from the one the cached chunks belong to."""


class WeightsUnavailableError(WeightsError):
    """The origin failed (or went away, or sent a truncated object) and retries ran out."""

"""The ASGI callables the gateway's parts pass around."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Receive = Callable[[], Awaitable[dict[str, Any]]]
# Any mutable mapping, as Starlette's: the platform's app hands its `send` to Starlette.
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

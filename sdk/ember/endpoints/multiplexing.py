"""`@ember.multiplexed(max_models=3)`: many models behind one endpoint, a few loaded per
replica (fine-tuned variants, LoRA adapters, one model per customer).

The decorated loader, `def load(self, model_id: str) -> Model` (or a function, or an
`async def`), becomes a cache of what it returns: calling it gives the loaded model,
loading it once however many calls ask at the same time, and forgets the least recently
used one past `max_models`. Callers name the model with the call's affinity key
(`_affinity="customer-7"`), which also sends a model's calls to the replica that has it
loaded; called without an id, the loader takes the call's key
(`ember.current_affinity_key()`).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ember.calling.affinity import current_affinity_key
from ember.errors import InputError, InvalidError

MAX_MODELS_LIMIT = 1024


def multiplexed(max_models: int = 3) -> Callable[[Callable[..., Any]], Any]:
    """Keep up to `max_models` of what the loader returns per replica, least recently
    used out first."""
    if isinstance(max_models, bool) or not isinstance(max_models, int):
        raise InvalidError(f"max_models must be a whole number, not {max_models!r}")
    if not 1 <= max_models <= MAX_MODELS_LIMIT:
        raise InvalidError(f"max_models={max_models} is out of range (1 to {MAX_MODELS_LIMIT})")

    def decorate(loader: Callable[..., Any]) -> Multiplexed:
        if not callable(loader):
            raise InvalidError("@ember.multiplexed() decorates a function that loads a model")
        return Multiplexed(loader, max_models)

    return decorate


def _model_id(model_id: str | None, name: str) -> str:
    if model_id is None:
        model_id = current_affinity_key()
    if model_id is None:
        raise InputError(
            f"{name}() needs a model id: call with an affinity key naming the model "
            "(_affinity=, X-Ember-Affinity) or pass the id"
        )
    if not isinstance(model_id, str):
        raise InvalidError(f"{name}(): a model id is a str, not {type(model_id).__name__}")
    return model_id


class ModelCache:
    """One replica's (one instance's) loaded models, most recently used last."""

    def __init__(self, loader: Callable[..., Any], max_models: int, name: str) -> None:
        self.loader = loader
        self.max_models = max_models
        self.name = name
        self.models: OrderedDict[str, Any] = OrderedDict()
        self.lock = threading.Lock()
        self.loading: dict[str, threading.Event] = {}  # sync loads in progress
        self.tasks: dict[str, asyncio.Future[Any]] = {}  # async loads in progress
        self.loads = 0  # models loaded so far

    def _hit(self, model_id: str) -> tuple[bool, Any]:
        with self.lock:
            if model_id in self.models:
                self.models.move_to_end(model_id)
                return True, self.models[model_id]
        return False, None

    def _keep(self, model_id: str, model: Any, seconds: float) -> None:
        with self.lock:
            self.models[model_id] = model
            self.models.move_to_end(model_id)
            self.loads += 1
            evicted = []
            while len(self.models) > self.max_models:
                evicted.append(self.models.popitem(last=False)[0])
            kept = len(self.models)
        print(
            f"ember: {self.name}: loaded model {model_id!r} in {seconds:.2f} s "
            f"({kept} of {self.max_models} kept)",
            file=sys.stderr,
        )
        for old in evicted:  # its last reference goes with it: what it holds is freed
            print(
                f"ember: {self.name}: unloaded model {old!r}, the least recently used",
                file=sys.stderr,
            )

    def get(self, args: tuple[Any, ...], model_id: str) -> Any:
        while True:
            found, model = self._hit(model_id)
            if found:
                return model
            with self.lock:
                waiting = self.loading.get(model_id)
                if waiting is None:
                    done = self.loading[model_id] = threading.Event()
            if waiting is not None:  # another call loads it: use what it loads
                waiting.wait()
                continue  # loaded, or failed (then this call tries in turn)
            try:
                began = time.perf_counter()
                model = self.loader(*args, model_id)
                self._keep(model_id, model, time.perf_counter() - began)
                return model
            finally:
                with self.lock:
                    del self.loading[model_id]
                done.set()

    async def aget(self, args: tuple[Any, ...], model_id: str) -> Any:
        while True:
            found, model = self._hit(model_id)
            if found:
                return model
            task = self.tasks.get(model_id)
            mine = task is None
            if task is None:
                task = self.tasks[model_id] = asyncio.ensure_future(self._aload(args, model_id))
                task.add_done_callback(lambda _t: self.tasks.pop(model_id, None))
            try:
                # Shielded: a caller that leaves does not stop a load others wait for.
                return await asyncio.shield(task)
            except Exception:
                if mine:
                    raise
                # Another call's load failed: this call tries in turn.

    async def _aload(self, args: tuple[Any, ...], model_id: str) -> Any:
        began = time.perf_counter()
        model = await self.loader(*args, model_id)
        self._keep(model_id, model, time.perf_counter() - began)
        return model


class Multiplexed:
    """The decorated loader: a descriptor, so that each instance of a class endpoint
    (one per replica) has a cache of its own; a function's is its own."""

    def __init__(self, loader: Callable[..., Any], max_models: int) -> None:
        self.loader = loader
        self.max_models = max_models
        self.name = getattr(loader, "__qualname__", "loader")
        self.is_async = inspect.iscoroutinefunction(loader)
        self._attribute = f"_ember_models_{getattr(loader, '__name__', 'loader')}"
        self._function_cache = ModelCache(loader, max_models, self.name)
        self._lock = threading.Lock()
        functools.update_wrapper(self, loader)

    def cache(self, owner: object | None) -> ModelCache:
        """The models of `owner` (an instance of a class endpoint), or of the function."""
        if owner is None:
            return self._function_cache
        with self._lock:
            found = owner.__dict__.get(self._attribute)
            if found is None:
                found = owner.__dict__[self._attribute] = ModelCache(
                    self.loader, self.max_models, self.name
                )
            return found

    def __get__(self, owner: object | None, owner_type: type | None = None) -> Any:
        if owner is None:
            return self
        return functools.partial(self._call, owner)

    def __call__(self, model_id: str | None = None) -> Any:
        return self._call(None, model_id)

    def _call(self, owner: object | None, model_id: str | None = None) -> Any:
        model_id = _model_id(model_id, self.name)
        cache = self.cache(owner)
        args = () if owner is None else (owner,)
        if self.is_async:
            return cache.aget(args, model_id)
        return cache.get(args, model_id)

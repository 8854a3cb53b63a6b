"""`@ember.multiplexed`: a replica's LRU of loaded models, one load per model however
many calls want it at once, the model id from the call's affinity key."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import ember
from ember import cancellation
from ember.errors import InputError, InvalidError


class Adapters:
    def __init__(self) -> None:
        self.loaded: list[str] = []

    @ember.multiplexed(max_models=2)
    def adapter(self, name: str) -> dict[str, str]:
        time.sleep(0.05)  # loading takes a while: concurrent callers must wait, not load
        self.loaded.append(name)
        if name == "broken":
            raise OSError("no such adapter")
        return {"name": name}


def test_a_model_loads_once_and_the_least_recently_used_goes_past_max_models() -> None:
    adapters = Adapters()
    a = adapters.adapter("a")
    assert adapters.adapter("a") is a
    adapters.adapter("b")
    adapters.adapter("a")  # a is now the most recently used
    adapters.adapter("c")  # so b goes
    assert adapters.loaded == ["a", "b", "c"]
    adapters.adapter("a")
    adapters.adapter("b")
    assert adapters.loaded == ["a", "b", "c", "b"]


def test_each_instance_has_its_own_models() -> None:
    one, two = Adapters(), Adapters()
    one.adapter("a")
    two.adapter("a")
    assert one.loaded == two.loaded == ["a"]


def test_concurrent_calls_for_one_model_share_one_load() -> None:
    adapters = Adapters()
    with ThreadPoolExecutor(max_workers=8) as pool:
        models = list(pool.map(lambda _: adapters.adapter("a"), range(8)))
    assert adapters.loaded == ["a"]
    assert all(model is models[0] for model in models)


def test_a_failed_load_raises_and_is_not_kept() -> None:
    adapters = Adapters()
    with pytest.raises(OSError, match="no such adapter"):
        adapters.adapter("broken")
    with pytest.raises(OSError):
        adapters.adapter("broken")
    assert adapters.loaded == ["broken", "broken"]


def test_the_model_id_defaults_to_the_calls_affinity_key() -> None:
    adapters = Adapters()
    with pytest.raises(InputError, match="needs a model id"):
        adapters.adapter()
    flag = cancellation.InputFlag("c-1", affinity="customer-7")
    done: list[object] = []
    cancellation.bound(flag, lambda: done.append(adapters.adapter()))()
    assert done == [{"name": "customer-7"}]
    assert ember.current_affinity_key() is None  # outside the call again


def test_an_async_loader_is_awaited_once_for_concurrent_calls() -> None:
    loads: list[str] = []

    @ember.multiplexed(max_models=1)
    async def model(name: str) -> str:
        await asyncio.sleep(0.05)
        loads.append(name)
        if name == "bad":
            raise ValueError("bad model")
        return name.upper()

    async def main() -> None:
        assert await asyncio.gather(*(model("x") for _ in range(5))) == ["X"] * 5
        assert await model("y") == "Y"
        assert await model("x") == "X"  # max_models=1: x was unloaded for y
        cancellation.bind_task(cancellation.InputFlag("c-2", affinity="z"))
        assert await model() == "Z"
        with pytest.raises(ValueError, match="bad model"):
            await model("bad")

    asyncio.run(main())
    assert loads == ["x", "y", "x", "z", "bad"]


def test_a_waiter_loads_in_turn_when_the_load_it_waited_for_failed() -> None:
    attempts = 0
    started = threading.Event()

    @ember.multiplexed()
    def flaky(name: str) -> str:
        nonlocal attempts
        attempts += 1
        if attempts == 1:
            started.set()
            time.sleep(0.1)
            raise OSError("the first try fails")
        return name

    with ThreadPoolExecutor(max_workers=2) as pool:
        first = pool.submit(flaky, "m")
        started.wait(5)
        second = pool.submit(flaky, "m")
        with pytest.raises(OSError):
            first.result(5)
        assert second.result(5) == "m"
    assert attempts == 2


@pytest.mark.parametrize(("value", "message"), [(0, "out of range"), (2.5, "whole number")])
def test_max_models_is_checked(value: object, message: str) -> None:
    with pytest.raises(InvalidError, match=message):
        ember.multiplexed(max_models=value)  # type: ignore[arg-type]


def test_the_loader_logs_what_it_loads_and_unloads(capsys: pytest.CaptureFixture[str]) -> None:
    adapters = Adapters()
    adapters.adapter("a")
    adapters.adapter("b")
    adapters.adapter("c")
    err = capsys.readouterr().err
    assert "Adapters.adapter: loaded model 'c' in" in err and "(2 of 2 kept)" in err
    assert "unloaded model 'a', the least recently used" in err

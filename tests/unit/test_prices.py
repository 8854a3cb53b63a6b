"""Prices an operator sets, what usage costs at them, and the tokens answers say: pure."""

from __future__ import annotations

import dataclasses

import pytest

from ember_platform.observability.prices import parse_prices
from ember_platform.observability.token_usage import TokenLedger, Tokens, answer_tokens
from ember_platform.observability.usage import EndpointUsage


def test_prices_are_per_hour_unless_they_say_otherwise() -> None:
    prices = parse_prices("cpu=0.036/h, memory-gib=0.6/min,gpu:H100=2.5")
    assert prices.cpu == pytest.approx(0.00001)
    assert prices.memory_gib == pytest.approx(0.01)
    assert prices.gpu == {"H100": pytest.approx(2.5 / 3600)}
    assert prices.per_second(2, 2048, "H100", 8) == pytest.approx(0.00002 + 0.02 + 8 * 2.5 / 3600)
    assert prices.per_second(1, 0, "A10", 1) == pytest.approx(0.00001)  # unpriced: free
    assert prices.describe()["gpu_per_hour"] == {"H100": pytest.approx(2.5)}
    assert not parse_prices("").set


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("cpu", "RESOURCE=AMOUNT"),
        ("cpu=cheap", "RESOURCE=AMOUNT"),
        ("cpu=-1/h", "RESOURCE=AMOUNT"),
        ("cpu=1/day", "RESOURCE=AMOUNT"),
        ("disk=1/h", "cpu, memory-gib and gpu:TYPE"),
        ("gpu:=1/h", "cpu, memory-gib and gpu:TYPE"),
    ],
)
def test_a_wrong_price_says_how_to_write_one(text: str, said: str) -> None:
    with pytest.raises(ValueError, match=said):
        parse_prices(text)


def test_the_cost_is_shared_out_by_output_tokens() -> None:
    usage = EndpointUsage("app", "chat", cpu_seconds=3600.0, gib_seconds=0.0)
    usage.tokens = {"online": Tokens(100, 1000, 10), "batch": Tokens(300, 3000, 30)}
    priced = usage.priced(parse_prices("cpu=1/h"))
    assert priced["cost"] == pytest.approx(1.0)
    batch = priced["by_traffic"]["batch"]
    assert batch["cost"] == pytest.approx(0.75)
    assert batch["cost_per_million_output_tokens"] == pytest.approx(250.0)
    assert batch["million_tokens_per_unit"] == pytest.approx(3300 / 1e6 / 0.75)


def test_tokens_come_from_an_answers_usage_only() -> None:
    assert answer_tokens(b'{"usage": {"prompt_tokens": 7, "completion_tokens": 3}}') == (7, 3)
    assert answer_tokens(b'{"usage": {"prompt_tokens": 7}}') == (7, 0)  # embeddings
    for body in (
        b'"usage"',
        b"{}",
        b'{"usage": null}',
        b'{"usage": {"prompt_tokens": -1}}',
        b'{"usage": {"prompt_tokens": true}}',
        b'{"usage": {"prompt_tokens": 1.5}}',
        b'{"usage": {"prompt_tokens": 1}',  # cut short
    ):
        assert answer_tokens(body) is None, body


def test_the_ledger_keeps_what_the_store_refused() -> None:
    from ember_platform.storage.records import TokenUsage
    from ember_platform.storage.state_store import StoreWriteError

    class Refusing:
        written: list[tuple[object, ...]] = []
        refuse = True

        def add_token_usage(self, usage: TokenUsage) -> None:
            if self.refuse:
                raise StoreWriteError("disk full")
            self.written.append(dataclasses.astuple(usage))

    ledger = TokenLedger()
    ledger.add("app", "chat", "online", (5, 7), now=125.0)
    ledger.add("app", "chat", "online", (1, 1), now=170.0)
    store = Refusing()
    ledger.flush(store)  # type: ignore[arg-type]
    assert store.written == []
    store.refuse = False
    ledger.flush(store)  # type: ignore[arg-type]
    assert store.written == [("app", "chat", "online", 120, 6, 8, 2)]

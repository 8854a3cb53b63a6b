"""Per-token rate limits: parsing, the token bucket's arithmetic on a given clock, and the
limit kept with the token."""

from __future__ import annotations

import pytest
from store_backends import StoreOpener

from ember_platform.security.rate_limits import (
    RateLimit,
    RateLimiter,
    parse_rate_limit,
    retry_after_header,
)
from ember_platform.security.tokens import Scope, TokenRegistry, checked_token_name, hash_token


@pytest.mark.parametrize(
    ("text", "limit"),
    [
        ("10/s", RateLimit(10, 1.0)),
        ("600/min", RateLimit(600, 60.0)),
        (" 5 / H ", RateLimit(5, 3600.0)),
    ],
)
def test_limits_are_read_and_written_back(text: str, limit: RateLimit) -> None:
    assert parse_rate_limit(text) == limit
    assert parse_rate_limit(str(limit)) == limit


@pytest.mark.parametrize(
    "text", ["10", "0/s", "ten/s", "10/day", "-1/s", "2000000/s", "", "\u0661\u0660/s"]
)
def test_what_is_not_a_limit_says_what_is(text: str) -> None:
    with pytest.raises(ValueError, match="such as 10/s, 600/min or 10000/h"):
        parse_rate_limit(text)


def test_a_burst_up_to_the_count_then_the_rate() -> None:
    limiter, limit = RateLimiter(), RateLimit(3, 1.0)
    assert [limiter.wait_needed("t", limit, 100.0) for _ in range(3)] == [0.0] * 3
    assert limiter.wait_needed("t", limit, 100.0) == pytest.approx(1 / 3)
    assert limiter.wait_needed("t", limit, 100.2) == pytest.approx(1 / 3 - 0.2)
    assert limiter.wait_needed("t", limit, 100.34) == 0.0  # one refilled
    assert limiter.wait_needed("other", limit, 100.34) == 0.0  # each token its own bucket
    # An idle client gets its whole burst back, never more.
    assert [limiter.wait_needed("t", limit, 200.0) for _ in range(4)][-1] > 0
    limiter.forget("t")
    assert limiter.wait_needed("t", limit, 200.0) == 0.0


def test_retry_after_rounds_up_to_whole_seconds() -> None:
    assert [retry_after_header(s) for s in (0.01, 1.0, 1.2)] == ["1", "1", "2"]


def test_a_tokens_limit_is_kept_and_only_for_tokens_that_call(open_store: StoreOpener) -> None:
    store = open_store()
    token = TokenRegistry(store).create(Scope.INVOKE, "client", rate_limit=RateLimit(600, 60.0))
    reloaded = TokenRegistry(store)  # as after a restart
    grant = reloaded.grant_of(f"Bearer {token}")
    assert grant is not None and grant.rate_limit == RateLimit(600, 60.0)
    assert [t.rate_limit for t in reloaded.stored() if t.token_hash == hash_token(token)] == [
        "600/min"
    ]
    with pytest.raises(ValueError, match="a worker token makes no calls to limit"):
        reloaded.create(Scope.WORKER, "node", rate_limit=RateLimit(1, 1.0))
    store.close()


@pytest.mark.parametrize(
    ("name", "problem"),
    [(["ci"], "is text"), ("x" * 101, "at most 100"), ("a\nb", "control"), ("\x1b[31m", "control")],
)
def test_a_token_name_that_would_garble_a_listing_is_refused(name: object, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        checked_token_name(name)


def test_token_names_may_be_any_printable_text_or_none() -> None:
    assert checked_token_name(None) == ""
    assert checked_token_name("模型 CI - nightly") == "模型 CI - nightly"

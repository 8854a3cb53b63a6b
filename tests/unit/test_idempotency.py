"""Idempotency keys of spawned calls: one call id per caller, endpoint, method and key."""

from __future__ import annotations

import pytest

from ember_platform.edge.errors import HttpError
from ember_platform.http.call_requests import idempotent_call_id

A = "Bearer emb_a"


def test_the_same_key_names_the_same_call_for_the_same_caller_and_method() -> None:
    call = idempotent_call_id(A, "app--chat", "generate", b"job-1")
    assert call == idempotent_call_id(A, "app--chat", "generate", b"job-1")
    assert call.startswith("c-") and len(call) == 18
    others = {
        idempotent_call_id("Bearer emb_b", "app--chat", "generate", b"job-1"),
        idempotent_call_id(A, "app--other", "generate", b"job-1"),
        idempotent_call_id(A, "app--chat", "embed", b"job-1"),
        idempotent_call_id(A, "app--chat", "generate", b"job-2"),
    }
    assert call not in others and len(others) == 4
    # The same token, spelled otherwise.
    assert idempotent_call_id("bearer  emb_a ", "app--chat", "generate", b"job-1") == call


@pytest.mark.parametrize("key", [b"", b"x" * 256, "café".encode(), b"tab\there"])
def test_keys_that_are_not_short_printable_ascii_are_refused(key: bytes) -> None:
    with pytest.raises(HttpError) as raised:
        idempotent_call_id(A, "app--chat", "generate", key)
    assert raised.value.status == 400

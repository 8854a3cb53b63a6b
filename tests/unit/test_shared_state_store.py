"""The state store's side of ember.Dict and ember.Queue: values by key with expiry, and
queues taken first in, first out; on both backends."""

from __future__ import annotations

from store_backends import StoreOpener


def test_dict_items_expire_and_belong_to_their_app_and_dict(open_store: StoreOpener) -> None:
    store = open_store()
    store.dict_put("app", "d", "b", b'"two"', None)
    store.dict_put("app", "d", "a", b"1", expires_at=100.0)
    store.dict_put("app", "other", "a", b"3", None)
    store.dict_put("other-app", "d", "a", b"4", None)
    assert store.dict_get("app", "d", "a", now=99.0) == b"1"
    assert store.dict_get("app", "d", "a", now=100.0) is None  # expired
    assert store.dict_keys("app", "d", now=50.0, limit=10) == ["a", "b"]
    assert store.dict_keys("app", "d", now=150.0, limit=10) == ["b"]
    assert store.dict_count("app", "d", now=150.0) == 1
    assert store.delete_expired_items(now=150.0) == 1
    assert store.dict_delete("app", "d", "b", now=150.0) == b'"two"'
    assert store.dict_delete("app", "d", "b", now=150.0) is None
    assert store.dict_get("app", "other", "a", now=0.0) == b"3"
    assert store.dict_clear("other-app", "d") == 1
    assert store.dict_get("app", "other", "a", now=0.0) == b"3"  # another dict is untouched


def test_queues_are_first_in_first_out_and_survive_a_reopen(open_store: StoreOpener) -> None:
    store = open_store()
    store.queue_put("app", "q", [b"1", b"2", b"3"])
    store.queue_put("app", "other", [b"x"])
    assert store.queue_take("app", "q", 2) == [b"1", b"2"]
    store.close()
    store = open_store()
    assert store.queue_length("app", "q") == 1
    assert store.queue_take("app", "q", 5) == [b"3"]
    assert store.queue_take("app", "q", 5) == []
    assert store.queue_clear("app", "other") == 1

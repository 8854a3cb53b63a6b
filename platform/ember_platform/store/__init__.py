"""State stores: the interface and its implementations."""

from ember_platform.store.base import StateStore, StoreWriteError
from ember_platform.store.sqlite import SqliteStateStore

__all__ = ["SqliteStateStore", "StateStore", "StoreWriteError"]

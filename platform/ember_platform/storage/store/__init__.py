"""State stores: the interface and its implementations."""

from ember_platform.storage.sqlite_store import SqliteStateStore
from ember_platform.storage.state_store import StateStore, StoreWriteError

__all__ = ["SqliteStateStore", "StateStore", "StoreWriteError"]

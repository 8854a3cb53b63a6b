"""Endpoints whose code dies or cannot start, for the failure-path tests."""

import os

import ember


@ember.endpoint(retries=1)
def crashy() -> dict:
    os._exit(1)  # the replica process dies in the middle of the input


@ember.endpoint(name="unloadable")
class Unloadable:
    @ember.enter(snap=True)
    def load(self) -> None:
        raise RuntimeError("weights missing")

    @ember.method
    def run(self) -> dict:
        return {}


@ember.endpoint(name="unready")
class Unready:
    @ember.enter()
    def connect(self) -> None:
        raise ConnectionError("database down")

    @ember.method
    def run(self) -> dict:
        return {}

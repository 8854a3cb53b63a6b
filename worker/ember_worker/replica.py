"""Entry point of a replica process: `python -m ember_worker.replica` (started by the agent)."""

from __future__ import annotations

import os
import sys
import threading
import traceback

from ember import eventloop
from ember.errors import InvalidError
from ember.loader import find_endpoints, load_module
from ember_worker.identity import ReplicaIdentity
from ember_worker.runtime import ReplicaRuntime

EXIT_STARTUP_FAILED = 3
EXIT_ORPHANED = 70


def _watch_lifeline() -> None:
    """The agent holds our stdin open; EOF means it is gone, and so must we be."""
    try:
        # os.read, not sys.stdin: a daemon thread blocked inside a buffered reader aborts
        # the interpreter at shutdown.
        while os.read(0, 4096):
            pass
    finally:
        os._exit(EXIT_ORPHANED)


def main() -> int:
    identity = ReplicaIdentity.from_env()
    threading.Thread(target=_watch_lifeline, name="ember-lifeline", daemon=True).start()
    os.chdir(identity.bundle_dir)
    try:
        module = load_module(identity.bundle_dir / identity.entry)
        endpoints = find_endpoints(module)
        definition = endpoints.get(identity.attribute)
        if definition is None:
            raise InvalidError(
                f"{identity.entry} no longer defines endpoint {identity.attribute!r}"
            )
        runtime = ReplicaRuntime(identity, definition)
        runtime.run_snap_hooks()
    except BaseException as exc:
        traceback.print_exc()
        print(f"ember: replica failed to start: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_STARTUP_FAILED
    return eventloop.run(runtime.serve())


if __name__ == "__main__":
    sys.exit(main())

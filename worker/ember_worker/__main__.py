"""`python -m ember_worker`: the worker agent (what `ember worker` and `ember server` run)."""

from __future__ import annotations

import gc
import sys

from ember_worker import node_probes

if __name__ == "__main__":
    node_probes.begin()  # its programs run while the agent's modules load
    from ember_worker.cli import main

    status = main()
    gc.freeze()  # the teardown's collections then skip every object: see ember.cli.main
    sys.exit(status)

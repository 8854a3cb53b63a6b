"""`python -m ember_worker`: the worker agent (what `ember worker` and `ember server` run)."""

from __future__ import annotations

import sys

from ember_worker.cli import main

if __name__ == "__main__":
    sys.exit(main())

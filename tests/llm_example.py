"""examples/llm's modules for the tests, imported by path (examples are not a package), one
import of each for the whole session."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "llm"


def example_module(name: str) -> ModuleType:
    """examples/llm/{name}.py."""
    unique = f"ember_example_llm_{name}"  # not a bare `model` another test could clash with
    if unique in sys.modules:
        return sys.modules[unique]
    spec = importlib.util.spec_from_file_location(unique, EXAMPLE / f"{name}.py")
    if spec is None or spec.loader is None:
        raise RuntimeError(f"examples/llm/{name}.py is missing")
    module = importlib.util.module_from_spec(spec)
    sys.modules[unique] = module  # dataclasses look their module up while the class is built
    # Its own imports of siblings (engine.py's of prompt_lookup.py) find them, as in a replica.
    sys.path.insert(0, str(EXAMPLE))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(EXAMPLE))
    return module

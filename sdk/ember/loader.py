"""Import a user's app file and find the endpoints it defines."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from ember.decorators import EndpointDefinition
from ember.errors import InvalidError


def load_module(path: Path) -> ModuleType:
    """Import `path` as a top-level module, with its folder first on sys.path."""
    path = path.resolve()
    if not path.is_file() or path.suffix != ".py":
        raise InvalidError(f"{path} is not a Python file")
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    name = path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise InvalidError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def find_endpoints(module: ModuleType) -> dict[str, EndpointDefinition]:
    """Module attribute name -> endpoint, in definition order; names must be unique."""
    found: dict[str, EndpointDefinition] = {}
    names: dict[str, str] = {}
    for attribute, value in vars(module).items():
        if not isinstance(value, EndpointDefinition):
            continue
        if value.name in names:
            raise InvalidError(
                f"{attribute} and {names[value.name]} are both named {value.name!r}; "
                "give one of them name=..."
            )
        names[value.name] = attribute
        found[attribute] = value
    return found

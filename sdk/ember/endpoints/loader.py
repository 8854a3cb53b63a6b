"""Import a user's app file and find the endpoints it defines."""

from __future__ import annotations

import importlib.util
import sys
import traceback
from pathlib import Path
from types import ModuleType

from ember.endpoints.decorators import EndpointDefinition
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


def import_app_file(path: Path) -> ModuleType:
    """load_module for a command: code that fails to import is an InvalidError that
    shows the user's own traceback, from their file on, without Ember's frames."""
    try:
        return load_module(path)
    except InvalidError:
        raise
    except Exception as exc:
        raise InvalidError(f"cannot import {path}:\n{user_traceback(exc, path)}") from None


def user_traceback(exc: BaseException, path: Path) -> str:
    """The exception's traceback from the first frame in `path` on, less the import
    machinery's frames (an import in the user's code goes through them); a syntax error
    in the file itself, which runs no frame of it, is just the error with its line."""
    entry = str(path.resolve())
    frames = traceback.extract_tb(exc.__traceback__)
    first = next((i for i, frame in enumerate(frames) if frame.filename == entry), len(frames))
    own = [frame for frame in frames[first:] if not frame.filename.startswith("<frozen importlib")]
    lines = traceback.format_exception_only(exc)
    if own:
        lines = ["Traceback (most recent call last):\n", *traceback.format_list(own), *lines]
    return "".join(lines).rstrip("\n")


def find_endpoints(module: ModuleType) -> dict[str, EndpointDefinition]:
    """Module attribute name -> endpoint, in definition order; names must be unique."""
    found: dict[str, EndpointDefinition] = {}
    names: dict[str, str] = {}
    for attribute, value in vars(module).items():
        if not isinstance(value, EndpointDefinition):
            continue
        if any(value is seen for seen in found.values()):
            continue  # another name for the same endpoint (`alias = echo`)
        if value.name in names:
            raise InvalidError(
                f"{attribute} and {names[value.name]} are both named {value.name!r}; "
                "give one of them name=..."
            )
        names[value.name] = attribute
        found[attribute] = value
    return found

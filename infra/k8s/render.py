"""Render a kustomization of infra/k8s/ (the base or an overlay) to one YAML stream.

    python infra/k8s/render.py infra/k8s/overlays/postgresql > ember.yaml
    kubectl apply -f ember.yaml          # or, with kubectl: kubectl apply -k DIR

The manifests are Kustomize's layout, so `kubectl apply -k` and `kustomize build` read them
as they are; this renders the same subset of Kustomize without either (the tests render
with it, where neither is installed): `resources` (files, and folders holding a
kustomization.yaml), `patches` as JSON 6902 operations (add, replace, remove) on a target
named by kind and name, and `images` (newName, newTag). Anything else in a
kustomization is refused, so that what this renders is what Kustomize would."""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped]

KUSTOMIZATION = "kustomization.yaml"
KNOWN_KEYS = {"apiVersion", "kind", "resources", "patches", "images"}
KNOWN_PATCH_KEYS = {"path", "patch", "target"}
KNOWN_IMAGE_KEYS = {"name", "newName", "newTag"}

Resource = dict[str, Any]


class RenderError(Exception):
    """A kustomization this renderer cannot render; the message says which and why."""


def render(folder: Path) -> list[Resource]:
    """The resources of the kustomization in `folder`, patched, in the order listed."""
    spec = _load_kustomization(folder)
    resources: list[Resource] = []
    for entry in spec.get("resources", []):
        path = folder / entry
        if path.is_dir():
            resources.extend(render(path))
        elif path.is_file():
            resources.extend(_documents(path))
        else:
            raise RenderError(f"{folder / KUSTOMIZATION}: resource {entry} is not there")
    for patch in spec.get("patches", []):
        _apply_patch(folder, patch, resources)
    for image in spec.get("images", []):
        _set_image(folder, image, resources)
    return resources


def to_yaml(resources: list[Resource]) -> str:
    return yaml.safe_dump_all(resources, sort_keys=False, explicit_start=True)


def _load_kustomization(folder: Path) -> dict[str, Any]:
    path = folder / KUSTOMIZATION
    if not path.is_file():
        raise RenderError(f"{folder} holds no {KUSTOMIZATION}")
    spec = yaml.safe_load(path.read_text())
    if not isinstance(spec, dict):
        raise RenderError(f"{path} is not a mapping")
    unknown = set(spec) - KNOWN_KEYS
    if unknown:
        raise RenderError(f"{path}: {', '.join(sorted(unknown))} not rendered here")
    return spec


def _documents(path: Path) -> list[Resource]:
    found = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    for doc in found:
        if not isinstance(doc, dict) or "kind" not in doc or "metadata" not in doc:
            raise RenderError(f"{path}: a document that is not a Kubernetes resource")
    return found


def _apply_patch(folder: Path, patch: dict[str, Any], resources: list[Resource]) -> None:
    where = folder / KUSTOMIZATION
    unknown = set(patch) - KNOWN_PATCH_KEYS
    if unknown or "target" not in patch or ("path" in patch) == ("patch" in patch):
        raise RenderError(f"{where}: a patch needs a target and one of path or patch")
    text = (folder / patch["path"]).read_text() if "path" in patch else patch["patch"]
    operations = yaml.safe_load(text)
    if not isinstance(operations, list):
        raise RenderError(f"{where}: only JSON 6902 patches (a list of operations) render here")
    target = patch["target"]
    if set(target) - {"kind", "name"}:
        raise RenderError(f"{where}: a patch's target is named by kind and name only")
    matched = [
        r
        for r in resources
        if r["kind"] == target.get("kind", r["kind"])
        and r["metadata"]["name"] == target.get("name", r["metadata"]["name"])
    ]
    if not matched:
        raise RenderError(f"{where}: no resource is the target {target}")
    for resource in matched:
        for operation in operations:
            _apply_operation(resource, operation, where)


def _pointer(path: str) -> list[str]:
    """A JSON pointer's tokens (RFC 6901)."""
    if not path.startswith("/"):
        raise ValueError(f"{path!r} is not a JSON pointer")
    return [t.replace("~1", "/").replace("~0", "~") for t in path[1:].split("/")]


def _apply_operation(resource: Resource, operation: dict[str, Any], where: Path) -> None:
    op = operation.get("op")
    try:
        *parents, last = _pointer(str(operation.get("path", "")))
        node: Any = resource
        for token in parents:
            node = node[int(token)] if isinstance(node, list) else node[token]
        if op in ("add", "replace"):
            value = copy.deepcopy(operation["value"])
            if isinstance(node, list):
                if last == "-":
                    node.append(value)
                elif op == "add":
                    node.insert(int(last), value)
                else:
                    node[int(last)] = value
            elif op == "replace" and last not in node:
                raise KeyError(last)
            else:
                node[last] = value
        elif op == "remove":
            del node[int(last) if isinstance(node, list) else last]
        else:
            raise RenderError(f"{where}: operation {op!r} is not rendered here")
    except (KeyError, IndexError, ValueError, TypeError) as exc:
        name = f"{resource['kind']}/{resource['metadata']['name']}"
        raise RenderError(f"{where}: {op} {operation.get('path')} on {name}: {exc!r}") from None


def _containers(resource: Resource) -> list[dict[str, Any]]:
    spec = resource.get("spec", {})
    pod = spec if resource["kind"] == "Pod" else spec.get("template", {}).get("spec", {})
    return [*pod.get("initContainers", []), *pod.get("containers", [])]


def split_image(reference: str) -> tuple[str, str]:
    """An image reference's name and tag ("" if none); a registry's port is the name's."""
    colon = reference.rfind(":")
    if colon > reference.rfind("/"):
        return reference[:colon], reference[colon + 1 :]
    return reference, ""


def _set_image(folder: Path, image: dict[str, Any], resources: list[Resource]) -> None:
    if set(image) - KNOWN_IMAGE_KEYS or "name" not in image:
        raise RenderError(f"{folder / KUSTOMIZATION}: an image needs a name (and newName, newTag)")
    for resource in resources:
        for container in _containers(resource):
            name, tag = split_image(container["image"])
            if name == image["name"]:
                new_name = image.get("newName", name)
                new_tag = image.get("newTag", tag)
                container["image"] = f"{new_name}:{new_tag}" if new_tag else new_name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a folder holding a kustomization.yaml")
    args = parser.parse_args(argv)
    try:
        sys.stdout.write(to_yaml(render(args.folder)))
    except (RenderError, OSError, yaml.YAMLError) as exc:
        print(f"render: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""infra/k8s/'s manifests as the tests read them: each kustomization (the base and its
overlays) rendered by infra/k8s/render.py, and what a container of them would be given."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "infra" / "k8s"
KUSTOMIZATIONS = {
    "base": K8S / "base",
    "postgresql": K8S / "overlays" / "postgresql",
    "three-replicas": K8S / "overlays" / "three-replicas",
}
CONTROL_PLANE = "ember-control-plane"
WORKER = "ember-worker"
SETTINGS = "ember-settings"
REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")  # Kubernetes' $(VAR) in args

Resource = dict[str, Any]


def renderer() -> ModuleType:
    """infra/k8s/render.py, a script rather than a package's module."""
    spec = importlib.util.spec_from_file_location("k8s_render", K8S / "render.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def render(name: str) -> list[Resource]:
    resources: list[Resource] = renderer().render(KUSTOMIZATIONS[name])
    return resources


def find(resources: list[Resource], kind: str, name: str) -> Resource:
    [found] = [r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name]
    return found


def pod_spec(resource: Resource) -> dict[str, Any]:
    spec: dict[str, Any] = resource["spec"]["template"]["spec"]
    return spec


def only_container(resource: Resource) -> dict[str, Any]:
    [container] = pod_spec(resource)["containers"]
    return dict(container)


def settings(resources: list[Resource]) -> dict[str, str]:
    data: dict[str, str] = find(resources, "ConfigMap", SETTINGS)["data"]
    return data


def literal_env(container: dict[str, Any], resources: list[Resource]) -> dict[str, str]:
    """The variables a container's $(VAR) may name, with the values the manifests give
    (those from Secrets or the pod's fields as their name in angle brackets)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(find(resources, "ConfigMap", source["configMapRef"]["name"])["data"])
    for variable in container.get("env", []):
        env[variable["name"]] = variable.get("value", f"<{variable['name']}>")
    return env


def expanded_args(container: dict[str, Any], resources: list[Resource]) -> list[str]:
    """The container's arguments as the kubelet would expand them; KeyError for a $(VAR)
    the container is not given (the kubelet would leave it as it is written)."""
    env = literal_env(container, resources)
    return [REFERENCE.sub(lambda m: env[m.group(1)], arg) for arg in container["args"]]


def option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]

"""The environments of the processes the agent starts, built from nothing.

Two kinds, never mixed:

- `ROOT_ENV`, for every process that runs as root outside a sandbox on a tenant's behalf
  (the cgroup-joining shell, the PID namespace's init, `sandbox_exec.py`, the image
  build's namespace and chroot commands): a fixed PATH of the system's folders and a
  locale, nothing else. The tenant's variables (`LD_PRELOAD`, `PATH`, `PYTHONPATH`...)
  travel beside them as data (`env_file`) and become an environment only in the `exec`
  that follows the drop to the workspace's uid inside the sandbox.
- a replica's own (`replica_base`): a PATH and a locale of Ember's, the node variables
  the operator names (`ember worker --replica-env NAME`), then the endpoint's env= and
  secrets over them (ReplicaProvisioning.replica_env). Nothing else of the worker's or
  the control plane's environment: an operator's S3 key or database password in it
  stays there.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping

SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ROOT_ENV: dict[str, str] = {"PATH": SYSTEM_PATH, "LANG": "C.UTF-8"}
REPLICA_BASE: dict[str, str] = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
REPLICA_ENV_ENV = "EMBER_REPLICA_ENV"  # --replica-env's default: names, ':' between
ENV_FD_OPTION = "--env-fd"  # of pid_namespace_init.py and sandbox_exec.py

# The node's proxy settings: downloads on a tenant's behalf (pip, a build step's apt) go
# through them as the node's own do.
NODE_PROXIES = ("http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY")


def node_proxies() -> dict[str, str]:
    """The node's proxy settings that are set."""
    return {name: os.environ[name] for name in NODE_PROXIES if name in os.environ}


# pip's settings a node's operator may give the worker (a mirror, its CA, timeouts),
# named one by one: whatever else of the worker's environment starts with PIP_ stays.
NODE_PIP_SETTINGS = (
    "PIP_INDEX_URL",
    "PIP_EXTRA_INDEX_URL",
    "PIP_TRUSTED_HOST",
    "PIP_CERT",
    "PIP_TIMEOUT",
    "PIP_RETRIES",
    "PIP_DEFAULT_TIMEOUT",
)


def node_pip_settings() -> dict[str, str]:
    """The node's pip settings of NODE_PIP_SETTINGS that are set."""
    return {name: os.environ[name] for name in NODE_PIP_SETTINGS if name in os.environ}


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# The worker's own credentials: never handed on, whatever an operator names.
NEVER_PASSED = frozenset({"EMBER_WORKER_TOKEN", "EMBER_TOKEN"})


def system_tool(name: str) -> str:
    """The absolute path of a program of the system's (never looked up on a PATH a tenant
    set); FileNotFoundError naming it when the node lacks it."""
    import shutil  # here: the namespace init imports this module and starts in milliseconds

    found = shutil.which(name, path=SYSTEM_PATH)
    if found is None:
        raise FileNotFoundError(f"{name} is not installed on this node (looked in {SYSTEM_PATH})")
    return found


def check_passed_name(name: str) -> str:
    """`name` if the operator may hand that node variable on to replicas, else ValueError."""
    if not _NAME.match(name):
        raise ValueError(f"{name!r} is not a variable name")
    if name in NEVER_PASSED:
        raise ValueError(f"{name} is the worker's own credential: it is never handed to replicas")
    return name


def replica_base(passed: Iterable[str], node: Mapping[str, str] | None = None) -> dict[str, str]:
    """A replica's environment before its endpoint's own variables: Ember's base and the
    node variables of the names in `passed` that are set."""
    node = os.environ if node is None else node
    env = dict(REPLICA_BASE)
    env.update({name: node[name] for name in passed if name in node})
    return env


def env_file(env: Mapping[str, str]) -> int:
    """A memory file holding `env` (JSON), at its start, for a child to read after it has
    dropped its privileges (`read_env_file`): a descriptor, not a pipe, so that no size
    of secrets can block the writer. The caller closes it once the child has it."""
    fd = os.memfd_create("ember-env", os.MFD_CLOEXEC)
    data = json.dumps(dict(env)).encode()
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def read_env_file(fd: int) -> dict[str, str]:
    """The environment in the memory file `fd` (closed here); ValueError if it is not one."""
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    os.close(fd)
    env = json.loads(b"".join(chunks))
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\0" not in k + v
        for k, v in env.items()
    ):
        raise ValueError("the environment file holds no environment")
    return env

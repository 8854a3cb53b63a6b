"""What the agent learns of its node from other programs before it registers: whether
replicas can have a PID namespace of their own (an interpreter started in a new one) and
what CRIU can do here (`criu --version`, `criu check`: a fifth of a second or more).

Begun in a thread as soon as the worker starts, they wait on those programs while the
agent's modules load, instead of after; the agent takes their answers when it is made.
"""

from __future__ import annotations

import contextlib
import email.parser  # noqa: F401  (see below)
import threading
from concurrent.futures import Future

from ember_worker.processes.replica_processes import pid_namespaces_available
from ember_worker.snapshots.support import SnapshotSupport, detect_support

# The probe thread must import nothing: an import there while the main thread imports
# can deadlock the two (Python then raises in one of them). What the probes import when
# they run is imported here, in the main thread: pycriu (detect_support checks that it
# is there) and email.parser (what importlib.metadata reads a package's version with).
with contextlib.suppress(ImportError):
    import pycriu  # noqa: F401


class NodeProbes:
    """The probes, under way in a daemon thread (a worker that exits early, on a bad
    argument, does not wait for them)."""

    def __init__(self) -> None:
        self._answer: Future[tuple[str | None, SnapshotSupport]] = Future()
        threading.Thread(target=self._probe, name="ember-node-probes", daemon=True).start()

    def _probe(self) -> None:
        try:
            pid_namespace_problem = pid_namespaces_available()
            support = detect_support(pid_namespace_problem)
        except BaseException as exc:  # raised again where the answer is taken
            self._answer.set_exception(exc)
        else:
            self._answer.set_result((pid_namespace_problem, support))

    def answers(self) -> tuple[str | None, SnapshotSupport]:
        """Why replicas cannot have their own PID namespace (None if they can), and the
        node's snapshot support; waits for the probes to end."""
        return self._answer.result()


_begun: NodeProbes | None = None


def begin() -> None:
    """Start the probes, once per process, for the agent made later to take."""
    global _begun
    if _begun is None:
        _begun = NodeProbes()


def take() -> NodeProbes:
    """The probes begun earlier (started now if none were), handed over once: another
    agent made in this process probes afresh."""
    global _begun
    probes = _begun if _begun is not None else NodeProbes()
    _begun = None
    return probes

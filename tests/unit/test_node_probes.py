"""The worker's node probes, begun early in a thread, answer as the probes run inline
do, and import nothing in their thread (where imports could deadlock the main thread's)."""

from __future__ import annotations

import subprocess
import sys

from ember_worker import node_probes
from ember_worker.processes.replica_processes import pid_namespaces_available
from ember_worker.snapshots.support import detect_support


def test_the_begun_probes_answer_as_the_probes_run_here() -> None:
    node_probes.begin()
    begun = node_probes.take()
    problem = pid_namespaces_available()
    assert begun.answers() == (problem, detect_support(problem))


def test_probes_are_taken_once_and_made_afresh_after() -> None:
    node_probes.begin()
    first = node_probes.take()
    second = node_probes.take()  # none begun since: started now
    assert first is not second
    assert first.answers() == second.answers()


PROBE_THREAD_IMPORTS = """
import sys, threading
imported = []
def hook(event, args):
    if event == "import" and threading.current_thread().name == "ember-node-probes":
        imported.append(args[0])
sys.addaudithook(hook)
from ember_worker import node_probes
node_probes.begin()
node_probes.take().answers()
print(",".join(imported))
"""


def test_the_probe_thread_imports_nothing() -> None:
    # A fresh interpreter: in this one, whatever the probes import is imported already.
    result = subprocess.run(
        [sys.executable, "-c", PROBE_THREAD_IMPORTS],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert result.stdout.strip() == ""

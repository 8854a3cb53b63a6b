"""Entry point of a replica process: `python -m ember_worker.replica.boot` (started by the agent).

The order matters for snapshots: everything up to the "quiet" report (imports, the
user's `enter(snap=True)` hooks) is what a snapshot holds; the process then blocks on
its control pipe, and whatever runs after that read (cold or restored) learns its
identity from the agent.
"""

from __future__ import annotations

import ctypes
import gc
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
import traceback

from ember.calling import eventloop
from ember.cancellation import current_call_id
from ember.endpoints.loader import find_endpoints, load_module
from ember.errors import InvalidError
from ember.wire import messages as wire
from ember.wire.bundle_rules import entry_path
from ember_worker.gpu_slots import VISIBLE_DEVICES_ENV
from ember_worker.identity import WORKDIR_ENV, ReplicaIdentity, ReplicaSpec, read_line
from ember_worker.processes import tenant_files
from ember_worker.processes.exits import make_oom_preferred
from ember_worker.processes.pid_namespace_init import REPLICA_PID_ENV, become
from ember_worker.processes.sandbox_mounts import SANDBOX_HOME
from ember_worker.replica.call_tagged_output import CallOfLine, CallTaggedWriter
from ember_worker.replica.loaded_weights import (
    check_weights_versions,
    drop_weights_connections,
    follow_weights_cache_dir,
    reset_weights_totals,
    weights_read,
)
from ember_worker.replica.reseed import reseed_generators
from ember_worker.replica.serving import EXIT_STARTUP_FAILED, ReplicaRuntime

EXIT_ORPHANED = 70
EXIT_STALE_WEIGHTS = 75  # restored with weights that changed at their origin since
# The agent waits a little longer (agent/replicas/replica_images.py).
WEIGHTS_CHECK_TIMEOUT = 20.0


def _watch_lifeline() -> None:
    """The agent holds our stdin open; EOF means it is gone, and so must we be."""
    try:
        # os.read, not sys.stdin: a daemon thread blocked inside a buffered reader aborts
        # the interpreter at shutdown.
        while os.read(0, 4096):
            pass
    finally:
        os._exit(EXIT_ORPHANED)


def _log_ember_lines() -> None:
    """Ember's own log lines in a replica (weights progress, say) go to its stderr, hence
    its log; the user's logging setup is left alone."""
    logger = logging.getLogger("ember")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _if_imported(module: str, function: str) -> None:
    """Call `module.function()` if the replica's code imported that module: the SDK's
    HTTP client and volumes hold state only once in use, and importing them just to
    find none would add a tenth of a second to every cold boot."""
    loaded = sys.modules.get(module)
    if loaded is not None:
        getattr(loaded, function)()


def _report(spec: ReplicaSpec, report: wire.StatusReport) -> None:
    os.write(spec.status_fd, wire.status_line(report))


def _check_weights(spec: ReplicaSpec) -> tuple[bool, float | None]:
    """After a restore, before serving: ask the origins of the weights read before the
    snapshot for their versions, and tell the agent (which boots a replica cold instead
    when one changed). Whether they are current, and how long asking took."""
    verdict = check_weights_versions(WEIGHTS_CHECK_TIMEOUT)
    if verdict is None:
        return True, None
    seconds = verdict.seconds
    _report(spec, verdict)
    for unchecked in verdict.unchecked:
        print(
            f"ember: could not check {unchecked.url} against the snapshot "
            f"({unchecked.error}); serving the weights the snapshot holds",
            file=sys.stderr,
        )
    if verdict.changed:
        for change in verdict.changed:
            print(
                f"ember: {change.url} changed since the snapshot "
                f"(version {change.was} then, {change.now} now)",
                file=sys.stderr,
            )
        return False, seconds
    print(
        f"ember: weights unchanged since the snapshot ({verdict.checked} object(s) "
        f"checked in {seconds:.3f} s)",
        file=sys.stderr,
    )
    return True, seconds


def _give_up_root(user: str, home: str | None) -> None:
    """Serve as the workspace's user from here on: a replica whose snapshot phase ran as
    root (CRIU dumps it so) drops root, groups and capabilities before its identity's
    tokens and secrets reach its code. Threads already running lose the uid and their
    capabilities too; no_new_privs and the bounding set are this thread's and those it
    starts from now on (docs/security.md)."""
    uid, _, gid = user.partition(":")
    # Root's during the snapshot phase in a sandbox: the user's now. (A restored one's is
    # its user's already, made by the agent.) By descriptor, never following a link: its
    # own threads run on meanwhile and may swap a folder for one.
    if home == SANDBOX_HOME and os.lstat(home).st_uid == 0:
        tenant_files.chown_tree(home, int(uid), int(gid))
    become(int(uid), int(gid), ctypes.CDLL(None, use_errno=True))


def main() -> int:
    # As PID 1 of its namespace the replica would ignore SIGTERM without a handler; until
    # its event loop installs the draining one, SIGTERM simply ends a booting replica.
    signal.signal(signal.SIGTERM, lambda *_: os._exit(143))
    make_oom_preferred()  # before user code, so that what it starts inherits it too
    spec = ReplicaSpec.from_env()
    if os.getsid(0) != os.getpid():
        os.setsid()  # our own session: what CRIU dumps is this process tree alone
    threading.Thread(target=_watch_lifeline, name="ember-lifeline", daemon=True).start()
    # Each line says which call printed it (`ember logs APP --call ID`).
    call_of_line = CallOfLine(current_call_id)
    sys.stdout = CallTaggedWriter(sys.stdout, call_of_line)
    sys.stderr = CallTaggedWriter(sys.stderr, call_of_line)
    _log_ember_lines()
    os.chdir(os.environ.get(WORKDIR_ENV) or spec.bundle_dir)  # an image's workdir
    began = time.monotonic()
    try:
        # Checked when deployed; here again, so no manifest runs code from outside.
        module = load_module(entry_path(spec.bundle_dir, spec.entry))
        endpoints = find_endpoints(module)
        definition = endpoints.get(spec.attribute)
        if definition is None:
            raise InvalidError(f"{spec.entry} no longer defines endpoint {spec.attribute!r}")
        runtime = ReplicaRuntime(spec, definition)
        call_of_line.running = runtime.inputs.tasks.keys
        runtime.run_snap_hooks()
    except BaseException as exc:
        traceback.print_exc()
        print(f"ember: replica failed to start: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_STARTUP_FAILED
    boot_seconds = time.monotonic() - began
    sys.stdout.flush()
    sys.stderr.flush()
    # Calls made by the hooks leave no connection in the image.
    _if_imported("ember.calling.connections", "close_shared_clients")
    # The weights read so far go into the image's metadata: a restore checks them.
    _report(spec, wire.Quiet(boot_seconds=boot_seconds, weights=weights_read()))
    # A snapshot, if one is taken, is taken while we wait here.
    try:
        identity = ReplicaIdentity.from_dict(json.loads(read_line(spec.control_fd)))
    except EOFError:
        return EXIT_ORPHANED
    if identity.user and os.getuid() == 0:
        try:
            _give_up_root(identity.user, identity.home)
        except OSError as exc:
            print(f"ember: replica cannot give up root: {exc}", file=sys.stderr)
            return EXIT_STARTUP_FAILED
    reseeded = reseed_generators()
    if identity.replica_pid is not None:  # a restored one's environment names the image's
        os.environ[REPLICA_PID_ENV] = str(identity.replica_pid)
    os.environ.update(identity.client_environment())
    if identity.env:  # the endpoint's secrets may name another platform
        os.environ.update(identity.env)
    if identity.home:  # a restored image's names the snapshot's replica's
        os.environ.update(identity.working_area())
        tempfile.tempdir = None  # gettempdir() asks TMPDIR again
    if identity.restored:
        drop_weights_connections()
        follow_weights_cache_dir()  # the environment now names this node's cache
        reset_weights_totals()
        _if_imported("ember.state.volumes", "forget_local_copies")
        if identity.cuda_visible_devices is not None:
            # Heeded by CUDA if it starts after the restore; state captured before the
            # snapshot was moved onto these GPUs by the driver (gpu_slots.remap_pairs).
            os.environ[VISIBLE_DEVICES_ENV] = identity.cuda_visible_devices
    weights_check_seconds = None
    if identity.restored:
        print(
            f"ember: restored from a snapshot in {identity.restore_seconds:.3f} s; "
            f"reseeded {', '.join(reseeded)}",
            file=sys.stderr,
        )
        current, weights_check_seconds = _check_weights(spec)
        if not current:
            return EXIT_STALE_WEIGHTS
    report = wire.StartReport(
        kind="restore" if identity.restored else "cold",
        boot_seconds=0.0 if identity.restored else boot_seconds,
        fetch_seconds=identity.fetch_seconds,
        restore_seconds=identity.restore_seconds,
        gpu_restore_seconds=identity.gpu_restore_seconds,
        memory_pending=identity.memory_pending,
        weights_check_seconds=weights_check_seconds,
        image_root=identity.image_root,
    )
    code = eventloop.run(runtime.serve(identity, report))
    # The interpreter's finalization would collect the whole heap: about a CPU-second for a
    # replica holding a compiled torch model, on a node whose next replica may be starting.
    # Frozen objects are skipped; their memory goes back with the process all the same.
    # Exit hooks have run, and atexit handlers and buffered output still run at exit.
    gc.freeze()
    return code


if __name__ == "__main__":
    sys.exit(main())

"""For the whole suite: a test that hangs where pytest-timeout's signal cannot stop it (in
C code, or a wait that the signal, landing on another thread, does not wake) still ends
the run soon after its timeout, printing every thread's stack, instead of running until
CI's own limit with no word of where it hung. Each failure is also printed as it happens,
so that a run stopped so still shows what failed before (pytest's summary comes at the
end)."""

from __future__ import annotations

import faulthandler
import os
import shutil
import tempfile
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from postgres_cluster import PostgresCluster
    from store_backends import StoreOpener

HARD_STOP_FACTOR = 1.5  # of the test's timeout, past which the whole run is stopped
HARD_STOP_FD = pytest.StashKey[int]()
FAILURE_TAIL = 6000  # characters of a failure's report printed as it happens


def pytest_configure(config: pytest.Config) -> None:
    # Output capture is off between conftest loading and the first test: fd 2 is the
    # terminal (or CI's log) here, and stays so in this copy.
    config.stash[HARD_STOP_FD] = os.dup(2)


def pytest_unconfigure(config: pytest.Config) -> None:
    if HARD_STOP_FD in config.stash:
        os.close(config.stash[HARD_STOP_FD])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    marker = item.get_closest_marker("timeout")  # a test's own, past the ini's
    timeout = float(
        marker.args[0] if marker and marker.args else item.config.getini("timeout") or 0
    )
    if timeout <= 0:
        return (yield)
    faulthandler.dump_traceback_later(
        timeout * HARD_STOP_FACTOR, exit=True, file=item.config.stash[HARD_STOP_FD]
    )
    try:
        return (yield)
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item,
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed and HARD_STOP_FD in item.config.stash:
        heading = f"\n--- {report.when} of {report.nodeid} failed (summary at the end) ---\n"
        text = heading + report.longreprtext[-FAILURE_TAIL:] + "\n"
        os.write(item.config.stash[HARD_STOP_FD], text.encode(errors="replace"))
    return report


# Modules (or single tests) whose engines run torch on every core. On several test
# processes (infra/test.sh: pytest-xdist, --dist loadfile) they all go to one, one after
# another, so two never share the machine's cores; every other module goes whole to any
# (its module-scoped servers made once). (xdist's own loadgroup does not group here: it
# renames items' node ids, which pytest 9 no longer takes.)
TORCH_ON_EVERY_CORE = {
    "tests/unit/test_llm_engine.py",
    "tests/e2e/test_example_llm.py",
    "tests/e2e/test_example_llm_own_model.py",
    "tests/e2e/test_example_transformer.py",
    "tests/e2e/test_example_embeddings.py",
    "tests/e2e/test_vllm.py",
    "tests/e2e/test_readme_tour.py::test_llm_block_runs_as_written",
    "tests/bench/test_bench_llm.py",
    "tests/bench/test_bench_gang.py",
    "tests/bench/test_bench_coldstart.py",
    "tests/bench/test_bench_llm_models.py",
    "tests/bench/test_bench_vllm_direct.py",
}
TORCH_GROUP = "torch-on-every-core"


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """--dist loadfile, but for the torch group's modules and tests, sent as one."""
    if config.getoption("dist") != "loadfile":
        return None  # xdist's own choice
    from xdist.scheduler import LoadScopeScheduling

    class ModulesAndTorch(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module, _, rest = nodeid.partition("::")
            test = f"{module}::{rest.split('[', 1)[0]}"
            if module in TORCH_ON_EVERY_CORE or test in TORCH_ON_EVERY_CORE:
                return TORCH_GROUP
            return module

    return ModulesAndTorch(config, log)


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """An S3 API on loopback: moto in server mode, in threads of this process, one per test
    module that asks (a module may define its own, as the LLM example's does)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M converted once for the whole session by examples/llm/convert.py (5-10 s,
    540 MB of fp32 weights), for the engine's unit tests and the deployed example alike."""
    from llm_example import example_module

    out = tmp_path_factory.mktemp("smollm2")
    example_module("convert").convert(out)
    return out


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[PostgresCluster]:
    """A throwaway PostgreSQL for the session (tests/postgres_cluster.py); a machine that
    cannot start one fails the tests that need it, unless $EMBER_TEST_ALLOW_SKIP says
    `postgres`."""
    from machine_needs import need
    from postgres_cluster import ClusterError, start_cluster

    try:
        cluster = start_cluster()
    except ClusterError as error:
        need("postgres", str(error))
    yield cluster
    cluster.stop()


@pytest.fixture
def postgres_url(postgres_cluster: PostgresCluster) -> str:
    """An empty database of this test's own."""
    return postgres_cluster.new_database()


@pytest.fixture(params=["sqlite", "postgres"])
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreOpener]:
    """The state store suite runs on both backends: SQLite in a folder that does not exist
    yet, PostgreSQL in a database of the test's own."""
    from store_backends import StoreOpener

    if request.param == "sqlite":
        opener = StoreOpener("sqlite", str(tmp_path / "state" / "state.db"))
    else:
        opener = StoreOpener("postgres", request.getfixturevalue("postgres_url"))
    yield opener
    for store in opener.opened:
        store.close()


REPO = Path(__file__).resolve().parents[1]
SANDBOX_WRITABLE_ENV = "EMBER_SANDBOX_WRITABLE"  # sandboxes.py's WRITABLE_ENV


@pytest.fixture(scope="session")
def sandbox_shared() -> Iterator[Path]:
    """One folder (1777) that every worker the tests start mounts writable into its
    replicas' sandboxes, with the coverage data folder infra/test.sh made: a sandbox
    shows a replica nothing else of the node's, /tmp included. One for the whole session,
    defined here only: the variable is the process's, and two values (one per folder's
    conftest) had a test's servers show their replicas another folder than the test's
    when pytest-xdist ran one folder's tests between another's."""
    folder = Path(tempfile.mkdtemp(prefix="ember-test-shared-"))
    folder.chmod(0o1777)
    shared = [str(folder)]
    if (REPO / ".coverage-data").is_dir():  # replicas write their coverage data there
        shared.append(str(REPO / ".coverage-data"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(SANDBOX_WRITABLE_ENV, ":".join(shared))
        try:
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def replica_writable(sandbox_shared: Path) -> Iterator[Path]:
    """A folder a replica may write into, whatever its user: replicas run as their
    workspace's unprivileged uid in a sandbox, and pytest's own temporary folders are
    root's alone (0700). For files a test and a replica pass each other (a PID, a
    progress mark)."""
    folder = Path(tempfile.mkdtemp(dir=sandbox_shared))
    folder.chmod(0o1777)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)

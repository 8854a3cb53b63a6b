"""Replicas restored from CRIU snapshots (real CRIU; infra/install.sh installs it)."""

from __future__ import annotations

import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from harness import Platform, join_worker, replicas_ready, running_platform, wait_for
from machine_needs import need

import ember
from ember_worker.processes.sandbox_mounts import SANDBOX_HOME
from ember_worker.snapshots.huge_pages import huge_pages_problem

APP = "snappy"
LABEL = f"{APP}--stateful"


@pytest.fixture(scope="module")
def snap_platform(tmp_path_factory: pytest.TempPathFactory) -> Platform:
    root = tmp_path_factory.mktemp("snapshots")
    with running_platform(root) as platform:
        problem = platform.status()["workers"][0]["snapshots"].get("problem")
        if problem:
            need("criu", f"snapshots are off on this machine: {problem}")
        yield platform


@pytest.fixture(scope="module")
def app_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("snappy-app")
    shutil.copy(Path(__file__).parent / "apps" / "snappy.py", folder / "app.py")
    return folder / "app.py"


def _logs(platform: Platform, endpoint: str) -> str:
    return platform.ember("logs", f"{APP}/{endpoint}", "-n", "500").stdout


def _snapshots(platform: Platform) -> list[dict]:
    return platform.endpoint_status(LABEL)["snapshots"]


def _image_dir(worker_dir: Path, snapshot: dict) -> Path:
    """A node's copy of an image: one folder per dump of a key."""
    return worker_dir / "snapshots" / f"{snapshot['key']}-{snapshot['image_id']}"


def test_restored_replicas_serve_beside_the_original(snap_platform: Platform, app_file: Path):
    platform = snap_platform
    platform.deploy(app_file, APP)
    stateful = ember.Endpoint.lookup(APP, "stateful", config=platform.config())
    first = stateful.info.call()
    assert first["loaded_pid"] == first["pid"]  # the first replica booted cold
    wait_for(lambda: _snapshots(platform), 60)
    # Two more replicas, restored from the snapshot, ready beside the first before three
    # slow calls at concurrency 1 take one each (calls that raced the restores would find
    # the first replica free again when a restore took longer than a call).
    with replicas_ready(platform, stateful, 3), ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(lambda _: stateful.info.call(seconds=2.0), range(3)))
    pids = {r["pid"] for r in results}
    assert len(pids) == 3
    restored = [r for r in results if r["pid"] != first["pid"]]
    assert len(restored) == 2
    for result in restored:
        # State built before the snapshot came back; the process is a new one.
        assert result["loaded_pid"] == first["pid"]
        assert result["loaded_at"] == first["loaded_at"]
        assert result["table"] == first["table"]
        assert result["ready_pid"] == result["pid"]
    # Restored processes were reseeded: no two replicas repeat the same numbers.
    assert len({r["random"] for r in results}) == 3
    logs = _logs(platform, "stateful")
    assert logs.count("restored from a snapshot") >= 2
    assert "reseeded random" in logs
    last_start = platform.endpoint_status(LABEL)["last_start"]
    assert last_start["kind"] == "restore" and "lazy" not in last_start
    assert logs.count("snapshot") >= 1 and logs.count(" taken in ") == 1  # one snapshot
    with platform.client() as client:
        metrics = client.get("/metrics").text
    labels = f'app="{APP}",endpoint="stateful"'
    assert f'ember:replica_starts_total{{{labels},kind="restore"}} 2.0' in metrics
    for event in ("dumped", "published"):
        assert f'ember:snapshot_events_total{{{labels},event="{event}"}} 1.0' in metrics
    assert "lazy restore" not in logs  # eager by default: all memory back before it runs


def test_changed_bundle_gets_a_new_snapshot(snap_platform: Platform, app_file: Path):
    platform = snap_platform
    before = {s["key"] for s in _snapshots(platform)}
    assert before
    app_file.write_text(app_file.read_text() + "\n# a change to the code\n")
    platform.deploy(app_file, APP)
    stateful = ember.Endpoint.lookup(APP, "stateful", config=platform.config())
    result = stateful.info.call()
    assert result["loaded_pid"] == result["pid"]  # new code: a cold boot, not a restore
    after = wait_for(lambda: {s["key"] for s in _snapshots(platform)} - before, 60)
    assert len(after) == 1
    # The old version's image was collected.
    assert not ({s["key"] for s in _snapshots(platform)} & before)


def _scale_to_zero(platform: Platform) -> None:
    platform.ember("stop", APP, check=False)  # not deployed yet when a test runs alone
    wait_for(lambda: LABEL not in {e["label"] for e in platform.status()["endpoints"]}, 30)


def _check_retaken(platform: Platform, bad: dict) -> None:
    """The image that failed to restore is gone, and a new image of its key was taken by
    the replica that booted cold instead (not by a later start)."""
    fresh = wait_for(
        lambda: [s for s in _snapshots(platform) if s["image_id"] != bad["image_id"]], 60
    )
    assert [s["key"] for s in fresh] == [bad["key"]]
    assert bad["image_id"] not in {s["image_id"] for s in _snapshots(platform)}
    assert _logs(platform, "stateful").count(" taken in ") >= 2  # the first take, and this


def test_corrupted_image_falls_back_to_a_cold_boot(snap_platform: Platform, app_file: Path):
    platform = snap_platform
    platform.deploy(app_file, APP)
    stateful = ember.Endpoint.lookup(APP, "stateful", config=platform.config())
    stateful.info.call()
    (snapshot,) = wait_for(lambda: _snapshots(platform), 60)
    images = _image_dir(platform.state_dir / "worker", snapshot) / "images"
    wait_for(images.exists, 30)
    for core in images.glob("core-*.img"):
        core.write_bytes(b"\xff" * 64)  # not the protobuf CRIU wrote
    # A second replica tries to restore from the damaged image, and is ready (booted
    # cold) before the calls, which then take one replica each.
    with replicas_ready(platform, stateful, 2), ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda _: stateful.info.call(seconds=1.5), range(2)))
    assert all(r["table"] == results[0]["table"] for r in results)
    logs = _logs(platform, "stateful")
    assert "failed, booting cold" in logs
    # The bad image was dropped; the replica that booted cold took a fresh one.
    _check_retaken(platform, snapshot)


def test_truncated_image_falls_back_to_a_cold_boot(snap_platform: Platform, app_file: Path):
    platform = snap_platform
    _scale_to_zero(platform)
    platform.deploy(app_file, APP)
    stateful = ember.Endpoint.lookup(APP, "stateful", config=platform.config())
    stateful.info.call()
    (snapshot,) = wait_for(lambda: _snapshots(platform), 60)
    images = _image_dir(platform.state_dir / "worker", snapshot) / "images"
    for pages in images.glob("pages-*.img"):
        with pages.open("r+b") as handle:  # as a full disk or a cut copy would leave it
            handle.truncate(pages.stat().st_size // 2)
    # A second replica tries the image, boots cold instead, and is ready before the calls.
    with replicas_ready(platform, stateful, 2), ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda _: stateful.info.call(seconds=1.5), range(2)))
    assert len({r["pid"] for r in results}) == 2
    assert "the image is truncated" in _logs(platform, "stateful")
    _check_retaken(platform, snapshot)


def test_missing_image_falls_back_to_a_cold_boot(snap_platform: Platform, app_file: Path):
    platform = snap_platform
    _scale_to_zero(platform)
    platform.deploy(app_file, APP)  # a fresh first replica takes a fresh snapshot
    stateful = ember.Endpoint.lookup(APP, "stateful", config=platform.config())
    stateful.info.call()
    (snapshot,) = wait_for(lambda: _snapshots(platform), 60)
    key = snapshot["key"]
    shutil.rmtree(_image_dir(platform.state_dir / "worker", snapshot), ignore_errors=True)
    for blob in (platform.state_dir / "blobs" / "snapshots").glob(key):
        blob.unlink()
    # A second replica finds no image, boots cold, and is ready before the calls.
    with replicas_ready(platform, stateful, 2), ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda _: stateful.info.call(seconds=1.5), range(2)))
    assert len({r["pid"] for r in results}) == 2
    assert "is not available" in _logs(platform, "stateful")


def test_ember_snapshot_ls_and_rm_drop_an_image_and_the_next_replica_takes_a_new_one(
    snap_platform: Platform, app_file: Path
) -> None:
    platform = snap_platform
    _scale_to_zero(platform)
    platform.deploy(app_file, APP)
    stateful = ember.Endpoint.lookup(APP, "stateful", config=platform.config())
    first = stateful.info.call()
    (old,) = wait_for(lambda: _snapshots(platform), 60)
    # A second replica, restored, is ready before the calls, which take one replica each.
    with replicas_ready(platform, stateful, 2), ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda _: stateful.info.call(seconds=1.5), range(2)))
    assert any(r["pid"] != first["pid"] for r in results)  # one was restored
    short = old["key"][:12]

    def listed() -> str:
        return platform.ember("snapshot", "ls", LABEL).stdout

    # Its row: ready, one restore, and the node that holds it (from its heartbeats).
    row = wait_for(
        lambda: next((x for x in listed().splitlines() if short in x and "local" in x), None),
        30,
    )
    assert LABEL in row and " ready " in row and " 1 " in row, row
    assert re.search(r"just now in \d+\.\d\d s", row), row  # its last restore, and how long
    assert f"{APP}--plain: snapshot=False" in platform.ember("snapshot", "ls", APP).stdout
    assert re.search(r"snapshot \d+ MB, 1 restore\b", platform.ember("ls", APP).stdout)
    listing = platform.ember("snapshot", "ls", "--json").stdout
    assert '"restores": 1' in listing and old["image_id"] in listing

    dropped = platform.ember("snapshot", "rm", LABEL).stdout
    assert f"dropped 1 snapshot of {LABEL}: {short}" in dropped
    assert _snapshots(platform) == []
    assert "none yet: the next replica to start takes one" in listed()
    # The node let its copy go, and the endpoint's log says who dropped it.
    wait_for(lambda: not _image_dir(platform.state_dir / "worker", old).exists(), 30)
    assert "snapshots dropped by an operator" in _logs(platform, "stateful")
    # With --restart the replicas running from it go too (after their inputs): the next
    # boots cold, and its state is new.
    again = platform.ember("snapshot", "rm", LABEL, "--restart").stdout
    assert "nothing to drop" in again and re.search(r"stopping [1-9] replicas? once", again)
    wait_for(lambda: not sum(platform.endpoint_status(LABEL)["replicas"].values()), 30)
    fresh = stateful.info.call()
    assert fresh["loaded_pid"] == fresh["pid"] and fresh["loaded_at"] > first["loaded_at"]
    (new,) = wait_for(lambda: _snapshots(platform), 60)
    assert new["key"] == old["key"] and new["image_id"] != old["image_id"]  # same code
    with replicas_ready(platform, stateful, 2), ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda _: stateful.info.call(seconds=1.5), range(2)))
    restored = [r for r in results if r["pid"] != fresh["pid"]]
    assert restored and restored[0]["loaded_at"] == fresh["loaded_at"]  # the new image's

    # By key prefix too; and what cannot be dropped says why.
    by_key = platform.ember("snapshot", "rm", new["key"][:8]).stdout
    assert f"dropped 1 snapshot of {new['key'][:8]}" in by_key
    unknown = platform.ember("snapshot", "rm", f"{APP}--nosuch", check=False)
    assert unknown.returncode != 0
    assert f"no endpoint {APP}--nosuch is deployed and no snapshot of it" in unknown.stderr
    with platform.client() as client:
        assert client.delete(f"/v1/snapshots/{new['key']}").status_code == 404
        assert client.delete("/v1/snapshots").status_code == 400
        invoke = platform.ember("token", "create", "--scope", "invoke").stdout.strip()
        denied = client.get("/v1/snapshots", headers={"Authorization": f"Bearer {invoke}"})
        assert denied.status_code == 403


def _on_node(platform: Platform, path: Path) -> Path:
    """Where the node keeps a file a replica names: the same path, or, for one in its
    sandbox's working area (/home/replica inside), in that replica's folder on the node
    (the newest one holding it)."""
    if not path.is_relative_to(SANDBOX_HOME):
        return path
    areas = (platform.state_dir / "worker" / "replicas").glob("*")
    found = [a / path.relative_to(SANDBOX_HOME) for a in areas]
    return max((f for f in found if f.exists()), key=lambda f: f.stat().st_mtime)


def test_a_file_the_replica_maps_comes_with_the_snapshot(
    snap_platform: Platform, app_file: Path
) -> None:
    """A restore on a node that lacks a file the image maps (compiled kernels in a cache
    under /tmp): the file travels in the snapshot and is put back before the restore."""
    platform = snap_platform
    platform.deploy(app_file, APP)
    mapper = ember.Endpoint.lookup(APP, "mapper", config=platform.config())
    first = mapper.info.call()
    assert first["head"] == "kernel!" and first["loaded_pid"] == first["pid"]
    wait_for(lambda: platform.endpoint_status(f"{APP}--mapper")["snapshots"], 60)
    mapped = _on_node(platform, Path(first["path"]))
    shutil.rmtree(mapped.parent)  # as on another node
    # A second replica, restored, is ready before the calls: one of them is its.
    with replicas_ready(platform, mapper, 2), ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda _: mapper.info.call(seconds=1.5), range(2)))
    restored = [r for r in results if r["pid"] != first["pid"]]
    assert restored, "no second replica started"
    assert restored[0]["loaded_pid"] == first["pid"], _logs(platform, "mapper")  # a restore
    assert restored[0]["head"] == "kernel!"
    mapped = _on_node(platform, Path(restored[0]["path"]))  # the restored replica's copy
    assert mapped.read_bytes() == b"kernel!" * 1000
    shutil.rmtree(mapped.parent)


def test_snapshot_false_never_snapshots(snap_platform: Platform, app_file: Path):
    platform = snap_platform
    platform.deploy(app_file, APP)
    plain = ember.Endpoint.lookup(APP, "plain", config=platform.config())
    plain.call()
    assert platform.endpoint_status(f"{APP}--plain")["snapshots"] == []
    logs = _logs(platform, "plain")
    assert "snapshot" not in logs.replace("snapshot=False", "")
    assert "snapshot=False" in platform.ember("ls").stdout


def _cgroup_dir(pid: int, controller: str) -> Path:
    """The node's directory of `pid`'s cgroup v1 group of `controller`, or v2 cgroup."""
    mounts = [line.split() for line in Path("/proc/self/mounts").read_text().splitlines()]
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            point = next(m[1] for m in mounts if m[2] == "cgroup" and controller in m[3].split(","))
            return Path(point) / path.lstrip("/")
    v2 = next(line for line in lines if line[:3] == "0::")
    return Path("/sys/fs/cgroup") / v2[3:].lstrip("/")


def _cpu_quota(group: Path) -> float | None:
    """The CPUs' worth of time per period the group may use; None if unlimited."""
    if (group / "cpu.max").exists():
        quota, period = (group / "cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    v1_quota = int((group / "cpu.cfs_quota_us").read_text())
    return None if v1_quota < 0 else v1_quota / int((group / "cpu.cfs_period_us").read_text())


def _with_cgroups(seen: dict) -> dict:
    """A Capped answer with its replica's cgroups as the node sees them."""
    group, cpu_group = _cgroup_dir(seen["pid"], "memory"), _cgroup_dir(seen["pid"], "cpu")
    limit = next(f for f in (group / "memory.limit_in_bytes", group / "memory.max") if f.exists())
    usage = next(
        f for f in (group / "memory.usage_in_bytes", group / "memory.current") if f.exists()
    )
    return {
        **seen,
        "cgroup": str(group),
        "limit": int(limit.read_text()),
        "usage": int(usage.read_text()),
        "cpu_cgroup": str(cpu_group),
        "cpu_quota": _cpu_quota(cpu_group),
    }


def test_memory_and_cpu_limits_hold_each_replica_restored_or_cold_in_its_own_cgroups(
    snap_platform: Platform, app_file: Path
):
    platform = snap_platform
    worker = platform.status()["workers"][0]
    problem = worker.get("memory_limits_problem") or worker.get("cpu_limits_problem")
    if problem:
        need("cgroups", f"memory or CPU limits are off on this machine: {problem}")
    platform.deploy(app_file, APP)
    label = f"{APP}--capped"
    capped = ember.Endpoint.lookup(APP, "capped", config=platform.config())
    cold = _with_cgroups(capped.info.call(burn=1.0))
    limit = 256 << 20
    assert cold["limit"] == limit
    # Half a CPU: a thread that spins for a second gets about half of it, and waits.
    assert cold["cpu_quota"] == 0.5
    assert cold["cpu_share"] < 0.8
    # The quota throttled it: on a machine busy with other tests, a second's spin may
    # never get half a CPU in one period, so it spins again (at most 5 s) until it has.
    cpu_stat = Path(cold["cpu_cgroup"]) / "cpu.stat"
    for _ in range(5):
        if int(cpu_stat.read_text().split("nr_throttled ")[1].split()[0]) > 0:
            break
        capped.info.call(burn=1.0)
    assert int(cpu_stat.read_text().split("nr_throttled ")[1].split()[0]) > 0
    wait_for(lambda: platform.endpoint_status(label)["snapshots"], 60)
    # A second replica, restored from the snapshot, is ready before two calls at once
    # at concurrency 1 take one replica each.
    with replicas_ready(platform, capped, 2), ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda _: capped.info.call(seconds=2.0), range(2)))
    restored = _with_cgroups(next(r for r in results if r["pid"] != cold["pid"]))
    assert restored["cgroup"] != cold["cgroup"]  # not the first replica's, nor the agent's
    assert restored["limit"] == limit
    assert restored["usage"] > 48 << 20  # the restored memory is charged to its own group
    assert restored["cpu_quota"] == 0.5 and restored["cpu_cgroup"] != cold["cpu_cgroup"]
    listing = platform.ember("ls").stdout
    assert "memory_limit=256" in listing and "cpu_limit=0.5" in listing
    # The wait is exported per replica, from the workers' heartbeats.
    pattern = re.compile(
        rf'ember:replica_cpu_throttled_seconds{{app="{APP}",endpoint="capped",'
        r'replica="r-[^"]+"} ([0-9.e+-]+)'
    )

    def throttled_seconds() -> float:
        with platform.client() as client:
            return max(map(float, pattern.findall(client.get("/metrics").text)), default=0.0)

    # Above zero, not a figure: beside other busy processes a spinning replica may get
    # less than its half CPU, and so wait little.
    wait_for(lambda: throttled_seconds() > 0, 30)
    # Over the limit: that replica, and only that one, is ended, and the caller told why.
    with platform.client(timeout=120) as client:
        response = client.post(f"/{label}/info", json={"fill_mb": 300})
    assert response.status_code == 502
    error = response.json()["error"]
    assert "OOM killer" in error["message"]
    assert "went over its endpoint's memory_limit=256 (MiB)" in error["message"]
    survivor = _with_cgroups(capped.info.call())
    assert survivor["limit"] == limit and survivor["state"] == 48 << 20
    # Replicas that are gone leave no cgroup behind.
    _scale_to_zero(platform)
    gone = [Path(r[key]) for r in (cold, restored) for key in ("cgroup", "cpu_cgroup")]
    wait_for(lambda: not any(path.exists() for path in gone), 30)
    # The log says how much the limit held the replica back.
    assert "cpu_limit=0.5 held it back in" in _logs(platform, "capped")


def test_a_published_snapshot_is_fetched_ahead_by_the_other_workers_and_those_that_join(
    tmp_path: Path, app_file: Path
) -> None:
    with running_platform(tmp_path / "cp") as platform:
        if platform.status()["workers"][0]["snapshots"].get("problem"):
            need("criu", "snapshots are off on this machine")
        token = platform.ember("token", "create", "--scope", "worker").stdout.strip()
        node_b = tmp_path / "node-b"
        worker = join_worker(platform, token, node_b)
        try:
            wait_for(lambda: len(platform.status()["workers"]) == 2, 30)
            platform.deploy(app_file, APP)
            stateful = ember.Endpoint.lookup(APP, "stateful", config=platform.config())
            stateful.info.call()
            wait_for(lambda: _snapshots(platform), 60)
            snapshot = _snapshots(platform)[0]
            # The worker that did not take it says it fetched it, and has it in its cache.
            line = wait_for(
                lambda: next(
                    (x for x in _logs(platform, "stateful").splitlines() if "fetched ahead" in x),
                    None,
                ),
                60,
            )
            other = line.split("onto worker ")[1].split()[0]
            caches = {"node-b": node_b, "local": platform.state_dir / "worker"}
            assert (_image_dir(caches[other], snapshot) / "images" / "meta.json").exists(), line
            # Its replicas restore from it there: drain the node that took it.
            taker = next(name for name in caches if name != other)
            platform.ember("node", "drain", taker, "--wait", "--timeout", "60")
            again = stateful.info.call()
            assert again["loaded_pid"] != again["pid"]  # restored, not booted
            assert platform.endpoint_status(LABEL)["last_start"]["kind"] == "restore"
            # A node that joins later fetches the deployed endpoints' images as it joins;
            # one started with --no-fetch-ahead (joined first) does not.
            node_c, node_d = tmp_path / "node-c", tmp_path / "node-d"
            frugal = join_worker(platform, token, node_d, "--no-fetch-ahead")
            wait_for(lambda: len(platform.status()["workers"]) == 3, 30)
            late = join_worker(platform, token, node_c)
            try:
                image = _image_dir(node_c, snapshot) / "images" / "meta.json"
                wait_for(image.exists, 60)
                assert "fetched ahead onto worker node-c" in _logs(platform, "stateful")
                assert not (_image_dir(node_d, snapshot) / "images").exists()
                assert "onto worker node-d" not in _logs(platform, "stateful")
            finally:
                for process in (late, frugal):
                    process.terminate()
                    process.wait(timeout=30)
        finally:
            worker.terminate()
            worker.wait(timeout=30)


def test_lazy_restore_runs_the_replica_then_brings_all_memory_in(tmp_path: Path, app_file: Path):
    with running_platform(tmp_path, extra=("--lazy-restore",)) as platform:
        support = platform.status()["workers"][0]["snapshots"]
        if support.get("problem") or not support.get("lazy_pages"):
            need("lazy-restores", f"lazy restores are not possible here: {support}")
        assert support["lazy_restore"] is True
        platform.deploy(app_file, APP)
        stateful = ember.Endpoint.lookup(APP, "stateful", config=platform.config())
        first = stateful.info.call()
        wait_for(lambda: _snapshots(platform), 60)
        # The first replica busy for longer than a restore takes even on a loaded machine:
        # the call beside it is the restored replica's, served as its memory comes in.
        busy = stateful.info.spawn(seconds=10.0)
        wait_for(lambda: platform.endpoint_status(LABEL)["running"] == 1, 30)
        results = [stateful.info.call(), busy.get(timeout=60)]
        restored = [r for r in results if r["pid"] != first["pid"]]
        assert restored and restored[0]["table"] == first["table"]
        wait_for(lambda: "lazy restore: all memory in" in _logs(platform, "stateful"), 30)
        logs = _logs(platform, "stateful")
        assert "restored from a snapshot" in logs
        start = wait_for(
            lambda: platform.endpoint_status(LABEL)["last_start"].get("memory_in_seconds"), 30
        )
        assert start > 0
        # The restored replica told the control plane its memory was still arriving, so
        # its answers counted only once all of it was in.
        assert platform.endpoint_status(LABEL)["last_start"]["lazy"] is True
        assert "last start: restore (lazy)" in platform.ember("ls").stdout


def test_huge_pages_restore_dense_memory_into_2_mib_pages(tmp_path: Path, app_file: Path):
    problem = huge_pages_problem()
    if problem:
        need("huge-pages", problem)
    with running_platform(tmp_path, extra=("--huge-pages",)) as platform:
        support = platform.status()["workers"][0]["snapshots"]
        if support.get("problem"):
            need("criu", f"snapshots are off on this machine: {support['problem']}")
        assert support["huge_pages"] is True
        platform.deploy(app_file, APP)
        weighty = ember.Endpoint.lookup(APP, "weighty", config=platform.config())
        first = weighty.memory.call()
        assert first["loaded_pid"] == first["pid"]  # booted cold
        wait_for(lambda: platform.endpoint_status(f"{APP}--weighty")["snapshots"], 60)
        # The first replica busy for longer than a restore takes: the next call is the
        # restored replica's.
        busy = weighty.memory.spawn(seconds=5.0)
        wait_for(lambda: platform.endpoint_status(f"{APP}--weighty")["running"] == 1, 30)
        restored = weighty.memory.call()
        assert busy.get(timeout=60)["pid"] == first["pid"]
        assert restored["pid"] != first["pid"] and restored["loaded_pid"] == first["pid"]
        assert restored["digest"] == first["digest"]  # every byte came back
        # Most of the 64 MiB is in 2 MiB pages (the kernel may find fewer free ones).
        assert restored["huge_kb"] >= 16 * 1024, restored
        logs = platform.ember("logs", f"{APP}/weighty", "-n", "500").stdout
        assert "restores into huge pages on this node" in logs
        # The image as dumped, what was published, is left as it was: the node restores
        # from a view of it beside it.
        (snapshot,) = platform.endpoint_status(f"{APP}--weighty")["snapshots"]
        folder = _image_dir(platform.state_dir / "worker", snapshot)
        assert (folder / "images-huge").is_dir() and (folder / "images").is_dir()
        assert sorted(p.name for p in (folder / "images").glob("mm-*.img")) == sorted(
            p.name for p in (folder / "images-huge").glob("mm-*.img")
        )


# A CRIU whose lazy-pages daemon dies once the restore is over (CRIU's swrk process gone)
# and the replica runs, while the daemon still has most of half a GiB to bring in. The
# rest goes to the real CRIU. `sw[r]k` keeps grep from finding its own command line.
DYING_LAZY_PAGES = """#!/bin/sh
if [ "$1" != lazy-pages ]; then exec {criu} "$@"; fi
{criu} "$@" &
daemon=$!
until ls -l /proc/$daemon/fd 2>/dev/null | grep -q userfaultfd; do
    if ! kill -0 $daemon 2>/dev/null; then wait $daemon; exit $?; fi
done
# Until the worker's (our parent's) CRIU restore is done: not any swrk of the machine's.
restoring() {{
    for dir in /proc/[0-9]*; do
        grep -qs 'sw[r]k' "$dir/cmdline" || continue
        [ "$(cut -d' ' -f4 "$dir/stat" 2>/dev/null)" = "$PPID" ] && return 0
    done
    return 1
}}
while restoring; do sleep 0.002; done
kill -KILL $daemon
exit 1
"""


def test_a_failed_lazy_restore_drops_its_image_and_the_input_is_served(
    tmp_path: Path, app_file: Path
):
    criu = shutil.which("criu", path="/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin")
    if criu is None:
        need("criu", "no CRIU on this machine")
    wrapper = tmp_path / "criu"
    wrapper.write_text(DYING_LAZY_PAGES.format(criu=criu))
    wrapper.chmod(0o755)
    env = {"EMBER_CRIU_BINARY": str(wrapper)}
    with running_platform(tmp_path, extra=("--lazy-restore",), env=env) as platform:
        support = platform.status()["workers"][0]["snapshots"]
        if support.get("problem") or not support.get("lazy_pages"):
            need("lazy-restores", f"lazy restores are not possible here: {support}")
        platform.deploy(app_file, APP)
        ballast = ember.Endpoint.lookup(APP, "ballast", config=platform.config())
        assert ballast.info.call()["ballast"] == 512 << 20
        label = f"{APP}--ballast"
        wait_for(lambda: platform.endpoint_status(label)["snapshots"], 60)
        failure = "lazy restore failed, the replica was stopped and snapshot"

        def logs() -> str:
            return platform.ember("logs", f"{APP}/ballast", "-n", "500").stdout

        def two_at_once(seconds: float) -> list[dict]:
            with ThreadPoolExecutor(max_workers=2) as pool:
                return list(pool.map(lambda _: ballast.info.call(seconds=seconds), range(2)))

        # A second replica is needed while the first is busy: restored, it loses its page
        # daemon and is killed, and its image goes. Both inputs are served.
        results = two_at_once(1.0)
        wait_for(lambda: failure in logs(), 30)
        # Again a second replica is needed, while one is busy for longer than a boot takes
        # even on a loaded machine: it boots cold rather than restore from the dropped
        # image, and serves.
        busy = ballast.info.spawn(seconds=10.0)
        wait_for(lambda: platform.endpoint_status(label)["running"] == 1, 30)
        beside = ballast.info.call()
        held = busy.get(timeout=60)
        assert [r["ballast"] for r in [*results, beside, held]] == [512 << 20] * 4
        assert beside["pid"] != held["pid"], "a second replica served"
        assert logs().count(failure) == 1


# CRIU as the worker runs it, except that a `criu swrk` (the service every dump and
# restore talks to) started while the file {hang} exists takes it away and never answers.
HANGING_SWRK = """#!/bin/sh
if [ "$1" = swrk ] && rm {hang} 2>/dev/null; then exec sleep 600; fi
exec {criu} "$@"
"""


def test_a_hung_dump_or_restore_times_out_and_the_inputs_are_served(tmp_path: Path, app_file: Path):
    criu = shutil.which("criu", path="/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin")
    if criu is None:
        need("criu", "no CRIU on this machine")
    hang = tmp_path / "hang-next"
    wrapper = tmp_path / "criu"
    wrapper.write_text(HANGING_SWRK.format(criu=criu, hang=hang))
    wrapper.chmod(0o755)
    env = {
        "EMBER_CRIU_BINARY": str(wrapper),
        "EMBER_CRIU_DUMP_TIMEOUT": "3",
        "EMBER_CRIU_RESTORE_TIMEOUT": "3",
    }
    with running_platform(tmp_path / "platform", env=env) as platform:
        problem = platform.status()["workers"][0]["snapshots"].get("problem")
        if problem:
            need("criu", f"snapshots are off on this machine: {problem}")
        platform.deploy(app_file, APP)

        # The first replica's dump hangs: it is given up after 3 s, and the replica
        # serves the input that was waiting, without a snapshot.
        hang.touch()
        stateful = ember.Endpoint.lookup(APP, "stateful", config=platform.config())
        first = stateful.info.call()
        assert first["loaded_pid"] == first["pid"] and not hang.exists()
        logs = _logs(platform, "stateful")
        assert (
            "snapshot failed; this replica runs on without one: CRIU dump timed out after 3 s"
            in logs
        )
        assert _snapshots(platform) == []
        assert stateful.info.call()["pid"] == first["pid"]  # and it lives on
        # `ember snapshot ls` says why it has none, and `rm` lets the next start try again.
        listing = platform.ember("snapshot", "ls", LABEL).stdout
        assert "failed just now, next try in" in listing, listing
        assert "CRIU dump timed out after 3 s" in listing
        forgot = platform.ember("snapshot", "rm", LABEL).stdout
        assert "forgot 1 failed snapshot" in forgot
        assert "none yet" in platform.ember("snapshot", "ls", LABEL).stdout

        # A restore that hangs: given up after 3 s, the image dropped, the replica boots
        # cold instead, and both inputs are served.
        mapper = ember.Endpoint.lookup(APP, "mapper", config=platform.config())
        original = mapper.info.call()
        label = f"{APP}--mapper"
        (hung,) = wait_for(lambda: platform.endpoint_status(label)["snapshots"], 60)
        hang.touch()
        # Each input holds its replica longer than the hang and a cold boot take.
        with ThreadPoolExecutor(max_workers=2) as pool:
            results = list(pool.map(lambda _: mapper.info.call(seconds=8.0), range(2)))
        assert not hang.exists()
        second = next(r for r in results if r["pid"] != original["pid"])
        assert second["loaded_pid"] == second["pid"]  # booted cold
        logs = _logs(platform, "mapper")
        assert "failed, booting cold: CRIU restore timed out after 3 s" in logs
        # That image is gone (the replica booted cold takes a new one).
        images = {s["image_id"] for s in platform.endpoint_status(label)["snapshots"]}
        assert hung["image_id"] not in images

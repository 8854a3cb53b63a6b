"""Issue 34's attacks, tried by a hostile endpoint of one workspace against a platform
and the app of another workspace: every one fails, and the attacked app still serves
its own code and its own secret.

One platform, one deployment per workspace: `bank` in main (a secret, a Dict item, a
Volume file), `thief` in workspace `evil`, whose one call tries everything and reports
what each attempt got. On a machine where the sandbox cannot be built (not root, no
libseccomp, no iptables) the test fails naming what is missing, unless
EMBER_TEST_ALLOW_SKIP names `sandbox`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from harness import Platform, running_platform, wait_for
from machine_needs import need

from ember.calling.tlsclient import client_context
from ember_worker.processes import seccomp_filter
from ember_worker.processes.egress_rules import chain_name
from ember_worker.processes.replica_processes import CAP_SYS_RESOURCE, holds_capability

BANK = """\
import os

import ember


@ember.endpoint(secrets=["vault"], scaledown_window=300)
def balance() -> dict:
    ember.Dict("ledger")["owner"] = "bank"
    ember.Volume("vault-files").write_file("key.txt", b"bank's")
    pid = int(os.environ["EMBER_REPLICA_PID"])  # the node's number for it
    return {"secret": os.environ["VAULT_KEY"], "code": "bank v1", "pid": pid, "uid": os.getuid()}


@ember.endpoint(scaledown_window=300)
def weights(url: str) -> list:
    return ember.weights.open(url)["w"].tolist()
"""

THIEF = """\
import ctypes
import errno
import os
import socket
import time

import httpx

import ember

libc = ctypes.CDLL(None, use_errno=True)


def outcome(action) -> str:
    try:
        action()
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno)) if exc.errno else str(exc)
    return "done"


def read(path: str) -> None:
    with open(path, "rb") as f:
        f.read(64)


def write(path: str) -> None:
    with open(path, "ab") as f:
        f.write(b"import os  # planted")


def call(name: str, *args) -> None:
    if getattr(libc, name)(*args) != 0:
        raise OSError(ctypes.get_errno(), name)


def ptrace_a_child() -> None:
    child = os.fork()
    if child == 0:
        time.sleep(30)
        os._exit(0)
    try:
        if libc.ptrace(16, child, 0, 0) != 0:  # PTRACE_ATTACH
            raise OSError(ctypes.get_errno(), "ptrace")
    finally:
        os.kill(child, 9)
        os.waitpid(child, 0)


def fill_tmp() -> int:
    written, chunk = 0, b"x" * (1 << 20)
    try:
        with open("/tmp/fill", "wb") as f:
            while written < 1 << 31:
                f.write(chunk)
                f.flush()
                written += len(chunk)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    finally:
        os.remove("/tmp/fill")
    return written


def fork_bomb() -> str:
    children, failure = [], "none"
    while len(children) < 100_000:
        try:
            pid = os.fork()
        except OSError as exc:
            failure = errno.errorcode.get(exc.errno, str(exc.errno))
            break
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        children.append(pid)
    for pid in children:
        os.kill(pid, 9)
    for pid in children:
        os.waitpid(pid, 0)
    return failure


def plant(source: str, target: str) -> None:
    # A copy of a cache's objects folder (data files, chunk markers, URLs) at target.
    import shutil

    shutil.copytree(source, target, dirs_exist_ok=True)


@ember.endpoint(scaledown_window=300)
def poison(url: str, bank_uid: int) -> dict:
    # Read the weights through its own cache, then overwrite every cached byte with junk:
    # the markers say the chunks are present, so a reader of this cache gets the junk.
    true = ember.weights.open(url)["w"].tolist()
    cache = os.environ["EMBER_WEIGHTS_CACHE"]
    objects = os.path.join(cache, "objects")
    for name in os.listdir(objects):
        if name.endswith(".data"):
            path = os.path.join(objects, name)
            with open(path, "r+b") as data:
                data.write(bytes([255]) * os.path.getsize(path))
    # Then the same poisoned objects wherever another workspace's cache could be.
    top = os.path.dirname(cache)
    tried = {
        "shared": os.path.join(top, "objects"),
        "bank's": os.path.join(top, f"uid-{bank_uid}", "objects"),
        "node's": os.path.join(os.path.dirname(top), "objects"),
    }
    return {
        "cache": cache,
        "true": true,
        "planted": {k: outcome(lambda t=t: plant(objects, t)) for k, t in tried.items()},
    }


def sys_view() -> dict:
    # What its /sys shows: the CPUs, its own cgroups (v2: one group; v1: per controller).
    groups = []
    for folder, dirs, files in os.walk("/sys/fs/cgroup"):
        groups += [os.path.join(folder, name) for name in dirs + files]
    limits = [g for g in groups if g.endswith("/pids.max")]
    with open("/sys/devices/system/cpu/online") as online:
        cpus = online.read().strip()
    return {
        "top": sorted(os.listdir("/sys")),
        "cpus online": cpus,
        "groups": groups,
        "pids.max": [open(limit).read().strip() for limit in limits],
    }


def link_local() -> None:
    with socket.create_connection(("169.254.169.254", 80), timeout=3):
        pass


def core_pattern() -> None:
    # Writes the node's value back (harmless if it were allowed): a uid 0 without any
    # capability may write a sysctl of mode 0644, and a core_pattern naming a command
    # runs it as the node's root at the next crash.
    with open("/proc/sys/kernel/core_pattern", "r+") as setting:
        value = setting.read()
        setting.seek(0)
        setting.write(value)


@ember.endpoint(name="early", scaledown_window=300)
class Early:
    # Its snapshot phase: as uid 0 without capabilities where CRIU lacks
    # CAP_SYS_RESOURCE (a container's root), else as its workspace's uid.
    @ember.enter(snap=True)
    def probe(self) -> None:
        self.uid = os.getuid()
        self.link_local = outcome(link_local)
        self.core_pattern = outcome(core_pattern)
        while not os.path.exists(GATE):  # the test execs into it meanwhile
            time.sleep(0.05)

    @ember.method
    def seen(self) -> dict:
        return {"uid": self.uid, "link-local": self.link_local, "sysctl": self.core_pattern}


@ember.endpoint(scaledown_window=300)
def attack(reads: list[str], writes: list[str], egress: bool) -> dict:
    api = httpx.Client(
        base_url=os.environ["EMBER_SERVER_URL"],
        verify=os.environ.get("EMBER_CA_CERT") or True,
        headers={"Authorization": f"Bearer {os.environ['EMBER_TOKEN']}"},
        timeout=30,
    )
    with api:
        platform = {
            "private endpoint": api.post("/bank--balance/", json={}).status_code,
            "dict": api.get("/v1/apps/bank/dicts/ledger/items/owner").status_code,
            "volume": api.get("/v1/apps/bank/volumes/vault-files/files/key.txt").status_code,
            "list tokens": api.get("/v1/tokens").status_code,
            "mint admin": api.post("/v1/tokens", json={"scope": "admin"}).status_code,
            "workspaces": api.post("/v1/workspaces", json={"name": "mine"}).status_code,
        }
    with open("/proc/self/status") as status:
        fields = dict(line.rstrip("\\n").split(":\\t", 1) for line in status if ":\\t" in line)
    return {
        "read": {path: outcome(lambda p=path: read(p)) for path in reads},
        "write": {path: outcome(lambda p=path: write(p)) for path in writes},
        "mount": outcome(lambda: call("mount", b"none", b"/tmp", b"tmpfs", 0, None)),
        "user namespace": outcome(lambda: call("unshare", 0x10000000)),
        "ptrace": outcome(ptrace_a_child),
        "tmp filled at": fill_tmp(),
        "fork bomb": fork_bomb(),
        "link-local": outcome(link_local) if egress else "not tried",
        "platform": platform,
        "processes": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
        "hostname": socket.gethostname(),
        "sys": sys_view(),
        "seccomp": fields["Seccomp"],
        "uid": os.getuid(),
    }
"""

REFUSED = {"EACCES", "ENOENT", "EROFS", "EPERM"}  # denied, absent, read-only mount


def _post(platform: Platform, token: str, label: str, body: dict[str, Any]) -> Any:
    with platform.client(token, timeout=240) as client:
        answer = client.post(f"/{label}" if "/" in label else f"/{label}/", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _replica_of(platform: Platform, token: str, suffix: str) -> str | None:
    """The id of the replica whose label ends with `suffix`, once there is one."""
    listed = platform.ember_as(token, "replica", "ls", "--json")
    ids = [r["id"] for r in json.loads(listed.stdout or "[]") if r["label"].endswith(suffix)]
    return ids[0] if ids else None


NO_ROUTE = {"ECONNREFUSED", "EHOSTUNREACH"}


def _local_worker_pid(platform: Platform) -> int:
    assert platform.process is not None
    for task in Path(f"/proc/{platform.process.pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            if "ember_worker" in Path(f"/proc/{child}/cmdline").read_text():
                return int(child)
    raise AssertionError("the local worker is not a child of the server")


def _sandbox_problem() -> str | None:
    if os.geteuid() != 0:
        return "the sandbox is built by a worker running as root"
    problem = seccomp_filter.available()
    if problem is not None:
        return problem
    if shutil.which("iptables") is None:
        return "iptables is not installed (the link-local egress rule)"
    return None


def _weights_file(folder: Path) -> tuple[str, list[list[float]]]:
    """A safetensors file in the folder every test sandbox mounts: its file:// URL, and
    its one tensor's values."""
    import torch
    from safetensors.torch import save_file

    values = torch.arange(64, dtype=torch.float32).reshape(4, 16) / 8
    save_file({"w": values}, str(folder / "isolated.safetensors"))
    (folder / "isolated.safetensors").chmod(0o644)  # every workspace's replicas read it
    return f"file://{folder}/isolated.safetensors", values.tolist()


def test_a_hostile_endpoint_reaches_nothing_of_the_platform_or_another_workspace(
    tmp_path: Path, sandbox_shared: Path
) -> None:
    problem = _sandbox_problem()
    if problem is not None:
        need("sandbox", f"replicas cannot be sandboxed here: {problem}")
    (tmp_path / "bank").mkdir()
    (tmp_path / "bank" / "app.py").write_text(BANK)
    (tmp_path / "thief").mkdir()
    gate = sandbox_shared / "early-may-go"
    (tmp_path / "thief" / "app.py").write_text(THIEF + f"\nGATE = {str(gate)!r}\n")
    # 512 processes a replica (4096 by default): the fork bomb waits out fewer forks.
    pids = ("--replica-pids-max", "512")
    with running_platform(tmp_path / "platform", extra=pids) as platform:
        platform.ember("secret", "set", "vault", "VAULT_KEY=bank-secret-123")
        platform.deploy(tmp_path / "bank" / "app.py", "bank")
        before = _post(platform, platform.token, "bank--balance", {})
        assert before["secret"] == "bank-secret-123"
        platform.ember("workspace", "create", "evil")
        evil = platform.ember("token", "create", "--workspace", "evil", "--scope", "deploy")
        evil_token = evil.stdout.strip()
        deployed = platform.ember_as(evil_token, "deploy", str(tmp_path / "thief" / "app.py"))
        assert deployed.returncode == 0, deployed.stderr

        state = platform.state_dir
        state_worker = state / "worker"
        bank_bundle = next(
            folder
            for folder in (state_worker / "bundles").glob("sha256-*")
            if folder.is_dir() and "bank v1" in (folder / "app.py").read_text()
        )
        worker_pid = _local_worker_pid(platform)
        rules = subprocess.run(["iptables", "-S", "OUTPUT"], capture_output=True, text=True)
        # Only with the rule in place: never send a packet to a real metadata service.
        egress = f"-j {chain_name(state_worker)}" in rules.stdout
        assert egress, f"the worker's link-local rule is missing: {rules.stdout}"
        chain = subprocess.run(
            ["iptables", "-S", chain_name(state_worker)], capture_output=True, text=True
        ).stdout
        # By uid, and by cgroup: the snapshot phase may run as uid 0.
        assert "--uid-owner" in chain and "--path" in chain, chain
        snapshots_off = platform.status()["workers"][0]["snapshots"].get("problem")
        with ThreadPoolExecutor(max_workers=1) as pool:
            starting = pool.submit(_post, platform, evil_token, "evil--thief--early/seen", {})
            early_replica = wait_for(lambda: _replica_of(platform, evil_token, "--early"), 60)
            # In its snapshot phase: no command in its namespaces while it is dumped.
            too_soon = platform.ember_as(evil_token, "replica", "exec", early_replica, "--", "true")
            if not snapshots_off:
                assert too_soon.returncode != 0 and "still starting" in too_soon.stderr, too_soon
            gate.touch()
            early = starting.result(timeout=240)
        # Refused at once: routed nowhere in its own network, and by the node's rule.
        assert early["link-local"] in NO_ROUTE, early
        assert early["sysctl"] == "EROFS", early  # the kernel's settings are read-only
        if not snapshots_off and not holds_capability(CAP_SYS_RESOURCE):
            assert early["uid"] == 0  # this machine's case: the phase the uid rule missed
        reads = [
            str(state / "admin-token"),
            str(state / "state.db"),
            str(state / "ca-key.pem"),
            str(state / "server-key.pem"),
            str(state / "webhook-secret"),
            platform.env["EMBER_CONFIG"],  # the client config: the admin token
            str(state_worker / "replica-users.json"),
            str(bank_bundle / "app.py"),
            str(state_worker / "volumes" / "bank" / "vault-files" / "key.txt"),
            f"/proc/{before['pid']}/environ",  # the bank's secret
            f"/proc/{before['pid']}/mem",
            f"/proc/{worker_pid}/environ",  # the worker's token
            f"/proc/{platform.process.pid}/environ" if platform.process else "/proc/0",
            "/etc/shadow",
        ]
        writes = [
            str(bank_bundle / "app.py"),  # what the bank runs at its next cold start
            str(state / "admin-token"),
            str(state_worker / "bundles" / "planted.py"),
            "/usr/lib/planted.py",
            "/etc/planted",
            "/planted",
            os.environ.get("VIRTUAL_ENV", "/usr/local/lib") + "/planted.pth",
            "/sys/fs/cgroup/pids.max",  # its own limit, read-only (v2)
            "/sys/fs/cgroup/pids/pids.max",  # (v1)
            "/sys/devices/system/cpu/cpu0/online",
        ]
        seen = _post(
            platform,
            evil_token,
            "evil--thief--attack",
            {"reads": reads, "writes": writes, "egress": egress},
        )
        assert set(seen["read"].values()) <= REFUSED, seen["read"]
        assert set(seen["write"].values()) <= REFUSED, seen["write"]
        assert seen["mount"] == "EPERM"
        assert seen["user namespace"] == "EPERM"
        assert seen["ptrace"] == "EPERM"
        assert seen["link-local"] in NO_ROUTE, seen
        assert 0 < seen["tmp filled at"] <= 256 * 2**20  # its /tmp's size, then ENOSPC
        assert seen["fork bomb"] == "EAGAIN"  # pids.max
        assert seen["platform"] == {
            "private endpoint": 403,
            "dict": 404,
            "volume": 404,
            "list tokens": 403,
            "mint admin": 403,
            "workspaces": 403,
        }
        # Its own view: its processes only, its host name, a seccomp filter, its uid.
        assert seen["processes"][0] == 1 and len(seen["processes"]) < 5
        assert seen["hostname"] == "replica"
        # A /sys of the CPUs and its own cgroups: none of the node's other groups.
        view = seen["sys"]
        assert view["top"] == ["devices", "fs"]
        assert view["cpus online"] == Path("/sys/devices/system/cpu/online").read_text().strip()
        assert view["pids.max"] == ["512"]  # --replica-pids-max
        inner = [Path(group).relative_to("/sys/fs/cgroup").parts for group in view["groups"]]
        assert inner and all(len(parts) <= 2 for parts in inner), view["groups"]
        assert seen["seccomp"] == "2"
        assert seen["uid"] >= 200_000

        # Weights cache poisoning: the thief reads a weights URL through its cache,
        # overwrites what it cached with junk and plants it where the bank's cache might
        # be; the bank then reads the same URL, and gets the true bytes.
        url, values = _weights_file(sandbox_shared)
        poison = _post(
            platform,
            evil_token,
            "evil--thief--poison",
            {"url": url, "bank_uid": before["uid"]},
        )
        assert poison["true"] == values
        assert set(poison["planted"].values()) <= REFUSED, poison["planted"]
        assert _post(platform, platform.token, "bank--weights", {"url": url}) == values
        bank_cache = state_worker / "weights" / f"uid-{before['uid']}"
        status = bank_cache.stat()
        assert (status.st_uid, status.st_mode & 0o007) == (before["uid"], 0)
        assert any((bank_cache / "objects").glob("*.data"))  # it read through its own
        assert not (state_worker / "weights" / "objects").exists()  # no shared cache

        # `ember replica exec` with the thief's deploy token: its command runs inside the
        # thief's replica as the replica runs, and reaches no more than its code did.
        listed = platform.ember_as(evil_token, "replica", "ls", "--json")
        (thief_replica,) = {
            r["id"] for r in json.loads(listed.stdout) if r["label"].endswith("--attack")
        }
        script = (
            'echo "uid=$(id -u)"; grep -E "^(Seccomp|CapEff|NoNewPrivs):" /proc/self/status; '
            'echo "processes=$(ls /proc | grep -c "^[0-9]")"; echo "host=$(hostname)"; '
            'echo "cgroup=$(tr "\\n" " " < /proc/self/cgroup)"; '
            + "".join(f'cat {p} >/dev/null 2>&1 && echo "read={p}"; ' for p in reads)
            + "".join(f'(echo x >> {p}) 2>/dev/null && echo "wrote={p}"; ' for p in writes)
            + "true"
        )
        ran = platform.ember_as(
            evil_token, "replica", "exec", thief_replica, "--", "sh", "-c", script
        )
        assert ran.returncode == 0, ran.stderr
        lines = ran.stdout.splitlines()
        assert f"uid={seen['uid']}" in lines
        assert {"Seccomp:\t2", "CapEff:\t0000000000000000", "NoNewPrivs:\t1"} <= set(lines)
        assert "host=replica" in lines
        assert int(next(x for x in lines if x.startswith("processes=")).split("=")[1]) < 8
        assert thief_replica in next(x for x in lines if x.startswith("cgroup="))
        assert not [x for x in lines if x.startswith(("read=", "wrote="))], lines
        # A command shaped like the exec wrapper's own options is only a command.
        posing = ["--pid", "1", "--cwd", "/", "cat", "/etc/shadow"]
        ran = platform.ember_as(evil_token, "replica", "exec", thief_replica, "--", *posing)
        assert ran.returncode == 127 and "root:" not in ran.stdout, (ran.stdout, ran.stderr)
        # Into the bank's replica: another workspace's, so not found for this token.
        bank_replica = json.loads(platform.ember("replica", "ls", "bank", "--json").stdout)[0]["id"]
        with httpx.Client(base_url=platform.url, verify=client_context(platform.ca)) as client:
            refused = client.post(
                f"/v1/replicas/{bank_replica}/exec",
                json={"command": ["id"]},
                headers={"Authorization": f"Bearer {evil_token}"},
            )
        assert refused.status_code == 404, refused.text
        tried = platform.ember_as(evil_token, "replica", "exec", bank_replica, "--", "id")
        assert tried.returncode != 0 and "no replica" in tried.stderr

        # The bank serves its own code and secret, from a bundle nobody changed.
        after = _post(platform, platform.token, "bank--balance", {})
        assert after["secret"] == "bank-secret-123" and after["code"] == "bank v1"
        assert "planted" not in (bank_bundle / "app.py").read_text()
        assert not Path("/etc/planted").exists() and not Path("/planted").exists()

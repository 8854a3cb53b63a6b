"""Gateway overhead: a no-op endpoint through the whole platform vs a bare Starlette app.

Both targets run on this machine in the same run, behind the same TLS certificate, on
uvicorn with the same options, and are driven by the same load generator in its own
process. The platform path is the real one: HTTPS gateway, bearer-token auth, queue,
WebSocket channel to a replica process, the replica's event loop, and back.

Reported: per-request latency at concurrency 1 (p50/p99, and the p50 the platform adds)
and requests/s at concurrency 32 (and the platform/bare ratio), with a verdict against
the reach: added p50 <= 1 ms, throughput >= 25 % of the bare app.

    .venv/bin/python bench/gateway.py            # about a minute
    .venv/bin/python bench/gateway.py --web-app  # the same Starlette app as a web-app endpoint
    .venv/bin/python bench/gateway.py --json     # machine-readable
    .venv/bin/python bench/gateway.py --quick    # one round of each phase, 1 s windows
    .venv/bin/python bench/gateway.py --profile cp.txt  # py-spy's stacks of the control plane

A run that fails part-way prints what the phases before measured, and which failed.

With `--web-app` the platform's target is the bare app's own Starlette app, deployed as
an `@ember.asgi_app()` endpoint: what the web-app relay adds to each request.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from procs import ServerProcess, progress, stopped_at_exit, wait_for_line

REACH_ADDED_P50_MS = 1.0
REACH_THROUGHPUT_RATIO = 0.25
BOOT_TIMEOUT_S = 120.0
CLIENT_TIMEOUT_S = 30.0  # past its phase: a hung request is a failure, not a slow sample

NOOP_APP = """\
import ember


@ember.endpoint(min_replicas=1, max_replicas=1, concurrency=64)
async def noop() -> dict:
    return {}
"""

# The same no-op route as the bare app below, served by the platform as a web app.
WEB_APP = """\
import ember


@ember.endpoint(min_replicas=1, max_replicas=1, concurrency=64)
@ember.asgi_app()
def noop():
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def answer(request):
        return JSONResponse({})

    return Starlette(routes=[Route("/noop/", answer, methods=["POST"])])
"""

# The baseline mirrors ember_platform.server: a socket bound the same way, and the same
# uvicorn.Config options, so the difference measured is the platform, not the HTTP stack.
BARE_APP = """\
import socket
import sys

import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route


async def noop(request):
    return JSONResponse({})


app = Starlette(routes=[Route("/noop/", noop, methods=["POST"])])

if __name__ == "__main__":
    cert, key, loop = sys.argv[1:4]
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(2048)
    sock.setblocking(False)
    print(f"serving at https://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    config = uvicorn.Config(
        app,
        loop=loop,
        ssl_certfile=cert,
        ssl_keyfile=key,
        log_level="warning",
        access_log=False,
        lifespan="off",
        ws_ping_interval=None,
        timeout_graceful_shutdown=5,
    )
    uvicorn.Server(config).run(sockets=[sock])
"""


# ===================================================================================
# The load generator. It runs in its own process (pinned to its own core when there
# are two or more), so its CPU never competes with the servers it measures.
# ===================================================================================


class Connection(Protocol):
    async def call(self) -> float:
        """Send one request; return its latency in seconds. Raises on a bad answer."""
        ...

    async def close(self) -> None: ...


class BadResponse(Exception):
    pass


class RawConnection:
    """One keep-alive HTTP/1.1 connection on asyncio streams + ssl.

    Chosen over httpx by default, measured here against the bare app: httpx used its
    whole core at ~1,200 requests/s (~830 us of client CPU per call) and added ~0.7 ms
    to every p50, so the client, not the server, set the bare app's rate and the ratio
    looked far better than it is (`--client httpx` shows it). This client writes one
    pre-built request and reads a Content-Length response: ~40 us of client CPU per
    call, TLS included, with the bare app near 18,000 requests/s on one core.
    """

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.request = request

    @classmethod
    async def open(cls, target: dict[str, Any], token: str, context: ssl.SSLContext) -> Any:
        reader, writer = await asyncio.open_connection(
            target["host"], target["port"], ssl=context, server_hostname=target["host"]
        )
        request = (
            f"POST {target['path']} HTTP/1.1\r\n"
            f"Host: {target['host']}:{target['port']}\r\n"
            f"Authorization: Bearer {token}\r\n"
            "Content-Type: application/json\r\n"
            "Content-Length: 2\r\n"
            "\r\n{}"
        ).encode()
        return cls(reader, writer, request)

    async def call(self) -> float:
        start = time.perf_counter()
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        match = re.search(rb"\r\ncontent-length:\s*(\d+)", head, re.IGNORECASE)
        if match is None:
            raise BadResponse(f"no Content-Length in {head[:200]!r}")
        body = await self.reader.readexactly(int(match.group(1)))
        elapsed = time.perf_counter() - start
        if head[9:12] != b"200" or body != b"{}":
            raise BadResponse(f"{head[:12].decode(errors='replace')} {body[:200]!r}")
        return elapsed

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()


class HttpxConnection:
    """The same call through httpx, each with a client of its own (one connection)."""

    def __init__(self, client: Any, url: str, headers: dict[str, str]) -> None:
        self.client = client
        self.url = url
        self.headers = headers

    @classmethod
    async def open(cls, target: dict[str, Any], token: str, context: ssl.SSLContext) -> Any:
        import httpx

        client = httpx.AsyncClient(
            verify=context, limits=httpx.Limits(max_connections=1), timeout=CLIENT_TIMEOUT_S
        )
        url = f"https://{target['host']}:{target['port']}{target['path']}"
        connection = cls(client, url, {"Authorization": f"Bearer {token}"})
        await connection.call()  # connect now, so the handshake is not a sample
        return connection

    async def call(self) -> float:
        start = time.perf_counter()
        response = await self.client.post(self.url, content=b"{}", headers=self.headers)
        elapsed = time.perf_counter() - start
        if response.status_code != 200 or response.content != b"{}":
            raise BadResponse(f"{response.status_code} {response.content[:200]!r}")
        return elapsed

    async def close(self) -> None:
        await self.client.aclose()


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process, from /proc (0 if it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class LoadGenerator:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.context = ssl.create_default_context(cafile=spec["ca"])
        opener = HttpxConnection if spec["client"] == "httpx" else RawConnection
        self.opener: Callable[..., Awaitable[Connection]] = opener.open

    async def _pool(self, target: dict[str, Any], size: int) -> list[Connection]:
        # Fresh connections per phase: uvicorn closes keep-alive connections idle for 5 s,
        # which the other target's turn would exceed. Handshakes fall in the warm-up.
        opened = [self.opener(target, self.spec["token"], self.context) for _ in range(size)]
        return list(await asyncio.gather(*opened))

    async def sequential(self, target: dict[str, Any]) -> list[float]:
        """One connection, one request at a time: `requests` of them or `duration` s."""
        (connection,) = await self._pool(target, 1)
        try:
            # Both phases are also bounded in time, so a slow target cannot stretch the run.
            await self._repeat(connection, self.spec["warmup_requests"], self.spec["warmup"])
            return await self._repeat(connection, self.spec["requests"], self.spec["duration"])
        finally:
            await connection.close()

    @staticmethod
    async def _repeat(connection: Connection, count: int, seconds: float) -> list[float]:
        latencies: list[float] = []
        deadline = time.perf_counter() + seconds
        # One timeout for the loop, not one per call: wait_for costs a task per request.
        async with asyncio.timeout(seconds + CLIENT_TIMEOUT_S):
            while len(latencies) < count and time.perf_counter() < deadline:
                latencies.append(await connection.call())
        return latencies

    async def saturate(self, target: dict[str, Any]) -> dict[str, Any]:
        """`concurrency` connections in closed loops; count what completes in the window."""
        pool = await self._pool(target, self.spec["concurrency"])
        counting = False
        stop = False
        latencies: list[float] = []

        async def loop(connection: Connection) -> None:
            while not stop:
                latency = await connection.call()
                if counting:
                    latencies.append(latency)

        tasks = [asyncio.ensure_future(loop(c)) for c in pool]
        try:
            await asyncio.sleep(self.spec["warmup"])
            pids: dict[str, int] = target["pids"]
            cpu_before = {name: _cpu_seconds(pid) for name, pid in pids.items()}
            client_before = time.process_time()
            started = time.perf_counter()
            counting = True
            await asyncio.sleep(self.spec["duration"])
            counting = False
            seconds = time.perf_counter() - started
            client_cpu = time.process_time() - client_before
            cpu = {name: _cpu_seconds(pid) - cpu_before[name] for name, pid in pids.items()}
            count = len(latencies)
            stop = True
            # Also raises what failed, and a request that hung in the window.
            async with asyncio.timeout(CLIENT_TIMEOUT_S):
                await asyncio.gather(*tasks)
        finally:
            stop = True
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.gather(*(c.close() for c in pool), return_exceptions=True)
        return {
            "requests": count,
            "seconds": seconds,
            "latencies": latencies[:count],
            "server_cpu": cpu,
            "client_cpu": client_cpu,
        }

    async def run(self, emit: Callable[[dict[str, Any]], None]) -> None:
        """Each phase's results to `emit` as the phase ends, so that a failure in the
        second leaves the first's."""
        targets: list[dict[str, Any]] = self.spec["targets"]
        sequential: dict[str, list[list[float]]] = {t["name"]: [] for t in targets}
        saturated: dict[str, list[dict[str, Any]]] = {t["name"]: [] for t in targets}
        # Alternate which target goes first, so drift (thermal, page cache, a noisy
        # neighbour) falls on both rather than on whichever always runs second.
        for number in range(self.spec["rounds"]):
            for target in targets if number % 2 == 0 else targets[::-1]:
                sequential[target["name"]].append(await self.sequential(target))
        emit({"sequential": sequential})
        for number in range(self.spec["rounds"]):
            for target in targets if number % 2 == 0 else targets[::-1]:
                saturated[target["name"]].append(await self.saturate(target))
        emit({"saturated": saturated})


def _run_event_loop(main: Coroutine[Any, Any, None]) -> None:
    # uvloop keeps the client's own cost per request low; it is the same for both targets.
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def client_main() -> int:
    """The load generator's process: a spec on stdin, each phase's results as a line of
    JSON on stdout."""
    spec = json.load(sys.stdin)
    if spec["cpus"]:
        os.sched_setaffinity(0, spec["cpus"])

    def emit(phase: dict[str, Any]) -> None:
        print(json.dumps(phase), flush=True)

    _run_event_loop(LoadGenerator(spec).run(emit))
    return 0


# ===================================================================================
# Orchestration: start both servers, run the client, stop everything.
# ===================================================================================


def loads_uvloop(pid: int) -> bool:
    """Whether uvloop's extension is mapped into the process (uvicorn's default loop)."""
    with contextlib.suppress(OSError):
        return "/uvloop/" in Path(f"/proc/{pid}/maps").read_text()
    return False


def start_service(
    name: str, command: Sequence[str], log: Path, env: dict[str, str], cpus: set[int] | None
) -> ServerProcess:
    def pin() -> None:
        # Inherited by everything the server starts later (worker, replicas).
        os.sched_setaffinity(0, cpus or set())

    return ServerProcess.start(name, command, log, env, preexec_fn=pin if cpus else None)


def wait_until_answering(url: str, token: str, ca: Path, timeout: float) -> None:
    """Call until a 200: the platform's first call may wait for its replica to boot."""
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    context = ssl.create_default_context(cafile=str(ca))
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        connection = http.client.HTTPSConnection(
            parts.hostname or "", parts.port, context=context, timeout=timeout
        )
        try:
            connection.request(
                "POST",
                parts.path,
                body=b"{}",
                headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
            )
            response = connection.getresponse()
            body = response.read()
            if response.status == 200:
                return
            last = f"{response.status} {body[:300]!r}"
        except OSError as exc:
            last = repr(exc)
        finally:
            connection.close()
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer 200 within {timeout:g} s (last: {last})")


@contextlib.contextmanager
def services() -> Iterator[list[ServerProcess]]:
    # Replicas exit soon after the worker stops them: a short grace before SIGKILL.
    with stopped_at_exit(term_timeout=20.0, grace=5.0) as started:
        yield started


def percentile(sorted_values: Sequence[float], fraction: float) -> float:
    """Linear interpolation between closest ranks."""
    if not sorted_values:
        return float("nan")
    position = (len(sorted_values) - 1) * fraction
    low = int(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def summarize(raw: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """Each target's figures, of the phases that ran (`raw` lacks a phase that failed)."""
    summary: dict[str, Any] = {}
    for name in names:
        summary[name] = {}
        if "sequential" in raw:
            rounds: list[list[float]] = raw["sequential"][name]
            pooled = sorted(x for r in rounds for x in r)
            summary[name] |= {
                "c1_p50_ms": percentile(pooled, 0.50) * 1e3,
                "c1_p99_ms": percentile(pooled, 0.99) * 1e3,
                "c1_round_p50_ms": [statistics.median(r) * 1e3 for r in rounds],
                "c1_samples": len(pooled),
            }
        if "saturated" not in raw:
            continue
        saturated: list[dict[str, Any]] = raw["saturated"][name]
        rates = [s["requests"] / s["seconds"] for s in saturated]
        total = sum(s["requests"] for s in saturated)
        c32_latencies = sorted(x for s in saturated for x in s["latencies"])
        cpu_names = saturated[0]["server_cpu"] if saturated else {}
        summary[name] |= {
            "rps": statistics.median(rates),
            "round_rps": rates,
            "c32_p50_ms": percentile(c32_latencies, 0.50) * 1e3,
            "c32_p99_ms": percentile(c32_latencies, 0.99) * 1e3,
            # CPU per request shows where the time goes, process by process.
            "cpu_us_per_request": {
                process: sum(s["server_cpu"][process] for s in saturated) / max(total, 1) * 1e6
                for process in cpu_names
            },
            "client_cpu_percent": sum(s["client_cpu"] for s in saturated)
            / max(sum(s["seconds"] for s in saturated), 1e-9)
            * 100,
        }
    return summary


def verdicts(summary: dict[str, Any]) -> dict[str, Any]:
    """The verdicts of the phases that ran."""
    bare, platform = summary["bare"], summary["platform"]
    found: dict[str, Any] = {}
    if "c1_p50_ms" in bare:
        added = platform["c1_p50_ms"] - bare["c1_p50_ms"]
        found["added_p50_ms"] = added
        found["added_p50_ms_by_round"] = [
            p - b for p, b in zip(platform["c1_round_p50_ms"], bare["c1_round_p50_ms"], strict=True)
        ]
        found["added_p50_pass"] = added <= REACH_ADDED_P50_MS
    if "rps" in bare:
        ratio = platform["rps"] / bare["rps"] if bare["rps"] else 0.0
        found["throughput_ratio"] = ratio
        found["throughput_ratio_by_round"] = [
            p / b for p, b in zip(platform["round_rps"], bare["round_rps"], strict=True) if b
        ]
        found["throughput_pass"] = ratio >= REACH_THROUGHPUT_RATIO
    return found


def report(result: dict[str, Any]) -> str:
    """The figures and verdicts of the phases that ran, and the failure if one did."""
    failed = result.get("failed")
    failure = [f"FAILED in {failed['part']}: {failed['error']}"] if failed else []
    if "setup" not in result:  # nothing measured
        return "\n".join(["gateway overhead: nothing measured", *failure])
    summary, verdict, setup = result["summary"], result["verdicts"], result["setup"]
    bare, platform = summary["bare"], summary["platform"]
    width = 12
    samples = (
        f" (samples: bare {bare['c1_samples']}, platform {platform['c1_samples']})"
        if "c1_samples" in bare
        else ""
    )
    lines = [
        f"gateway overhead: no-op {setup['platform_target']} endpoint, {setup['client']} client, "
        f"{setup['rounds']} rounds alternating targets",
        f"  cpus: {setup['cpu_layout']}",
        f"  c=1: up to {setup['requests']} requests or {setup['duration']:g} s per round"
        f"{samples}; c={setup['concurrency']}: {setup['duration']:g} s per round",
        "  uvloop loaded: "
        + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in setup["uvloop_loaded"].items()),
        "",
        f"{'':24}{'bare':>{width}}{'platform':>{width}}{'platform/bare':>{width + 4}}",
    ]

    def row(label: str, key: str, fmt: str, ratio: bool = True) -> None:
        if key not in bare:  # its phase failed, or one before it
            return
        b, p = bare[key], platform[key]
        share = f"{p / b:.2f}x" if ratio and b else ""
        lines.append(f"{label:24}{b:>{width}{fmt}}{p:>{width}{fmt}}{share:>{width + 4}}")

    row("c=1 p50 (ms)", "c1_p50_ms", ".3f")
    row("c=1 p99 (ms)", "c1_p99_ms", ".3f")
    row(f"c={setup['concurrency']} requests/s", "rps", ",.0f")
    row(f"c={setup['concurrency']} p50 (ms)", "c32_p50_ms", ".2f")
    row("client CPU (% of core)", "client_cpu_percent", ".0f", ratio=False)
    if "rps" in bare:
        for name, values in (("bare", bare), ("platform", platform)):
            parts = ", ".join(f"{k} {v:.0f}" for k, v in values["cpu_us_per_request"].items())
            lines.append(f"  server CPU us/request, {name}: {parts}")
        if bare["client_cpu_percent"] > 90:
            lines.append("  warning: the client used a whole core: it may cap the bare app's rate")
    lines.append("")
    if "added_p50_pass" in verdict:
        by_round = ", ".join(f"{x:.2f}" for x in verdict["added_p50_ms_by_round"])
        lines.append(
            f"added p50 latency: {verdict['added_p50_ms']:.2f} ms "
            f"(reach <= {REACH_ADDED_P50_MS:g} ms): "
            f"{'PASS' if verdict['added_p50_pass'] else 'MISS'}   [by round: {by_round}]"
        )
    if "throughput_pass" in verdict:
        ratio_round = ", ".join(f"{x:.0%}" for x in verdict["throughput_ratio_by_round"])
        lines.append(
            f"throughput: {verdict['throughput_ratio']:.0%} of bare "
            f"(reach >= {REACH_THROUGHPUT_RATIO:.0%}): "
            f"{'PASS' if verdict['throughput_pass'] else 'MISS'}   [by round: {ratio_round}]"
        )
    return "\n".join(lines + failure)


def cpu_layout(pin: bool) -> tuple[list[int] | None, set[int] | None, str]:
    """Which CPUs the client and the servers get: the client one core of its own."""
    available = sorted(os.sched_getaffinity(0))
    if not pin or len(available) < 2:
        why = "--no-pin" if not pin else "only one CPU"
        return None, None, f"{len(available)} shared by client and servers ({why})"
    client, servers = available[-1:], set(available[:-1])
    note = f"client on CPU {client[0]}; servers (each whole tree) on CPU {sorted(servers)}"
    if len(servers) == 1:
        note += ": the control plane and its replica share that one core"
    return client, servers, note


def run(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Fills result["setup"], then result["raw"] phase by phase (and result["failed"]
    names the part a failure happens in)."""
    client_cpus, server_cpus, layout = cpu_layout(args.pin)
    result["failed"] = {"part": "starting the servers", "error": ""}  # until they answer
    with (
        tempfile.TemporaryDirectory(prefix="ember-bench-", ignore_cleanup_errors=True) as tmp,
        services() as started,
    ):
        work = Path(tmp)
        state = work / "state"
        (work / "noop.py").write_text(WEB_APP if args.web_app else NOOP_APP)
        (work / "bare_app.py").write_text(BARE_APP)
        env = {**os.environ, "EMBER_CONFIG": str(work / "config.json")}
        env.pop("EMBER_TOKEN", None)

        what = "web-app" if args.web_app else "no-op"
        progress(args.quiet, f"starting ember server and deploying the {what} endpoint ...")
        command = [sys.executable, "-m", "ember.cli.main", "server", "--state-dir", str(state)]
        command += ["--port", "0", "--deploy", str(work / "noop.py")]
        ember = start_service("ember server", command, work / "ember.log", env, server_cpus)
        started.append(ember)
        url = wait_for_line(
            ember.process, ember.log, ember.name, r"^\s+noop--noop\s+(https://\S+)", BOOT_TIMEOUT_S
        ).group(1)
        if args.web_app:
            url += "noop/"  # the app's route, under the endpoint's URL
        token = (state / "admin-token").read_text().strip()
        ca = state / "ca.pem"
        wait_until_answering(url, token, ca, BOOT_TIMEOUT_S)

        progress(args.quiet, "starting the bare Starlette app ...")
        command = [sys.executable, str(work / "bare_app.py")]
        command += [str(state / "server.pem"), str(state / "server-key.pem"), args.bare_loop]
        bare = start_service("bare app", command, work / "bare.log", env, server_cpus)
        started.append(bare)
        bare_url = wait_for_line(
            bare.process, bare.log, bare.name, r"serving at (https://\S+)", BOOT_TIMEOUT_S
        ).group(1)
        bare_url += "/noop/"
        wait_until_answering(bare_url, token, ca, BOOT_TIMEOUT_S)

        pids = {"control plane": ember.process.pid}
        ember.remember()
        for pid, line in ember.seen.items():
            if "ember_worker.replica.boot" in line:
                pids["replica"] = pid
            elif "ember_worker" in line:
                pids["worker"] = pid
        uvloop = {"bare server": loads_uvloop(bare.process.pid)}
        uvloop |= {f"platform {name}": loads_uvloop(pid) for name, pid in pids.items()}

        spec = {
            "ca": str(ca),
            "token": token,
            "client": args.client,
            "cpus": client_cpus,
            "rounds": args.rounds,
            "requests": args.requests,
            "warmup_requests": max(50, args.requests // 10),
            "duration": args.duration,
            "warmup": args.warmup,
            "concurrency": args.concurrency,
            "targets": [_target("bare", bare_url, {"server": bare.process.pid})],
        }
        spec["targets"].append(_target("platform", url, pids))
        result["setup"] = {
            "client": args.client,
            "rounds": args.rounds,
            "requests": args.requests,
            "duration": args.duration,
            "concurrency": args.concurrency,
            "cpu_layout": layout,
            "cpu_count": os.cpu_count(),
            "bare_loop": args.bare_loop,
            "platform_target": "web-app (@ember.asgi_app)" if args.web_app else "function",
            "uvloop_loaded": uvloop,
        }
        most = args.rounds * 2 * 2 * (args.duration + args.warmup)
        progress(
            args.quiet, f"measuring: c=1, then c={args.concurrency} (at most {most:.0f} s) ..."
        )
        result["raw"] = {}
        try:
            with profiled(args.profile, {"platform": ember.process.pid, "bare": bare.process.pid}):
                run_client(spec, result["raw"])
        except BaseException:
            done = "sequential" in result["raw"]
            result["failed"]["part"] = f"the c={args.concurrency if done else 1} phase"
            raise
        del result["failed"]
        progress(args.quiet, "stopping the servers ...")


@contextlib.contextmanager
def profiled(out: Path | None, pids: dict[str, int]) -> Iterator[None]:
    """py-spy samples each server while the block runs, the platform's control plane into
    `out` and the bare app into `out` + ".bare" (each is idle during the other's rounds),
    their stacks collapsed."""
    if out is None:
        yield
        return
    spy = Path(sys.executable).with_name("py-spy")
    recorders = []
    for name, pid in pids.items():
        path = out if name == "platform" else out.with_name(f"{out.name}.{name}")
        command = [str(spy), "record", "--pid", str(pid), "--format", "raw", "--rate", "250"]
        command += ["--nonblocking", "--output", str(path)]
        recorders.append(
            subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        )
    try:
        yield
    finally:
        for recorder in recorders:
            recorder.send_signal(signal.SIGINT)  # py-spy writes its file on Ctrl+C
        for recorder in recorders:
            _, errors = recorder.communicate(timeout=30)
            if recorder.returncode not in (0, -signal.SIGINT):
                print(f"py-spy: {errors.decode(errors='replace')}", file=sys.stderr)


def _target(name: str, url: str, pids: dict[str, int]) -> dict[str, Any]:
    match = re.fullmatch(r"https://([^:/]+):(\d+)(/.*)", url)
    if match is None:
        raise RuntimeError(f"unexpected URL {url!r}")
    host, port, path = match.groups()
    return {"name": name, "host": host, "port": int(port), "path": path, "pids": pids}


def run_client(spec: dict[str, Any], raw: dict[str, Any]) -> None:
    """The load generator in its own process; each phase's results into `raw` as they
    come, so that what finished stays when a later phase fails."""
    process = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--client-process"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(json.dumps(spec).encode())
        process.stdin.close()
        for line in process.stdout:
            raw.update(json.loads(line))
        process.wait()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    if process.returncode != 0:
        raise RuntimeError(f"the load generator failed (exit code {process.returncode})")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/gateway.py",
        description="Measure what the Ember platform adds to a no-op call: the endpoint "
        "called through `ember server` (gateway, auth, queue, replica) against a bare "
        "Starlette no-op app on uvicorn with the same TLS certificate and options, driven "
        "by the same client in its own process, alternating targets in rounds. Prints p50/"
        f"p99 at concurrency 1, requests/s at concurrency 32, and verdicts against the "
        f"reach (added p50 <= {REACH_ADDED_P50_MS:g} ms, throughput >= "
        f"{REACH_THROUGHPUT_RATIO:.0%} of bare).",
        epilog="Exit status: 0 when both verdicts pass, 1 when one misses, 2 on error (with "
        "--quick: 0 once both are printed).",
    )
    parser.add_argument(
        "--requests",
        type=int,
        metavar="N",
        help="measured requests per target per round at concurrency 1, unless --duration "
        "runs out first (default: 2000; --quick: 500)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        metavar="N",
        help="rounds per phase; targets alternate (default: 3; --quick: 1)",
    )
    parser.add_argument(
        "--duration",
        type=float,
        metavar="SECONDS",
        help="measured seconds per target per round at concurrency 32, and the most a "
        "concurrency-1 round may take (default: 4; --quick: 1)",
    )
    parser.add_argument(
        "--warmup",
        type=float,
        metavar="SECONDS",
        help="unmeasured load before each measured window: up to this long, and at "
        "concurrency 1 up to a tenth of --requests, at least 50 (default: 1; --quick: 0.5)",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=32,
        metavar="N",
        help="connections in the throughput phase (default: 32)",
    )
    parser.add_argument(
        "--client",
        choices=("raw", "httpx"),
        default="raw",
        help="load generator: asyncio streams + ssl (default), or httpx to compare",
    )
    parser.add_argument(
        "--bare-loop",
        choices=("auto", "asyncio", "uvloop"),
        default="auto",
        help="the bare app's event loop: auto picks uvloop when installed, as uvicorn does "
        "(default: auto)",
    )
    parser.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="let client and servers share all CPUs (default: the client gets a core alone)",
    )
    parser.add_argument(
        "--web-app",
        action="store_true",
        help="deploy the bare app's Starlette app as an @ember.asgi_app() endpoint instead",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="one round of each phase, 1 s windows: every figure and verdict in seconds, "
        "too few samples to judge a reach (exit 0 whichever the verdicts are)",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="FILE",
        help="sample the control plane with py-spy during the measured phases and write its "
        "stacks to FILE (the bare app's to FILE.bare), collapsed: one line per stack and "
        "its count, as flamegraph.pl and speedscope read them (sampling costs a few percent)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--client-process", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    defaults = {"requests": (2000, 500), "rounds": (3, 1), "duration": (4.0, 1.0)}
    defaults["warmup"] = (1.0, 0.5)
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.requests < 1 or args.rounds < 1 or args.duration <= 0 or args.concurrency < 1:
        parser.error("--requests, --rounds, --duration and --concurrency must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.client_process:
        return client_main()
    result: dict[str, Any] = {}
    try:
        run(args, result)
    except KeyboardInterrupt:
        print("interrupted; servers stopped", file=sys.stderr)
        return 130
    except Exception as exc:  # what the phases before measured is printed all the same
        failed = result.setdefault("failed", {"part": "the run", "error": ""})
        failed["error"] = f"{type(exc).__name__}: {exc}"
    raw = result.pop("raw", {})
    if "setup" in result:
        result["summary"] = summarize(raw, ("bare", "platform"))
        result["verdicts"] = verdicts(result["summary"])
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(report(result))
    if "failed" in result:
        failed = result["failed"]
        print(f"bench/gateway.py: {failed['part']} failed: {failed['error']}", file=sys.stderr)
        return 2
    if args.quick:  # a few samples: the verdicts are printed, not judged
        return 0
    verdict = result["verdicts"]
    return 0 if verdict["added_p50_pass"] and verdict["throughput_pass"] else 1


if __name__ == "__main__":
    sys.exit(main())

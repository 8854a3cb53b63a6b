"""Endpoints for the end-to-end tests of calls, errors and streaming."""

import asyncio
import os
import time

import ember


def host_pid() -> int:
    """This process's PID as the host sees it (replicas are PID 1 of their namespace)."""
    return int(os.environ.get("EMBER_REPLICA_PID") or os.readlink("/proc/self"))


ECHOES = ember.Counter("echoes", "Calls of echo, by how many times they repeat", ["times"])
LAST_LENGTH = ember.Gauge("echo_last_length", "Characters in echo's last answer")
TEXT_LENGTHS = ember.Histogram("echo_text_length", "Characters echo was given", buckets=[2, 10])


@ember.endpoint(concurrency=4, max_replicas=2)
def echo(text: str, times: int = 1) -> dict:
    print(f"echo called with {text!r}")
    ECHOES.inc(times=times)
    LAST_LENGTH.set(len(text) * times)
    TEXT_LENGTHS.observe(len(text))
    return {"text": text * times, "pid": host_pid()}


@ember.endpoint()
def boom(message: str = "kaboom") -> dict:
    raise ValueError(message)


@ember.endpoint(timeout=1.0, retries=0)
def sleepy(seconds: float) -> dict:
    time.sleep(seconds)
    return {"slept": seconds}


@ember.endpoint(concurrency=4)
def numbers(to: int = 3, delay: float = 0.0, refuse_at: int | None = None):
    for n in range(to):
        if n == refuse_at:
            raise ember.InputError(f"{n} is not for counting")
        time.sleep(delay)
        yield {"n": n}


@ember.endpoint(public=True)
async def open_echo(text: str = "") -> dict:
    return {"text": text}


@ember.endpoint(gpu="H100")
def needs_gpu() -> dict:
    return {}


@ember.endpoint()
def bad_return(nan: bool = False) -> object:
    return {"score": float("nan")} if nan else {1, 2}  # NaN is not JSON, nor a set


@ember.endpoint(max_replicas=1)
def sized(mib: float) -> dict:
    """A result of about `mib` MiB, and the replica's PID and how often it ran."""
    global runs
    runs += 1
    return {"text": "x" * int(mib * 1024 * 1024), "pid": host_pid(), "runs": runs}


runs = 0


@ember.endpoint(name="model", concurrency=2)
class Model:
    @ember.enter(snap=True)
    def load(self) -> None:
        print("loading model")
        self.factor = 3

    @ember.enter()
    def ready(self) -> None:
        self.ready_at = time.time()

    @ember.method
    def scale(self, x: float) -> dict:
        return {"y": x * self.factor}

    @ember.method
    async def info(self) -> dict:
        return {"factor": self.factor, "ready": self.ready_at > 0}

    @ember.method
    def tokens(self, n: int = 3):
        for i in range(n):
            yield {"token": i}

    @ember.method
    def patient(self, seconds: float) -> dict:
        """Sleeps in small steps, stopping early once its caller has gone."""
        began = time.monotonic()
        while time.monotonic() - began < seconds:
            if ember.cancelled():
                print(f"patient: the caller left; stopping after {time.monotonic() - began:.1f} s")
                return {"stopped": True}
            time.sleep(0.02)
        return {"stopped": False}

    @ember.method(path="v1/count", stream_flag="stream")
    def count(self, n: int = 3, stream: bool = False):
        """One answer or a stream of `n` events, as the call's `stream` asks."""
        if n < 0:
            raise ember.InputError(f"n must be 0 or more, not {n}")
        if stream:
            return ({"i": i} for i in range(n))
        return {"total": n}

    @ember.method(path="v2/count", stream_flag="stream")
    async def count_async(self, n: int = 3, stream: bool = False, lie: bool = False):
        """The same from a coroutine; `lie` returns an iterator to a plain call."""

        async def events():
            for i in range(n):
                yield {"i": i}

        return events() if stream or lie else {"total": n}

    @ember.exit
    def close(self) -> None:
        print("model closing")


@ember.endpoint(concurrency=1)
def forever(interval: float = 0.05):
    try:
        n = 0
        while True:
            time.sleep(interval)
            yield {"n": n}
            n += 1
    finally:
        print("forever: generator closed")


# A descriptor to write to from any forked child that runs Python (the at-fork hook).
_python_in_child: list[int] = []


def _mark_python_in_child() -> None:
    if _python_in_child:
        os.write(_python_in_child[0], b"x")


os.register_at_fork(after_in_child=_mark_python_in_child)


@ember.endpoint()
async def shell_out(word: str) -> dict:
    """The code's own asyncio subprocess, on the replica's loop: whether Python ran in the
    forked child before its exec (uvloop's own subprocesses run it)."""
    read_end, write_end = os.pipe()
    _python_in_child[:] = [write_end]
    try:
        child = await asyncio.create_subprocess_exec("echo", word, stdout=asyncio.subprocess.PIPE)
        out, _ = await child.communicate()
    finally:
        _python_in_child.clear()
        os.close(write_end)
    with os.fdopen(read_end, "rb") as marks:
        python_ran = marks.read() != b""
    return {
        "out": out.decode(),
        "status": child.returncode,
        "loop": type(asyncio.get_running_loop()).__name__,
        "python_in_child": python_ran,
    }

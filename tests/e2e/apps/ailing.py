"""A class endpoint whose health check the tests make fail (test_health_checks.py)."""

import os
import time

import ember


def host_pid() -> int:
    return int(os.environ.get("EMBER_REPLICA_PID") or os.readlink("/proc/self"))


@ember.endpoint(concurrency=4, scaledown_window=60)
class Ailing:
    @ember.enter()
    def ready(self) -> None:
        self.state = "well"

    @ember.method
    def pid(self) -> int:
        return host_pid()

    @ember.method
    def sicken(self, how: str) -> None:
        self.state = how

    @ember.method
    def slow(self, seconds: float) -> int:
        time.sleep(seconds)
        return host_pid()

    @ember.health_check(period=0.2, timeout=0.5, failures=2)
    def check(self) -> None:
        if self.state == "raises":
            raise RuntimeError("the GPU fell off the bus")
        if self.state == "hangs":
            time.sleep(3600)

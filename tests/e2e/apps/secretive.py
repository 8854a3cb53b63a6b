"""Endpoints that read the variables of the secret `greeting`."""

import os
import time

import ember


# Its own variables too; the secret's GREETING wins over the one here.
@ember.endpoint(secrets=["greeting"], env={"GREETING": "from env=", "MODE": "fast"})
def plain() -> dict:
    return {
        "greeting": os.environ.get("GREETING"),
        "token": os.environ.get("API_TOKEN"),
        "mode": os.environ.get("MODE"),
    }


@ember.endpoint(name="loaded", secrets=["greeting"], max_replicas=2, scaledown_window=60)
class Loaded:
    @ember.enter(snap=True)
    def load(self) -> None:
        self.at_load = os.environ.get("GREETING")  # before the snapshot, if one is taken
        self.loaded_pid = int(os.environ.get("EMBER_REPLICA_PID") or os.readlink("/proc/self"))

    @ember.method
    def info(self, seconds: float = 0.0) -> dict:
        time.sleep(seconds)
        return {
            "at_load": self.at_load,
            "now": os.environ.get("GREETING"),
            "restored": self.loaded_pid
            != int(os.environ.get("EMBER_REPLICA_PID") or os.readlink("/proc/self")),
        }

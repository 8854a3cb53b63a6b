"""An endpoint whose weights come from S3 through `weights=`: loaded in enter(snap=True),
one more tensor read lazily per call (after a restore too)."""

import os

import ember

URL = os.environ.get("EMBER_TEST_WEIGHTS_URL", "s3://weights/tiny.safetensors")
S3_ENDPOINT = os.environ.get("EMBER_TEST_S3_ENDPOINT")


def host_pid() -> int:
    return int(os.environ.get("EMBER_REPLICA_PID") or os.readlink("/proc/self"))


@ember.endpoint(
    name="tiny",
    weights={"model": URL},
    s3_endpoint_url=S3_ENDPOINT,
    max_replicas=3,
    scaledown_window=60,
)
class Tiny:
    @ember.enter(snap=True)
    def load(self) -> None:
        import torch

        self.loaded_pid = host_pid()
        self.model = torch.nn.Linear(16, 4)
        self.loaded = self.weights["model"].load_into(self.model, strict=False)

    @ember.method
    def info(self, seconds: float = 0.0) -> dict:
        import time

        time.sleep(seconds)
        view = self.weights["model"]
        return {
            "pid": host_pid(),
            "loaded_pid": self.loaded_pid,
            "loaded": sorted(self.loaded),
            "keys": sorted(view.keys()),
            "weight_sum": float(self.model.weight.sum()),
            "bias": self.model.bias.tolist(),
            "extra": view["extra"].tolist(),  # read now, through a fresh connection
        }

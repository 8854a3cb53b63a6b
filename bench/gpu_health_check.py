"""The worker's GPU health watch (worker/ember_worker/gpus/health.py) on this
machine's real GPUs through NVML: each GPU's state, what made it so, and the readings it
judged by, twice, a heartbeat apart.

    python bench/gpu_health_check.py [--dry-run]

Exit status 0 when NVML answered for every GPU nvidia-smi lists (whatever their health);
1 when a GPU's health is unknown or none is found. --dry-run (a machine without a GPU)
runs the same watch on two GPUs whose NVML answers are scripted (scripted_nvml.py): one
healthy, one with XID 79, and exits 0 when it judges them so."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from ember_worker.gpus import scripted_nvml
from ember_worker.gpus.health import GpuHealthWatch
from ember_worker.resources import GpuDevice, detect_gpus

HEARTBEAT_SECONDS = 2.0


def report(watch: GpuHealthWatch) -> list[str]:
    states = []
    for gpu in watch.check({}):
        why = "; ".join(gpu.reasons) or "-"
        fenced = "fenced" if gpu.fenced else "in service"
        print(f"GPU {gpu.index} ({gpu.kind}): {gpu.state}, {fenced} ({why})")
        states.append(gpu.state)
    return states


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    if args.dry_run:
        folder = tempfile.mkdtemp(prefix="ember-nvml-")
        script = Path(folder) / "nvml.json"
        script.write_text(json.dumps({"gpus": [{}, {"xids": [79]}]}))
        os.environ[scripted_nvml.SCRIPT_ENV] = str(script)
        devices = [GpuDevice("H100", 0), GpuDevice("H100", 1)]
    else:
        devices = detect_gpus()
    if not devices:
        print("FAIL: no GPU found (nvidia-smi lists none)")
        return 1
    watch = GpuHealthWatch(devices, scripted_nvml.nvml_module)
    first = report(watch)
    time.sleep(HEARTBEAT_SECONDS)
    print("a heartbeat later:")
    second = report(watch)
    if args.dry_run:
        ok = first == second == ["healthy", "failed"]
        print("dry run:", "judged as scripted" if ok else "FAIL: not judged as scripted")
        return 0 if ok else 1
    unknown = [i for i, state in enumerate(second) if state == "unknown"]
    if unknown:
        print(f"FAIL: health unknown for GPU {', '.join(map(str, unknown))}")
        return 1
    print(f"every GPU read: {', '.join(second)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

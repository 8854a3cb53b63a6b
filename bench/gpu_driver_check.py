"""What a GPU replica on an image gets of this node's NVIDIA driver (docs/images.md, GPU
images): the files found (worker/ember_worker/agent/replicas/gpu_driver_files.py), each
with where it is mounted inside, then nvidia-smi run from a folder laid out as the
replica's /ember/driver is (links named as the mounts are), that folder on
LD_LIBRARY_PATH (ahead of the loader's cache) and PATH.

    python bench/gpu_driver_check.py [--dry-run]

Exit status 0 when libcuda.so.1, libnvidia-ml.so.1 and nvidia-smi are found and that
nvidia-smi lists a GPU; 1 otherwise. --dry-run (a machine without a GPU) prints what is
found and exits 0."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from ember_worker.agent.replicas.gpu_driver_files import DRIVER_INSIDE, node_driver_files

NEEDED = ("lib/libcuda.so.1", "lib/libnvidia-ml.so.1", "bin/nvidia-smi")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    found = node_driver_files()
    for host, inside in found.mounts:
        print(f"{inside} <- {host}")
    names = {path.removeprefix(DRIVER_INSIDE + "/") for _, path in found.mounts}
    missing = [name for name in NEEDED if name not in names]
    if args.dry_run:
        print(f"dry run: {len(found.mounts)} file(s) found; missing: {missing or 'none'}")
        return 0
    if missing:
        print(f"FAIL: not found: {', '.join(missing)}")
        return 1
    with tempfile.TemporaryDirectory() as folder:
        for host, path in found.mounts:
            link = Path(folder) / path.removeprefix(DRIVER_INSIDE + "/")
            link.parent.mkdir(exist_ok=True)
            link.symlink_to(host)
        env = found.env({"PATH": ""})
        env["LD_LIBRARY_PATH"] = env["LD_LIBRARY_PATH"].replace(DRIVER_INSIDE, folder)
        env["PATH"] = env["PATH"].replace(DRIVER_INSIDE, folder)
        ran = subprocess.run(
            [f"{folder}/bin/nvidia-smi", "-L"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    print(ran.stdout.strip() or ran.stderr.strip())
    if ran.returncode != 0 or "GPU 0" not in ran.stdout:
        print(f"FAIL: nvidia-smi -L exited with {ran.returncode}")
        return 1
    print("PASS: the driver's files a replica on an image gets run nvidia-smi")
    return 0


if __name__ == "__main__":
    sys.exit(main())

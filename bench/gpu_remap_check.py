"""GPU check of the CUDA checkpoint calls Ember makes, without CRIU: in place, twice.

A restored replica that gets other GPUs than its snapshot's has the CUDA driver move its
device memory onto them: `CudaCheckpointer.restore(pid, gpu_pairs)` hands the driver
(old UUID, new UUID) pairs, which cuda-bindings 13 has (`CUcheckpointRestoreArgs`). A
machine with one GPU cannot show a move, but it can show that the driver takes the
arguments Ember builds. In under a minute:

1. a child process puts a known tensor on the GPU and waits;
2. Ember's checkpointer locks it and moves its device memory to the host, then
   restores and unlocks it with no pairs (what a restore onto the same GPU does);
3. the same again, restoring with the pair (this GPU's UUID, this GPU's UUID);
4. after each cycle the child checks its tensor, bit for bit, and computes on it.

    python3 bench/gpu_remap_check.py   # on the GPU machine, with Ember installed

Exit status 0 when every check passes, 1 when one fails; on a machine without an NVIDIA
GPU it prints "skipped: no NVIDIA GPU" and exits 0. Older cuda-bindings (12.x) run step 2
and report step 3 as not possible there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

# Its tensor's bytes and a kernel's result on it, compared before and after each cycle.
CHILD = """
import sys, torch
x = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
expected = x.cpu().clone()
before = (x * 2).sum().item()
print("ready", flush=True)
for line in sys.stdin:
    print(torch.equal(x.cpu(), expected), (x * 2).sum().item() == before, flush=True)
"""


def main() -> int:
    from ember_worker.resources import detect_gpus
    from ember_worker.snapshots.cuda_checkpoint import detect, gpu_node

    if not gpu_node():
        print("skipped: no NVIDIA GPU")
        return 0
    began = time.monotonic()
    failures = 0

    def check(ok: bool, what: str) -> None:
        nonlocal failures
        print(f"{'PASS' if ok else 'FAIL'}: {what}", flush=True)
        failures += not ok

    cuda, problem = detect()
    if cuda is None:
        check(False, f"the CUDA checkpoint API is not usable here: {problem}")
        return 1
    gpus = detect_gpus()
    if not gpus or gpus[0].uuid is None:
        check(False, "nvidia-smi gave no GPU UUID")
        return 1
    uuid = gpus[0].uuid
    print(f"GPU 0: {gpus[0].kind} {uuid}; GPU pairs possible: {cuda.can_remap}", flush=True)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": uuid},
    )
    try:
        assert child.stdin is not None and child.stdout is not None
        check(child.stdout.readline().strip() == "ready", "the child put its tensor on the GPU")
        cycles = [("no pairs", [])]
        if cuda.can_remap:
            cycles.append(("the pair (this GPU, this GPU)", [(uuid, uuid)]))
        else:
            print("not possible here: GPU pairs need cuda-bindings 13 and a CUDA 13 driver")
        for name, pairs in cycles:
            out = cuda.checkpoint(child.pid)
            back = cuda.restore(child.pid, pairs)
            child.stdin.write("check\n")
            child.stdin.flush()
            answer = child.stdout.readline().split()
            check(
                answer == ["True", "True"],
                f"checkpoint {out:.3f} s, restore with {name} {back:.3f} s: the tensor is "
                f"intact and a kernel on it gives the same sum ({' '.join(answer) or 'no answer'})",
            )
    except Exception as exc:  # a driver error is a result here, not a crash
        check(False, f"{type(exc).__name__}: {exc}")
    finally:
        child.kill()
        child.wait()
    verdict = "PASS" if not failures else "FAIL"
    print(f"{verdict}: GPU remap check ({time.monotonic() - began:.0f} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

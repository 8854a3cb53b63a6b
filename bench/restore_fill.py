"""How fast CRIU fills a restored process's memory: 4 KiB pages against 2 MiB pages.

    .venv/bin/python bench/restore_fill.py              # about a minute, as root
    .venv/bin/python bench/restore_fill.py --quick      # 64 MB, 2 rounds, 0.2 s apart
    .venv/bin/python bench/restore_fill.py --mb 2048 --json

A process holding `--mb` of dense memory (as weights are) is dumped once with CRIU. The
same image is then restored `--rounds` times each way, the order alternating: as dumped
(4 KiB pages) and from the view of it that `ember worker --huge-pages` makes
(ember_worker.snapshots.huge_pages: its dense mappings advised MADV_HUGEPAGE, which the CRIU that
infra/criu.sh builds applies before it reads the pages in). Each restore is timed from
`criu restore` to its exit, with CRIU's own restore time and the huge pages the restored
process got; restores are `--gap` seconds apart, as replica starts are.

It prints the p50 both ways and their ratio, and whether the machine is a VM whose host
takes free memory back (virtio-balloon free page reporting), where a huge page is mostly
memory the host must fault in again. No reach: it tells whether `--huge-pages` pays on a
machine. Exit status 0, or 2 on an error (after what was measured before it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from procs import Parts

# The process whose memory is restored: dense bytes, then it waits to be dumped.
HOLDER = """
import os, sys, time
block = os.urandom(1 << 20)
held = bytearray(block * int(sys.argv[1]))
open(sys.argv[2], "w").write("ready")
while True:
    time.sleep(1)
"""
REPORTING_FEATURE = 5  # VIRTIO_BALLOON_F_REPORTING


def free_page_reporting() -> bool:
    """Whether a virtio balloon on this machine reports free pages to its host."""
    for features in Path("/sys/bus/virtio/drivers/virtio_balloon").glob("virtio*/features"):
        bits = features.read_text().strip()
        if len(bits) > REPORTING_FEATURE and bits[REPORTING_FEATURE] == "1":
            return True
    return False


def huge_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def restore_time(images: Path) -> float:
    """CRIU's own restore time, from the stats it writes beside the image."""
    import pycriu

    with (images / "stats-restore").open("rb") as handle:
        entry = pycriu.images.load(handle)["entries"][0]
    return int(entry["restore"]["restore_time"]) / 1e6


def gone(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}").exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"process {pid} did not go away")
        time.sleep(0.01)


def dump_holder(criu: str, megabytes: int, work: Path) -> tuple[int, Path]:
    ready = work / "ready"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(megabytes), str(ready)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own session: CRIU dumps it alone
    )
    while not ready.exists():
        if holder.poll() is not None:
            raise RuntimeError(f"the holder process exited with {holder.returncode}")
        time.sleep(0.05)
    images = work / "image" / "images"
    images.mkdir(parents=True)
    dumped = subprocess.run(
        [criu, "dump", "-t", str(holder.pid), "-D", str(images), "-o", "dump.log"],
        capture_output=True,
        text=True,
    )
    holder.wait()
    if dumped.returncode:
        log = (images / "dump.log").read_text()[-2000:]
        raise RuntimeError(f"criu dump failed ({dumped.returncode}):\n{log}")
    return holder.pid, images


def restore_once(criu: str, images: Path, pid: int) -> dict[str, float]:
    started = time.perf_counter()
    restored = subprocess.run(
        [criu, "restore", "-d", "-D", str(images), "-o", "restore.log"],
        capture_output=True,
        text=True,
    )
    seconds = time.perf_counter() - started
    if restored.returncode:
        log = (images / "restore.log").read_text()[-2000:]
        raise RuntimeError(f"criu restore failed ({restored.returncode}):\n{log}")
    sample = {"seconds": seconds, "criu_seconds": restore_time(images), "huge_kb": huge_kb(pid)}
    os.kill(pid, signal.SIGKILL)
    gone(pid)
    return sample


def run(args: argparse.Namespace, parts: Parts, result: dict[str, Any]) -> None:
    """Fill `result` as the parts go: the image's figures, then each restore's sample."""
    from ember_worker.snapshots.huge_pages import huge_page_images, huge_pages_problem
    from ember_worker.snapshots.support import detect_support

    parts.now = "the checks of CRIU and huge pages"
    support = detect_support(None)
    if support.problem or support.criu_binary is None:
        raise RuntimeError(f"CRIU cannot be used here: {support.problem}")
    if problem := huge_pages_problem():
        raise RuntimeError(problem)
    criu = support.criu_binary
    result.update(
        criu=criu,
        megabytes=args.mb,
        gap_seconds=args.gap,
        free_page_reporting=free_page_reporting(),
    )
    work = Path(tempfile.mkdtemp(prefix="ember-restore-fill-"))
    try:
        parts.now = "the dump"
        pid, images = dump_holder(criu, args.mb, work)
        parts.now = "the huge-page view"
        view, advice = huge_page_images(images)
        result["image_bytes"] = sum(p.stat().st_size for p in images.glob("pages-*.img"))
        result["advised_bytes"] = advice.bytes if advice else 0
        for path in images.iterdir():  # into the page cache, as a node's cached image is
            if path.is_file():
                path.read_bytes()
        ways = {"small": images, "huge": view}
        samples: dict[str, list[dict[str, float]]] = {"small": [], "huge": []}
        result["samples"] = samples
        for number in range(args.rounds):
            order = ("small", "huge") if number % 2 == 0 else ("huge", "small")
            for way in order:
                parts.now = f"round {number + 1}, the restore with {way} pages"
                time.sleep(args.gap)
                samples[way].append(restore_once(criu, ways[way], pid))
                if not args.quiet:
                    s = samples[way][-1]
                    print(
                        f"round {number + 1}/{args.rounds} {way:5}: {s['seconds']:.3f} s "
                        f"(CRIU {s['criu_seconds']:.3f} s, {s['huge_kb'] / 1024:.0f} MiB huge)",
                        file=sys.stderr,
                    )
    finally:
        shutil.rmtree(work, ignore_errors=True)


def summarize(result: dict[str, Any]) -> None:
    """The p50 of each way that has samples, and their ratio once both have."""
    samples = result.get("samples", {})
    p50 = {
        way: statistics.median(s["seconds"] for s in group)
        for way, group in samples.items()
        if group
    }
    result["p50_seconds"] = p50
    if len(p50) == 2:
        result["huge_over_small"] = p50["huge"] / p50["small"]


def report(result: dict[str, Any]) -> str:
    if "image_bytes" not in result:
        return "no image: nothing measured"
    p50 = result["p50_seconds"]
    gb = result["image_bytes"] / 1e9
    lines = [
        f"image: {result['image_bytes'] / 1e6:.0f} MB of pages, "
        f"{result['advised_bytes'] / 1e6:.0f} MB advised for huge pages ({result['criu']})",
    ]
    for way, label in (("small", "4 KiB pages"), ("huge", "2 MiB pages")):
        if way not in p50:
            continue
        times = ", ".join(f"{s['seconds']:.3f}" for s in result["samples"][way])
        huge = statistics.median(s["huge_kb"] for s in result["samples"][way]) / 1024
        lines.append(
            f"{label}: {p50[way]:.3f} s p50 = {gb / p50[way]:.2f} GB/s "
            f"[{times}], {huge:.0f} MiB in huge pages"
        )
    if "huge_over_small" in result:
        lines.append(f"huge/small: {result['huge_over_small']:.2f}x the time")
    if result["free_page_reporting"]:
        lines.append(
            "this machine is a VM whose balloon reports free pages to its host: huge pages "
            "are mostly memory the host faults in again (keep --huge-pages off here)"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="bench/restore_fill.py",
        description="Restore one CRIU image of a process holding dense memory, alternating "
        "4 KiB pages (as dumped) and 2 MiB pages (the view `ember worker --huge-pages` "
        "makes), and print both times and their ratio. Needs root and CRIU.",
    )
    parser.add_argument("--mb", type=int, default=None, help="memory held (768; quick 64)")
    parser.add_argument("--rounds", type=int, default=None, help="restores each way (6; quick 2)")
    parser.add_argument(
        "--gap",
        type=float,
        default=None,
        help="seconds between restores, as between replica starts (3; quick 0.2)",
    )
    parser.add_argument("--quick", action="store_true", help="64 MB, 2 rounds, 0.2 s apart")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args()
    for name, (full, quick) in {"mb": (768, 64), "rounds": (6, 2), "gap": (3.0, 0.2)}.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    parts = Parts("bench/restore_fill.py")
    result: dict[str, Any] = {}
    failed = None
    try:
        run(args, parts, result)
    except Exception as error:
        failed = error
    summarize(result)
    return 2 if parts.show(result, failed, args.json, report) else 0


if __name__ == "__main__":
    sys.exit(main())

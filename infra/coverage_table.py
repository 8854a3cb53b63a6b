"""Combine the test run's coverage data and print it per package, with the floor.

    .venv/bin/python infra/coverage_table.py           # the table; fails below the floor
    .venv/bin/python infra/coverage_table.py --no-floor  # a partial run: the table only

infra/test.sh runs it after pytest. The data holds every Python process the run started
(pytest itself, servers, agents, replicas cold and restored, CLI calls): see
[tool.coverage.run] in pyproject.toml. A package is a folder of source; the floor is
[tool.coverage.report] fail_under, on the total.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import warnings
from collections import defaultdict
from pathlib import Path

import coverage

ROOT = Path(__file__).resolve().parents[1]


def per_package(files: dict[str, dict[str, dict[str, int]]]) -> dict[str, tuple[int, int]]:
    """Statements and covered statements of each folder, from a JSON report's files."""
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for name, report in files.items():
        folder = Path(name).resolve().parent
        key = str(folder.relative_to(ROOT)) if folder.is_relative_to(ROOT) else str(folder)
        summary = report["summary"]
        totals[key][0] += summary["num_statements"]
        totals[key][1] += summary["covered_lines"]
    return {key: (stmts, covered) for key, (stmts, covered) in sorted(totals.items())}


def percent(covered: int, statements: int) -> float:
    return 100.0 * covered / statements if statements else 100.0


def table(packages: dict[str, tuple[int, int]]) -> list[str]:
    width = max(len(name) for name in packages)
    lines = [f"{'package':<{width}}  {'statements':>10}  {'missed':>7}  {'cover':>6}"]
    for name, (statements, covered) in packages.items():
        cover = percent(covered, statements)
        lines.append(f"{name:<{width}}  {statements:>10}  {statements - covered:>7}  {cover:5.1f}%")
    statements = sum(s for s, _ in packages.values())
    covered = sum(c for _, c in packages.values())
    total = percent(covered, statements)
    lines.append(f"{'total':<{width}}  {statements:>10}  {statements - covered:>7}  {total:5.1f}%")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--no-floor", action="store_true", help="print the table only")
    args = parser.parse_args(argv)
    cov = coverage.Coverage(config_file=str(ROOT / "pyproject.toml"))
    cov.load()
    with warnings.catch_warnings(record=True) as unread:
        warnings.simplefilter("always")
        cov.combine()
    cov.save()
    if unread:
        # A process killed (SIGKILL) while it wrote its data leaves a file it never finished.
        print(f"coverage: {len(unread)} data file(s) could not be read and were left out")
    if not cov.get_data().measured_files():
        print("coverage: no data was recorded (was the run started under coverage?)")
        return 1
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "coverage.json"
        cov.json_report(outfile=str(report))
        files = json.loads(report.read_text())["files"]
    packages = per_package(files)
    print("\n".join(table(packages)))
    statements = sum(s for s, _ in packages.values())
    total = percent(sum(c for _, c in packages.values()), statements)
    floor = float(cov.get_option("report:fail_under") or 0)  # type: ignore[arg-type]
    if args.no_floor or not floor:
        return 0
    if total < floor:
        print(f"coverage: {total:.1f}% is below the floor of {floor:.0f}% (pyproject.toml)")
        return 1
    print(f"coverage: {total:.1f}% (floor {floor:.0f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

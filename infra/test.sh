#!/usr/bin/env bash
# Install everything the tests need, check lint and format, and run the whole suite under
# coverage (every Python process it starts included), then print coverage per package.
set -euo pipefail
cd "$(dirname "$0")/.."
# The suite starts some thousands of Python processes (servers, workers, replicas, CLI
# calls): with bytecode caching off (a setting some machines carry) each one compiles
# Ember's modules again, about 0.1 s of CPU a process.
unset PYTHONDONTWRITEBYTECODE
bash infra/install.sh --test
# Fails, naming the cause, when a root Linux machine cannot take snapshots (install.sh
# only warns then), unless EMBER_TEST_ALLOW_SKIP names criu.
.venv/bin/python tests/machine_needs.py
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/lint-imports  # the layering contracts in pyproject.toml
if [ "${EMBER_TEST_COVERAGE:-1}" = 0 ]; then
    exec .venv/bin/python -m pytest "$@"
fi
rm -rf .coverage-data
# Every process writes its data here, replicas too: they run as unprivileged users.
mkdir -m 1777 .coverage-data
status=0
.venv/bin/python -m coverage run -m pytest "$@" || status=$?
# The floor (pyproject.toml) is for the whole suite; a run of some tests prints the table.
floor=()
if [ $# -gt 0 ]; then floor=(--no-floor); fi
.venv/bin/python infra/coverage_table.py "${floor[@]}" || { [ "$status" -ne 0 ] || status=1; }
exit "$status"

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
pytest=(.venv/bin/python -m pytest)
if [ "${EMBER_TEST_COVERAGE:-1}" != 0 ]; then
    rm -rf .coverage-data
    # Every process writes its data here, replicas too: they run as unprivileged users.
    mkdir -m 1777 .coverage-data
    pytest=(.venv/bin/python -m coverage run -m pytest)
fi
status=0
if [ $# -gt 0 ]; then
    "${pytest[@]}" "$@" || status=$?
else
    # tests/unit runs in-process, one core a test: two processes share it (pytest-xdist),
    # whole files to each so a module's fixtures are made once. Then the rest (the LLM
    # engine's unit tests, the e2e, security, bench and weights tests) on three
    # processes: mostly servers and replicas starting and waiting, so three at once keep
    # two cores busier than two did (the e2e took 1290 s on three, 1587 s on two, in
    # clean-clone runs on 2 cores); a module at a time to each (its servers made once),
    # the modules that run torch on every core all to one of them, one after another
    # (tests/conftest.py's TORCH_ON_EVERY_CORE).
    rest=()
    for folder in tests/*/; do
        case "$folder" in tests/unit/ | */__pycache__/) ;; *) rest+=("$folder") ;; esac
    done
    "${pytest[@]}" -n 2 --dist loadfile tests/unit --ignore=tests/unit/test_llm_engine.py \
        || status=$?
    "${pytest[@]}" -n 3 --dist loadfile tests/unit/test_llm_engine.py "${rest[@]}" \
        || status=$?
fi
if [ "${EMBER_TEST_COVERAGE:-1}" = 0 ]; then
    exit "$status"
fi
# The floor (pyproject.toml) is for the whole suite; a run of some tests prints the table.
floor=()
if [ $# -gt 0 ]; then floor=(--no-floor); fi
.venv/bin/python infra/coverage_table.py "${floor[@]}" || { [ "$status" -ne 0 ] || status=1; }
exit "$status"

#!/usr/bin/env bash
# Install everything the tests need, check lint and format, and run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash infra/install.sh --test
# Fails, naming the cause, when a root Linux machine cannot take snapshots (install.sh
# only warns then), unless EMBER_TEST_ALLOW_SKIP names criu.
.venv/bin/python tests/machine_needs.py
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/lint-imports  # the layering contracts in pyproject.toml
exec .venv/bin/python -m pytest "$@"

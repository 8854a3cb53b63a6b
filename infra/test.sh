#!/usr/bin/env bash
# Install everything the tests need, check lint and format, and run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash infra/install.sh --test
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/lint-imports  # the layering contracts in pyproject.toml
exec .venv/bin/python -m pytest "$@"

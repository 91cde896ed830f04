#!/usr/bin/env bash
# The test command (README, CI): bootstrap the venv, lint, type-check, then run the default test suite.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -m slow` for the scale tests).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/ruff check plate_inspect cli reports tests benchmarks
.venv/bin/ruff format --check plate_inspect cli reports tests benchmarks
.venv/bin/mypy  # [tool.mypy] in pyproject.toml: plate_inspect, reports, cli (the package ships py.typed)
.venv/bin/python -m pytest -q "$@"

#!/usr/bin/env bash
# Install gpuremote with its test tools into .venv, then lint, type-check and run the tests.
set -euo pipefail
EXTRAS="test,ray" source "$(dirname "$0")/_venv.sh"
.venv/bin/ruff check gpuremote transports bench tests examples
.venv/bin/ruff format --check gpuremote transports bench tests examples
.venv/bin/mypy gpuremote transports bench
.venv/bin/python -m pytest "$@"

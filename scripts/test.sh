#!/usr/bin/env bash
# Install gpuremote with its test tools into .venv, then lint, type-check and run the tests.
set -euo pipefail
# torch: the exact version whose private backend APIs gpuremote.torch is tested with, first
PREINSTALL="torch==2.13.0" EXTRAS="test,ray,torch" source "$(dirname "$0")/_venv.sh"
# ucx:// (the [ucx] extra): its tests run where ucxx installs, and skip, with the reason, where not
if ! .venv/bin/python -c "import ucxx" 2>/dev/null; then
    .venv/bin/python -m pip install --quiet -e ".[ucx]" \
        || echo "the [ucx] extra did not install: the ucx:// tests will skip" >&2
fi
.venv/bin/ruff check gpuremote transports bench tests examples
.venv/bin/ruff format --check gpuremote transports bench tests examples
.venv/bin/mypy gpuremote transports bench
./scripts/lint_imports.sh  # the layers: import-linter's contracts in pyproject.toml
.venv/bin/python -m pytest "$@"

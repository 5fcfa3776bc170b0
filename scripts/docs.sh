#!/usr/bin/env bash
# Build the documentation site (mkdocs, strict: a broken link or reference fails) into site/,
# then serve it at http://127.0.0.1:8000 (--build-only: build and stop).
set -euo pipefail
EXTRAS="docs" source "$(dirname "$0")/_venv.sh"
.venv/bin/mkdocs build --strict
if [[ ${1:-} != --build-only ]]; then
    exec .venv/bin/mkdocs serve --dev-addr 127.0.0.1:8000
fi

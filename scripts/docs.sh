#!/usr/bin/env bash
# Build the documentation site (mkdocs, strict: a broken link or reference fails) into site/,
# then serve it at http://127.0.0.1:8000 (--build-only: build and stop).
set -euo pipefail
# the API reference documents gpuremote.torch: the site needs the CPU build of torch it is
# tested with (first, and held while the rest installs)
PREINSTALL="torch==2.13.0" CONSTRAINTS="scripts/constraints.txt" EXTRAS="docs,torch" \
    source "$(dirname "$0")/_venv.sh"
.venv/bin/mkdocs build --strict
if [[ ${1:-} != --build-only ]]; then
    exec .venv/bin/mkdocs serve --dev-addr 127.0.0.1:8000
fi

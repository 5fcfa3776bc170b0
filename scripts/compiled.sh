#!/usr/bin/env bash
# Build gpuremote's wheel (the hot modules compiled by mypyc, setup.py) and unpack it into
# .whl/site, where PYTHONPATH=.whl/site runs it beside .venv's packages:
#   ./scripts/compiled.sh && cd .whl && PYTHONPATH=site ../.venv/bin/gpuremote --version
# (from a folder without the sources: the working directory comes first on the path)
# Prints the build the wheel holds ("compiled", or "pure" where mypyc or a C compiler is
# missing); used by scripts/test.sh and scripts/eval_mypyc.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl build
.venv/bin/python -m pip wheel --quiet --no-deps --wheel-dir .whl . 2>.whl.log \
    || { cat .whl.log >&2; exit 1; }
.venv/bin/python -m zipfile -e .whl/gpuremote-*.whl .whl/site
rm -f .whl.log
cd .whl && PYTHONPATH=site ../.venv/bin/python -c "from gpuremote import _build; print(_build.build())"

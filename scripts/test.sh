#!/usr/bin/env bash
# Install gpuremote with its test tools into .venv, then lint, type-check and run the tests.
#   ./scripts/test.sh [PYTEST_ARGS]          everything: what CI runs (a fresh clone: ~13 min)
#   ./scripts/test.sh --quick [PYTEST_ARGS]  the inner loop: no installs once .venv exists,
#                                            the checks, and the tests not marked slow (~1.5 min)
set -euo pipefail
cd "$(dirname "$0")/.."
QUICK=0
if [[ ${1:-} == --quick ]]; then
    QUICK=1
    shift
fi
if (( ! QUICK )) || [ ! -x .venv/bin/python ]; then
    # torch: the exact version whose private backend APIs gpuremote.torch is tested with,
    # first (and held while the rest installs: transformers and diffusers would pull a newer
    # one)
    PREINSTALL="torch==2.13.0" CONSTRAINTS="scripts/constraints.txt" \
        EXTRAS="test,ray,torch,docs,models" source scripts/_venv.sh
    # a headless browser for the docs site's test (Debian's chromium), where apt can install
    # it; without one that test skips, saying why
    if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        { apt-get install -y -q chromium || { apt-get update -q && apt-get install -y -q chromium; }; } \
            >/dev/null 2>&1 || echo "chromium did not install: the docs' browser test will skip" >&2
    fi
    # ucx:// (the [ucx] extra): its tests run where ucxx installs, and skip, with the reason,
    # where not
    if ! .venv/bin/python -c "import ucxx" 2>/dev/null; then
        .venv/bin/python -m pip install --quiet -c scripts/constraints.txt -e ".[ucx]" \
            || echo "the [ucx] extra did not install: the ucx:// tests will skip" >&2
    fi
fi
.venv/bin/ruff check gpuremote transports bench tests examples
.venv/bin/ruff format --check gpuremote transports bench tests examples
.venv/bin/mypy gpuremote transports bench
./scripts/lint_imports.sh  # the layers: import-linter's contracts in pyproject.toml
if (( QUICK )); then
    exec .venv/bin/python -m pytest -q -m "not slow" "$@"
fi
# the documentation site: a broken link or reference fails the build
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$(mktemp -d)"
.venv/bin/python -m pytest "$@"
# the compiled build: the wheel's hot modules (mypyc: scripts/compiled.sh), where a C compiler
# and Python's headers are present; the hot path's tests run on it as well (the editable
# install above runs the sources). There, a wheel that fell back to pure Python fails here
# instead of passing unnoticed.
build=$(./scripts/compiled.sh)
if [ "$build" = compiled ]; then
    # (from .whl: the working directory, first on the path, must not hold the sources)
    (cd .whl && GPUREMOTE_EXPECT_COMPILED=1 PYTHONPATH=site ../.venv/bin/python -m pytest \
        -m "not slow" ../tests/test_native.py ../tests/test_protocol.py ../tests/test_framing.py \
        ../tests/test_executor.py ../tests/test_client.py ../tests/test_inproc.py \
        ../tests/test_arraycore.py ../tests/test_steps.py ../tests/test_device_queue.py \
        ../tests/test_xp.py ../tests/test_security.py ../tests/test_torch.py \
        ../tests/test_deadlines.py ../tests/test_connections.py ../tests/test_faults.py "$@")
elif [ "${GPUREMOTE_COMPILE:-1}" != 0 ] && command -v "${CC:-cc}" >/dev/null 2>&1 \
    && .venv/bin/python -c "import os, sysconfig, sys; \
sys.exit(not os.path.isfile(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))"; then
    echo "the wheel's hot modules did not compile, though a C compiler is here" >&2
    exit 1
fi

# Shared by scripts/demo.sh and scripts/test.sh: make .venv (once) and install gpuremote into it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    if ! "$PYTHON" -m venv .venv; then
        echo "could not create a virtual environment with $PYTHON;" \
             "on Debian/Ubuntu: apt-get install python3-venv" >&2
        exit 1
    fi
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# exact versions first (PREINSTALL): torch==2.13.0 is the CPU build here; an extra's range
# alone could pull a multi-GB CUDA build
if [ -n "${PREINSTALL:-}" ]; then
    # shellcheck disable=SC2086
    .venv/bin/python -m pip install --quiet $PREINSTALL
fi
# CONSTRAINTS: a file of versions held while the extras install (torch, for one)
HOLD=()
if [ -n "${CONSTRAINTS:-}" ]; then
    HOLD=(-c "$CONSTRAINTS")
fi
if [ -n "${EXTRAS:-}" ]; then
    .venv/bin/python -m pip install --quiet "${HOLD[@]}" -e ".[$EXTRAS]"
else
    .venv/bin/python -m pip install --quiet "${HOLD[@]}" -e .
fi

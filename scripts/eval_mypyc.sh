#!/usr/bin/env bash
# Issue #41's third step, measured: the hot modules as the install compiled them (mypyc, by
# setup.py) against their Python source (GPUREMOTE_PURE=1), by scripts/floor_xp_op.py (the xp
# synchronous op in one process), in the same run, alternating.
#
#   ./scripts/eval_mypyc.sh [ROUNDS]      (needs .venv, installed where a C compiler is present)
#
# Compiled code enforces annotations: a value that an annotation misstates changes (an
# ``int`` parameter given ``True`` turns it into ``1``; that is how a misstated ``ack: int``
# made the proxy never acknowledge, until it was annotated ``bool | int``); cProfile cannot
# see calls inside compiled code, so compare times, not call counts.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-2}
PY=$PWD/.venv/bin/python
build=$("$PY" -c "import gpuremote._native as n; print(n.build(), n.pure_reason() or '')")
if [ "${build%% *}" != compiled ]; then
    echo "the hot modules are not compiled here ($build): pip install -e . compiles them" >&2
    exit 1
fi
for i in $(seq "$ROUNDS"); do
    echo "== round $i: pure Python (GPUREMOTE_PURE=1)"
    GPUREMOTE_PURE=1 "$PY" scripts/floor_xp_op.py
    echo "== round $i: the compiled hot modules"
    "$PY" scripts/floor_xp_op.py
done

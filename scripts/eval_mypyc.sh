#!/usr/bin/env bash
# The hot modules compiled (mypyc: the wheel scripts/compiled.sh builds, in .whl/site) against
# their Python source (the editable install in .venv), by scripts/floor_xp_op.py (the xp
# synchronous op in one process), in the same run, alternating.
#
#   ./scripts/eval_mypyc.sh [ROUNDS]      (needs .venv; a C compiler for the compiled side)
#
# Compiled code enforces annotations: a value that an annotation misstates changes (an
# ``int`` parameter given ``True`` turns it into ``1``; that is how a misstated ``ack: int``
# made the proxy never acknowledge, until it was annotated ``bool | int``); cProfile cannot
# see calls inside compiled code, so compare times, not call counts.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-2}
PY=$PWD/.venv/bin/python
build=$(./scripts/compiled.sh)
if [ "$build" != compiled ]; then
    echo "the wheel's hot modules are not compiled here ($build): mypyc and a C compiler" >&2
    exit 1
fi
for i in $(seq "$ROUNDS"); do
    echo "== round $i: pure Python (the editable install)"
    "$PY" scripts/floor_xp_op.py
    echo "== round $i: the compiled hot modules (the wheel)"
    PYTHONPATH=.whl/site "$PY" scripts/floor_xp_op.py
done

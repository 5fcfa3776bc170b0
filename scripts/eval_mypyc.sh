#!/usr/bin/env bash
# Issue #41's third step, measured: the hot modules compiled with mypyc, against the same
# commit in pure Python, by scripts/floor_xp_op.py (the xp synchronous op in one process), in
# the same run, alternating. Builds in a temporary copy of HEAD; leaves the tree as it is.
#
#   ./scripts/eval_mypyc.sh [ROUNDS]      (needs .venv with the [test] extra: mypy, a C compiler)
#
# The copy is patched only where mypyc requires it: the classes that interpreted classes
# subclass (RemoteArray, the xp Array, the xp Device's driver, the proxy's Executor) are marked
# @mypyc_attr(allow_interpreted_subclasses=True), and one reversed() that mypyc 2.4 cannot
# compile is a slice. Note what compiling changes besides speed:
# compiled code enforces annotations, so a value that an annotation misstates changes (an
# ``int`` parameter given ``True`` turns it into ``1``; that is how a misstated ``ack: int``
# made the proxy never acknowledge, until it was annotated ``bool | int``); cProfile cannot
# see calls inside compiled code, so compare times, not call counts.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-2}
PY=$PWD/.venv/bin/python
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT  # KEEP_TMP=1 keeps it
[ -n "${KEEP_TMP:-}" ] && trap - EXIT
git archive HEAD | tar -x -C "$TMP"
HOT=(
    gpuremote/wire/protocol.py gpuremote/wire/framing.py gpuremote/wire/limits.py
    gpuremote/wire/calls.py gpuremote/session/pipeline.py gpuremote/core/arrays.py
    gpuremote/core/driver.py gpuremote/proxy/state.py gpuremote/proxy/executor.py
    gpuremote/proxy/session.py gpuremote/proxy/devicequeue.py
    gpuremote/proxy/handlers/launches.py gpuremote/proxy/scheduler.py
)
(
    cd "$TMP"
    "$PY" - <<'EOF'
import re
for path, classes in {
    "gpuremote/core/arrays.py": ("ArrayMetadata", "ArrayRef"),
    "gpuremote/core/driver.py": ("SyncDriver",),
    "gpuremote/proxy/state.py": ("SessionState",),
}.items():
    text = open(path).read()
    for c in classes:
        text = re.sub(rf"^class {c}\b", f"@mypyc_attr(allow_interpreted_subclasses=True)\nclass {c}", text, count=1, flags=re.M)
    text = text.replace("from __future__ import annotations\n", "from __future__ import annotations\n\nfrom mypy_extensions import mypyc_attr\n", 1)
    if path.endswith("state.py"):  # mypyc 2.4 fails on reversed() of a list of Any
        text = text.replace("for s in reversed(streams):", "for s in streams[::-1]:")
    open(path, "w").write(text)
EOF
    echo "compiling ${#HOT[@]} modules with mypyc (a few minutes)..." >&2
    PATH=$(dirname "$PY"):$PATH mypyc "${HOT[@]}" >"$TMP/mypyc.log" 2>&1 || { tail -20 "$TMP/mypyc.log"; exit 1; }
)
(cd "$TMP" && PYTHONPATH=$TMP "$PY" -c "import gpuremote.wire.protocol as p, gpuremote.proxy.session as s; \
assert p.__file__.endswith('.so') and s.__file__.endswith('.so'), 'not compiled'")
for i in $(seq "$ROUNDS"); do
    echo "== round $i: pure Python (HEAD)"
    "$PY" scripts/floor_xp_op.py
    echo "== round $i: mypyc-compiled hot modules"
    (cd "$TMP" && PYTHONPATH=$TMP "$PY" scripts/floor_xp_op.py)
done

#!/usr/bin/env bash
# The checks that need a CUDA GPU, as one prepared script (a few minutes), one summary line
# per check at the end. Run it from a clone on a machine with a GPU:
#
#     bash scripts/gpu_check.sh          # install, run every check, summarise
#     bash scripts/gpu_check.sh --list   # print the checks it would run, run nothing
#
# Exit status: 0 every check passed; 1 a check failed (or the install did); 3 no GPU here
# (nothing was run). Each check's output is in /tmp/gpu_check.NAME.log.
#
# Where CuPy is importable already (a GPU image), the venv sees it (--system-site-packages)
# and the [cuda] extra is not installed over it; otherwise the [cuda] extra is installed.
# The [ucx] extra is installed too; where it cannot be, the ucx checks fail (and say why).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
NO_GPU=3
bin=.venv-gpu/bin
E2E="tests/test_client.py tests/test_xp.py tests/test_peers.py tests/test_gpu.py tests/test_failover.py"

# name | time budget (s) | command: the checks, in order
CHECKS=(
    "device|30|$bin/python -c 'import cupy; n = cupy.cuda.runtime.getDeviceCount(); p = cupy.cuda.runtime.getDeviceProperties(0); print(n, \"device(s):\", p[\"name\"].decode(), p[\"totalGlobalMem\"] >> 30, \"GiB\")'"
    "e2e-cupy|150|env GPUREMOTE_TEST_BACKENDS=cupy UCX_WARN_UNUSED_ENV_VARS=n $bin/python -m pytest -q -x -p no:randomly $E2E"
    "ucx-device-buffers|40|env UCX_WARN_UNUSED_ENV_VARS=n $bin/python -m pytest -q -x tests/test_ucx.py -k 'device or large'"
    "torch-cupy|240|env GPUREMOTE_TEST_BACKENDS=cupy $bin/python -m pytest -q -x -p no:randomly tests/test_torch.py tests/test_torch_hostile.py tests/test_torch_compile.py tests/test_torch_rewrites.py"
    "torch-graphs|240|env GPUREMOTE_TEST_BACKENDS=cupy $bin/python -m pytest -q -x -p no:randomly -m 'slow or not slow' tests/test_proxy_graphs.py"
    "torch-devices|90|env GPUREMOTE_TEST_BACKENDS=cupy $bin/python -m pytest -q -x -p no:randomly tests/test_torch_devices.py"
    "demo|30|$bin/gpuremote demo --backend cupy"
    "bench-compare|50|env UCX_WARN_UNUSED_ENV_VARS=n $bin/gpuremote bench throughput --backend cupy --compare tcp,ucx --sizes 1m,64m,256m --json"
)

if [[ ${1:-} == --list ]]; then
    echo "gpu_check would install .venv-gpu with the [test,cuda,ucx] extras and torch==2.13.0, then run:"
    for c in "${CHECKS[@]}"; do
        IFS='|' read -r name budget cmd <<<"$c"
        printf '  %-20s (<= %3s s)  %s\n' "$name" "$budget" "$cmd"
    done
    exit 0
fi
if [[ $# -gt 0 ]]; then
    echo "usage: $0 [--list]" >&2
    exit 2
fi

# a GPU at all? (before installing anything)
if ! { command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; } \
    && ! ls /dev/nvidia[0-9]* >/dev/null 2>&1; then
    echo "gpu_check: no NVIDIA GPU on this machine (no nvidia-smi GPU, no /dev/nvidia*):" \
        "nothing run; exit $NO_GPU"
    exit $NO_GPU
fi

t_start=$SECONDS
if "$PYTHON" -c "import cupy; cupy.cuda.runtime.getDeviceCount()" 2>/dev/null; then
    "$PYTHON" -m venv --system-site-packages .venv-gpu
    extras="test,ucx"
else
    "$PYTHON" -m venv .venv-gpu
    extras="test,cuda,ucx"
fi
$bin/python -m pip install --quiet --upgrade pip
if ! $bin/python -m pip install --quiet -e ".[$extras]"; then
    echo "gpu_check summary:"
    echo "  FAIL  install: pip install -e .[$extras] failed"
    exit 1
fi
# PyTorch for the torch check: the exact version gpuremote.torch is tested with (on a GPU
# machine its CUDA build; where it cannot be installed, the torch check fails and says so)
if ! $bin/python -c "import torch" 2>/dev/null; then
    $bin/python -m pip install --quiet "torch==2.13.0" \
        || echo "gpu_check: torch==2.13.0 did not install: the torch check will fail" >&2
fi
echo "gpu_check: installed in $((SECONDS - t_start)) s: $($bin/gpuremote --version)"

summary=()
for c in "${CHECKS[@]}"; do
    IFS='|' read -r name budget cmd <<<"$c"
    t0=$SECONDS
    if timeout "$budget" bash -c "$cmd" >"/tmp/gpu_check.$name.log" 2>&1; then
        summary+=("PASS  $name ($((SECONDS - t0)) s)")
    else
        rc=$?
        why="exit $rc"
        [[ $rc == 124 ]] && why="over its $budget s budget"
        summary+=("FAIL  $name ($((SECONDS - t0)) s, $why): $(tail -n 1 "/tmp/gpu_check.$name.log" | cut -c1-120) [/tmp/gpu_check.$name.log]")
    fi
done

echo
echo "gpu_check summary ($((SECONDS - t_start)) s in all):"
for line in "${summary[@]}"; do
    echo "  $line"
done
for line in "${summary[@]}"; do
    [[ $line == PASS* ]] || exit 1
done
exit 0

#!/usr/bin/env bash
# The checks that need a CUDA GPU, as one prepared script (a few minutes), one summary line
# per check at the end. Run it from a clone on a machine with a GPU:
#
#     bash scripts/gpu_check.sh
#
# Where CuPy is importable already (a GPU image), the venv sees it (--system-site-packages)
# and the [cuda] extra is not installed over it; otherwise the [cuda] extra is installed.
# The [ucx] extra is installed when the registry has it; its checks skip, with the reason,
# where it cannot be.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
summary=()
check() {  # check NAME COMMAND...: run it, remember one line
    local name=$1
    shift
    local t0=$SECONDS
    if "$@" >"/tmp/gpu_check.$name.log" 2>&1; then
        summary+=("PASS  $name ($((SECONDS - t0)) s)")
    else
        summary+=("FAIL  $name ($((SECONDS - t0)) s): see /tmp/gpu_check.$name.log")
    fi
}

if "$PYTHON" -c "import cupy; cupy.cuda.runtime.getDeviceCount()" 2>/dev/null; then
    "$PYTHON" -m venv --system-site-packages .venv-gpu
    extras="test"
else
    "$PYTHON" -m venv .venv-gpu
    extras="test,cuda"
fi
.venv-gpu/bin/python -m pip install --quiet --upgrade pip
.venv-gpu/bin/python -m pip install --quiet -e ".[$extras]" || exit 1
.venv-gpu/bin/python -m pip install --quiet -e ".[ucx]" 2>/dev/null || true
bin=.venv-gpu/bin

check device "$bin/python" -c "
import cupy
n = cupy.cuda.runtime.getDeviceCount()
p = cupy.cuda.runtime.getDeviceProperties(0)
print(n, 'device(s):', p['name'].decode(), p['totalGlobalMem'] >> 30, 'GiB')"
check gpu-tests "$bin/python" -m pytest -q -m gpu tests/test_gpu.py
check device-queue-tests "$bin/python" -m pytest -q tests/test_device_queue.py tests/test_executor.py
check demo "$bin/gpuremote" demo --backend cupy
check bench-ops "$bin/gpuremote" bench ops --backend cupy --json --iterations 1000 --rounds 3
check bench-tenants "$bin/gpuremote" bench tenants --backend cupy --json --seconds 2 --n 4096 --matmuls 8
check bench-throughput "$bin/gpuremote" bench throughput --backend cupy --json
check ucx-tests env UCX_WARN_UNUSED_ENV_VARS=n "$bin/python" -m pytest -q tests/test_ucx.py
check bench-compare env UCX_WARN_UNUSED_ENV_VARS=n "$bin/gpuremote" bench throughput \
    --backend cupy --compare tcp,ucx --sizes 1m,64m,256m --json

echo
echo "gpu_check summary:"
for line in "${summary[@]}"; do
    echo "  $line"
done
for line in "${summary[@]}"; do
    [[ $line == PASS* ]] || exit 1
done

#!/usr/bin/env bash
# The PyTorch tests on another torch release, in a virtual environment of its own:
#   ./scripts/test_torch_release.sh 2.14.1
# installs that torch (with the torchvision made for it, and timm: the release CI's 2.13 cannot
# load torchvision beside the CPU build, so timm and torchvision run here), gpuremote with its
# test and model extras, holding the release while the rest installs; then runs the torch tests
# and PyTorch's OpInfo suite (float32) against tests/torch_opinfo_unsupported.txt.
# On this kind of machine pip takes torch 2.14.1 and torchvision 0.29.1 from the local disk:
# a CUDA build, ~5.5 GB in the environment, which runs on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
RELEASE=${1:?"usage: $0 TORCH_VERSION (e.g. 2.14.1)"}
case "$RELEASE" in
    2.13.*) VISION="" ;;  # torchvision 0.28's wheel is a CUDA build that CPU torch cannot load
    2.14.*) VISION="torchvision==0.29.1" ;;
    *) VISION="" ;;
esac
VENV=".venv-torch-$RELEASE"
PYTHON=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
HOLD=$(mktemp)
trap 'rm -f "$HOLD"' EXIT
echo "torch==$RELEASE" > "$HOLD"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
# shellcheck disable=SC2086
"$VENV/bin/python" -m pip install --quiet "torch==$RELEASE" $VISION
MODELS="timm"
[ -n "$VISION" ] || MODELS=""  # timm needs torchvision
# shellcheck disable=SC2086
"$VENV/bin/python" -m pip install --quiet -c "$HOLD" -e ".[test,models]" $MODELS
"$VENV/bin/python" -c "import torch; print('torch', torch.__version__)"
"$VENV/bin/python" -m pytest -q tests/test_torch.py tests/test_torch_correctness.py \
    tests/test_torch_libraries.py tests/test_torch_compile.py tests/test_torch_hostile.py \
    tests/test_isolation.py "${@:2}"
"$VENV/bin/python" -m gpuremote.torch.conformance --isolate --dtypes float32 \
    --expected tests/torch_opinfo_unsupported.txt

#!/usr/bin/env bash
# The main job: install gpuremote into .venv, start a local proxy, train a small MLP through it,
# check the result against NumPy and say how long it took; then measure the round trip.
set -euo pipefail
EXTRAS="" source "$(dirname "$0")/_venv.sh"
.venv/bin/gpuremote demo "$@"
.venv/bin/gpuremote bench ping --count 5000

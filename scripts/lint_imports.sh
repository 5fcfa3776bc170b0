#!/usr/bin/env bash
# The layers (import-linter's contracts in pyproject.toml), checked on the package as it is
# installed: transports/ and bench/ become gpuremote.transports and gpuremote.bench.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
cp -r "$root/gpuremote" "$stage/gpuremote"
cp -r "$root/transports" "$stage/gpuremote/transports"
cp -r "$root/bench" "$stage/gpuremote/bench"
cd "$stage"
PYTHONPATH="$stage" "$root/.venv/bin/lint-imports" --no-cache "$root/pyproject.toml"

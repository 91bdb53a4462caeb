#!/usr/bin/env bash
# Sets up .venv (pinned JAX/Flax; JAX's CUDA plugin too where `nvidia-smi -L` lists a GPU) and
# runs `flashjax demo`: checks flashjax against the reference on whatever device is present and
# says which backend runs; on a GPU it also times it against XLA and cuDNN (without one,
# `--timing` forces interpret-mode timings).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/flashjax demo "$@"

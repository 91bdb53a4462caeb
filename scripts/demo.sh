#!/usr/bin/env bash
# Sets up .venv (pinned JAX/Flax) and runs `flashjax demo`: checks flashjax against the
# reference and times it against XLA (and cuDNN on a GPU) on whatever device is present.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/flashjax demo "$@"

#!/usr/bin/env bash
# Sets up .venv (pinned JAX/Flax, test extras) and runs the test suite.
# On a machine without a GPU the Pallas kernels run in interpret mode and GPU-only tests are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
exec .venv/bin/python -m pytest -n "${FLASHJAX_TEST_WORKERS:-2}" "$@"

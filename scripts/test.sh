#!/usr/bin/env bash
# Sets up .venv (pinned JAX/Flax, test extras) and runs the test suite.
# On a machine without a GPU the Pallas kernels run in interpret mode and GPU-only tests are skipped.
#
# bash scripts/test.sh --latest: sets up .venv-latest with the newest JAX/Flax that pip resolves
# inside pyproject's ranges and runs a quick subset there (a few minutes): the API, the reference,
# the Triton kernels in interpret mode, the Hopper kernels' lowering and the Flax layer.
# Further arguments go to pytest; FLASHJAX_TEST_WORKERS sets pytest-xdist's workers (default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
workers="${FLASHJAX_TEST_WORKERS:-2}"
# On a GPU each pytest worker would take 75% of its memory up front (JAX's default): allocate on demand.
export XLA_PYTHON_CLIENT_PREALLOCATE="${XLA_PYTHON_CLIENT_PREALLOCATE:-false}"
if [ "${1:-}" = "--latest" ]; then
  shift
  bash scripts/setup.sh --latest test
  exec .venv-latest/bin/python -m pytest -n "$workers" -m "not slow" \
    tests/test_api.py tests/test_reference.py tests/test_attention.py tests/test_lowering.py tests/test_flax.py "$@"
fi
bash scripts/setup.sh test
exec .venv/bin/python -m pytest -n "$workers" "$@"

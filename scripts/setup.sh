#!/usr/bin/env bash
# Creates .venv with Python >= 3.12 and installs flashjax with the pinned JAX/Flax.
# Usage: source scripts/setup.sh [extras]   (extras: test, gpu, dev; default none)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
  py=""
  for candidate in python3.12 python3.13 /root/.pyenv/versions/3.12.1/bin/python3 python3; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      py="$candidate"; break
    fi
  done
  if [ -z "$py" ] && command -v pyenv >/dev/null 2>&1; then py="$(PYENV_VERSION=3.12.1 pyenv which python3 2>/dev/null || true)"; fi
  [ -n "$py" ] || { echo "flashjax needs Python >= 3.12 (none found)" >&2; exit 1; }
  "$py" -m venv .venv
fi
spec="."; [ -n "$extras" ] && spec=".[${extras}]"
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q -c constraints.txt -e "$spec" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import jax, flax, flashjax; print('flashjax', flashjax.__version__, '| jax', jax.__version__, '| flax', flax.__version__, '|', jax.default_backend())"

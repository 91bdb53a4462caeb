"""Runs a test body on several CPU devices, in a fresh Python process.

XLA creates the CPU host devices once, when JAX's backend starts, from
``--xla_force_host_platform_device_count`` in ``XLA_FLAGS``. The pytest process
(and every pytest-xdist worker) has started it long before a test runs: the shared
``conftest.py`` asks for the backend at import. So the multi-device tests run their
bodies here, in a subprocess that sets the flag before importing JAX: one process
per test case, which keeps failures per case and works the same under ``-n 2``.

Usage (what `run_on_devices` does)::

    python tests/multidevice.py tests/test_ring.py check_ring '{"causal": true}'
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

DEVICES = 4
TIMEOUT_S = 300


def run_on_devices(module_path: str, function: str, **kwargs) -> None:
    """Runs ``function(**kwargs)`` of the test module at `module_path` on `DEVICES` CPU devices.

    Raises AssertionError with the subprocess's output when it fails. ``kwargs``
    must be JSON-serialisable.
    """
    cmd = [sys.executable, __file__, str(module_path), function, json.dumps(kwargs)]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    if result.returncode != 0:
        raise AssertionError(
            f"{function}({kwargs}) failed on {DEVICES} CPU devices (exit {result.returncode}):\n"
            f"{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
        )


def gpus_or_skip(what: str) -> int:
    """The count of visible GPUs for a test that spreads `what` over all of them (in the
    pytest process, on a GPU machine); skips the test with fewer than 2."""
    import jax
    import pytest

    gpus = jax.device_count()
    if gpus < 2:
        pytest.skip(f"needs 2 or more GPUs to spread {what} over; {gpus} visible")
    return gpus


def two_rows_or_skip(gpus: int) -> tuple[int, int]:
    """The mesh shape (2, gpus / 2) of a test with a second mesh axis; skips the test where
    the count is odd or under 4."""
    import pytest

    if gpus < 4 or gpus % 2:
        pytest.skip(f"a 2 x (GPUs / 2) mesh needs an even count >= 4; {gpus} visible")
    return 2, gpus // 2


def _main(module_path: str, function: str, kwargs_json: str) -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={DEVICES}".strip()
    # The test helpers of tests/conftest.py are imported as `conftest`, as under pytest.
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    import jax

    assert jax.device_count() == DEVICES, f"expected {DEVICES} CPU devices, got {jax.devices()}"
    spec = importlib.util.spec_from_file_location("_multidevice_case", module_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    getattr(module, function)(**json.loads(kwargs_json))


if __name__ == "__main__":
    _main(*sys.argv[1:4])

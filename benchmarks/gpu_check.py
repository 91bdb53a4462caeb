"""Runs the test suite on a CUDA GPU: the compiled kernels, not the interpreter.

On the CPU the suite runs the Pallas kernels in interpret mode; on a GPU the same
tests (forward, gradients, variants, dropout, Flax) compile them with Triton,
and tests/test_gpu.py adds realistic bf16 sizes. Tests that only make sense on
the CPU (multi-host-device rings, notebooks, the CLI) are left out.

    python benchmarks/gpu_check.py [-n WORKERS] [extra pytest args]

Each pytest worker gets a slice of GPU memory instead of JAX's default 75%.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU_TESTS = [
    "tests/test_gpu.py",
    "tests/test_mosaic.py",
    "tests/test_attention.py",
    "tests/test_grad.py",
    "tests/test_variants.py",
    "tests/test_dropout.py",
    "tests/test_api.py",
    "tests/test_flax.py",
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--workers", type=int, default=4)
    args, extra = parser.parse_known_args(argv)
    env = dict(os.environ)
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{0.9 / max(1, args.workers):.2f}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *GPU_TESTS, *extra]
    if args.workers > 1:
        cmd[3:3] = ["-n", str(args.workers)]
    print(" ".join(cmd), flush=True)
    return subprocess.call(cmd, cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main())

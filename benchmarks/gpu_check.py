"""Runs the test suite on a CUDA GPU: the compiled kernels, not the interpreter.

On the CPU the suite runs the Pallas kernels in interpret mode; on a GPU the same
tests (forward, gradients, variants, dropout, Flax) compile them with Triton (and
Mosaic GPU on Hopper), and tests/test_gpu.py adds realistic bf16 sizes. Tests that
only make sense on the CPU (multi-host-device rings, notebooks, the CLI) are left out.
The groups fit one 10-minute device call each on an H100 with 8 workers. The
``multigpu`` group runs the ring and batch/head sharding over every visible GPU (skipped
with fewer than 2): give it ``-n 1``, each of its tests uses all the GPUs, and split it
over two calls, ``-k ring`` and ``-k "not ring"`` (the ring's tests took ~4 minutes on 4
H100s and ~3.3 on 2 H200s; the whole group did not finish in 400 s).

    python benchmarks/gpu_check.py [--group mosaic|triton|grads|flax|decode|properties|multigpu|all] [-n WORKERS] [extra pytest args]

Each pytest worker gets a slice of GPU memory instead of JAX's default 75%; a test that
hangs is stopped after --timeout seconds (its worker restarts) instead of stalling the run,
where pytest-timeout is installed (else --timeout does nothing, and the run says so).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GROUPS = {
    "mosaic": ["tests/test_mosaic.py", "tests/test_api.py"],
    "triton": ["tests/test_gpu.py", "tests/test_edge_cases.py", "tests/test_variants.py", "tests/test_dropout.py"],
    "grads": ["tests/test_attention.py", "tests/test_grad.py"],
    "flax": ["tests/test_flax.py"],
    "decode": ["tests/test_decode.py", "tests/test_flex.py"],
    "properties": ["tests/test_properties.py"],
    # The ring and batch/head sharding over every visible GPU (each test uses all of them:
    # run the group with -n 1).
    "multigpu": ["tests/test_ring.py::test_ring_on_gpus", "tests/test_sharding.py::test_sharded_on_gpus",
                 "tests/test_sharding.py::test_explicit_layouts_on_gpus",
                 "tests/test_sharding.py::test_inside_user_shard_map_on_gpus",
                 "tests/test_sharding.py::test_partly_manual_shard_map_on_gpus",
                 "tests/test_decode.py::test_decode_on_explicit_meshes_on_gpus"],
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", choices=(*GROUPS, "all"), default="all")
    parser.add_argument("-n", "--workers", type=int, default=8)
    parser.add_argument("--timeout", type=int, default=300, help="seconds one test may take")
    args, extra = parser.parse_known_args(argv)
    tests = [t for name, files in GROUPS.items() if args.group in (name, "all") for t in files]
    env = dict(os.environ)
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{0.9 / max(1, args.workers):.2f}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    # The reference's matmuls need no autotuning to be exact, and XLA's autotuner costs
    # seconds per compiled shape (every test compiles its own); the kernels are unaffected.
    env["XLA_FLAGS"] = " ".join(filter(None, [env.get("XLA_FLAGS"), "--xla_gpu_autotune_level=0"]))
    cmd = [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", "--durations=15", *tests, *extra]
    if args.workers > 1:
        cmd[3:3] = ["-n", str(args.workers)]
    if _has_plugin("pytest_timeout"):
        cmd[3:3] = [f"--timeout={args.timeout}", "--timeout-method=thread"]
    else:
        print(f"gpu_check: pytest-timeout is not installed: --timeout {args.timeout} has no effect", file=sys.stderr)
    if _has_plugin("pytest_benchmark"):
        cmd[3:3] = ["-p", "no:benchmark"]  # its warning per xdist worker buries the output
    print(" ".join(cmd), flush=True)
    return subprocess.call(cmd, cwd=ROOT, env=env)


def _has_plugin(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


if __name__ == "__main__":
    sys.exit(main())

"""The ``flashjax`` command: ``flashjax demo`` and ``flashjax bench``.

    flashjax demo            # check against the reference, then time vs XLA (and cuDNN on a GPU)
    flashjax demo --quick    # the smallest check and timing (seconds, any device)
    flashjax bench [flags]   # benchmarks/attention.py of the repository (see --help there)

The demo needs nothing but the package; ``bench`` runs the benchmark scripts of a
source checkout (they are not part of the installed package).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time
from pathlib import Path

__all__ = ["main", "demo", "bench"]

BENCHMARKS_DIR = Path(__file__).resolve().parent.parent / "benchmarks"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``flashjax`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"demo": demo, "bench": bench}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print(__doc__.strip())
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nunknown command {argv[0]!r}; choose from {sorted(commands)}", file=sys.stderr)
            return 2
        return 0
    return commands[argv[0]](argv[1:])


# ---- bench ------------------------------------------------------------------------------
def bench(argv: list[str]) -> int:
    """Runs ``benchmarks/attention.py``'s ``main(argv)`` from the source checkout."""
    script = BENCHMARKS_DIR / "attention.py"
    if not script.exists():
        print(
            f"flashjax bench runs the benchmark scripts of a source checkout, and {script} does not exist.\n"
            "Clone the repository and install it editable (bash scripts/setup.sh), or run\n"
            "`python benchmarks/attention.py` from the checkout.",
            file=sys.stderr,
        )
        return 2
    spec = importlib.util.spec_from_file_location("flashjax_benchmarks_attention", script)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCHMARKS_DIR))  # the benchmark imports its sibling scripts
    sys.modules[spec.name] = module  # dataclasses look their module up while the script executes
    spec.loader.exec_module(module)
    return int(module.main(argv) or 0)


# ---- demo -------------------------------------------------------------------------------
def _median_seconds(fn, *args, reps: int, inner: int = 3) -> float:
    """The protocol of benchmarks/attention.py: 2 warm-ups, median of `reps` x `inner` calls."""
    import jax

    for _ in range(2):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / inner)
    return sorted(times)[len(times) // 2]


def _rel_err(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return float("nan")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _inputs(shape, dtype, seed=0):
    """(q, k, v, do) for shape (batch, seq, heads, kv_heads, head_dim)."""
    import jax

    b, t, h, hkv, d = shape
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    return (jax.random.normal(ks[0], (b, t, h, d), dtype), jax.random.normal(ks[1], (b, t, hkv, d), dtype),
            jax.random.normal(ks[2], (b, t, hkv, d), dtype), jax.random.normal(ks[3], (b, t, h, d), dtype))


def check(shape, causal: bool, dtype, tol: float) -> tuple[bool, str]:
    """flashjax (backend="auto") output and (dq, dk, dv) against the float32 reference."""
    import jax
    import jax.numpy as jnp

    import flashjax
    from flashjax import reference

    q, k, v, do = _inputs(shape, dtype)
    f = jax.jit(lambda q, k, v: flashjax.flash_attention(q, k, v, causal=causal))
    out, vjp = jax.vjp(f, q, k, v)
    grads = vjp(do)
    f32 = lambda x: x.astype(jnp.float32)
    ref_out, ref_vjp = jax.vjp(lambda q, k, v: reference.attention(q, k, v, causal=causal), f32(q), f32(k), f32(v))
    ref_grads = ref_vjp(f32(do))
    errs = [_rel_err(out, ref_out)] + [_rel_err(a, b) for a, b in zip(grads, ref_grads)]
    ok = all(e < tol for e in errs)  # nan fails
    b, t, h, hkv, d = shape
    label = f"B={b} T={t} H={h}/{hkv} D={d} {jnp.dtype(dtype).name} causal={causal}"
    detail = "rel err out/dq/dk/dv " + " ".join(f"{e:.1e}" for e in errs)
    return ok, f"{'ok  ' if ok else 'FAIL'} {label:44s} {detail} (tol {tol:g})"


def _demo_plan(platform: str, quick: bool):
    """(checks, timings) suited to the device: tiny on the CPU, realistic on a GPU."""
    import jax.numpy as jnp

    if platform == "gpu" and not quick:
        checks = [((2, 1024, 8, 8, 128), True), ((2, 2048, 16, 4, 64), False), ((1, 1000, 8, 8, 256), True)]
        timings = [((16384 // t, t, 16, 16, 128), c) for t in (1024, 4096, 16384) for c in (False, True)]
        return checks, jnp.bfloat16, 2e-2, timings, ("flashjax", "cudnn", "xla"), 10
    if platform == "gpu":
        return [((1, 512, 4, 4, 64), True)], jnp.bfloat16, 2e-2, [((4, 1024, 8, 8, 64), True)], ("flashjax", "cudnn", "xla"), 5
    if quick:
        return [((1, 128, 2, 1, 32), True)], jnp.float32, 1e-3, [((1, 128, 2, 2, 32), True)], ("flashjax", "xla"), 3
    # Each shape costs a ~10 s interpreter compile: two cover GQA, causal and ragged lengths.
    checks = [((1, 256, 4, 2, 64), True), ((2, 200, 4, 1, 32), False)]
    timings = [((1, 256, 4, 4, 64), True), ((1, 512, 4, 4, 64), True)]
    return checks, jnp.float32, 1e-3, timings, ("flashjax", "xla"), 5


def _impl(name: str, causal: bool):
    import jax

    import flashjax

    if name == "flashjax":
        return lambda q, k, v: flashjax.flash_attention(q, k, v, causal=causal)
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=name)


def time_case(shape, causal: bool, dtype, impl: str, mode: str, reps: int) -> float | str:
    """Median seconds of one implementation on one problem, or a short reason it did not run."""
    import jax
    import jax.numpy as jnp

    b, t, h, _, _ = shape
    if impl == "xla" and b * h * t * t * (6 if mode == "fwd" else 12) > 40e9:
        return "oom"  # XLA materialises the scores: skip what cannot fit rather than crash
    q, k, v, do = _inputs(shape, dtype)
    fn = _impl(impl, causal)
    if mode == "fwd":
        f = jax.jit(fn)
        args = (q, k, v)
    else:
        f = jax.jit(jax.grad(lambda q, k, v, do: jnp.sum(fn(q, k, v).astype(jnp.float32) * do), argnums=(0, 1, 2)))
        args = (q, k, v, do.astype(jnp.float32))
    try:
        return _median_seconds(f, *args, reps=reps)
    except Exception as e:  # a peer missing on this device is reported, not fatal
        return "oom" if "RESOURCE_EXHAUSTED" in str(e) else "n/a"


def demo(argv: list[str]) -> int:
    """``flashjax demo``: checks flashjax against the reference, then times it; 1 if a check fails."""
    parser = argparse.ArgumentParser(prog="flashjax demo", description="Check flashjax and time it on this device.")
    parser.add_argument("--quick", action="store_true", help="one tiny check and one tiny timing")
    parser.add_argument("--no-timing", action="store_true", help="checks only")
    args = parser.parse_args(argv)

    import warnings

    warnings.filterwarnings("ignore")  # the CPU interpreter's warnings would bury the table
    import jax
    from tqdm import tqdm

    import flashjax

    platform = jax.default_backend()
    checks, dtype, tol, timings, impls, reps = _demo_plan(platform, args.quick)
    device = jax.devices()[0].device_kind
    mode_note = "Pallas Triton kernels" if platform == "gpu" else "no GPU: kernels in interpret mode / reference"
    print(f"flashjax {flashjax.__version__} | jax {jax.__version__} | {device} ({platform}; {mode_note})")

    lines, ok = [], True
    for shape, causal in tqdm(checks, desc="checks", leave=False):
        passed, line = check(shape, causal, dtype, tol)
        ok &= passed
        lines.append(line)
    print("\n".join(lines))
    if args.no_timing:
        return 0 if ok else 1

    rows = []
    cases = [(s, c, m) for s, c in timings for m in ("fwd", "fwdbwd")]
    bar = tqdm(total=len(cases) * len(impls), desc="timing", leave=False)
    for shape, causal, mode in cases:
        row = {}
        for impl in impls:
            row[impl] = time_case(shape, causal, dtype, impl, mode, reps)
            bar.update()
        rows.append((shape, causal, mode, row))
    bar.close()
    print(_timing_table(rows, impls, dtype))
    if not ok:
        print("A check FAILED: flashjax disagrees with the reference (see above).", file=sys.stderr)
    return 0 if ok else 1


def _timing_table(rows, impls, dtype) -> str:
    import jax.numpy as jnp

    header = ["B", "T", "H", "D", "causal", "mode"] + [f"{i} ms (TF/s)" for i in impls] + ["flashjax speedup"]
    lines = [header]
    for (b, t, h, _, d), causal, mode, row in rows:
        fl = 4.0 * b * h * t * t * d / (2 if causal else 1) * (3.5 if mode == "fwdbwd" else 1)
        cells = [str(b), str(t), str(h), str(d), "yes" if causal else "no", mode]
        for impl in impls:
            s = row[impl]
            cells.append(s if isinstance(s, str) else f"{s * 1e3:.3g} ({fl / s / 1e12:.3g})")
        peers = [row[i] for i in impls if i != "flashjax" and not isinstance(row[i], str)]
        mine = row["flashjax"]
        cells.append("-" if isinstance(mine, str) or not peers else
                     " ".join(f"x{row[i] / mine:.2f} vs {i}" for i in impls if i != "flashjax" and not isinstance(row[i], str)))
        lines.append(cells)
    widths = [max(len(l[c]) for l in lines) for c in range(len(header))]
    out = ["  ".join(s.rjust(w) for s, w in zip(l, widths)) for l in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    out.append(f"{jnp.dtype(dtype).name}; median of the protocol in benchmarks/attention.py; "
               "speedup = peer time / flashjax time")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())

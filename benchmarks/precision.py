"""Accuracy of the gradients of peaked rows (huge logits) in float32/bf16/fp16, against a float64 oracle.

    python benchmarks/precision.py            # any device; writes benchmarks/results/peaked-rows.md

For each dtype and logit magnitude L (the largest |scale * q.k| of the problem), random
[1, 64, 2, 64] inputs are scaled to reach L, rounded to the dtype, and dq, dk, dv of
`flash_attention` are compared with float64 reference gradients on the same rounded
inputs (relative Frobenius error, median of 3 seeds): backend="xla" (the reference,
differentiated by JAX in float32), backend="triton", and backend="triton" with
float32_residual=True (the backward's delta = rowsum(dO * O) from the unrounded output).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flashjax import benchmark, flash_attention, reference  # noqa: E402

VARIANTS = {
    "xla": dict(backend="xla"),
    "triton": dict(backend="triton"),
    "triton, float32_residual": dict(backend="triton", float32_residual=True),
}
LOGITS = (3, 10, 30, 100, 300, 1000, 10000)


def errors(dtype, logit: float, seed: int) -> dict:
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q, k, v, do = (jax.random.normal(key, (1, 64, 2, 64), jnp.float32) for key in ks)
    s = np.sqrt(logit / (float(jnp.abs(jnp.einsum("bqhd,bkhd->bhqk", q, k)).max()) / 8))
    q, k, v, do = ((a * m).astype(dtype) for a, m in ((q, s), (k, s), (v, 1), (do, 1)))
    with jax.enable_x64(True):
        f64 = lambda a: jnp.asarray(np.asarray(a, np.float64))
        _, pullback = jax.vjp(lambda q, k, v: reference.attention(q, k, v), f64(q), f64(k), f64(v))
        truth = [np.asarray(g) for g in pullback(f64(do))]
    out = {}
    for name, options in VARIANTS.items():
        _, pullback = jax.vjp(lambda q, k, v: flash_attention(q, k, v, **options), q, k, v)
        out[name] = [benchmark.rel_err(g, t) for g, t in zip(pullback(do), truth)]
    return out


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)  # --help; no options
    lines = ["| dtype | max logit | " + " | ".join(f"{name}: dq / dk / dv" for name in VARIANTS) + " |",
             "|---|---|" + "---|" * len(VARIANTS)]
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        for logit in LOGITS:
            runs = [errors(dtype, logit, seed) for seed in range(3)]
            cells = [" / ".join(f"{e:.1e}" for e in np.median([r[name] for r in runs], axis=0)) for name in VARIANTS]
            lines.append(f"| {jnp.dtype(dtype).name} | {logit:g} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    out = Path(__file__).resolve().parent / "results" / "peaked-rows.md"
    out.write_text(
        "# Gradients of peaked rows: relative error against a float64 oracle\n\n"
        f"`python benchmarks/precision.py` ({benchmark.device_name()}, jax {jax.__version__}); "
        "median of 3 seeds, [1, 64, 2, 64] inputs scaled to the max logit, rounded to the dtype.\n\n"
        + "\n".join(lines) + "\n\n"
        "In a peaked row dS = P (dP - delta) cancels, so an error in P or in delta = rowsum(dO * O) is "
        "amplified. In float32 the backward recomputes S = scale q.k with its own order of additions, "
        "whose rounding grows with the logit (about |logit| x 6e-8), and P = exp(S - lse) moves off the "
        "forward's with it: dq and dk are within a few times the reference's own error up to logits of "
        "1e3 and fall behind it past that (the float32 rows). "
        "With O rounded to bf16/fp16, dq and dk are 2-6x less accurate than the reference's at logits "
        "10-1000; `float32_residual=True` keeps O in float32 for the backward and brings them to within "
        "~1.5x of it. At logits of 1e4 the forward's P, rounded to the dtype for the P V product, is "
        "itself too far from the backward's float32 P, and neither way is accurate (the float32 "
        "reference stays at ~2e-3 because JAX differentiates its own float32 P).\n"
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

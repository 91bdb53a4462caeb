"""Quick Hopper-backend loop: correctness spot checks, then mosaic vs triton vs cuDNN timings.

    python benchmarks/mosaic_quick.py                    # checks + d128 T in {1k,4k,16k}
    python benchmarks/mosaic_quick.py --no-check --seqlens 4096 --modes fwd \\
        --variants "block_kv=128;block_kv=64,stages=3"   # MosaicConfig overrides

Same protocol as benchmarks/attention.py (bf16, 16384 tokens per batch, FLOPs
4*B*H*Tq*Tk*D halved for causal, x3.5 for fwd+bwd, median of >= 10 repetitions of a
few back-to-back calls). Prints one table at the end. Not the full sweep: that is
benchmarks/attention.py --impls flashjax,flashjax_mosaic,cudnn.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import flashjax  # noqa: E402
from flashjax import reference  # noqa: E402
from flashjax.config import Config, MosaicConfig  # noqa: E402
from flashjax.kernels.mosaic import padded_head_dim  # noqa: E402
from attention import flops, median_time  # noqa: E402

TOKENS = 16384


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not np.all(np.isfinite(a)):
        return float("nan")
    d = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / d) if d else float(np.linalg.norm(a))


def config_with(variant, head_dim):
    """Config whose MosaicConfig is the tuned one of this head dim with "key=value,..." applied."""
    if not variant:
        return None
    kw = {key: int(value) if value.isdigit() else value for key, value in (kv.split("=") for kv in variant.split(",") if kv)}
    mosaic = dataclasses.replace(MosaicConfig.default(padded_head_dim(head_dim)), **kw)
    return dataclasses.replace(Config.default(head_dim, jnp.bfloat16), mosaic=mosaic)


def check(cases, grads: bool, variant=None):
    """Forward (and gradients) of backend='mosaic' against the float32 reference."""
    rows = []
    for i, (b, tq, tk, h, hkv, d, dtype, causal, mul) in enumerate(cases):
        name = f"B{b} q{tq} k{tk} h{h}/{hkv} d{d} {jnp.dtype(dtype).name} {'causal' if causal else 'full'}" + (f" x{mul}" if mul != 1 else "") + (f" [{variant}]" if variant else "")
        cfg = config_with(variant, d)
        try:
            ks = jax.random.split(jax.random.PRNGKey(100 + i), 5)
            q = (jax.random.normal(ks[0], (b, tq, h, d), jnp.float32) * mul).astype(dtype)
            k = jax.random.normal(ks[1], (b, tk, hkv, d), jnp.float32).astype(dtype)
            v = jax.random.normal(ks[2], (b, tk, hkv, d), jnp.float32).astype(dtype)
            do = jax.random.normal(ks[3], (b, tq, h, d), jnp.float32).astype(dtype)
            dlse = jax.random.normal(ks[4], (b, h, tq), jnp.float32)

            def run(fn, *xs):
                (o, lse), vjp = jax.vjp(fn, *xs)
                return (o, lse) + (vjp((do.astype(o.dtype), dlse)) if grads else ())

            got = run(jax.jit(lambda q, k, v: flashjax.flash_attention(q, k, v, causal=causal, return_lse=True, backend="mosaic", config=cfg)), q, k, v)
            up = [x.astype(jnp.float32) for x in (q, k, v)]
            want = run(jax.jit(lambda q, k, v: reference.attention(q, k, v, causal=causal, return_lse=True)), *up)
            lse_g, lse_w = np.asarray(got[1]), np.asarray(want[1])
            lse_err = float(np.max(np.abs(np.where(np.isinf(lse_w), 0, lse_g - lse_w)))) if np.all(np.isinf(lse_g) == np.isinf(lse_w)) else float("inf")
            errs = [rel(got[0], want[0]), lse_err] + [rel(g, w) for g, w in zip(got[2:], want[2:])]
            nan = any(not np.all(np.isfinite(np.asarray(x))) for j, x in enumerate(got) if j != 1)
            tol = {"bfloat16": 1.6e-2, "float16": 2e-3}[jnp.dtype(dtype).name]
            ok = (not nan) and all(e <= tol for j, e in enumerate(errs) if j != 1) and errs[1] <= 1e-3
            rows.append((name, "ok" if ok else "FAIL", " ".join(f"{e:.1e}" for e in errs)))
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            rows.append((name, "ERROR", f"{type(e).__name__}: {str(e)[:200]}"))
        print(rows[-1], flush=True)
    return rows


def bench(seqlens, modes, causals, impls, variants, head_dim=128, heads=16):
    rows = []
    for t in seqlens:
        b = max(1, TOKENS // t)
        ks = jax.random.split(jax.random.PRNGKey(t), 4)
        q, k, v, do = (jax.random.normal(kk, (b, t, heads, head_dim), jnp.bfloat16) for kk in ks)
        for causal in causals:
            for mode in modes:
                for impl in impls:
                    for var in (variants if impl == "mosaic" else [None]):
                        label = impl if var is None else f"mosaic[{var}]"
                        if impl == "cudnn":
                            fn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
                        else:
                            cfg = config_with(var, head_dim)
                            fn = functools.partial(flashjax.flash_attention, causal=causal, backend=impl, config=cfg)
                        if mode == "fwd":
                            f = jax.jit(lambda q, k, v, do, fn=fn: fn(q, k, v))
                        else:
                            f = jax.jit(jax.grad(lambda q, k, v, do, fn=fn: jnp.sum(fn(q, k, v).astype(jnp.float32) * do.astype(jnp.float32)), argnums=(0, 1, 2)))
                        try:
                            sec, _, _ = median_time(lambda: f(q, k, v, do), jax.block_until_ready, reps=10)
                            tf = flops(b, heads, t, t, head_dim, causal, mode) / sec / 1e12
                            rows.append((t, "causal" if causal else "full", mode, label, f"{tf:7.1f}", f"{sec * 1e3:8.3f} ms"))
                        except Exception as e:  # noqa: BLE001
                            traceback.print_exc()
                            rows.append((t, "causal" if causal else "full", mode, label, "ERROR", f"{type(e).__name__}: {str(e)[:160]}"))
                        print(rows[-1], flush=True)
    return rows


CHECKS = [
    # (B, Tq, Tk, H, Hkv, D, dtype, causal, logit multiplier)
    (2, 1024, 1024, 4, 4, 128, jnp.bfloat16, False, 1),
    (2, 1024, 1024, 4, 4, 128, jnp.bfloat16, True, 1),
    (2, 1000, 1000, 4, 2, 64, jnp.float16, True, 1),
    (1, 2047, 2047, 4, 1, 128, jnp.float16, False, 1),
    (1, 512, 512, 4, 4, 256, jnp.bfloat16, True, 1),
    (1, 130, 1000, 8, 2, 128, jnp.bfloat16, True, 1),
    (1, 1000, 130, 8, 4, 64, jnp.bfloat16, True, 1),
    (1, 1, 17, 2, 1, 128, jnp.float16, True, 1),
    (1, 17, 1, 2, 2, 64, jnp.float16, True, 1),
    (1, 300, 300, 2, 2, 96, jnp.bfloat16, False, 30),
    (1, 1024, 1024, 2, 2, 256, jnp.float16, False, 1),
]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--grads", action="store_true", help="also check dq, dk, dv")
    p.add_argument("--checks", default="", help="comma-separated indices into CHECKS (default: all)")
    p.add_argument("--seqlens", default="1024,4096,16384")
    p.add_argument("--modes", default="fwd,fwdbwd")
    p.add_argument("--causal", default="both")
    p.add_argument("--impls", default="mosaic,triton,cudnn")
    p.add_argument("--variants", default="", help="';'-separated MosaicConfig overrides, e.g. 'block_kv=64,stages=3;dq_block_kv=128'")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--check-variants", default="", help="';'-separated MosaicConfig overrides the checks also run with")
    a = p.parse_args()
    print(jax.devices()[0].device_kind, jax.__version__, flush=True)
    t0 = time.time()
    cases = [CHECKS[int(i)] for i in a.checks.split(",")] if a.checks else CHECKS
    crow = []
    if not a.no_check:
        for variant in [None] + [v for v in a.check_variants.split(";") if v]:
            crow += check(cases, a.grads, variant)
    causals = {"both": [False, True], "yes": [True], "no": [False]}[a.causal]
    variants = a.variants.split(";") if a.variants else [None]
    heads = 2048 // a.head_dim if a.head_dim != 256 else 8
    brow = bench([int(s) for s in a.seqlens.split(",") if s], a.modes.split(","), causals, a.impls.split(","), variants, a.head_dim, heads)
    print(f"\n==== done in {time.time() - t0:.0f}s ====")
    for r in crow:
        print("CHECK", *r)
    for r in brow:
        print("BENCH", *r)


if __name__ == "__main__":
    main()

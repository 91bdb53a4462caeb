"""Quick GPU check used while tuning: correctness at a realistic size, then fwd and
fwd+bwd timings of a few tile configurations against cuDNN and JAX's Pallas mha.
Not the benchmark (see benchmarks/attention.py); prints one line per measurement."""

import dataclasses
import os
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

warnings.filterwarnings("ignore")
import flashjax
from flashjax import reference
from flashjax.config import Config, KernelConfig


def median_time(f, *args, reps=10, inner=3):
    out = f(*args)
    jax.block_until_ready(out)
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = f(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / inner)
    return float(np.median(times))


def rel(a, b):
    a = np.asarray(a, np.float64); b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def check():
    key = jax.random.PRNGKey(1)
    for (b, tq, tk, h, hkv, d, causal) in [(2, 1000, 1000, 8, 2, 128, True), (2, 1000, 1000, 8, 8, 64, False),
                                           (1, 777, 1500, 4, 1, 96, True), (1, 513, 513, 4, 4, 256, True)]:
        ks = jax.random.split(key, 4)
        q = jax.random.normal(ks[0], (b, tq, h, d), jnp.bfloat16)
        k = jax.random.normal(ks[1], (b, tk, hkv, d), jnp.bfloat16)
        v = jax.random.normal(ks[2], (b, tk, hkv, d), jnp.bfloat16)
        do = jax.random.normal(ks[3], (b, tq, h, d), jnp.bfloat16)
        f = jax.jit(lambda q, k, v: flashjax.flash_attention(q, k, v, causal=causal, backend="triton"))
        o, vjp = jax.vjp(f, q, k, v)
        g = vjp(do)
        r = lambda q, k, v: reference.attention(q, k, v, causal=causal)
        ro, rvjp = jax.vjp(r, *(x.astype(jnp.float32) for x in (q, k, v)))
        rg = rvjp(do.astype(jnp.float32))
        errs = [rel(o, ro)] + [rel(a, b_) for a, b_ in zip(g, rg)]
        print(f"CHECK b={b} tq={tq} tk={tk} h={h} hkv={hkv} d={d} causal={causal} rel o/dq/dk/dv = " + " ".join(f"{e:.2e}" for e in errs), "OK" if max(errs) < 2e-2 else "FAIL", flush=True)


def flops(b, h, t, d, causal):
    return 4 * b * h * t * t * d / (2 if causal else 1)


def bench(configs, seqlens=(4096, 16384), d=128, h=16):
    from jax.experimental.pallas.ops.gpu import attention as pallas_mha
    key = jax.random.PRNGKey(0)
    for t in seqlens:
        b = 16384 // t
        ks = jax.random.split(key, 4)
        q, k, v, do = (jax.random.normal(kk, (b, t, h, d), jnp.bfloat16) for kk in ks)
        for causal in (False, True):
            fl = flops(b, h, t, d, causal)
            impls = {
                "cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn"),
                "pallas_mha": lambda q, k, v: pallas_mha.mha(q, k, v, None, sm_scale=d ** -0.5, causal=causal),
            }
            for name, cfg in configs.items():
                impls[name] = (lambda cfg: lambda q, k, v: flashjax.flash_attention(q, k, v, causal=causal, backend="triton", config=cfg))(cfg)
            for name, fn in impls.items():
                try:
                    fwd = jax.jit(fn)
                    fb = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * do.astype(jnp.float32)), argnums=(0, 1, 2)))
                    tf = median_time(fwd, q, k, v)
                    tb = median_time(fb, q, k, v)
                    print(f"T={t:6d} causal={causal!s:5} {name:28s} fwd {tf*1e3:8.3f} ms {fl/tf/1e12:6.1f} TF/s | fwd+bwd {tb*1e3:8.3f} ms {3.5*fl/tb/1e12:6.1f} TF/s", flush=True)
                except Exception as e:
                    print(f"T={t:6d} causal={causal!s:5} {name:28s} ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
    print(jax.devices()[0].device_kind, jax.__version__, flush=True)
    check()
    base = Config.default(128, jnp.bfloat16)
    K = KernelConfig
    configs = {
        "default": base,
        "f128x128w8s3": dataclasses.replace(base, fwd=K(128, 128, 8, 3)),
        "f128x64w4s3": dataclasses.replace(base, fwd=K(128, 64, 4, 3)),
        "f64x64w4s3": dataclasses.replace(base, fwd=K(64, 64, 4, 3)),
        "b:dkv32x128w4s3,dq128x32w4s3": dataclasses.replace(base, dkv=K(32, 128, 4, 3), dq=K(128, 32, 4, 3)),
        "b:dkv64x64w4s3,dq64x64w4s3": dataclasses.replace(base, dkv=K(64, 64, 4, 3), dq=K(64, 64, 4, 3)),
        "b:dkv128x128w8s2,dq128x128w8s2": dataclasses.replace(base, dkv=K(128, 128, 8, 2), dq=K(128, 128, 8, 2)),
    }
    bench(configs)

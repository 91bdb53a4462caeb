"""Quick GPU checks used while developing: bf16 correctness of every variant at a
realistic size, and per-kernel tile sweeps (forward; dK/dV and dQ with the other
kernel fixed) for each head dim. Not the benchmark (see benchmarks/attention.py).

    python benchmarks/quick.py check variants sweep:128 sweep:64 sweep:256
"""

import dataclasses
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

warnings.filterwarnings("ignore")
import flashjax  # noqa: E402
from flashjax import reference  # noqa: E402
from flashjax.config import Config, KernelConfig as K  # noqa: E402


def median_time(f, *args, reps=10, inner=3):
    jax.block_until_ready(f(*args))
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
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _inputs(key, b, tq, tk, h, hkv, d, dtype=jnp.bfloat16):
    ks = jax.random.split(key, 4)
    return (jax.random.normal(ks[0], (b, tq, h, d), dtype), jax.random.normal(ks[1], (b, tk, hkv, d), dtype),
            jax.random.normal(ks[2], (b, tk, hkv, d), dtype), jax.random.normal(ks[3], (b, tq, h, d), dtype))


def compare(name, q, k, v, do, **kw):
    """bf16 kernels vs the float32 reference: output and the three input gradients."""
    f = jax.jit(lambda q, k, v: flashjax.flash_attention(q, k, v, backend="triton", **kw))
    o, vjp = jax.vjp(f, q, k, v)
    g = vjp(do)
    r = lambda q, k, v: reference.attention(q, k, v, **kw)
    ro, rvjp = jax.vjp(r, *(x.astype(jnp.float32) for x in (q, k, v)))
    rg = rvjp(do.astype(jnp.float32))
    errs = [rel(o, ro)] + [rel(a, b) for a, b in zip(g, rg)]
    finite = all(bool(jnp.isfinite(x).all()) for x in (o, *g))
    ok = max(errs) < 2e-2 and finite
    print(f"CHECK {name:34s} rel o/dq/dk/dv = " + " ".join(f"{e:.2e}" for e in errs), "OK" if ok else "FAIL", flush=True)
    return ok


def check():
    key = jax.random.PRNGKey(1)
    for (b, tq, tk, h, hkv, d, causal) in [(2, 1000, 1000, 8, 2, 128, True), (2, 1000, 1000, 8, 8, 64, False),
                                           (1, 777, 1500, 4, 1, 96, True), (1, 513, 513, 4, 4, 256, True)]:
        compare(f"b{b} tq{tq} tk{tk} h{h}/{hkv} d{d} causal={causal}", *_inputs(key, b, tq, tk, h, hkv, d), causal=causal)


def variants():
    key = jax.random.PRNGKey(2)
    b, t, h, hkv, d = 2, 1000, 8, 2, 128
    q, k, v, do = _inputs(key, b, t, t, h, hkv, d)
    ks = jax.random.split(key, 4)
    seg = jnp.sort(jax.random.randint(ks[0], (b, t), 0, 4), axis=1)
    bias = jax.random.normal(ks[1], (1, h, t, t), jnp.bfloat16)
    mask = jax.random.bernoulli(ks[2], 0.9, (b, 1, t, t))
    cases = {
        "segments+causal": dict(segment_ids=seg, causal=True),
        "lengths": dict(q_lengths=jnp.array([1000, 611]), kv_lengths=jnp.array([900, 333])),
        "window(256,0)": dict(window=(256, 0)),
        "bias+mask": dict(bias=bias, mask=mask),
        "softcap+alibi": dict(softcap=20.0, alibi_slopes=jnp.linspace(0.01, 0.3, h)),
        "dropout0.1+causal": dict(dropout_rate=0.1, dropout_rng=jax.random.PRNGKey(5), causal=True),
    }
    for name, kw in cases.items():
        try:
            compare(name, q, k, v, do, **kw)
        except Exception as e:  # report and go on: one failing variant must not hide the rest
            print(f"CHECK {name:34s} ERROR {type(e).__name__}: {str(e)[:400]}", flush=True)


def flops(b, h, t, d, causal):
    return 4 * b * h * t * t * d / (2 if causal else 1)


def time_config(t, h, d, causal, config, mode):
    b = 16384 // t
    q, k, v, do = _inputs(jax.random.PRNGKey(0), b, t, t, h, h, d)
    fn = lambda q, k, v: flashjax.flash_attention(q, k, v, causal=causal, backend="triton", config=config)
    if mode == "fwd":
        f = jax.jit(fn)
    else:
        f = jax.jit(lambda q, k, v, do: jax.vjp(fn, q, k, v)[1](do))
    args = (q, k, v) if mode == "fwd" else (q, k, v, do)
    sec = median_time(f, *args)
    return sec, flops(b, h, t, d, causal) * (1 if mode == "fwd" else 3.5) / sec / 1e12


SWEEPS = {
    128: dict(fwd=[K(128, 128, 8, 3), K(128, 128, 8, 4), K(128, 128, 8, 2), K(128, 64, 8, 3), K(128, 64, 4, 3), K(64, 128, 4, 3)],
              dkv=[K(64, 64, 4, 3), K(64, 64, 4, 2), K(64, 128, 4, 3), K(32, 128, 4, 3), K(64, 128, 8, 3), K(128, 128, 8, 2), K(128, 64, 8, 3)],
              dq=[K(64, 64, 4, 3), K(64, 64, 4, 2), K(128, 64, 4, 3), K(128, 64, 8, 3), K(128, 32, 4, 3), K(64, 128, 4, 3), K(128, 128, 8, 2)]),
    64: dict(fwd=[K(128, 64, 4, 3), K(128, 128, 4, 3), K(128, 128, 8, 3), K(64, 64, 4, 3), K(128, 64, 4, 4)],
             dkv=[K(64, 64, 4, 3), K(64, 128, 4, 3), K(128, 128, 8, 3), K(128, 64, 4, 3), K(32, 128, 4, 3)],
             dq=[K(64, 64, 4, 3), K(128, 64, 4, 3), K(128, 128, 8, 3), K(64, 128, 4, 3), K(128, 32, 4, 3)]),
    256: dict(fwd=[K(64, 64, 8, 2), K(64, 64, 4, 2), K(128, 64, 8, 2), K(64, 32, 4, 2), K(128, 32, 8, 2)],
              dkv=[K(32, 32, 4, 2), K(32, 64, 4, 2), K(64, 32, 4, 2), K(64, 64, 8, 2), K(32, 64, 8, 2)],
              dq=[K(32, 32, 4, 2), K(64, 32, 4, 2), K(32, 64, 4, 2), K(64, 64, 8, 2), K(64, 32, 8, 2)]),
}


def sweep(d, t=8192, causal=False):
    h = 2048 // d
    base = Config.default(d, jnp.bfloat16)
    for kernel, candidates in SWEEPS[d].items():
        for cand in candidates:
            config = dataclasses.replace(base, **{kernel: cand})
            mode = "fwd" if kernel == "fwd" else "fwdbwd"
            try:
                sec, tf = time_config(t, h, d, causal, config, mode)
                print(f"SWEEP d={d} T={t} causal={causal} {kernel:3s} {cand.block_q:3d}x{cand.block_k:3d} w{cand.num_warps} s{cand.num_stages}  {mode:6s} {sec*1e3:8.3f} ms {tf:6.1f} TF/s", flush=True)
            except Exception as e:
                print(f"SWEEP d={d} {kernel} {cand} ERROR {type(e).__name__}: {str(e)[:200]}", flush=True)


def mgpu():
    """Probe of JAX's own Hopper (Mosaic GPU) forward: correctness and speed, bf16."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu as mg

    d, h = 128, 16
    for t in (4096, 16384):
        b = 16384 // t
        q, k, v, _ = _inputs(jax.random.PRNGKey(0), b, t, t, h, h, d)
        for causal in (False, True):
            for cfg in (mg.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=causal),
                        mg.TuningConfig(block_q=128, block_kv=128, max_concurrent_steps=2, causal=causal),
                        mg.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=3, causal=causal)):
                try:
                    f = jax.jit(lambda q, k, v: mg.attention(q, k, v, cfg, save_residuals=True))
                    o, (lse,) = f(q, k, v)
                    if t == 4096:
                        ro, rlse = reference.attention(q[:1], k[:1], v[:1], causal=causal, return_lse=True)
                        err = rel(o[:1], ro)
                        lse_err = rel(lse[:1] * np.log(2.0), rlse)
                    else:
                        err = lse_err = float("nan")
                    sec = median_time(jax.jit(lambda q, k, v: mg.attention(q, k, v, cfg)), q, k, v)
                    print(f"MGPU T={t} causal={causal} bq={cfg.block_q} bkv={cfg.block_kv} steps={cfg.max_concurrent_steps} "
                          f"rel o {err:.2e} lse(base2->e) {lse_err:.2e}  fwd {sec*1e3:.3f} ms {flops(b, h, t, d, causal)/sec/1e12:.1f} TF/s", flush=True)
                except Exception as e:
                    print(f"MGPU T={t} causal={causal} {cfg} ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
    print(jax.devices()[0].device_kind, jax.__version__, flush=True)
    for arg in sys.argv[1:] or ["check"]:
        if arg == "check":
            check()
        elif arg == "variants":
            variants()
        elif arg == "mgpu":
            mgpu()
        elif arg.startswith("sweep:"):
            sweep(int(arg.split(":")[1]))

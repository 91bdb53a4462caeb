"""Benchmark of the attention variants (issue 3): skipping must show in the times.

Rows, bf16, D = 128, H = 16, forward and forward+backward, flashjax beside cuDNN
(`jax.nn.dot_product_attention(implementation="cudnn")`) where cuDNN has the variant:

* full row vs 4 packed documents per row (segment ids; cuDNN gets the equivalent
  block-diagonal boolean mask): the packed row should cost about a quarter;
* 50% right padding (q/kv lengths; cuDNN: query/key_value_seq_lengths);
* sliding window (1024 left, causal) for T = 4k .. 64k: time linear in T
  (cuDNN: local_window_size);
* an additive bias [1, H, T, T] (cuDNN: bias).

FLOPs are those of the dense problem (4 B H T^2 D, x3.5 for fwd+bwd), so a
variant that skips work shows an "effective" rate above the dense one; the
`useful_fraction` column gives the fraction of (q, k) pairs that are visible.

    python benchmarks/variants.py [--out benchmarks/results/variants-<device>.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

warnings.filterwarnings("ignore")
import flashjax  # noqa: E402

HEADS, HEAD_DIM = 16, 128


def median_ms(f, *args, reps=10, inner=3):
    jax.block_until_ready(f(*args))
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = f(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / inner)
    return 1e3 * float(np.median(times))


def timed(fn, q, k, v, do, mode):
    if mode == "fwd":
        return median_ms(jax.jit(fn), q, k, v)
    grad = jax.jit(lambda q, k, v, do: jax.vjp(fn, q, k, v)[1](do))
    return median_ms(grad, q, k, v, do)


def inputs(batch, seq):
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    return [jax.random.normal(kk, (batch, seq, HEADS, HEAD_DIM), jnp.bfloat16) for kk in ks]


def cases(quick: bool):
    """(name, T, batch, flashjax kwargs, cuDNN kwargs or None, visible fraction)."""
    out = []
    t = 16384
    docs = 4
    seg = jnp.repeat(jnp.arange(docs, dtype=jnp.int32), t // docs)[None, :]
    doc_mask = seg[:, None, :, None] == seg[:, None, None, :]
    out.append(("full", t, 1, {}, {}, 1.0))
    out.append(("segments x4", t, 1, dict(segment_ids=seg), dict(mask=doc_mask), 1.0 / docs))
    half = jnp.array([t // 2], jnp.int32)
    out.append(("padding 50%", t, 1, dict(q_lengths=half, kv_lengths=half),
                dict(query_seq_lengths=half, key_value_seq_lengths=half), 0.25))
    bias_t = 4096
    bias = jax.random.normal(jax.random.PRNGKey(3), (1, HEADS, bias_t, bias_t), jnp.bfloat16)
    out.append(("full", bias_t, 4, {}, {}, 1.0))
    out.append(("bias [1,H,T,T]", bias_t, 4, dict(bias=bias), dict(bias=bias), 1.0))
    for seq in (4096, 8192, 16384) if quick else (4096, 8192, 16384, 32768, 65536):
        visible = min(1.0, (1024 + 1) / seq)  # roughly: each query sees <= 1025 keys
        out.append((f"window 1024 causal", seq, 1, dict(window=(1024, 0), causal=True),
                    dict(local_window_size=(1024, 0), is_causal=True), visible))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    device = jax.devices()[0].device_kind
    rows = []
    print(f"{'variant':22s} {'T':>6s} {'B':>2s} | {'flashjax fwd':>13s} {'fwd+bwd':>9s} | {'cuDNN fwd':>10s} {'fwd+bwd':>9s} (ms)")
    for name, seq, batch, fj_kw, cudnn_kw, visible in cases(args.quick):
        q, k, v, do = inputs(batch, seq)
        row = dict(variant=name, seq=seq, batch=batch, heads=HEADS, head_dim=HEAD_DIM, useful_fraction=visible)
        dense_flops = 4 * batch * HEADS * seq * seq * HEAD_DIM
        impls = {"flashjax": lambda q, k, v, kw=fj_kw: flashjax.flash_attention(q, k, v, backend="triton", **kw)}
        if cudnn_kw is not None:
            impls["cudnn"] = lambda q, k, v, kw=cudnn_kw: jax.nn.dot_product_attention(q, k, v, implementation="cudnn", **kw)
        for impl, fn in impls.items():
            for mode in ("fwd", "fwdbwd"):
                try:
                    ms = timed(fn, q, k, v, do, mode)
                    flops = dense_flops * (3.5 if mode == "fwdbwd" else 1.0)
                    row[f"{impl}_{mode}_ms"] = ms
                    row[f"{impl}_{mode}_dense_tflops"] = flops / ms / 1e9
                except Exception as e:  # a peer without the variant is recorded, not fatal
                    row[f"{impl}_{mode}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        cell = lambda impl, mode: f"{row[f'{impl}_{mode}_ms']:.3f}" if f"{impl}_{mode}_ms" in row else "n/a"
        print(f"{name:22s} {seq:6d} {batch:2d} | {cell('flashjax', 'fwd'):>13s} {cell('flashjax', 'fwdbwd'):>9s} | "
              f"{cell('cudnn', 'fwd'):>10s} {cell('cudnn', 'fwdbwd'):>9s}", flush=True)
    result = dict(device=device, jax=jax.__version__, host=platform.node(), date=time.strftime("%Y-%m-%d"), rows=rows)
    out = args.out or os.path.join(os.path.dirname(__file__), "results", f"variants-{device.replace(' ', '_')}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()

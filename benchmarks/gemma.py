"""Gemma 3 270M training step: the Flax example's attention vs flashjax (examples/gemma_flashjax.py).

    python benchmarks/gemma.py                        # gemma3_270m, T = 8192 and 32768, bf16
    python benchmarks/gemma.py --seqlens 8192 --steps 20
    python benchmarks/gemma.py --smoke                # tiny config on the CPU, to check the script

One training step is the loss and the parameter gradients (no optimizer update) of
the example's ``Transformer`` (Flax's ``examples/gemma``, fetched from the Flax
sdist) on ``batch`` sequences of ``T`` tokens, next-token cross entropy over its
full vocabulary, activations in bfloat16 and parameters in float32:

* ``original``: the example's ``modules.Attention`` with the ``[B, T, T]`` causal
  mask that its ``train.py`` builds (``transformer.make_causal_attn_mask``);
* ``flashjax``: `gemma_flashjax.FlashAttention`, same parameters, the causal mask
  and the local layers' window as flashjax options (``CausalMask()``: no padding).

Each (variant, T) runs in its own process, so peak memory
(``memory_stats()['peak_bytes_in_use']``) and an out-of-memory stay its own; an
out-of-memory is a result (``"oom"``), not a crash. Tokens/s is ``batch * T``
over the median of ``--steps`` timed steps after ``--warmup`` untimed ones (the
first compiles). Prints a table and writes ``benchmarks/results/gemma-<device>.json``
(``--smoke``: under the system's temporary directory, ``flashjax-smoke/``; ``--out`` to choose).

The example's code comes from the Flax sdist in ``${FLASHJAX_CACHE:-~/.cache/flashjax}``
(see examples/flax_sdist.py). On a machine without network, fetch it where pip
works and bring the folder along, e.g. ``FLASHJAX_CACHE=$PWD/.flaxcache python
examples/flax_sdist.py`` here, then ``FLASHJAX_CACHE=$PWD/.flaxcache python
benchmarks/gemma.py`` there (``.flaxcache/flax-<version>`` is ~27 MB; its
``PKG-INFO`` and ``examples/gemma`` are all that is read).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from flashjax import benchmark  # noqa: E402  (is_oom, results paths)

RESULTS_DIR = ROOT / "benchmarks" / "results"
VARIANTS = ("original", "flashjax")
# Let each process take (nearly) the whole GPU instead of JAX's default 75%: at 32k
# the [B, T, 262144] logits and their gradient alone are ~34 GB in bf16.
MEM_FRACTION = "0.95"
# --smoke: Gemma 3's structure (qk-norm, 5 local : 1 global, multi-query heads) at toy size.
SMOKE_CONFIG = dict(num_layers=6, num_embed=128, embed_dim=32, hidden_dim=64, num_heads=4, head_dim=16,
                    num_kv_heads=1, sliding_window_size=16)


def worker(variant: str, seq: int, batch: int, steps: int, warmup: int, smoke: bool, num_embed: int | None) -> dict:
    """One (variant, T): build, compile, time; returns the row (runs in its own process)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    sys.path.insert(0, str(ROOT / "examples"))
    import gemma_flashjax as gemma

    device = jax.devices()[0]
    row = {"variant": variant, "seq": seq, "batch": batch, "device": device.device_kind,
           "platform": jax.default_backend()}
    override = dict(SMOKE_CONFIG) if smoke else {}
    if num_embed:
        override["num_embed"] = num_embed
    config = gemma.transformer_cfg.TransformerConfig.gemma3_270m(
        dtype=jnp.bfloat16, weight_dtype=jnp.float32, **override)
    row["config"] = {"name": "gemma3_270m" + (" (smoke)" if smoke else ""), "num_layers": config.num_layers,
                     "num_embed": config.num_embed, "embed_dim": config.embed_dim, "num_heads": config.num_heads,
                     "num_kv_heads": config.num_kv_heads, "head_dim": config.head_dim,
                     "sliding_window_size": config.sliding_window_size, "dtype": "bfloat16",
                     "weight_dtype": "float32"}

    model = gemma.transformer_lib.Transformer(config, rngs=nnx.Rngs(0))
    if variant == "flashjax":
        model = gemma.to_flashjax(model)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    row["parameters"] = int(sum(x.size for x in jax.tree.leaves(params)))

    def attention_mask(input_mask):
        if variant == "flashjax":
            return gemma.CausalMask()  # causal, no padding: nothing but options
        return gemma.transformer_lib.make_causal_attn_mask(input_mask)  # as the example's train.py

    @jax.jit
    def train_step(params, rest, tokens):
        def loss_fn(params):
            input_mask = tokens > 0
            positions = gemma.transformer_lib.build_positions_from_mask(input_mask)
            model = nnx.merge(graphdef, params, rest)
            logits, _ = model(tokens[:, :-1], positions[:, :-1], None, attention_mask(input_mask[:, :-1]))
            # Cross entropy without a float32 copy of the [B, T, vocab] logits.
            lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
            picked = jnp.take_along_axis(logits, tokens[:, 1:, None], axis=-1)[..., 0].astype(jnp.float32)
            return jnp.mean(lse - picked)

        return jax.value_and_grad(loss_fn)(params)

    tokens = jax.random.randint(jax.random.key(0), (batch, seq + 1), 1, config.num_embed)
    try:
        start = time.perf_counter()
        loss, grads = train_step(params, rest, tokens)
        jax.block_until_ready((loss, grads))
        row["first_step_s"] = time.perf_counter() - start  # compile + one step
        for _ in range(max(0, warmup - 1)):
            jax.block_until_ready(train_step(params, rest, tokens))
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            loss, grads = train_step(params, rest, tokens)
            jax.block_until_ready((loss, grads))
            times.append(time.perf_counter() - start)
    except Exception as err:  # noqa: BLE001 -- an OOM is a result; anything else is reported
        if not benchmark.is_oom(err):
            raise
        row.update(status="oom", error=str(err).strip().splitlines()[0][:300])
        return row
    median = statistics.median(times)
    stats = device.memory_stats() or {}
    grad_norm = float(jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads))))
    row.update(status="ok", loss=float(loss), grad_norm=grad_norm, step_s=times, median_step_s=median,
               tokens_per_s=batch * seq / median, peak_bytes=stats.get("peak_bytes_in_use"))
    return row


def run_one(variant: str, seq: int, args) -> dict:
    """`worker` in a subprocess; its row, or what killed it."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", variant, "--seqlens", str(seq),
               "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--worker-out", str(out)]
        cmd += ["--smoke"] if args.smoke else []
        cmd += ["--num-embed", str(args.num_embed)] if args.num_embed else []
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", MEM_FRACTION)
        base = {"variant": variant, "seq": seq, "batch": args.batch}
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return {**base, "status": "timeout"}
        if out.exists():
            return json.loads(out.read_text())
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])[:400]
        return {**base, "status": "oom" if benchmark.is_oom(proc.stderr) else "error", "error": tail}


def table(rows: list[dict]) -> str:
    lines = [f"{'variant':<9} {'T':>6} {'batch':>5}  {'status':<7} {'tokens/s':>10} {'step ms':>9} "
             f"{'peak GiB':>8}  {'loss':>7}"]
    for r in rows:
        if r.get("status") == "ok":
            peak = r.get("peak_bytes")
            lines.append(
                f"{r['variant']:<9} {r['seq']:>6} {r['batch']:>5}  ok      {r['tokens_per_s']:>10,.0f} "
                f"{r['median_step_s'] * 1e3:>9.1f} {'-' if peak is None else f'{peak / 2**30:.2f}':>8}  "
                f"{r['loss']:>7.4f}")
        else:
            lines.append(f"{r['variant']:<9} {r['seq']:>6} {r['batch']:>5}  {r.get('status', '?'):<7} "
                         f"{r.get('error', '')[:70]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlens", default=None, help="comma-separated T (default 8192,32768; --smoke: 64,128)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default 1; --smoke: 2)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 10; --smoke: 2)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first, compile included")
    p.add_argument("--num-embed", type=int, default=None, help="vocabulary size override (default: the config's)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per (variant, T) process")
    p.add_argument("--smoke", action="store_true", help="tiny Gemma 3 config, short sequences: runs on a CPU")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/gemma[-smoke]-<device>.json)")
    p.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.seqlens = args.seqlens or ("64,128" if args.smoke else "8192,32768")
    args.batch = args.batch or (2 if args.smoke else 1)
    args.steps = args.steps or (2 if args.smoke else 10)

    if args.worker:
        row = worker(args.worker, int(args.seqlens), args.batch, args.steps, args.warmup, args.smoke,
                     args.num_embed)
        Path(args.worker_out).write_text(json.dumps(row))
        return 0

    rows = []
    for seq in (int(s) for s in args.seqlens.split(",")):
        for variant in args.variants.split(","):
            rows.append(run_one(variant, seq, args))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    device = next((r["device"] for r in rows if "device" in r), "unknown")
    path = benchmark.results_path(RESULTS_DIR, args.out, device, prefix="gemma-", smoke=args.smoke)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"device": device, "date": datetime.date.today().isoformat(),
              "mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", MEM_FRACTION),
              "config": next((r["config"] for r in rows if "config" in r), None),
              "batch": args.batch, "steps": args.steps, "warmup": args.warmup, "rows": rows}
    path.write_text(json.dumps(record, indent=1))
    print(f"\n{table(rows)}\n\nwrote {path}")
    failed = [r for r in rows if r.get("status") not in ("ok", "oom")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

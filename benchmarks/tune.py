"""Tile search for the three kernels, per head dim: prints a `_TUNED` table for flashjax/config.py.

    python benchmarks/tune.py                               # D = 64, 128, 256 at T = 8k, causal and not
    python benchmarks/tune.py --head-dims 128 --seqlens 4096,8192 --max-candidates 16
    python benchmarks/tune.py --smoke                       # CPU: exercises the code path only

For each head dim, each kernel is tuned with the other two at their current default:
the forward by timing the forward; dK/dV and dQ by timing forward+backward (the
forward is the same for every candidate, so the ordering is the backward's). A
candidate's score is the geometric mean of its TFLOP/s over the (T, causal)
settings. The grid (block_q, block_k in {32, 64, 128}, warps {4, 8}, stages
{2, 3, 4}) is pruned of tiles that cannot fit the registers and capped to the
candidates nearest the current default; candidates that fail to compile are skipped.
Writes benchmarks/results/tuning-<device>.json with every measurement.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import itertools
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attention as protocol  # noqa: E402  (benchmarks/attention.py: timing, FLOPs, file names)

KERNELS = ("fwd", "dkv", "dq")
GRID = dict(block=(32, 64, 128), num_warps=(4, 8), num_stages=(2, 3, 4))


def heads_for(head_dim: int) -> int:
    """H * D = 2048 as in the benchmark, except head dim 256 (H = 8)."""
    return 8 if head_dim >= 256 else 2048 // head_dim


def candidates(head_dim: int, default, cap: int):
    """The pruned grid, nearest the default first (the default itself leads), at most `cap`."""
    from flashjax import KernelConfig

    grid = []
    for bq, bk, w, s in itertools.product(GRID["block"], GRID["block"], GRID["num_warps"], GRID["num_stages"]):
        tile = bq * bk
        if head_dim >= 256 and tile > 64 * 128:
            continue  # the fp32 accumulators and both tiles of a 128x128 D=256 program spill
        if tile >= 128 * 128 and w == 4 and head_dim >= 128:
            continue  # 4 warps cannot hold a 128x128 fp32 score tile beside a D>=128 accumulator
        if tile <= 32 * 32 and w == 8:
            continue  # too little work per warp to be worth it
        grid.append(KernelConfig(bq, bk, w, s))

    def distance(c):
        log = lambda x: math.log2(x)
        return (abs(log(c.block_q) - log(default.block_q)) + abs(log(c.block_k) - log(default.block_k))
                + (c.num_warps != default.num_warps) + 0.5 * abs(c.num_stages - default.num_stages))

    ordered = [default] + sorted((c for c in grid if c != default), key=distance)
    return ordered[:cap]


def _config_literal(c) -> str:
    return f"KernelConfig({c.block_q}, {c.block_k}, {c.num_warps}, {c.num_stages})"


def tuned_literal(table: dict) -> str:
    """A `_TUNED` dict literal: {head_dim: (fwd, dkv, dq)} as flashjax/config.py spells it."""
    lines = ["_TUNED: dict[int, tuple[KernelConfig, KernelConfig, KernelConfig]] = {"]
    for d in sorted(table):
        lines.append(f"    {d}: ({', '.join(_config_literal(c) for c in table[d])}),")
    lines.append("}")
    return "\n".join(lines)


def tune_kernel(head_dim, kernel, cands, settings, args, deadline) -> list[dict]:
    """Compiles every candidate (threads), then times each over the settings; one dict per candidate."""
    import jax

    import flashjax
    from flashjax import Config

    base = Config.default(head_dim, "bfloat16")
    mode = "fwd" if kernel == "fwd" else "fwdbwd"
    heads = heads_for(head_dim)
    results = [dict(kernel=kernel, config=dataclasses.asdict(c), runs=[]) for c in cands]
    for seq, causal in settings:
        cell = protocol.Cell(f"d{head_dim}", heads, heads, head_dim, seq, causal, mode, "flashjax", args.tokens)
        inputs = protocol.make_inputs(cell)

        def compile_one(cand):
            config = dataclasses.replace(base, **{kernel: cand})
            fn = lambda q, k, v: flashjax.flash_attention(q, k, v, causal=causal, backend="triton", config=config)
            try:
                return jax.jit(protocol.timed_fn(cell, fn)).lower(*inputs).compile(), None
            except Exception as e:  # a tile that does not compile (shared memory, registers) is skipped
                return None, protocol.short_error(e)

        if time.perf_counter() > deadline:
            break
        with concurrent.futures.ThreadPoolExecutor(max(1, args.compile_workers)) as pool:
            compiled = list(pool.map(compile_one, cands))
        for res, (executable, error) in zip(results, compiled):
            run = dict(seq=seq, causal=causal, mode=mode)
            if executable is not None and time.perf_counter() < deadline:
                try:
                    median, _, _ = protocol.median_time(lambda: executable(*inputs), jax.block_until_ready, reps=args.reps)
                    run.update(ms=median * 1e3, tflops=cell.flops() / median / 1e12)
                except Exception as e:
                    error = protocol.short_error(e)
            if "tflops" not in run:
                run["error"] = error or "budget spent"
            res["runs"].append(run)
    for res in results:
        tf = [r["tflops"] for r in res["runs"] if "tflops" in r]
        complete = len(tf) == len(settings) and len(tf) > 0
        res["score"] = math.exp(sum(map(math.log, tf)) / len(tf)) if complete else None
    return results


def main(argv: list[str] | None = None) -> int:
    """Tunes the kernels, prints the `_TUNED` literal and writes the tuning JSON."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head-dims", default="64,128,256")
    p.add_argument("--seqlens", default="8192", help="T values to score on, e.g. 4096,8192")
    p.add_argument("--causal", default="both", help="both | yes | no")
    p.add_argument("--kernels", default=",".join(KERNELS))
    p.add_argument("--max-candidates", type=int, default=12, help="per kernel and head dim (the default included)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--tokens", type=int, default=protocol.TOKENS)
    p.add_argument("--budget-s", type=float, default=280.0, help="stop timing after this many seconds")
    p.add_argument("--compile-workers", type=int, default=8)
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/tuning-<device>.json)")
    p.add_argument("--smoke", action="store_true", help="CPU-sized: D=32, T=128, 2 candidates, 2 reps")
    args = p.parse_args(argv)
    if args.smoke:
        args.head_dims, args.seqlens, args.causal = "32", "128", "yes"
        args.max_candidates, args.reps, args.tokens = min(args.max_candidates, 2), 2, 256

    import jax

    from flashjax import Config
    from flashjax.config import _TUNED

    head_dims = protocol.parse_list(args.head_dims, None, "head dim", int)
    kernels = protocol.parse_list(args.kernels, KERNELS, "kernel")
    settings = [(t, c) for t in protocol.parse_list(args.seqlens, None, "seqlen", protocol.parse_seq)
                for c in protocol.causal_values(args.causal)]
    device = jax.devices()[0].device_kind
    start = time.perf_counter()
    deadline = start + args.budget_s
    table = dict(_TUNED)
    report = dict(device=device, jax=jax.__version__, date=datetime.date.today().isoformat(),
                  settings=[dict(seq=t, causal=c) for t, c in settings], tokens=args.tokens, results={})
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = lambda x, **_: x
    for head_dim in tqdm(head_dims, desc="head dims"):
        base = Config.default(head_dim, "bfloat16")
        best = {}
        for kernel in kernels:
            default = getattr(base, kernel)
            cands = candidates(head_dim, default, args.max_candidates)
            results = tune_kernel(head_dim, kernel, cands, settings, args, deadline)
            report["results"][f"{head_dim}/{kernel}"] = results
            scored = [(r["score"], c) for r, c in zip(results, cands) if r["score"] is not None]
            best[kernel] = max(scored, key=lambda x: x[0])[1] if scored else default
            default_score = results[0]["score"]
            top = max(scored, key=lambda x: x[0])[0] if scored else None
            print(f"D={head_dim} {kernel:3s}: best {_config_literal(best[kernel])} "
                  f"{top or float('nan'):.3g} TF/s (default {_config_literal(default)} {default_score or float('nan'):.3g})",
                  flush=True)
        table[head_dim] = tuple(best.get(k, getattr(base, k)) for k in KERNELS)
    literal = tuned_literal(table)
    report["tuned"] = {str(d): [dataclasses.asdict(c) for c in table[d]] for d in head_dims}
    report["literal"] = literal
    out = Path(args.out) if args.out else protocol.RESULTS_DIR / f"tuning-{protocol.device_slug(device)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\n# {device}, {time.perf_counter() - start:.0f} s; paste into flashjax/config.py\n{literal}")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

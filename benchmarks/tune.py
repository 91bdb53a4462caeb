"""Tile search per head dim: the Triton kernels' `_TUNED` table, or the Hopper kernels' per-GPU table.

    python benchmarks/tune.py                               # Triton: D = 64, 128, 256 at T = 8k, causal and not
    python benchmarks/tune.py --head-dims 128 --seqlens 4096,8192 --max-candidates 16
    python benchmarks/tune.py --backend mosaic --seqlens 4096,16384   # Hopper: writes flashjax/tuned_mosaic.json
    python benchmarks/tune.py --smoke                       # CPU: exercises the code path only

Triton: prints a `_TUNED` literal to paste into flashjax/config.py. Mosaic (sm90 only):
the forward's key tile and ring depth (timed forward) and the backward's dQ key tile
and ring depth (timed forward+backward) are searched, and the winners are written
into flashjax/tuned_mosaic.json under this GPU's name, which `MosaicConfig.default`
reads (nothing is tuned at import or call time). The forward schedule is not searched:
its choice depends on causality, which a per-head-dim entry cannot express (see
MosaicConfig.fwd_schedule).

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
# Hopper kernels: MosaicConfig fields searched per group; "fwd" is scored on the
# forward, "bwd" on forward+backward. Tiles that overflow shared memory fail to
# compile and are skipped.
MOSAIC_GROUPS = {
    "fwd": dict(block_kv=(64, 128), stages=(2, 3, 4)),
    "bwd": dict(dq_block_kv=(64, 128), bwd_stages=(2, 3)),
}


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


def mosaic_candidates(default, group: str, cap: int) -> list:
    """MosaicConfigs varying the group's fields over MOSAIC_GROUPS, the default first, at most `cap`."""
    fields = MOSAIC_GROUPS[group]
    grid = [dataclasses.replace(default, **dict(zip(fields, values))) for values in itertools.product(*fields.values())]
    return ([default] + [c for c in grid if c != default])[:cap]


def update_mosaic_table(path: Path, device: str, head_dim: int, config, group_fields, note: str) -> dict:
    """Writes the searched fields of `config` into the tuning file under this device and head dim."""
    from flashjax.config import device_slug

    table = json.loads(path.read_text()) if path.exists() else {}
    entry = table.setdefault(device_slug(device), {})
    entry[str(head_dim)] = {name: getattr(config, name) for name in group_fields} | {"_source": note}
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return table


def _config_literal(c) -> str:
    return f"KernelConfig({c.block_q}, {c.block_k}, {c.num_warps}, {c.num_stages})"


def tuned_literal(table: dict) -> str:
    """A `_TUNED` dict literal: {head_dim: (fwd, dkv, dq)} as flashjax/config.py spells it."""
    lines = ["_TUNED: dict[int, tuple[KernelConfig, KernelConfig, KernelConfig]] = {"]
    for d in sorted(table):
        lines.append(f"    {d}: ({', '.join(_config_literal(c) for c in table[d])}),")
    lines.append("}")
    return "\n".join(lines)


def tune_kernel(head_dim, kernel, cands, settings, args, deadline, backend: str = "triton") -> list[dict]:
    """Compiles every candidate (threads), then times each over the settings; one dict per candidate."""
    import jax

    import flashjax
    from flashjax import Config

    base = Config.default(head_dim, "bfloat16")
    mode = "fwd" if kernel == "fwd" else "fwdbwd"
    heads = heads_for(head_dim)
    results = [dict(kernel=kernel, config=dataclasses.asdict(c), runs=[]) for c in cands]
    checker = protocol.Checker()

    def with_candidate(cand):
        if backend == "mosaic":
            return dataclasses.replace(base, mosaic=cand)
        return dataclasses.replace(base, **{kernel: cand})
    for seq, causal in settings:
        cell = protocol.Cell(f"d{head_dim}", heads, heads, head_dim, seq, causal, mode, "flashjax", args.tokens)
        inputs = protocol.make_inputs(cell)

        def compile_one(cand):
            config = with_candidate(cand)
            fn = lambda q, k, v: flashjax.flash_attention(q, k, v, causal=causal, backend=backend, config=config)
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
                    # A tile that computes the wrong thing fast must not win: the same
                    # check against the float32 reference as the benchmark, then timing.
                    errors = checker.check(cell, executable(*inputs), *inputs)
                    run["rel_err"] = errors
                    if max(errors.values()) >= protocol.TOLERANCE:
                        error = f"mismatch: relative error {errors}"
                    else:
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
    p.add_argument("--backend", choices=("triton", "mosaic"), default="triton")
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
        args.head_dims, args.seqlens, args.causal = ("64" if args.backend == "mosaic" else "32"), "128", "yes"
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
    if args.backend == "mosaic":
        return tune_mosaic(args, head_dims, settings, report, deadline, start)
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


def tune_mosaic(args, head_dims, settings, report, deadline, start) -> int:
    """The Hopper kernels: each MOSAIC_GROUPS group searched in turn (the earlier winners kept)."""
    from flashjax.config import MOSAIC_TUNING_FILE, MosaicConfig

    device = report["device"]
    out = Path(args.out) if args.out else protocol.RESULTS_DIR / f"tuning-mosaic-{protocol.device_slug(device)}.json"
    for head_dim in head_dims:
        best = MosaicConfig.default(head_dim, device_kind=device)
        for group in MOSAIC_GROUPS:
            cands = mosaic_candidates(best, group, args.max_candidates)
            results = tune_kernel(head_dim, group, cands, settings, args, deadline, backend="mosaic")
            report["results"][f"{head_dim}/{group}"] = results
            scored = [(r["score"], c) for r, c in zip(results, cands) if r["score"] is not None]
            default_score = results[0]["score"]
            if scored:
                top, best = max(scored, key=lambda x: x[0])
                print(f"D={head_dim} {group}: best {dict((f, getattr(best, f)) for f in MOSAIC_GROUPS[group])} "
                      f"{top:.3g} TF/s (default {default_score or float('nan'):.3g})", flush=True)
        # The built-in tiling (each group's first candidate) must have run everywhere.
        if all(report["results"][f"{head_dim}/{g}"][0]["score"] is not None for g in MOSAIC_GROUPS):
            fields = [f for g in MOSAIC_GROUPS.values() for f in g]
            seqs = sorted({s["seq"] for s in report["settings"]})
            causal = sorted({s["causal"] for s in report["settings"]})
            note = f"benchmarks/tune.py --backend mosaic, {report['date']}, T in {seqs}, causal in {causal}"
            update_mosaic_table(MOSAIC_TUNING_FILE, device, head_dim, best, fields, note)
            report["tuned"] = {**report.get("tuned", {}), str(head_dim): dataclasses.asdict(best)}
        else:
            print(f"D={head_dim}: the default did not run on every setting; {MOSAIC_TUNING_FILE.name} left as it is")
    # Each run is appended: tuning one head dim at a time keeps the others' measurements.
    runs = json.loads(out.read_text()).get("runs", []) if out.exists() else []
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"runs": runs + [report]}, indent=1))
    print(f"# {device}, {time.perf_counter() - start:.0f} s; table: {MOSAIC_TUNING_FILE}\nresults: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

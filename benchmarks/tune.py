"""Tile search per head dim: the winners go into the backend's tuned table under this GPU's name.

    python benchmarks/tune.py                                  # Triton: D = 64, 128, 256 at T = 8k, causal and not
    python benchmarks/tune.py --head-dims 128 --seqlens 4096,8192 --max-candidates 16
    python benchmarks/tune.py --backend mosaic --seqlens 4096,16384   # the Hopper kernels (sm90)
    python benchmarks/tune.py --smoke --out /tmp/tune --table /tmp/tuned.json   # CPU: the code path only

A thin command over `flashjax.tuning.search`, which checks every candidate against the
float32 reference and times it with the protocol of `flashjax.benchmark`; a candidate's
score is the geometric mean of its TFLOP/s over the (T, causal) settings. The winners
are written with `flashjax.tuning.write_entry` into the backend's table,
flashjax/kernels/<backend>/tuned.json (`TritonConfig.default` / `MosaicConfig.default`
read it), under this GPU's device slug, and only for a head dim whose current default
ran on every setting (else the comparison is incomplete and the table is left as it is).
Without a GPU nothing is written into the package's tables; `--table PATH` writes a copy.
Nothing is tuned at import or call time.

Triton: each kernel (fwd, dkv, dq) is searched with the other two at their current
tuned value: the forward by timing the forward; dK/dV and dQ by timing forward+backward
(the forward is the same for every candidate, so the ordering is the backward's).
Candidates: block_q, block_k in {32, 64, 128}, warps {4, 8}, stages {2, 3, 4}, pruned
of tiles that cannot fit the registers, nearest the current value first (it leads),
at most --max-candidates; a candidate that fails to compile is skipped.

Mosaic: the groups of MosaicConfig fields in MOSAIC_GROUPS, in turn, each with the
earlier groups' winners: the forward's key tile and ring depth (timed forward), the
backward's dQ key tile and ring depth (timed forward+backward). The forward schedule
and the dQ way are not searched: the schedule's choice depends on causality, which a
per-head-dim entry cannot express (see MosaicConfig.fwd_schedule).

Every measurement is appended to benchmarks/results/tuning-[mosaic-]<device>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from flashjax import benchmark, tuning  # noqa: E402  (the harness and the search)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
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


def candidates(head_dim: int, default, cap: int) -> list:
    """KernelConfigs of the pruned grid, nearest the default first (the default itself leads), at most `cap`."""
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
        log = math.log2
        return (abs(log(c.block_q) - log(default.block_q)) + abs(log(c.block_k) - log(default.block_k))
                + (c.num_warps != default.num_warps) + 0.5 * abs(c.num_stages - default.num_stages))

    return ([default] + sorted((c for c in grid if c != default), key=distance))[:cap]


def mosaic_candidates(default, group: str, cap: int) -> list:
    """MosaicConfigs varying the group's fields over MOSAIC_GROUPS, the default first, at most `cap`."""
    fields = MOSAIC_GROUPS[group]
    grid = [dataclasses.replace(default, **dict(zip(fields, values))) for values in itertools.product(*fields.values())]
    return ([default] + [c for c in grid if c != default])[:cap]


def make_call(cell, config):
    """fn(q, k, v) with a candidate config (which selects its backend)."""
    import flashjax

    return lambda q, k, v: flashjax.flash_attention(q, k, v, causal=cell.causal, config=config)


def search(args, head_dim: int, name: str, cands: list, mode: str, deadline: float, report: dict):
    """Runs tuning.search for one kernel/group; returns (winner, its score, the default's score)."""
    heads = 2 if args.smoke else heads_for(head_dim)
    kv_heads = 1 if args.smoke else heads
    impl = "flashjax_mosaic" if args.backend == "mosaic" else "flashjax"
    cells = [benchmark.Cell(f"d{head_dim}", heads, kv_heads, head_dim, seq, causal, mode, impl, args.tokens)
             for seq, causal in args.settings]
    results = tuning.search(cells, cands, make_call, reps=args.reps, deadline=deadline,
                            compile_workers=args.compile_workers)
    report["results"][f"{head_dim}/{name}"] = results
    scored = [(r["score"], c) for r, c in zip(results, cands) if r["score"] is not None]
    top, best = max(scored, key=lambda x: x[0]) if scored else (None, cands[0])
    return best, top, results[0]["score"]


def _score(x) -> str:
    return "-" if x is None else f"{x:.3g} TF/s"


def tune_triton(args, head_dim: int, device: str | None, deadline: float, report: dict):
    """(fields for the table, complete): each kernel's winner with the others at their tuned value."""
    import jax.numpy as jnp

    from flashjax import TritonConfig

    base = TritonConfig.default(head_dim, jnp.bfloat16, device_kind=device)
    best, complete = {}, True
    for kernel in args.kernel_list:
        default = getattr(base, kernel)
        cands = [dataclasses.replace(base, **{kernel: c}) for c in candidates(head_dim, default, args.max_candidates)]
        winner, top, default_score = search(args, head_dim, kernel, cands, "fwd" if kernel == "fwd" else "fwdbwd",
                                            deadline, report)
        best[kernel] = getattr(winner, kernel)
        complete &= default_score is not None
        print(f"D={head_dim} {kernel:3s}: best {best[kernel]} {_score(top)} (default {default} {_score(default_score)})",
              flush=True)
    return {k: dataclasses.asdict(best.get(k, getattr(base, k))) for k in KERNELS}, complete


def tune_mosaic(args, head_dim: int, device: str | None, deadline: float, report: dict):
    """(fields for the table, complete): each group of MOSAIC_GROUPS in turn, earlier winners kept."""
    from flashjax import MosaicConfig

    best, complete = MosaicConfig.default(head_dim, device_kind=device), True
    for group in MOSAIC_GROUPS:
        cands = mosaic_candidates(best, group, args.max_candidates)
        best, top, default_score = search(args, head_dim, group, cands, "fwd" if group == "fwd" else "fwdbwd",
                                          deadline, report)
        complete &= default_score is not None
        chosen = {f: getattr(best, f) for f in MOSAIC_GROUPS[group]}
        print(f"D={head_dim} {group}: best {chosen} {_score(top)} (default {_score(default_score)})", flush=True)
    return {f: getattr(best, f) for fields in MOSAIC_GROUPS.values() for f in fields}, complete


def append_report(path: Path, report: dict):
    """Appends a run to the tuning results file (a file of the older one-report format becomes its first run)."""
    previous = json.loads(path.read_text()) if path.exists() else {}
    runs = previous.get("runs", [previous] if previous else [])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"runs": runs + [report]}, indent=1))


def main(argv: list[str] | None = None) -> int:
    """Searches the tiles, writes the winners into the tuned table and the measurements into results/."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("triton", "mosaic"), default="triton")
    p.add_argument("--head-dims", default="64,128,256")
    p.add_argument("--seqlens", default="8192", help="T values to score on, e.g. 4096,8192")
    p.add_argument("--causal", default="both", help="both | yes | no")
    p.add_argument("--kernels", default=",".join(KERNELS), help="Triton kernels to search (fwd,dkv,dq)")
    p.add_argument("--max-candidates", type=int, default=12, help="per kernel (group) and head dim, the default included")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--tokens", type=int, default=benchmark.TOKENS)
    p.add_argument("--budget-s", type=float, default=280.0, help="stop timing after this many seconds")
    p.add_argument("--compile-workers", type=int, default=8)
    p.add_argument("--out", default=None, help="results .json or directory (default benchmarks/results/)")
    p.add_argument("--table", default=None,
                   help="tuned table to write (default: the backend's flashjax/kernels/<backend>/tuned.json on a GPU, none without)")
    p.add_argument("--smoke", action="store_true", help="CPU-sized: D=32 (mosaic: 64), H=2, T=128, 2 candidates, 2 reps")
    args = p.parse_args(argv)
    if args.smoke:
        args.head_dims, args.seqlens, args.causal = ("64" if args.backend == "mosaic" else "32"), "128", "yes"
        args.max_candidates, args.reps, args.tokens = min(args.max_candidates, 2), 2, 256
        args.compile_workers = min(args.compile_workers, 2)

    import jax

    from flashjax.kernels.mosaic.config import TUNED as MOSAIC_TUNED
    from flashjax.kernels.triton.config import TUNED as TRITON_TUNED

    head_dims = benchmark.parse_list(args.head_dims, None, "head dim", int)
    args.kernel_list = benchmark.parse_list(args.kernels, KERNELS, "kernel")
    args.settings = [(t, c) for t in benchmark.parse_list(args.seqlens, None, "seqlen", benchmark.parse_seq)
                     for c in benchmark.causal_values(args.causal)]
    device = jax.devices()[0].device_kind
    gpu = tuning.first_gpu_kind()
    package_table = MOSAIC_TUNED if args.backend == "mosaic" else TRITON_TUNED
    table = Path(args.table) if args.table else package_table if gpu else None
    if table is not None and not table.exists():  # a copy starts as the package's table (its defaults included)
        table.parent.mkdir(parents=True, exist_ok=True)
        table.write_text(package_table.read_text())
    start = time.perf_counter()
    deadline = start + args.budget_s
    date = datetime.date.today().isoformat()
    report = dict(backend=args.backend, device=device, jax=jax.__version__, date=date, tokens=args.tokens,
                  settings=[dict(seq=t, causal=c) for t, c in args.settings], results={}, tuned={})
    tune = tune_mosaic if args.backend == "mosaic" else tune_triton
    seqs = sorted({t for t, _ in args.settings})
    causal = sorted({c for _, c in args.settings})
    for head_dim in head_dims:
        fields, complete = tune(args, head_dim, gpu, deadline, report)
        if not complete:
            print(f"D={head_dim}: the current default did not run on every setting; no table entry written")
            continue
        report["tuned"][str(head_dim)] = fields
        if table is not None:
            note = f"benchmarks/tune.py --backend {args.backend}, {date}, T in {seqs}, causal in {causal}"
            tuning.write_entry(table, device, head_dim, fields, note)
    out = benchmark.results_path(RESULTS_DIR, args.out, device,
                                 prefix="tuning-mosaic-" if args.backend == "mosaic" else "tuning-", smoke=args.smoke)
    append_report(out, report)
    where = f"table: {table} ({tuning.device_slug(device)})" if table else "no GPU: no table written (--table PATH writes one)"
    print(f"# {device}, {time.perf_counter() - start:.0f} s; {where}\nresults: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

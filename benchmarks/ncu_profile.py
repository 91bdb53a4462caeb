"""Nsight Compute profile of one forward+backward step, flashjax's Hopper kernels beside cuDNN.

On the device (ncu is there; --clock-control none leaves the GPU's clocks alone):

    ncu --clock-control none --profile-from-start off --csv --page raw \\
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \\
        --section LaunchStats --section Occupancy --log-file raw.csv \\
        python benchmarks/ncu_profile.py run --cells 8192:no,16384:yes

Then, anywhere:

    python benchmarks/ncu_profile.py summarize raw.csv

`run` compiles and warms each (cell, implementation) first, then profiles exactly one
jitted forward+backward call per window (cuProfilerStart/Stop around it), in the
order it prints; a one-thread marker kernel opens each window so `summarize` can
tell the windows apart. Problems and inputs are those of `flashjax.benchmark` (bf16,
16384 tokens per batch) at H=16 and the head dims of `--dims` (default 128; "192x128":
queries and keys 192 wide, values 128, as MLA).
`summarize` prints, per window, each kernel's time, the FLOPs its matrix products
perform (not the credited count: the recomputing backward does more) and the
counters that say what bounds it.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import itertools
import json
import sys
from pathlib import Path

MARKER = "flashjax_window_marker"
HEADS = 16

# Matrix products each kernel performs, in units of 2*B*H*Tq*Tk*D (one Tq x Tk x D product),
# before halving for causal, as (products over the query/key head dim, over the value head
# dim). Forward: S; PV. dK/dV: S^T, dK; dP^T, dV. dQ: S, dQ; dP.
PRODUCTS = {"flashjax_mosaic_fwd": (1, 1), "flashjax_mosaic_dkv": (2, 2), "flashjax_mosaic_dq": (2, 1)}


def parse_dims(text):
    """'128,192x128' -> [(128, 128), (192, 128)]: (query/key head dim, value head dim)."""
    dims = []
    for item in text.split(","):
        head_dim, _, v_head_dim = item.partition("x")
        dims.append((int(head_dim), int(v_head_dim or head_dim)))
    return dims


def parse_cells(text):
    """'8192:no,32768:yes:4096' -> [(8192, False, None), (32768, True, 4096)]: (seq, causal,
    sliding window's left extent or None)."""
    cells = []
    for item in text.split(","):
        seq, causal, *window = item.split(":")
        cells.append((int(seq), causal == "yes", int(window[0]) if window else None))
    return cells


def visible_pairs(seq: int, causal: bool, window: int | None = None) -> int:
    """(query, key) pairs a [seq, seq] call scores: query i sees keys i - window .. i with a
    sliding window (window, 0), 0 .. i causal, all of them otherwise."""
    if window is None:
        return seq * (seq + 1) // 2 if causal else seq * seq
    rows = min(seq, window + 1)  # the first rows, before the window is full
    return rows * (rows + 1) // 2 + (seq - rows) * (window + 1)


def parse_impls(text):
    """'mosaic:bwd_stages=3,stages=3,cudnn' -> ['mosaic:bwd_stages=3,stages=3', 'cudnn']:
    a FIELD=VALUE item continues the implementation before it."""
    impls = []
    for item in text.split(","):
        if "=" in item and ":" not in item and impls:
            impls[-1] += "," + item
        else:
            impls.append(item)
    return impls


def flashjax_config(backend: str, fields: str, head_dim: int, v_head_dim: int):
    """None (the tuned default), or the backend's default config at these head dims with "field=value,..." applied."""
    if not fields:
        return None
    import jax.numpy as jnp

    from flashjax import MosaicConfig, TritonConfig
    from flashjax.benchmark import config_overrides

    default = (MosaicConfig.default(head_dim, v_head_dim=v_head_dim) if backend == "mosaic"
               else TritonConfig.default(head_dim, jnp.bfloat16))
    return config_overrides(default, fields)


def run(args):
    import jax

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import flashjax
    from flashjax.benchmark import Cell, make_inputs, timed_fn

    cuda = ctypes.CDLL("libcuda.so.1")
    marker = None
    try:
        import cupy

        marker = cupy.RawKernel(f'extern "C" __global__ void {MARKER}(int x) {{}}', MARKER)
    except Exception as e:  # noqa: BLE001 - profile without markers rather than not at all
        print(f"no window markers ({type(e).__name__}: {e}); windows follow the order below", flush=True)

    windows = []
    for (head_dim, v_head_dim), (seq, causal, window) in itertools.product(parse_dims(args.dims), parse_cells(args.cells)):
        cell = Cell(f"d{head_dim}", HEADS, HEADS, head_dim, seq, causal, "fwdbwd", "profile")
        batch = cell.batch
        q, k, v, do = make_inputs(cell, seed=seq)
        v, do = v[..., :v_head_dim], do[..., :v_head_dim]  # MLA: narrower values
        for impl in parse_impls(args.impls):
            extent = None if window is None else (window, 0)
            if impl == "cudnn":
                attend = lambda q, k, v, c=causal, w=extent: jax.nn.dot_product_attention(
                    q, k, v, is_causal=c, local_window_size=w, implementation="cudnn")
            elif impl == "fa3":
                import flash_attn3_jax

                attend = lambda q, k, v, c=causal, w=extent: flash_attn3_jax.flash_mha(
                    q, k, v, softmax_scale=cell.scale, is_causal=c, window_size=w or (-1, -1))
            else:
                # "mosaic:bwd_stages=3": config fields after the colon (flashjax.benchmark.config_overrides).
                backend, _, fields = impl.partition(":")
                config = flashjax_config(backend, fields, head_dim, v_head_dim)
                attend = lambda q, k, v, c=causal, b=backend, cfg=config, w=extent: flashjax.flash_attention(
                    q, k, v, causal=c, window=w, backend=b, config=cfg)
            step = jax.jit(timed_fn(cell, attend))  # jax.grad of sum(out * do) w.r.t. q, k, v
            for _ in range(3):
                jax.block_until_ready(step(q, k, v, do))
            if marker is not None:
                marker((1,), (1,), (0,))
                cupy.cuda.runtime.deviceSynchronize()
            cuda.cuProfilerStart()
            if marker is not None:
                marker((1,), (1,), (len(windows),))
            jax.block_until_ready(step(q, k, v, do))
            cuda.cuProfilerStop()
            windows.append({"seq": seq, "causal": causal, "impl": impl, "batch": batch, "head_dim": head_dim,
                            "v_head_dim": v_head_dim, "sliding_window": window})
            print("window", len(windows) - 1, json.dumps(windows[-1]), flush=True)
    if args.windows:
        Path(args.windows).write_text(json.dumps(windows))


def read_raw(path):
    """Rows of ncu's `--csv --page raw` log (a header row, a units row, one row per kernel)."""
    lines = [line for line in Path(path).read_text().splitlines() if line.startswith('"')]
    rows = list(csv.reader(lines))
    header, units, body = rows[0], rows[1], rows[2:]
    return [dict(zip(header, r)) for r in body], dict(zip(header, units))


def number(text):
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return float("nan")


def summarize(args):
    rows, units = read_raw(args.raw)
    windows = json.loads(Path(args.windows).read_text()) if args.windows else None
    groups, current = [], None
    for row in rows:
        if MARKER in row["Kernel Name"]:
            current = []
            groups.append(current)
        elif current is not None:
            current.append(row)
    if not groups:  # no markers: one group
        groups = [rows]
    to_ns = {"ns": 1.0, "nsecond": 1.0, "us": 1e3, "usecond": 1e3, "ms": 1e6, "msecond": 1e6, "s": 1e9, "second": 1e9}[units.get("gpu__time_duration.sum", "nsecond")]
    stall_cols = [c for c in rows[0] if c.startswith("smsp__average_warps_issue_stalled_") and c.endswith("_per_issue_active.ratio")]
    for i, group in enumerate(groups):
        w = windows[i] if windows and i < len(windows) else {}
        # Windows written before --dims carry no head dims: D=128.
        head_dim = w.get("head_dim", 128)
        v_head_dim = w.get("v_head_dim", head_dim)
        dims = f"D={head_dim}" + (f"x{v_head_dim}" if v_head_dim != head_dim else "")
        mask = ("causal" if w.get("causal") else "full") + (f" sliding window {w['sliding_window']}" if w.get("sliding_window") else "")
        title = f"{dims} T={w.get('seq')} {mask} {w.get('impl')}" if w else f"window {i}"
        total = sum(number(r["gpu__time_duration.sum"]) for r in group) * to_ns
        print(f"\n## {title}: {len(group)} kernels, {total / 1e6:.3f} ms")
        for r in sorted(group, key=lambda r: -number(r["gpu__time_duration.sum"])):
            ns = number(r["gpu__time_duration.sum"]) * to_ns
            name = r["Kernel Name"]
            line = f"- {name[:60]:60s} {ns / 1e6:8.3f} ms"
            short = next((k for k in PRODUCTS if k in name), None)
            if short and w:
                qk_products, v_products = PRODUCTS[short]
                width = qk_products * head_dim + v_products * v_head_dim  # summed over the kernel's products
                # The protocol's count (causal: half the square); a sliding window's pairs exactly.
                window = w.get("sliding_window")
                pairs = w["seq"] ** 2 * (0.5 if w["causal"] else 1) if window is None else visible_pairs(w["seq"], True, window)
                work = 2 * w["batch"] * HEADS * pairs * width
                line += f"  performed {work / ns / 1e3:6.1f} TFLOP/s"
            if ns < 0.02 * total:
                print(line)
                continue
            stalls = sorted(((number(r[c]), c) for c in stall_cols), reverse=True)[:4]
            detail = {
                "tensor_pipe%": r.get("sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed"),
                "sm%": r.get("sm__throughput.avg.pct_of_peak_sustained_elapsed"),
                "dram%": r.get("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"),
                "regs": r.get("launch__registers_per_thread"),
                "grid": r.get("launch__grid_size"),
                "smem/blk": r.get("launch__shared_mem_per_block"),
                "warps_active%": r.get("sm__warps_active.avg.pct_of_peak_sustained_active"),
            }
            print(line)
            print("    " + ", ".join(f"{k}={v}" for k, v in detail.items() if v not in (None, "")))
            print("    top stalls (cycles per issue): " + ", ".join(
                f"{c.removeprefix('smsp__average_warps_issue_stalled_').removesuffix('_per_issue_active.ratio')}={v:.2f}" for v, c in stalls))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="the profiled program (start it under ncu)")
    r.add_argument("--cells", default="8192:no,16384:yes",
                   help="SEQ:yes|no causal[:LEFT sliding window (LEFT, 0)], comma-separated")
    r.add_argument("--impls", default="mosaic,cudnn", help="flashjax backends (mosaic:FIELD=VALUE,... sets MosaicConfig fields, "
                        "triton:fwd.block_k=64,... TritonConfig fields), cudnn and/or fa3 (flash-attn3-jax)")
    r.add_argument("--dims", default="128", help="head dims, comma-separated: D, or DQKxDV (192x128: MLA)")
    r.add_argument("--windows", default="", help="write the window list (JSON) here")
    s = sub.add_parser("summarize", help="read ncu's raw CSV log")
    s.add_argument("raw")
    s.add_argument("--windows", default="", help="the JSON `run --windows` wrote")
    args = p.parse_args(argv)
    run(args) if args.command == "run" else summarize(args)


if __name__ == "__main__":
    main()

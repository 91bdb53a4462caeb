"""PyTorch FlashAttention-2 (`scaled_dot_product_attention`, FLASH_ATTENTION backend), measured
with the protocol of `flashjax.benchmark`, like the JAX cells of benchmarks/attention.py.

benchmarks/attention.py runs this in a subprocess before JAX claims the GPU: torch and
JAX in one process would compete for GPU memory (each grabs a pool of its own). Here JAX
runs on the CPU only (JAX_PLATFORMS=cpu, set before it loads): it draws the cell's
inputs (`benchmark.make_inputs`, the very inputs of the JAX cells) and checks torch's
result against the float32 reference (`benchmark.Checker`); the GPU is torch's alone.
It takes the same flags plus ``--json PATH`` and writes ``{"device", "torch", "cells":
{key: cell}}`` in the format of attention.py's results, which the parent merges.

    python benchmarks/torch_sdpa.py --seqlens 1024,4096 --configs d128 --json /tmp/torch.json

Layout is [B, H, T, D]. GQA is passed as ``enable_gqa=True``; if the flash backend
refuses it, K/V are repeated (inside the timed call) and the cell says so.
"""

from __future__ import annotations

import os

os.environ["JAX_PLATFORMS"] = "cpu"  # before JAX loads: inputs and the reference only; the GPU is torch's

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attention  # noqa: E402  (benchmarks/attention.py: the flags and the plan of the sweep)
from flashjax import benchmark  # noqa: E402  (the protocol: flashjax/benchmark.py)


def _device(torch) -> str:
    # The CPU only serves `--smoke` (torch has a CPU flash kernel); the benchmark is on CUDA.
    return "cuda" if torch.cuda.is_available() else "cpu"


def _sync(torch):
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _to_torch(torch, x, device):
    """A JAX bfloat16 array [B, T, H, D] as a torch tensor [B, H, T, D] on `device` (same bits)."""
    bits = np.array(x).view(np.int16)  # a writable copy: torch has no numpy bfloat16, int16 has its width
    return torch.from_numpy(bits).view(torch.bfloat16).permute(0, 2, 1, 3).contiguous().to(device)


def _rows_to_numpy(x, rows: int | None = None):
    """The last `rows` (default all) rows of batch row 0 of a torch [B, H, T, D] as float32 numpy [1, rows, H, D]."""
    x = x[:1] if rows is None else x[:1, :, -rows:]
    return x.detach().float().permute(0, 2, 1, 3).cpu().numpy()


def _attention_fn(torch, cell, q, k, v):
    """(fn, note): fn(q, k, v) under the flash backend; GQA natively if the backend takes it."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = cell.heads // cell.kv_heads

    def native(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=cell.causal, scale=cell.scale,
                                                  enable_gqa=group > 1)

    if group == 1:
        return native, ""
    try:
        native(q[:1, :, :128], k[:1, :, :128], v[:1, :, :128])
        return native, "enable_gqa=True"
    except Exception:
        def repeated(q, k, v):
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=cell.causal, scale=cell.scale)

        return repeated, f"K/V repeated x{group} (inside the timed call): flash backend refused enable_gqa"


def run_cell(torch, cell, reps: int, checker: benchmark.Checker) -> dict:
    """Checks then times one cell; errors are recorded, never raised."""
    try:
        inputs = benchmark.make_inputs(cell)
        q, k, v, do = (_to_torch(torch, x, _device(torch)) for x in inputs)
        fn, note = _attention_fn(torch, cell, q, k, v)
        if cell.mode == "fwdbwd":
            q, k, v = (x.requires_grad_(True) for x in (q, k, v))
            call = lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), do)
        else:
            call = lambda: fn(q, k, v)
        grad_ctx = torch.no_grad if cell.mode == "fwd" else torch.enable_grad
        with grad_ctx():
            result = call()
        rows = min(benchmark.CHECK_ROWS, cell.seq)
        got = (_rows_to_numpy(result, rows) if cell.mode == "fwd"
               else (_rows_to_numpy(result[0], rows), _rows_to_numpy(result[1]), _rows_to_numpy(result[2])))
        errors = checker.check(cell, got, *inputs)
        fields = dict(rel_err=errors, note=note)
        del result, got
        if not all(e < benchmark.TOLERANCE for e in errors.values()):  # nan fails too
            return benchmark.record(cell, "mismatch", error=f"rel err {errors} >= {benchmark.TOLERANCE}", **fields)
        cuda = torch.cuda.is_available()
        _sync(torch)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        with grad_ctx():
            median, times, inner = benchmark.median_time(call, lambda _: _sync(torch), reps=reps)
        if cuda:  # the closest analogue of XLA's temp bytes: peak allocation beyond the inputs
            fields["temp_bytes"] = int(torch.cuda.max_memory_allocated() - base)
        return benchmark.record(cell, "ok", median_ms=median * 1e3, reps_ms=[t * 1e3 for t in times],
                                inner=inner, **fields)
    except Exception as e:
        return benchmark.record(cell, "oom" if benchmark.is_oom(e) else "error", error=benchmark.short_error(e))
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    """Runs the torch cells of the sweep the flags describe and writes --json."""
    parser = attention.build_parser()
    parser.add_argument("--json", required=True, help="where to write the cells")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    args.impls = "torch_fa2"
    import torch

    start = time.perf_counter()
    cells = attention.plan(args)
    checker = benchmark.Checker()
    entries = {}
    for cell in cells:
        if time.perf_counter() - start > args.budget_s:
            entry = benchmark.record(cell, "skipped", error=f"budget of {args.budget_s:.0f} s spent")
        elif not (torch.cuda.is_available() or args.smoke):
            entry = benchmark.record(cell, "unavailable", error="torch sees no CUDA device")
        else:
            entry = run_cell(torch, cell, args.reps, checker)
        entry["torch"] = torch.__version__  # on each cell: the JAX sweep merges cells, not this file's header
        entries[cell.key] = entry
        mark = f"{entry['tflops']:.0f} TFLOP/s" if entry["status"] == "ok" else f"{entry['status']} {entry.get('error', '')[:100]}"
        print(f"torch_fa2 {cell.key}: {mark}", file=sys.stderr, flush=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"device": device, "torch": torch.__version__, "cells": entries}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

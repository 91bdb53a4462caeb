"""PyTorch FlashAttention-2 (`scaled_dot_product_attention`, FLASH_ATTENTION backend), timed
with the protocol of benchmarks/attention.py.

benchmarks/attention.py runs this in a subprocess before JAX starts: torch and JAX in
one process would compete for GPU memory (each grabs a pool of its own). It takes the
same flags plus ``--json PATH`` and writes ``{"device", "torch", "cells": {key: cell}}``
in the format of attention.py's results, which the parent merges.

    python benchmarks/torch_sdpa.py --seqlens 1024,4096 --configs d128 --json /tmp/torch.json

Layout is [B, H, T, D]. GQA is passed as ``enable_gqa=True``; if the flash backend
refuses it, K/V are repeated (inside the timed call) and the cell says so.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attention as protocol  # noqa: E402  (benchmarks/attention.py: shared cells, timing, FLOPs)


def _device(torch) -> str:
    # The CPU only serves `--smoke` (torch has a CPU flash kernel); the benchmark is on CUDA.
    return "cuda" if torch.cuda.is_available() else "cpu"


def _sync(torch):
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _inputs(torch, cell):
    device = _device(torch)
    gen = torch.Generator(device=device).manual_seed(0)
    shape = lambda h: (cell.batch, h, cell.seq, cell.head_dim)
    randn = lambda h: torch.randn(shape(h), generator=gen, device=device, dtype=torch.bfloat16)
    q, k, v, do = randn(cell.heads), randn(cell.kv_heads), randn(cell.kv_heads), randn(cell.heads)
    return q, k, v, do


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


def _reference(torch, cell, q, k, v, do, rows):
    """float32 output and dq of the last `rows` queries of batch row 0 (causal aligned bottom-right)."""
    kv_heads = min(cell.kv_heads, 2)
    heads = kv_heads * (cell.heads // cell.kv_heads)
    group = cell.heads // cell.kv_heads
    qs = q[:1, :heads, -rows:].float().requires_grad_(True)
    ks = k[:1, :kv_heads].float().repeat_interleave(group, dim=1)
    vs = v[:1, :kv_heads].float().repeat_interleave(group, dim=1)
    s = (qs @ ks.transpose(-1, -2)) * cell.scale
    if cell.causal:
        i = torch.arange(rows, device=q.device)[:, None] + (cell.seq - rows)
        j = torch.arange(cell.seq, device=q.device)[None, :]
        s = s.masked_fill(j > i, float("-inf"))
    out = torch.softmax(s, dim=-1) @ vs
    (dq,) = torch.autograd.grad(out, qs, do[:1, :heads, -rows:].float())
    return heads, out.detach(), dq


def run_cell(torch, cell, reps: int) -> dict:
    """Checks then times one cell; errors are recorded, never raised."""
    try:
        q, k, v, do = _inputs(torch, cell)
        fn, note = _attention_fn(torch, cell, q, k, v)
        if cell.mode == "fwdbwd":
            q, k, v = (x.requires_grad_(True) for x in (q, k, v))
            call = lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), do)
        else:
            call = lambda: fn(q, k, v)
        rows = min(protocol.CHECK_ROWS, cell.seq)
        heads, out_ref, dq_ref = _reference(torch, cell, q.detach(), k.detach(), v.detach(), do, rows)
        with torch.no_grad() if cell.mode == "fwd" else torch.enable_grad():
            result = call()
        got, want = ((result[:1, :heads, -rows:], out_ref) if cell.mode == "fwd"
                     else (result[0][:1, :heads, -rows:], dq_ref))
        err = protocol.rel_err(got.float().cpu().numpy(), want.cpu().numpy())
        fields = dict(rel_err={"out" if cell.mode == "fwd" else "dq": err}, note=note)
        del result, out_ref, dq_ref
        if not err < protocol.TOLERANCE:
            return protocol.record(cell, "mismatch", error=f"rel err {err:.3g} >= {protocol.TOLERANCE}", **fields)
        cuda = torch.cuda.is_available()
        _sync(torch)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        grad_ctx = torch.no_grad if cell.mode == "fwd" else torch.enable_grad
        with grad_ctx():
            median, times, inner = protocol.median_time(call, lambda _: _sync(torch), reps=reps)
        if cuda:  # the closest analogue of XLA's temp bytes: peak allocation beyond the inputs
            fields["temp_bytes"] = int(torch.cuda.max_memory_allocated() - base)
        return protocol.record(cell, "ok", median_ms=median * 1e3, reps_ms=[t * 1e3 for t in times],
                               inner=inner, **fields)
    except Exception as e:
        status = "oom" if "out of memory" in str(e).lower() else "error"
        return protocol.record(cell, status, error=protocol.short_error(e))
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    """Runs the torch cells of the sweep the flags describe and writes --json."""
    parser = protocol.build_parser()
    parser.add_argument("--json", required=True, help="where to write the cells")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    args.impls = "torch_fa2"
    import torch

    start = time.perf_counter()
    cells = protocol.plan(args)
    entries = {}
    for cell in cells:
        if time.perf_counter() - start > args.budget_s:
            entry = protocol.record(cell, "skipped", error=f"budget of {args.budget_s:.0f} s spent")
        elif not (torch.cuda.is_available() or args.smoke):
            entry = protocol.record(cell, "unavailable", error="torch sees no CUDA device")
        else:
            entry = run_cell(torch, cell, args.reps)
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

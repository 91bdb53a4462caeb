"""PyTorch FlexAttention on the cases of benchmarks/flex.py, measured with the protocol of
`flashjax.benchmark`, like flex.py's flashjax cells.

benchmarks/flex.py runs this in a subprocess before JAX claims the GPU (torch and JAX in
one process would compete for GPU memory). Here JAX runs on the CPU only
(JAX_PLATFORMS=cpu, set before it loads): it draws each cell's inputs (`flex.inputs_for`,
the very inputs of the flashjax cells), counts the visible pairs (the FLOPs) and computes
the float32 reference that torch's output or dq is checked against (`flex.expected`); the
GPU is torch's alone. It takes flex.py's flags plus ``--json PATH`` and writes ``{"device",
"torch", "compile", "cells": {key: cell}}`` in flex.py's format, which the parent merges.

    python benchmarks/torch_flex.py --cases alibi --seqlens 4k --json /tmp/torch_flex.json

Each case's mods are written here as FlexAttention takes them, ``score_mod(score, b, h,
q_idx, kv_idx)`` and ``mask_mod(b, h, q_idx, kv_idx)`` on tensors, reading the same arrays
(document ids, slopes, the T5 table, prefix lengths) as flex.py's. The block mask
(``create_block_mask``, 128 x 128, batch-wide only where the mask reads the batch index) is
built once per row, outside the timed call; ``flex_attention`` runs under
``torch.compile(dynamic=False)`` on CUDA and eagerly elsewhere (``--torch-compile``). Layout
[B, H, T, D]. Forward+backward is ``autograd.grad`` of the output with the cotangent w.r.t.
q, k, v and the case's learned arrays (the T5 table requires grad).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"  # before JAX loads: inputs, FLOPs and the reference only; the GPU is torch's
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402

import flex  # noqa: E402  (benchmarks/flex.py: the cases, the flags, the check)
import torch_sdpa  # noqa: E402  (benchmarks/torch_sdpa.py: JAX arrays to torch and back)
from flashjax import benchmark  # noqa: E402  (the protocol: flashjax/benchmark.py)


# ---- the mods, as FlexAttention takes them ----------------------------------------------------------
def _causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def t5_relative_bucket(torch, relative_position, num_buckets: int, max_distance: int):
    """`flashjax.mods.t5_relative_bucket` (bidirectional) in torch: the same buckets."""
    num_buckets //= 2
    n = -relative_position
    bucket = torch.where(n < 0, num_buckets, 0)
    n = n.abs()
    max_exact = num_buckets // 2
    large = max_exact + (
        torch.log(n.clamp(min=max_exact).to(torch.float32) / max_exact)
        / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).to(torch.int32)
    large = large.clamp(max=num_buckets - 1)
    return bucket + torch.where(n < max_exact, n, large)


def torch_mods(torch, name: str, a: dict, s: flex.Sizes) -> tuple:
    """(score_mod, mask_mod, whether the mask reads the batch index) of a case; `a` holds its
    arrays as tensors on the device."""
    if name == "causal":
        return None, _causal, False
    if name == "causal_document":
        doc = a["document_ids"]
        return None, lambda b, h, q, kv: (kv <= q) & (doc[b, q] == doc[b, kv]), True
    if name == "sliding_window":
        return None, lambda b, h, q, kv: (kv <= q) & (q - kv <= s.window), False
    if name == "document_window":
        doc = a["document_ids"]
        return None, lambda b, h, q, kv: (doc[b, q] == doc[b, kv]) & (kv <= q) & (q - kv <= s.window), True
    if name == "chunked":
        return None, lambda b, h, q, kv: (q // s.chunk == kv // s.chunk) & (kv <= q), False
    if name == "prefix_lm":
        prefix = a["prefix_lengths"]
        return None, lambda b, h, q, kv: (kv <= q) | (kv < prefix[b]), True
    if name == "alibi":
        slopes = a["slopes"]
        return lambda score, b, h, q, kv: score - slopes[h] * (q - kv).abs().to(torch.float32), _causal, False
    if name == "softcap":
        cap = s.softcap
        return lambda score, b, h, q, kv: cap * torch.tanh(score / cap), _causal, False
    if name == "t5_bias":
        table = a["table"]

        def score_mod(score, b, h, q, kv):
            return score + table[h, t5_relative_bucket(torch, kv - q, s.t5_buckets, s.t5_max_distance)]

        return score_mod, None, False
    raise ValueError(f"torch_flex.py has no mods for case {name!r}")


# ---- running ---------------------------------------------------------------------------------------
def flex_function(torch, setting: str):
    """(flex_attention, compiled or not; a note saying which)."""
    from torch.nn.attention.flex_attention import flex_attention

    if setting == "on" or (setting == "auto" and torch.cuda.is_available()):
        # Every case and T compiles anew: more than dynamo's default limit of recompilations.
        for limit in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
            if hasattr(torch._dynamo.config, limit):
                setattr(torch._dynamo.config, limit, 4096)
        return torch.compile(flex_attention, dynamic=False), "torch.compile(flex_attention, dynamic=False)"
    return flex_attention, "flex_attention eager (no torch.compile)"


class Inputs:
    """The inputs of the last problem shape, as JAX arrays (for the reference) and torch tensors:
    every case at one T shares them."""

    def __init__(self, torch):
        self.torch, self.shape, self.jax, self.tensors = torch, None, None, None

    def get(self, cell: flex.FlexCell):
        shape = (cell.batch, cell.seq, cell.heads, cell.head_dim, cell.v_head_dim)
        if shape != self.shape:
            self.shape, self.jax, self.tensors = shape, None, None  # the old ones go first
            self.jax = flex.inputs_for(cell)
            device = torch_sdpa._device(self.torch)
            self.tensors = tuple(torch_sdpa._to_torch(self.torch, x, device) for x in self.jax)
        return self.jax, self.tensors


def run_row(torch, row: flex.Row, sizes: flex.Sizes, attend, note: str, reps: int, cache: Inputs) -> list[dict]:
    """Checks then times the row's torch cells; errors are recorded, never raised."""
    from torch.nn.attention.flex_attention import create_block_mask

    case, first = row.case, row.cells[0]
    device = torch_sdpa._device(torch)
    try:
        inputs, (q, k, v, do) = cache.get(first)
        arrays = flex.draw_arrays(case, first.batch, row.seq, sizes)
        visible = flex.visible_fraction(case, sizes, first.batch, row.seq, flex.as_jax(arrays))
        cells = [dataclasses.replace(c, visible=visible) for c in row.cells]
        modes = dict.fromkeys(c.mode for c in cells)
        want = {mode: flex.expected(case, sizes, mode, inputs, arrays) for mode in modes}
        if "fwdbwd" in modes:
            want["kv"] = flex.expected_kv(case, sizes, inputs, arrays)
        tensors = {name: torch.from_numpy(a).to(device) for name, a in arrays.items()}
        _, mask_mod, per_batch = torch_mods(torch, case.name, tensors, sizes)
        block_mask = None
        if mask_mod is not None:
            block_mask = create_block_mask(mask_mod, first.batch if per_batch else None, None, row.seq, row.seq,
                                           device=device)
    except Exception as e:  # the row's cells record it
        status = "oom" if benchmark.is_oom(e) else "error"
        return [benchmark.record(c, status, error=benchmark.short_error(e), case=case.name) for c in row.cells]
    rows = min(benchmark.CHECK_ROWS, row.seq)
    entries = []
    for cell in cells:
        fields = dict(case=case.name, visible=visible, note=note)
        try:
            fwd = cell.mode == "fwd"
            learned = {name: tensors[name].clone().requires_grad_(not fwd) for name in case.learned}
            score_mod = torch_mods(torch, case.name, {**tensors, **learned}, sizes)[0]
            leaves = [x.detach().requires_grad_(not fwd) for x in (q, k, v)]

            def forward():
                return attend(*leaves, score_mod=score_mod, block_mask=block_mask, scale=cell.scale)

            call = forward if fwd else lambda: torch.autograd.grad(forward(), [*leaves, *learned.values()], do)
            grad_ctx = torch.no_grad if fwd else torch.enable_grad
            with grad_ctx():
                result = call()
            got = torch_sdpa._rows_to_numpy(result if fwd else result[0], rows)
            errors = {flex.error_name(cell.mode): flex.check(want[cell.mode], got)}
            if not fwd:  # result: (dq, dk, dv, learned arrays' gradients)
                errors.update(flex.check_kv(want["kv"], *map(torch_sdpa._rows_to_numpy, result[1:3])))
            fields["rel_err"] = errors
            del result, got
            if not all(e < benchmark.TOLERANCE for e in errors.values()):  # nan fails too
                entries.append(benchmark.record(cell, "mismatch", error=f"rel err {errors} >= {benchmark.TOLERANCE}", **fields))
                continue
            torch_sdpa._sync(torch)
            with grad_ctx():
                median, times, inner = benchmark.median_time(call, lambda _: torch_sdpa._sync(torch), reps=reps)
            entries.append(benchmark.record(cell, "ok", median_ms=median * 1e3, reps_ms=[t * 1e3 for t in times],
                                            inner=inner, **fields))
        except NotImplementedError as e:  # e.g. no FlexAttention backward on the CPU
            entries.append(benchmark.record(cell, "unsupported", error=benchmark.short_error(e), **fields))
        except Exception as e:
            status = "oom" if benchmark.is_oom(e) else "error"
            entries.append(benchmark.record(cell, status, error=benchmark.short_error(e), **fields))
        finally:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return entries


def main(argv: list[str] | None = None) -> int:
    """Runs the torch cells of the plan the flags describe and writes --json."""
    parser = flex.build_parser()
    parser.add_argument("--json", required=True, help="where to write the cells")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.smoke:
        args.reps = min(args.reps, 2)
    start = time.perf_counter()
    budget = args.torch_budget_s if args.torch_budget_s is not None else args.budget_s * flex.TORCH_SHARE
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    attend, note = flex_function(torch, args.torch_compile)
    sizes = flex.sizes_of(args)
    done = set()
    if args.resume:  # the parent's results file, named by the same device name
        path = benchmark.results_path(flex.RESULTS_DIR, args.out, device, prefix="flex-", smoke=args.smoke)
        done = {k for k, e in benchmark.load_results(path)["cells"].items() if e.get("status") == "ok"}
    entries = {}
    cache = Inputs(torch)
    for row in flex.plan(args):
        cells = [c for c in row.cells if c.impl == "torch_flex" and c.key not in done]
        if not cells:
            continue
        row = dataclasses.replace(row, cells=cells)
        if time.perf_counter() - start > budget:
            new = [benchmark.record(c, "skipped", error=f"torch budget of {budget:.0f} s spent", case=c.config) for c in cells]
        elif not (torch.cuda.is_available() or args.smoke):
            new = [benchmark.record(c, "unavailable", error="torch sees no CUDA device", case=c.config) for c in cells]
        else:
            new = run_row(torch, row, sizes, attend, note, args.reps, cache)
        for entry, cell in zip(new, cells):
            entries[cell.key] = entry
            mark = f"{entry['median_ms']:.3f} ms" if entry["status"] == "ok" else f"{entry['status']} {entry.get('error', '')[:100]}"
            print(f"torch_flex {cell.key}: {mark}", file=sys.stderr, flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"device": device, "torch": torch.__version__, "compile": note, "cells": entries}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

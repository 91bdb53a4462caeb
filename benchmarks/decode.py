"""Decoding: one new token per sequence against a KV cache, flashjax beside its peers.

    python benchmarks/decode.py                               # the sweep below (an H100: a few minutes)
    python benchmarks/decode.py --batches 1,8 --contexts 32k --caches paged,fp8 --impls flashjax,fa3
    python benchmarks/decode.py --q-len 16 --out /tmp/q16.json   # chunked prefill / speculative verification
    python benchmarks/decode.py --smoke --out /tmp/decode     # CPU: tiny, interpret mode

Problem: bfloat16 queries [B, q_len, 32, 128] (q_len = 1 by default) over 8 kv heads,
every sequence holding the whole context (B x context tokens in the cache), causal (for
q_len = 1 the same as none). Cells: batch 1, 8, 64 x context 4k, 32k, 128k x cache:

* ``contiguous``: [B, context, 8, 128] bfloat16;
* ``paged``: a pool of pages [B * context / page_size, page_size, 8, 128] bfloat16, each
  sequence's pages scattered through it by a random page table (``--page-size``, 64);
* ``fp8``: the same pool in float8_e4m3fn with a float32 scale per kv head;
* ``mla``: absorbed multi-head latent attention (DeepSeek-V3's decode): a paged bf16 latent
  cache [pages, page_size, 1, 576] whose first 512 features are the values (``v_cache=None,
  v_head_dim=512``), read once for 16 query heads (128 heads over 8 GPUs).

Implementations (a peer that cannot run a cell is recorded "unsupported", one that is not
installed "unavailable"):

* ``flashjax``: `flashjax.decode_attention` (auto: the Triton split-KV kernel); with
  ``--flashjax-configs`` also ``flashjax[block_k=64,...]``, the kernel with a `flashjax.DecodeConfig`
  (to tune its tiling);
* ``flashjax_mosaic``: `flashjax.decode_attention(backend="mosaic")`, the Hopper forward
  kernel on the contiguous cache split into batch rows (q_len 1, bf16; sm90 only);
* ``xla``: ``jax.nn.dot_product_attention(implementation="xla", key_value_seq_lengths=)`` on
  the contiguous cache; `decode_attention(backend="xla")` (pages gathered, float8
  dequantised, in float32) on the others, left unrun ("oom") past ~40 GB;
* ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn", key_value_seq_lengths=)``,
  contiguous bfloat16 only;
* ``pallas_gqa``: ``jax.experimental.pallas.ops.gpu.decode_attention.gqa`` (JAX's Triton
  split-K example; contiguous, q_len 1, ``k_splits=16``);
* ``fa3``: flash-attn3-jax's ``flash_mha_with_kvcache(q, k_cache, v_cache, cache_seqlens=,
  page_table=, num_splits=)``, contiguous and paged bfloat16 (its binding takes no float8
  cache). Its binding takes no automatic ``num_splits`` (it must be >= 1), so each cell runs
  every count of ``--fa3-num-splits`` (default 1,2,4,8,16,32) and keeps the fastest, recorded
  with the count: the peer at its best split for that cell.

Protocol (`flashjax.benchmark`'s timing and checks, decode-sized): every cell is compiled
once, its output checked against the float32 reference (`flashjax.reference`, on the
dequantised cache) on the first and last batch rows and the query heads of 2 kv heads
(relative error < `benchmark.TOLERANCE`, else "mismatch" and not timed), warmed up twice,
then timed as the median of >= 10 repetitions of back-to-back steps, as many as fill
`STEP_SPAN_S` (up to `benchmark.MOST_INNER_CALLS`): the steady state of a generation loop,
which issues its steps without waiting for each. (The attention sweep's 5 calls per
repetition leave the host's round trip in each repetition, ~230 us on the H100's host: 45 us
of a 370-us step, the same for every implementation; `--span-s 0` times that way.) Reported: time
per step and the effective bandwidth, bytes of K/V read (B x context x kv heads x head dim
x 2 x bytes per element, scales and queries not counted) over that time, also as a
fraction of the GPU's HBM bandwidth (H100 SXM 3.35 TB/s, H200 4.8 TB/s).

Results are merged into benchmarks/results/decode-<device>.json (cells keyed by cache,
batch, context, q_len and implementation) and printed as a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import sys
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from flashjax.benchmark import (  # noqa: E402  (the protocol: flashjax/benchmark.py)
    TOLERANCE,
    config_overrides,
    device_name,
    is_oom,
    load_results,
    median_time,
    parse_list,
    parse_seq,
    rel_err,
    results_path,
    save_results,
    short_error,
)
from flashjax.params import KVCache  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
BATCHES = (1, 8, 64)
CONTEXTS = (4096, 32768, 131072)
CACHES = ("contiguous", "paged", "fp8", "mla")
IMPLS = ("flashjax", "flashjax_mosaic", "xla", "cudnn", "pallas_gqa", "fa3")
HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 64
SMOKE = dict(batches=(2,), contexts=(256,), heads=4, kv_heads=2, head_dim=32, page_size=16)
# The mla cells' heads and head dims (values: the latent cache's first v_head_dim features).
MLA = dict(heads=16, kv_heads=1, head_dim=576, v_head_dim=512)
SMOKE_MLA = dict(heads=4, kv_heads=1, head_dim=48, v_head_dim=32)
# HBM bandwidth (bytes/s) by a word of the device name.
HBM_BANDWIDTH = {"h100": 3.35e12, "h200": 4.8e12}
# Each timed repetition runs back-to-back steps for about this long (see the docstring).
STEP_SPAN_S = 0.02
XLA_GATHER_LIMIT = 40e9  # bytes the xla path's float32 cache and scores may take
CHECK_KV_HEADS = 2


@dataclasses.dataclass(frozen=True)
class DecodeCell:
    """One measurement: a problem (cache kind, batch, context, q_len) and an implementation."""

    cache: str
    batch: int
    context: int
    impl: str
    q_len: int = 1
    heads: int = HEADS
    kv_heads: int = KV_HEADS
    head_dim: int = HEAD_DIM
    page_size: int = PAGE_SIZE
    v_head_dim: int | None = None  # the mla cells' values: the keys' first v_head_dim features

    @property
    def key(self) -> str:
        return f"{self.cache}/B{self.batch}/T{self.context}/q{self.q_len}/{self.impl}"

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V a step reads (every sequence holds the whole context; a latent
        cache is read once, its values being inside its keys)."""
        itemsize = 1 if self.cache == "fp8" else 2
        sides = 1 if self.cache == "mla" else 2
        return sides * self.batch * self.context * self.kv_heads * self.head_dim * itemsize


class Problem(NamedTuple):
    """A cell's inputs: q, and the cache as decode_attention takes it."""

    q: object
    cache: KVCache


class Unsupported(Exception):
    """A cell an implementation cannot run by design (recorded as 'unsupported')."""


class EstimatedOOM(Exception):
    """A cell whose materialised cache and scores would not fit (recorded as 'oom', not run)."""


def make_problem(cell: DecodeCell, seed: int = 0) -> Problem:
    """Random bf16 queries and cache. A paged cache is a pool of random pages and a random
    page table (a permutation: every page belongs to one sequence); a float8 one is that pool
    quantised with a scale per kv head (amax / 448). Drawn per batch row (vmap), under jit,
    so that no float32 copy of a 128k-token cache is ever made."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    b, t, hkv, d = cell.batch, cell.context, cell.kv_heads, cell.head_dim
    q = jax.random.normal(keys[0], (b, cell.q_len, cell.heads, d), jnp.bfloat16)
    lengths = jnp.full((b,), t, jnp.int32)
    shape = (t, hkv, d) if cell.cache == "contiguous" else (t // cell.page_size, cell.page_size, hkv, d)

    @jax.jit
    def side(key):
        rows = jax.vmap(lambda k: jax.random.normal(k, shape, jnp.bfloat16))(jax.random.split(key, b))
        return rows if cell.cache == "contiguous" else rows.reshape(-1, *shape[1:])

    @jax.jit
    def quantise(x):
        scale = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=(0, 1, 3)) / 448.0
        return (x.astype(jnp.float32) / scale[:, None]).astype(jnp.float8_e4m3fn), scale

    if cell.cache == "contiguous":
        return Problem(q, KVCache(side(keys[1]), side(keys[2]), lengths))
    table = jax.random.permutation(keys[3], b * (t // cell.page_size)).reshape(b, -1).astype(jnp.int32)
    if cell.cache == "paged":
        return Problem(q, KVCache(side(keys[1]), side(keys[2]), lengths, table))
    if cell.cache == "mla":
        return Problem(q, KVCache(side(keys[1]), None, lengths, table))
    k, k_scale = quantise(side(keys[1]))
    v, v_scale = quantise(side(keys[2]))
    return Problem(q, KVCache(k, v, lengths, table, k_scale, v_scale))


def dense_row(cache: KVCache, b: int, kv_heads: int, v_head_dim: int | None = None):
    """Batch row b's keys and values [1, context, kv_heads, D], float32, dequantised (a
    latent cache's values: its keys' first v_head_dim features)."""
    import jax.numpy as jnp

    def side(x, scale):
        x = x[b] if cache.page_table is None else x[cache.page_table[b]].reshape(-1, *x.shape[2:])
        x = x[:, :kv_heads].astype(jnp.float32)
        return (x if scale is None else x * scale[:kv_heads, None])[None]

    k = side(cache.k, cache.k_scale)
    return k, (k[..., :v_head_dim] if cache.v is None else side(cache.v, cache.v_scale))


def check(cell: DecodeCell, out, problem: Problem) -> dict:
    """Relative errors of the output on the first and last batch rows, query heads of the first
    CHECK_KV_HEADS kv heads, against the float32 reference on the dequantised cache."""
    import jax.numpy as jnp

    from flashjax import reference

    kv_heads = min(CHECK_KV_HEADS, cell.kv_heads)
    heads = kv_heads * (cell.heads // cell.kv_heads)
    errors = {}
    for b in sorted({0, cell.batch - 1}):
        k, v = dense_row(problem.cache, b, kv_heads, cell.v_head_dim)
        want = reference.attention(problem.q[b:b + 1, :, :heads].astype(jnp.float32), k, v, causal=True)
        errors[f"out[{b}]"] = rel_err(out[b:b + 1, :, :heads], want)
    return errors


def _on_gpu() -> bool:
    import jax

    return jax.default_backend() == "gpu"


def impl_fn(cell: DecodeCell, fa3_num_splits: int = 1):
    """fn(problem) -> out [B, q_len, H, D] for the cell's implementation."""
    import jax

    import flashjax

    scale = 1.0 / math.sqrt(cell.head_dim)
    contiguous = cell.cache == "contiguous"
    def decode(p: Problem, backend: str = "auto", config=None):
        c = p.cache
        return flashjax.decode_attention(p.q, c.k, c.v, c.lengths, page_table=c.page_table, k_scale=c.k_scale,
                                         v_scale=c.v_scale, scale=scale, backend=backend, config=config,
                                         v_head_dim=cell.v_head_dim if c.v is None else None)

    if cell.impl == "flashjax":
        return decode
    if cell.impl == "flashjax_mosaic":
        import jax.numpy as jnp

        platform, capability = flashjax.backends.describe_device()
        call = flashjax.params.DecodeCall(
            batch=cell.batch, q_len=cell.q_len, heads=cell.heads, kv_heads=cell.kv_heads, head_dim=cell.head_dim,
            dtype=jnp.dtype(jnp.bfloat16), cache_dtype=jnp.dtype(jnp.float8_e4m3fn if cell.cache == "fp8" else jnp.bfloat16),
            capacity=cell.context, page_size=None if contiguous else cell.page_size, platform=platform,
            compute_capability=capability, v_head_dim=cell.v_head_dim, latent=cell.cache == "mla")
        reasons = flashjax.backends.get("mosaic").decode.supports(call)
        if reasons:
            raise Unsupported("; ".join(reasons))
        return lambda p: decode(p, backend="mosaic")
    if cell.impl.startswith("flashjax["):  # flashjax[field=value,...]: a DecodeConfig of the Triton kernel
        config = config_overrides(flashjax.DecodeConfig(), cell.impl[len("flashjax["):-1])
        return lambda p: decode(p, config=config)
    if cell.impl == "xla":
        if contiguous:
            return lambda p: jax.nn.dot_product_attention(
                p.q, p.cache.k, p.cache.v, scale=scale, key_value_seq_lengths=p.cache.lengths, implementation="xla")
        need = (2 * cell.kv_heads * cell.head_dim + 2 * cell.heads * cell.q_len) * 4 * cell.batch * cell.context
        if need > XLA_GATHER_LIMIT:
            raise EstimatedOOM(f"the gathered float32 cache and scores need ~{need / 1e9:.0f} GB")
        return lambda p: decode(p, backend="xla")
    if cell.impl == "cudnn":
        if not contiguous:
            raise Unsupported("jax.nn.dot_product_attention takes a contiguous bfloat16 cache")
        if not _on_gpu():
            raise Unsupported("cuDNN needs a GPU")
        return lambda p: jax.nn.dot_product_attention(
            p.q, p.cache.k, p.cache.v, scale=scale, key_value_seq_lengths=p.cache.lengths, implementation="cudnn")
    if cell.impl == "pallas_gqa":
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu import decode_attention as pallas_decode
        if not contiguous or cell.q_len != 1:
            raise Unsupported("takes one query per sequence and a contiguous bfloat16 cache")
        interpret = not _on_gpu()
        return lambda p: pallas_decode.gqa(
            p.q[:, 0], p.cache.k, p.cache.v, kv_seq_len=p.cache.lengths, sm_scale=scale, interpret=interpret)[:, None]
    if cell.impl == "fa3":
        import flash_attn3_jax

        if cell.cache == "fp8":
            raise Unsupported("flash_mha_with_kvcache takes q's dtype in the cache (no float8)")
        if cell.cache == "mla":
            raise Unsupported("flash_mha_with_kvcache takes no latent cache (values inside the keys)")
        if not _on_gpu():
            raise Unsupported("flash-attn3-jax needs a GPU")
        return lambda p: flash_attn3_jax.flash_mha_with_kvcache(
            p.q, p.cache.k, p.cache.v, cache_seqlens=p.cache.lengths, page_table=p.cache.page_table,
            softmax_scale=scale, is_causal=True, num_splits=fa3_num_splits)
    raise Unsupported(f"unknown implementation {cell.impl}")


def record(cell: DecodeCell, status: str, **fields) -> dict:
    """The JSON record of one cell, with the effective bandwidth when it has a median time."""
    entry = dict(cache=cell.cache, batch=cell.batch, context=cell.context, q_len=cell.q_len, impl=cell.impl,
                 heads=cell.heads, kv_heads=cell.kv_heads, head_dim=cell.head_dim,
                 page_size=None if cell.cache == "contiguous" else cell.page_size, kv_bytes=cell.kv_bytes,
                 v_head_dim=cell.v_head_dim,
                 status=status, time=datetime.datetime.now().isoformat(timespec="seconds"))
    entry.update(fields)
    if entry.get("median_ms"):
        entry["tb_per_s"] = cell.kv_bytes / (entry["median_ms"] * 1e-3) / 1e12
    return entry


def run_row(cells: list[DecodeCell], reps: int, fa3_num_splits: tuple[int, ...], span_s: float) -> list[dict]:
    """One problem (cache, batch, context): built once, then each implementation compiled,
    checked and timed in turn (fa3 once per split count, the fastest kept)."""
    problem = make_problem(cells[0])
    entries = []
    for cell in cells:
        try:
            if cell.impl != "fa3":
                entries.append(time_cell(cell, impl_fn(cell), problem, reps, span_s))
                continue
            tried = [time_cell(cell, impl_fn(cell, n), problem, reps, span_s) | {"num_splits": n} for n in fa3_num_splits]
            ok = [e for e in tried if e["status"] == "ok"]
            best = min(ok, key=lambda e: e["median_ms"]) if ok else tried[0]
            best["median_ms_by_num_splits"] = {e["num_splits"]: e.get("median_ms") for e in tried}
            entries.append(best)
        except Unsupported as e:
            entries.append(record(cell, "unsupported", error=str(e)))
        except EstimatedOOM as e:
            entries.append(record(cell, "oom", error=str(e)))
        except ImportError as e:
            entries.append(record(cell, "unavailable", error=short_error(e)))
        except Exception as e:  # recorded; a peer never stops the sweep
            entries.append(record(cell, "oom" if is_oom(e) else "error", error=short_error(e)))
    return entries


def time_cell(cell: DecodeCell, fn, problem: Problem, reps: int, span_s: float = 0.0) -> dict:
    """Compiles fn, checks its output, and times it: the cell's record ("ok" or "mismatch");
    a failure to compile or run raises."""
    import jax

    compiled = jax.jit(fn).lower(problem).compile()
    out = compiled(problem)
    errors = check(cell, out, problem)
    del out
    if not all(e < TOLERANCE for e in errors.values()):  # nan fails too
        return record(cell, "mismatch", rel_err=errors, error=f"rel err {errors} >= {TOLERANCE}")
    median, times, inner = median_time(lambda run=compiled: run(problem), jax.block_until_ready, reps=reps,
                                       span_s=span_s or None)
    return record(cell, "ok", rel_err=errors, median_ms=median * 1e3, reps_ms=[t * 1e3 for t in times], inner=inner)


def hbm_bandwidth(device: str) -> float | None:
    name = device.lower()
    return next((bw for word, bw in HBM_BANDWIDTH.items() if word in name), None)


STATUS_MARK = {"unsupported": "n/a", "unavailable": "n/a", "error": "err", "mismatch": "MISMATCH", "oom": "oom",
               "skipped": "skip"}


def table(entries: list[dict], hbm: float | None) -> str:
    """Rows (cache, batch, context); per implementation the time per step (us) and the
    effective bandwidth (TB/s, and % of HBM when the GPU's is known)."""
    if not entries:
        return "(no cells)"
    impls = [i for i in IMPLS if any(e["impl"] == i for e in entries)]
    impls += sorted({e["impl"] for e in entries} - set(IMPLS))  # flashjax[config] variants
    by_key = {(e["cache"], e["batch"], e["context"], e["impl"]): e for e in entries}
    rows = sorted({(e["cache"], e["batch"], e["context"]) for e in entries},
                  key=lambda r: (CACHES.index(r[0]) if r[0] in CACHES else 9, r[1], r[2]))

    def val(row, impl):
        e = by_key.get((*row, impl))
        if e is None:
            return "-"
        if e["status"] != "ok":
            return STATUS_MARK.get(e["status"], e["status"])
        share = f" {100 * e['tb_per_s'] * 1e12 / hbm:.0f}%" if hbm else ""
        return f"{e['median_ms'] * 1e3:.0f}us {e['tb_per_s']:.2f}TB/s{share}"

    lines = [["cache", "B", "context"] + impls]
    lines += [[row[0], str(row[1]), str(row[2])] + [val(row, i) for i in impls] for row in rows]
    widths = [max(len(line[c]) for line in lines) for c in range(len(lines[0]))]
    text = ["  ".join(s.rjust(w) for s, w in zip(line, widths, strict=True)) for line in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    note = "time per step; effective bandwidth = bytes of K/V read / time" + (f" (% of {hbm / 1e12:.2f} TB/s HBM)" if hbm else "")
    return "\n".join(text + [note])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default=",".join(map(str, BATCHES)), help="e.g. 1,8,64")
    p.add_argument("--contexts", default=",".join(map(str, CONTEXTS)), help="e.g. 4k,32k,128k")
    p.add_argument("--caches", default=",".join(CACHES), help=f"subset of {','.join(CACHES)}")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"subset of {','.join(IMPLS)}")
    p.add_argument("--flashjax-configs", default=None,
                   help="also run flashjax with these DecodeConfigs, ';'-separated field=value lists, "
                        "e.g. 'block_k=64;block_k=256,num_stages=3' (columns flashjax[...])")
    p.add_argument("--q-len", type=int, default=1, help="new queries per sequence (1: decoding)")
    p.add_argument("--page-size", type=int, default=PAGE_SIZE, help="keys per page of the paged caches")
    p.add_argument("--fa3-num-splits", default="1,2,4,8,16,32",
                   help="flash_mha_with_kvcache's num_splits counts to try per cell (the fastest is kept)")
    p.add_argument("--reps", type=int, default=10, help="timed repetitions per cell (>= 10 for the protocol)")
    p.add_argument("--span-s", type=float, default=STEP_SPAN_S,
                   help="back-to-back steps per repetition: as many as fill this many seconds (0: the sweep's few)")
    p.add_argument("--budget-s", type=float, default=540.0, help="stop starting new rows after this many seconds")
    p.add_argument("--out", default=None, help="results directory or .json file (default benchmarks/results/)")
    p.add_argument("--fresh", action="store_true", help="do not merge into an existing results file")
    p.add_argument("--smoke", action="store_true", help="tiny CPU-sized run of every code path (interpret mode, 2 reps)")
    return p


def plan(args) -> list[DecodeCell]:
    """The cells, row by row; the small problems first, so a budget cuts the largest."""
    shape = {}
    if args.smoke:
        batches, contexts = SMOKE["batches"], SMOKE["contexts"]
        shape = {k: SMOKE[k] for k in ("heads", "kv_heads", "head_dim", "page_size")}
        mla = SMOKE_MLA
    else:
        batches = parse_list(args.batches, None, "batch", int)
        contexts = parse_list(args.contexts, None, "context", parse_seq)
        shape = dict(page_size=args.page_size)
        mla = MLA
    caches = parse_list(args.caches, CACHES, "cache")
    impls = parse_list(args.impls, IMPLS, "implementation")
    impls += [f"flashjax[{spec.strip()}]" for spec in (args.flashjax_configs or "").split(";") if spec.strip()]
    page_size = shape.get("page_size", PAGE_SIZE)
    bad = [t for t in contexts if t % page_size]
    if bad and set(caches) - {"contiguous"}:
        raise SystemExit(f"contexts {bad} are not multiples of the page size {page_size}")
    return [
        DecodeCell(cache, batch, context, impl, q_len=args.q_len, **{**shape, **(mla if cache == "mla" else {})})
        for context in contexts for batch in batches for cache in caches for impl in impls
    ]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.smoke:
        args.reps, args.span_s = min(args.reps, 2), 0.0
    start = time.perf_counter()
    cells = plan(args)

    import jax

    import flashjax

    device = device_name()
    path = results_path(RESULTS_DIR, args.out, device, prefix="decode-", smoke=args.smoke)
    results = {"cells": {}} if args.fresh else load_results(path)
    hbm = hbm_bandwidth(device)
    results.update(
        device=device, platform=jax.default_backend(), jax=jax.__version__, flashjax=flashjax.__version__,
        date=datetime.date.today().isoformat(), hbm_bytes_per_s=hbm,
        protocol=dict(dtype="bfloat16", reps=args.reps, span_s=args.span_s, tolerance=TOLERANCE, check="first and last batch rows, "
                      f"query heads of {CHECK_KV_HEADS} kv heads", bandwidth="K/V bytes read / median time"),
    )
    rows: dict[tuple, list[DecodeCell]] = {}
    for c in cells:
        rows.setdefault((c.cache, c.batch, c.context), []).append(c)
    new_entries = []
    for row_cells in rows.values():
        if time.perf_counter() - start > args.budget_s:
            entries = [record(c, "skipped", error=f"budget of {args.budget_s:.0f} s spent") for c in row_cells]
        else:
            entries = run_row(row_cells, args.reps, tuple(int(n) for n in args.fa3_num_splits.split(",")), args.span_s)
        for cell, e in zip(row_cells, entries, strict=True):
            if e["status"] != "skipped" or cell.key not in results["cells"]:  # a skip never hides a measurement
                results["cells"][cell.key] = e
        new_entries += entries
        save_results(path, results)  # after every row: an interrupted sweep keeps what it measured
    shapes = sorted({(c.cache == "mla", c.heads, c.kv_heads, c.head_dim, c.v_head_dim) for c in cells})
    shapes = ", ".join(f"{'mla: ' if mla else ''}{h} heads over {hkv} kv heads, D={d}" + (f" (values {dv})" if dv else "")
                       for mla, h, hkv, d, dv in shapes)
    print(f"\n{device} | jax {jax.__version__} | q_len {args.q_len}, {shapes} | {time.perf_counter() - start:.0f} s")
    print(table(new_entries, hbm))
    bad = [e for e in new_entries if e["status"] not in ("ok", "unsupported", "unavailable")]
    if bad:
        print("not measured:\n" + "\n".join(f"  {e['cache']}/B{e['batch']}/T{e['context']}/{e['impl']}: "
                                             f"{e['status']} {e.get('error', '')[:160]}" for e in bad))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

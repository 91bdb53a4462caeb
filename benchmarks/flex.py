"""FlexAttention-style mods: flashjax's score_mod / mask_mod beside its built-in options and PyTorch's FlexAttention.

    python benchmarks/flex.py                                  # every case below, within --budget-s (420 s)
    python benchmarks/flex.py --cases alibi,document_window --seqlens 8k --modes fwdbwd
    python benchmarks/flex.py --resume                         # measure what a budget-cut run left out
    python benchmarks/flex.py --smoke --out /tmp/flex.json     # CPU: tiny, interpret mode

Problem: bfloat16 [B, T, 16, 128] (self-attention, as many kv heads as query heads),
16384 tokens per batch (B = 16384 // T), T = 4k, 8k, 16k, forward and forward+backward.

Cases, each a mod written the way a user writes it (`flashjax.mods` or a few lines here)
and, where flashjax has a built-in option for the same logits and pattern, that option:

* ``causal``: mask_mod ``kv <= q`` (`mods.causal`)         | built-in ``causal=True``
* ``causal_document``: causal within packed documents      | ``causal=True, segment_ids=``
* ``sliding_window``: causal, 1024 keys back               | ``causal=True, window=(1024, 0)``
* ``document_window``: both (`mods.document_window`)       | ``causal=True, segment_ids=, window=``
* ``chunked``: causal within chunks of 2048 (`mods.chunked`) | ``causal=True, segment_ids=T // 2048``
* ``prefix_lm``: bidirectional prefix of T/8..T/2 keys per row, then causal (`mods.prefix_lm`)
* ``alibi``: score_mod `mods.alibi`, causal                | ``alibi_slopes=, causal=True``
* ``softcap``: score_mod `mods.tanh_softcap(50)`, causal   | ``softcap=50, causal=True``
* ``t5_bias``: score_mod `mods.t5_relative_bias` with a learned [16, 32] table, no mask
* ``sinks``: ``sinks=`` (a learned logit per head), causal, beside the plain causal call
* ``mla``: Dqk = 192, Dv = 128 (MLA), causal, beside the plain causal call (D = 128)

Documents: 2048 tokens on average, their boundaries drawn at random per batch row.

Implementations (cells of one row: a case at one T):

* ``flashjax``: `flashjax.flash_attention(backend="triton", score_mod=, block_mask=)`;
  a mask_mod's block mask is built once by `flashjax.block_mask` (128 x 128 tiles,
  outside the timed call, as FlexAttention users do with ``create_block_mask``);
* ``flashjax_builtin``: the built-in option, on the same backend;
* ``flashjax_mosaic``, ``flashjax_mosaic_builtin``: the same two on the Hopper kernels
  (``backend="mosaic"``), the block mask built at their 64 x 64 tiles. A mod the Hopper
  kernels cannot evaluate (a closed-over array read at a pair of positions: the T5 table)
  is recorded "unsupported" with the reason;
* ``torch_flex``: PyTorch's ``flex_attention`` under ``torch.compile(dynamic=False)``
  (default mode and kernel options) with ``create_block_mask`` built outside the timed
  call, in a subprocess (benchmarks/torch_flex.py) that runs before JAX claims the GPU.
  Without torch its cells are "unavailable", with the reason; on a CPU (``--smoke``) it
  runs eagerly (FlexAttention has no CPU backward: those cells are "unsupported").
  A learned array (the T5 table) requires grad on both sides.

Plus, at T = 32k, a block-mask row: ``flashjax.block_mask`` of the data-dependent masks
(causal_document, document_window, prefix_lm) built under ``jax.jit`` with the document
ids / prefix lengths as arguments (the median of repeated builds, as a training step builds
it) and called eagerly (5 repetitions: the call traces and compiles its builder each time),
each as a fraction of one causal forward at 32k (``flashjax_builtin`` of ``causal``).

Protocol (`flashjax.benchmark`'s, with mods): every program is compiled once, its output
(forward) or dq (forward+backward) checked against the float32 reference
(`flashjax.reference.attention` with the case's mods, their query index shifted to the
checked rows) on the last CHECK_ROWS query rows of batch row 0 and 2 heads, and for
forward+backward dk and dv of those heads over every query row (`expected_kv`: the
reference by chunks of query rows); a relative error of TOLERANCE or more is recorded
"mismatch" and not timed. Then two warm-up calls
and the median of >= 10 repetitions of a few back-to-back calls. Forward+backward is
``jax.grad`` of ``sum(out * cotangent)`` w.r.t. q, k, v and the case's learned arrays
(the T5 table, the sinks), which travel with q (``timed_fn``'s first argument is the
pair (q, learned arrays)); torch's is ``autograd.grad`` w.r.t. the same tensors.

FLOPs count the visible (query, key) pairs: the dense ``4 * B * H * T^2 * D`` forward
(`benchmark.flops`, x3.5 for forward+backward) times the exact fraction of pairs the mask
lets through (``visible``, counted by evaluating the mask; causal is (T + 1) / 2T, not the
harness's 1/2). So TFLOP/s is useful work per second, comparable across cases; the ratios
below are of times. MLA counts each product with its own head dim: Q K^T, and in the
backward its recomputation, dQ and dK, with Dqk = 192; P V, dP and dV with Dv = 128.

Reported per (case, T, mode): flashjax's time, the built-in's and their ratio (mod /
built-in; <= 1.10 is the bar), torch's and torch / flashjax (>= 1.2 for fwd+bwd is the
bar), TFLOP/s and the visible fraction; sinks and MLA as TFLOP/s against the plain causal
call's (>= 0.95); block-mask builds against the causal forward (<= 5%). Results are
merged into benchmarks/results/flex-<device>.json (cells keyed as attention.py's:
case/T/causal|full/mode/impl, plus a "summary" of the ratios) and printed as tables.
``--budget-s`` stops starting new rows past a time budget (torch gets
``--torch-budget-s`` of it); ``--resume`` then measures only what is missing.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import datetime
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from flashjax import benchmark  # noqa: E402  (the protocol: flashjax/benchmark.py)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SEQLENS = (4096, 8192, 16384)
BLOCK_MASK_SEQ = 32768
MODES = benchmark.MODES
IMPLS = ("flashjax", "flashjax_builtin", "flashjax_mosaic", "flashjax_mosaic_builtin", "torch_flex")
# Each flashjax backend's pair of implementations: (its mod, its built-in).
BACKEND_IMPLS = {"triton": ("flashjax", "flashjax_builtin"), "mosaic": ("flashjax_mosaic", "flashjax_mosaic_builtin")}
# The block mask's tiles per backend (its kernels' finest).
BLOCK_MASK_TILES = {"triton": 128, "mosaic": 64}
BUILD_IMPLS = ("block_mask_jit", "block_mask_eager")
CHECK_HEADS = 2
EAGER_BUILD_REPS = 5
VISIBLE_STEP_PAIRS = 1 << 23  # (query, key) pairs per step when counting the visible ones
TORCH_SHARE = 0.4  # of --budget-s, for the torch subprocess, unless --torch-budget-s
# The bars the summary checks (docstring).
MOD_VS_BUILTIN_MAX, TORCH_OVER_FLASHJAX_MIN, BUILD_SHARE_MAX, FEATURE_VS_PLAIN_MIN = 1.10, 1.2, 0.05, 0.95


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The problem's dimensions and the cases' parameters (the device's, or `SMOKE_SIZES`)."""

    heads: int = 16
    head_dim: int = 128
    mla_dims: tuple[int, int] = (192, 128)  # (Dqk, Dv)
    tokens: int = benchmark.TOKENS
    window: int = 1024
    chunk: int = 2048
    document_length: int = 2048  # mean
    softcap: float = 50.0
    t5_buckets: int = 32
    t5_max_distance: int = 128


SMOKE_SIZES = Sizes(heads=2, head_dim=32, mla_dims=(48, 32), tokens=256, window=32, chunk=64, document_length=48)
SMOKE_SEQLENS = (128,)
SMOKE_BLOCK_MASK_SEQ = 512


@dataclasses.dataclass(frozen=True)
class FlexCell(benchmark.Cell):
    """A cell of this benchmark: `benchmark.Cell` with the visible fraction of (q, k) pairs
    and MLA's value head dim, which its FLOP count uses (module docstring)."""

    visible: float | None = None  # None: not counted yet (FLOPs of the dense problem)
    v_head_dim: int | None = None  # None: head_dim

    def flops(self) -> float:
        if self.mode not in MODES:  # a block-mask build
            return 0.0
        dense = lambda head_dim, mode: benchmark.flops(self.batch, self.heads, self.seq, self.seq, head_dim, False, mode)
        dv = self.v_head_dim or self.head_dim
        if dv == self.head_dim:
            total = dense(self.head_dim, self.mode)
        else:  # per product: Dqk for Q K^T (+ recomputation, dQ, dK), Dv for P V (+ dP, dV)
            qk_products, pv_products = (4, 3) if self.mode == "fwdbwd" else (1, 1)
            total = (qk_products * dense(self.head_dim, "fwd") + pv_products * dense(dv, "fwd")) / 2
        return total * (1.0 if self.visible is None else self.visible)


# ---- the cases ------------------------------------------------------------------------------------
def causal_document(document_ids):
    """Causal attention within packed documents (``document_ids``: int [batch, seq])."""

    def mask_mod(batch, head, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (document_ids[batch, q_idx] == document_ids[batch, kv_idx])

    return mask_mod


def sliding_window(left: int):
    """Causal sliding window: the ``left`` keys before the query and itself."""

    def mask_mod(batch, head, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx <= left)

    return mask_mod


def document_ids(rng, batch: int, seq: int, mean_length: int) -> np.ndarray:
    """int32 [batch, seq]: ``seq // mean_length`` (>= 2) documents per row, boundaries drawn at random."""
    count = max(2, seq // mean_length)
    rows = []
    for _ in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, seq), count - 1, replace=False))
        rows.append(np.searchsorted(cuts, np.arange(seq), side="right"))
    return np.stack(rows).astype(np.int32)


def _documents(rng, batch, seq, s: Sizes):
    return dict(document_ids=document_ids(rng, batch, seq, s.document_length))


def _chunk_ids(rng, batch, seq, s: Sizes):
    return dict(chunk_ids=np.broadcast_to(np.arange(seq, dtype=np.int32) // s.chunk, (batch, seq)).copy())


def _prefix_lengths(rng, batch, seq, s: Sizes):
    return dict(prefix_lengths=rng.integers(seq // 8, seq // 2 + 1, size=batch).astype(np.int32))


def _alibi_slopes(rng, batch, seq, s: Sizes):
    return dict(slopes=(2.0 ** (-8.0 * np.arange(1, s.heads + 1) / s.heads)).astype(np.float32))


def _t5_table(rng, batch, seq, s: Sizes):
    return dict(table=rng.standard_normal((s.heads, s.t5_buckets)).astype(np.float32))


def _sinks(rng, batch, seq, s: Sizes):
    return dict(sinks=rng.standard_normal(s.heads).astype(np.float32))


def _no_arrays(rng, batch, seq, s: Sizes):
    return {}


@dataclasses.dataclass(frozen=True)
class Case:
    """One row of the benchmark at each T.

    ``mod(arrays, sizes)`` and ``builtin(arrays, sizes)`` give `flash_attention`'s keyword
    arguments (the mod form is also the reference's); ``arrays(rng, batch, seq, sizes)``
    draws the numpy arrays they read; ``learned`` names those differentiated in fwd+bwd.
    ``baseline``: "builtin" (its own built-in, when it has one) or "plain" (the causal
    call, for sinks and MLA). ``torch``: whether torch_flex.py has it.
    """

    name: str
    description: str
    causal: bool  # its pattern lies in the causal triangle (the key's causal/full)
    mod: Callable
    builtin: Callable | None = None
    arrays: Callable = _no_arrays
    learned: tuple[str, ...] = ()
    baseline: str = "builtin"
    torch: bool = True
    mla: bool = False

    def head_dims(self, sizes: Sizes) -> tuple[int, int]:
        return sizes.mla_dims if self.mla else (sizes.head_dim, sizes.head_dim)


def _cases():
    from flashjax import mods

    return (
        Case("causal", "mods.causal: kv <= q | causal=True", True,
             mod=lambda a, s: dict(mask_mod=mods.causal()),
             builtin=lambda a, s: dict(causal=True)),
        Case("causal_document", "mask_mod: causal within packed documents | causal=True, segment_ids=", True, arrays=_documents,
             mod=lambda a, s: dict(mask_mod=causal_document(a["document_ids"])),
             builtin=lambda a, s: dict(causal=True, segment_ids=a["document_ids"])),
        Case("sliding_window", "mask_mod: causal, `window` keys back | causal=True, window=(window, 0)", True,
             mod=lambda a, s: dict(mask_mod=sliding_window(s.window)),
             builtin=lambda a, s: dict(causal=True, window=(s.window, 0))),
        Case("document_window", "mods.document_window | causal=True, segment_ids=, window=(window, 0)", True, arrays=_documents,
             mod=lambda a, s: dict(mask_mod=mods.document_window(a["document_ids"], s.window)),
             builtin=lambda a, s: dict(causal=True, segment_ids=a["document_ids"], window=(s.window, 0))),
        Case("chunked", "mods.chunked | causal=True, segment_ids=position // chunk", True, arrays=_chunk_ids,
             mod=lambda a, s: dict(mask_mod=mods.chunked(s.chunk)),
             builtin=lambda a, s: dict(causal=True, segment_ids=a["chunk_ids"])),
        Case("prefix_lm", "mods.prefix_lm: bidirectional prefix, then causal | none", False, arrays=_prefix_lengths,
             mod=lambda a, s: dict(mask_mod=mods.prefix_lm(a["prefix_lengths"]))),
        Case("alibi", "score_mod mods.alibi, causal=True | alibi_slopes=, causal=True", True, arrays=_alibi_slopes,
             mod=lambda a, s: dict(score_mod=mods.alibi(a["slopes"]), causal=True),
             builtin=lambda a, s: dict(alibi_slopes=a["slopes"], causal=True)),
        Case("softcap", "score_mod mods.tanh_softcap, causal=True | softcap=, causal=True", True,
             mod=lambda a, s: dict(score_mod=mods.tanh_softcap(s.softcap), causal=True),
             builtin=lambda a, s: dict(softcap=s.softcap, causal=True)),
        Case("t5_bias", "score_mod mods.t5_relative_bias, learned table | none", False, arrays=_t5_table, learned=("table",),
             mod=lambda a, s: dict(score_mod=mods.t5_relative_bias(a["table"], max_distance=s.t5_max_distance))),
        Case("sinks", "sinks= (learned), causal=True | the plain causal call", True, arrays=_sinks, learned=("sinks",),
             mod=lambda a, s: dict(causal=True, sinks=a["sinks"]), baseline="plain", torch=False),
        Case("mla", "Dqk, Dv = 192, 128, causal=True | the plain causal call (D=128)", True,
             mod=lambda a, s: dict(causal=True), baseline="plain", torch=False, mla=True),
    )


CASES = {case.name: case for case in _cases()}
PLAIN = "causal"  # the case whose built-in is the plain call of sinks and MLA
BLOCK_MASK_CASES = ("causal_document", "document_window", "prefix_lm")


def draw_arrays(case: Case, batch: int, seq: int, sizes: Sizes) -> dict:
    """The case's numpy arrays (the same draws in every process)."""
    return case.arrays(np.random.default_rng(seq), batch, seq, sizes)


# ---- the plan --------------------------------------------------------------------------------------
@dataclasses.dataclass
class Row:
    """A case at one T and its cells. Kinds: "attention" (the case's implementations),
    "plain" (only the built-in causal call, the baseline of sinks and MLA), "build" (the
    block-mask builds) and "build_baseline" (the causal forward the builds are compared with)."""

    case: Case
    seq: int
    cells: list
    kind: str = "attention"

    @property
    def timed_like_attention(self) -> bool:
        return self.kind != "build"


def make_cell(case: Case, seq: int, mode: str, impl: str, sizes: Sizes) -> FlexCell:
    dqk, dv = case.head_dims(sizes)
    return FlexCell(case.name, sizes.heads, sizes.heads, dqk, seq, case.causal, mode, impl, sizes.tokens,
                    v_head_dim=dv if dv != dqk else None)


def backend_of(impl: str) -> str:
    """The flashjax backend of a flashjax implementation."""
    return next(name for name, pair in BACKEND_IMPLS.items() if impl in pair)


def runs(case: Case, impl: str) -> bool:
    """Whether the case has the implementation."""
    return {"flashjax": True, "flashjax_builtin": case.builtin is not None,
            "flashjax_mosaic": True,
            "flashjax_mosaic_builtin": case.builtin is not None, "torch_flex": case.torch}[impl]


def plan(args) -> list[Row]:
    """The rows, in the order they run (a budget cuts the last): the block-mask row, then
    every case at each T, shortest first; sinks and MLA get the plain causal call."""
    sizes = sizes_of(args)
    names = parse_cases(args.cases)
    seqlens = SMOKE_SEQLENS if args.smoke else benchmark.parse_list(args.seqlens, None, "seqlen", benchmark.parse_seq)
    modes = benchmark.parse_list(args.modes, MODES, "mode")
    impls = benchmark.parse_list(args.impls, IMPLS, "implementation")
    rows = []
    build_seq = benchmark.parse_seq(args.block_mask_seq)
    if args.smoke and build_seq:
        build_seq = SMOKE_BLOCK_MASK_SEQ
    built = [n for n in BLOCK_MASK_CASES if n in names]
    if build_seq and built and "flashjax" in impls:
        rows.append(Row(CASES[PLAIN], build_seq, [make_cell(CASES[PLAIN], build_seq, "fwd", "flashjax_builtin", sizes)],
                        kind="build_baseline"))
        rows += [Row(CASES[n], build_seq, [make_cell(CASES[n], build_seq, "build", i, sizes) for i in BUILD_IMPLS],
                     kind="build") for n in built]
    # Sinks and MLA are measured against the plain causal call on the same backend.
    plain_impls = [builtin for mod_impl, builtin in BACKEND_IMPLS.values() if mod_impl in impls]
    needs_plain = any(CASES[n].baseline == "plain" for n in names)
    for seq in seqlens:
        for name in CASES:
            case = CASES[name]
            chosen = [i for i in impls if runs(case, i)] if name in names else []
            kind = "attention" if chosen else "plain"
            if name == PLAIN and needs_plain:
                chosen += [i for i in plain_impls if i not in chosen]
            cells = [make_cell(case, seq, mode, impl, sizes) for mode in modes for impl in chosen]
            if cells:
                rows.append(Row(case, seq, cells, kind))
    return rows


def parse_cases(text: str) -> list[str]:
    return benchmark.parse_list(text, CASES, "case")


def sizes_of(args) -> Sizes:
    return SMOKE_SIZES if args.smoke else dataclasses.replace(Sizes(), tokens=args.tokens)


# ---- shared by both processes: inputs, visible pairs, the reference check ------------------------
def inputs_for(cell: FlexCell):
    """(q, k, v, do) of the cell (`benchmark.make_inputs`; for MLA v and do keep their first Dv channels)."""
    q, k, v, do = benchmark.make_inputs(cell)
    if cell.v_head_dim:
        v, do = v[..., :cell.v_head_dim], do[..., :cell.v_head_dim]
    return q, k, v, do


def as_jax(arrays: dict) -> dict:
    import jax.numpy as jnp

    return {name: jnp.asarray(a) for name, a in arrays.items()}


def visible_fraction(case: Case, sizes: Sizes, batch: int, seq: int, arrays: dict) -> float:
    """The exact fraction of (query, key) pairs the case's mask lets through (head 0: no mask
    here depends on the head), counted row block by row block."""
    import jax
    import jax.numpy as jnp

    from flashjax import reference

    structural = ("causal", "window", "segment_ids", "mask_mod")
    if not any(name in case.mod(arrays, sizes) for name in structural):
        return 1.0
    rows = 1 << max(0, (VISIBLE_STEP_PAIRS // (batch * seq)).bit_length() - 1)
    rows = min(rows, 1 << (seq - 1).bit_length())
    steps = -(-seq // rows)

    @jax.jit
    def count(arrays):  # the arrays as arguments: nothing for XLA to fold into a constant
        options = {k: v for k, v in case.mod(arrays, sizes).items() if k in structural}

        def step(i):
            positions = i * rows + jnp.arange(rows, dtype=jnp.int32)
            allowed = reference.logits_mask(batch, seq, seq, rows=positions, **options)
            return jnp.sum(allowed & (positions < seq)[:, None], dtype=jnp.int32)

        return jax.lax.map(step, jnp.arange(steps, dtype=jnp.int32))

    return float(np.asarray(count(arrays), np.int64).sum()) / (batch * seq * seq)


def _rows_options(options: dict, start: int, heads: int) -> dict:
    """The mod-form options as the reference sees them for query rows [start, T) of batch
    row 0 and the first `heads` heads: the mods' query index shifted by `start`."""
    out = {}
    for name, value in options.items():
        if name == "score_mod":
            out[name] = lambda s, b, h, q_idx, kv_idx, fn=value: fn(s, b, h, q_idx + start, kv_idx)
        elif name == "mask_mod":
            out[name] = lambda b, h, q_idx, kv_idx, fn=value: fn(b, h, q_idx + start, kv_idx)
        elif name == "sinks":
            out[name] = value[:heads]
        elif name in ("causal", "window", "softcap", "scale"):  # bottom-right aligned: the same on the last rows
            out[name] = value
        else:
            raise ValueError(f"no row slice for option {name!r}: add one to check this case")
    return out


def expected(case: Case, sizes: Sizes, mode: str, inputs, arrays: dict):
    """The float32 reference's output (fwd) or dq (fwd+bwd) on the last CHECK_ROWS query rows
    of batch row 0 and CHECK_HEADS heads, from the case's mod form: numpy [1, rows, heads, D]."""
    import jax
    import jax.numpy as jnp

    from flashjax import reference

    q, k, v, do = inputs
    seq = q.shape[1]
    rows, heads = min(benchmark.CHECK_ROWS, seq), min(CHECK_HEADS, q.shape[2])
    options = _rows_options(case.mod(as_jax(arrays), sizes), seq - rows, heads)
    f32 = lambda x: x.astype(jnp.float32)
    qs, dos = f32(q[:1, -rows:, :heads]), f32(do[:1, -rows:, :heads])
    ks, vs = f32(k[:1, :, :heads]), f32(v[:1, :, :heads])

    def ref(q_, do_):
        out, pullback = jax.vjp(lambda x: reference.attention(x, ks, vs, **options), q_)
        return out if mode == "fwd" else pullback(do_)[0]

    # The reference's matmuls need no autotuning to be exact (and XLA's autotuner is slow).
    compiler_options = {"xla_gpu_autotune_level": 0} if jax.default_backend() == "gpu" else None
    return np.asarray(jax.jit(ref).lower(qs, dos).compile(compiler_options)(qs, dos))


def _chunk_options(options: dict, start, size: int, heads: int, seq: int) -> dict:
    """The mod-form options as the reference sees them for query rows [start, start + size) of
    batch row 0 among all `seq` keys (`start` a traced scalar; the cases attend to
    themselves): `_rows_options`, with causal and the window, which the reference aligns to
    the rows it is given, stated as a mask of these rows' own positions."""
    import jax.numpy as jnp

    from flashjax import reference

    out = _rows_options({k: v for k, v in options.items() if k not in ("causal", "window")}, start, heads)
    out["mask"] = reference.logits_mask(1, seq, seq, causal=bool(options.get("causal")), window=options.get("window"),
                                        rows=start + jnp.arange(size))
    return out


def expected_kv(case: Case, sizes: Sizes, inputs, arrays: dict, chunk: int = 512):
    """(dk, dv): the float32 reference's gradients of batch row 0's CHECK_HEADS heads from every
    query row, numpy [1, T, heads, D] (`benchmark.reference_kv_grads`, by chunks of rows)."""
    import jax.numpy as jnp

    q, k, v, do = inputs
    heads = min(CHECK_HEADS, q.shape[2])
    rows = lambda x: x[:1, :, :heads].astype(jnp.float32)
    rows_options = lambda operands, start, size: _chunk_options(case.mod(operands, sizes), start, size, heads,
                                                                q.shape[1])
    return benchmark.reference_kv_grads(rows(q), rows(k), rows(v), rows(do), rows_options, as_jax(arrays), chunk=chunk)


def check(want, got) -> float:
    """Relative error of `got` (the full output / dq, or its checked rows) against `expected`'s."""
    rows, heads = want.shape[1], want.shape[2]
    return benchmark.rel_err(got[:1, -rows:, :heads], want)


def check_kv(want, dk, dv) -> dict:
    """{"dk", "dv"}: relative errors of full-size (or batch row 0's) dk, dv against `expected_kv`'s."""
    heads = want[0].shape[2]
    return dict(dk=benchmark.rel_err(dk[:1, :, :heads], want[0]), dv=benchmark.rel_err(dv[:1, :, :heads], want[1]))


def error_name(mode: str) -> str:
    return "out" if mode == "fwd" else "dq"


# ---- flashjax (JAX, this process) ------------------------------------------------------------------
class Unsupported(Exception):
    """A cell the backend cannot run (flashjax.explain's reasons)."""


def attention_fn(case: Case, impl: str, sizes: Sizes, arrays: dict, block_mask):
    """fn((q, learned arrays), k, v) -> out for a flashjax cell; a mask_mod comes in `block_mask`."""
    import flashjax

    backend = backend_of(impl)
    form = case.builtin if impl == BACKEND_IMPLS[backend][1] else case.mod
    fixed = {name: a for name, a in arrays.items() if name not in case.learned}

    def options(learned):
        kwargs = form({**fixed, **learned}, sizes)
        if "mask_mod" in kwargs:  # the block mask carries it
            kwargs.pop("mask_mod")
            kwargs["block_mask"] = block_mask
        return kwargs

    def fn(q_and_learned, k, v):
        q, learned = q_and_learned
        return flashjax.flash_attention(q, k, v, backend=backend, **options(learned))

    return fn, options


@dataclasses.dataclass
class Prepared:
    """A row ready to time: its cells (with `visible`), compiled programs or errors, expected results."""

    row: Row
    cells: list
    programs: dict  # cell -> (compiled, temp bytes) or an exception
    expected: dict  # mode -> numpy, and "kv" -> (dk, dv) with forward+backward cells
    args: tuple  # ((q, learned arrays), k, v, do); (arrays,) for a block-mask row
    block_mask: object = None  # at the Triton tiles (BLOCK_MASK_TILES)
    arrays: dict | None = None
    block_masks: dict | None = None  # backend -> its block mask

    def block_mask_for(self, impl: str):
        return None if self.block_masks is None else self.block_masks[backend_of(impl)]


def prepare_row(row: Row, sizes: Sizes, inputs, deadline: float) -> Prepared | None:
    """Counts the row's visible pairs, builds its block mask and computes the expected results
    (its programs are compiled by `compile_program`); None past the deadline (the row is skipped)."""
    import flashjax

    if time.perf_counter() > deadline:
        return None
    case, first = row.case, row.cells[0]
    arrays = as_jax(draw_arrays(case, first.batch, row.seq, sizes))
    visible = visible_fraction(case, sizes, first.batch, row.seq, arrays)
    cells = [dataclasses.replace(c, visible=visible) for c in row.cells]
    mod_options = case.mod(arrays, sizes)
    block_masks = None
    if "mask_mod" in mod_options:
        flashjax_impls = [impl for pair in BACKEND_IMPLS.values() for impl in pair]
        backends = {backend_of(c.impl) for c in cells if c.impl in flashjax_impls} | ({"triton"} if row.kind == "build" else set())
        block_masks = {backend: flashjax.block_mask(mod_options["mask_mod"], first.batch, first.heads, row.seq, row.seq,
                                                    block_q=BLOCK_MASK_TILES[backend], block_k=BLOCK_MASK_TILES[backend])
                       for backend in backends}
    block_mask = block_masks and block_masks.get("triton")
    if row.kind == "build":
        return Prepared(row, cells, {}, {}, (arrays,), block_mask)
    learned = {name: arrays[name] for name in case.learned}
    q, k, v, do = inputs
    modes = dict.fromkeys(c.mode for c in cells)
    want = {mode: expected(case, sizes, mode, inputs, arrays) for mode in modes}
    if "fwdbwd" in modes:
        want["kv"] = expected_kv(case, sizes, inputs, arrays)
    return Prepared(row, cells, {}, want, ((q, learned), k, v, do), block_mask, arrays, block_masks)


class BudgetSpent(Exception):
    """A program not compiled: the time budget was spent first."""


def compile_program(prepared: Prepared, cell: FlexCell, sizes: Sizes, deadline: float):
    """(compiled, temp bytes) of a flashjax cell, or the exception that stopped it."""
    import flashjax

    if time.perf_counter() > deadline:
        return BudgetSpent("budget spent before it compiled")
    try:
        fn, options = attention_fn(prepared.row.case, cell.impl, sizes, prepared.arrays, prepared.block_mask_for(cell.impl))
        (q, learned), k, v, _ = prepared.args
        try:  # the backend's own reasons when it cannot run the cell
            flashjax.explain(q, k, v, backend=backend_of(cell.impl), **options(learned))
        except NotImplementedError as e:
            return Unsupported(benchmark.short_error(e))
        return benchmark.compile_cell(cell, fn, prepared.args)
    except Exception as e:  # recorded when the row is timed
        return e


def time_row(prepared: Prepared, reps: int) -> list[dict]:
    """Checks, then times, each flashjax cell of a prepared row."""
    import jax

    entries = []
    for cell in prepared.cells:
        if cell.impl == "torch_flex":
            continue
        program = prepared.programs[cell]
        tile = BLOCK_MASK_TILES[backend_of(cell.impl)]
        fields = dict(case=cell.config, visible=cell.visible, v_head_dim=cell.v_head_dim,
                      note=f"block mask prebuilt ({tile} x {tile})" if prepared.block_mask_for(cell.impl) is not None
                      and cell.impl in ("flashjax", "flashjax_mosaic") else "")
        if isinstance(program, Exception):
            status = ("unsupported" if isinstance(program, Unsupported) else "skipped" if isinstance(program, BudgetSpent)
                      else "oom" if benchmark.is_oom(program) else "error")
            entries.append(benchmark.record(cell, status, error=benchmark.short_error(program), **fields))
            continue
        compiled, temp = program
        fields["temp_bytes"] = temp
        try:
            result = compiled(*prepared.args)
            got = result if cell.mode == "fwd" else result[0][0]
            errors = {error_name(cell.mode): check(prepared.expected[cell.mode], got)}
            if cell.mode == "fwdbwd":  # result: ((dq, learned arrays' gradients), dk, dv)
                errors.update(check_kv(prepared.expected["kv"], result[1], result[2]))
            fields["rel_err"] = errors
            del result, got
            if not all(e < benchmark.TOLERANCE for e in errors.values()):  # nan fails too
                entries.append(benchmark.record(cell, "mismatch", error=f"rel err {errors} >= {benchmark.TOLERANCE}", **fields))
                continue
            median, times, inner = benchmark.median_time(lambda: compiled(*prepared.args), jax.block_until_ready, reps=reps)
            entries.append(benchmark.record(cell, "ok", median_ms=median * 1e3, reps_ms=[t * 1e3 for t in times],
                                            inner=inner, **fields))
        except Exception as e:
            entries.append(benchmark.record(cell, "oom" if benchmark.is_oom(e) else "error", error=benchmark.short_error(e), **fields))
    return entries


def time_builds(prepared: Prepared, sizes: Sizes, reps: int) -> list[dict]:
    """The block-mask row: `flashjax.block_mask` under jit (arrays as arguments) and called eagerly,
    each checked against the block mask built for the row."""
    import jax

    import flashjax

    case, row = prepared.row.case, prepared.row
    (arrays,) = prepared.args
    batch, heads = prepared.cells[0].batch, prepared.cells[0].heads
    build = lambda a: flashjax.block_mask(case.mod(a, sizes)["mask_mod"], batch, heads, row.seq, row.seq)
    want = np.asarray(prepared.block_mask.blocks)
    calls = {"block_mask_jit": (jax.jit(lambda a: build(a).blocks), reps, 2),
             "block_mask_eager": (lambda a: build(a).blocks, EAGER_BUILD_REPS, 1)}
    entries = []
    for cell in prepared.cells:
        call, n, warmup = calls[cell.impl]
        fields = dict(case=case.name, visible=cell.visible, note="" if cell.impl == "block_mask_jit" else
                      f"eager call, {n} repetitions after {warmup} warm-up")
        try:
            if not np.array_equal(np.asarray(call(arrays)), want):
                entries.append(benchmark.record(cell, "mismatch", error="blocks differ from flashjax.block_mask's", **fields))
                continue
            median, times, inner = benchmark.median_time(lambda: call(arrays), jax.block_until_ready, reps=n, warmup=warmup)
            entry = benchmark.record(cell, "ok", median_ms=median * 1e3, reps_ms=[t * 1e3 for t in times], inner=inner, **fields)
        except Exception as e:
            entry = benchmark.record(cell, "error", error=benchmark.short_error(e), **fields)
        entry.pop("tflops", None)
        entries.append(entry)
    return entries


def run_jax(rows: list[Row], args, sizes: Sizes, deadline: float, on_row) -> None:
    """Per T (and head dims): prepares the rows and compiles every program concurrently, then
    checks and times them row by row; `on_row(row, entries)` records each row."""
    import jax

    groups: dict[tuple, list[Row]] = {}
    for row in rows:
        first = row.cells[0]
        groups.setdefault((row.seq, first.head_dim, first.v_head_dim), []).append(row)
    workers = max(1, args.compile_workers)
    for group in groups.values():
        if time.perf_counter() > deadline:
            for row in group:
                on_row(row, skipped(row.cells, args.budget_s))
            continue
        timed = [r for r in group if r.timed_like_attention]
        inputs = jax.block_until_ready(inputs_for(timed[0].cells[0])) if timed else None
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            prepared = list(pool.map(lambda r: _prepare_or_error(r, sizes, inputs, deadline), group))
            jobs = [(p, c) for p in prepared if isinstance(p, Prepared) and p.row.kind != "build"
                    for c in p.cells if c.impl != "torch_flex"]
            for (p, cell), program in zip(jobs, pool.map(lambda job: compile_program(*job, sizes, deadline), jobs)):
                p.programs[cell] = program
        for row, ready in zip(group, prepared):
            if ready is None:
                on_row(row, skipped(row.cells, args.budget_s))
            elif isinstance(ready, Exception):
                on_row(row, [benchmark.record(c, "error", error=benchmark.short_error(ready), case=c.config)
                             for c in row.cells if c.impl != "torch_flex"])
            elif row.kind == "build":
                on_row(row, time_builds(ready, sizes, args.reps))
            else:
                if workers > 1:
                    _retry_failed(ready, sizes)
                on_row(row, time_row(ready, args.reps))
        prepared = jobs = inputs = None  # this T's arrays and programs go before the next T's are made


def _prepare_or_error(row, sizes, inputs, deadline):
    try:
        return prepare_row(row, sizes, inputs, deadline)
    except Exception as e:  # the row's cells record it
        return e


def _retry_failed(prepared: Prepared, sizes: Sizes) -> None:
    """Concurrent compilation is a speed-up, never a cause of failure: programs that failed to
    compile beside others are compiled again, alone."""
    for cell, program in prepared.programs.items():
        if isinstance(program, Exception) and not isinstance(program, (Unsupported, BudgetSpent)):
            prepared.programs[cell] = compile_program(prepared, cell, sizes, float("inf"))


def skipped(cells, budget_s: float) -> list[dict]:
    return [benchmark.record(c, "skipped", error=f"budget of {budget_s:.0f} s spent", case=c.config) for c in cells]


# ---- PyTorch, in its own process -------------------------------------------------------------------
def torch_cells(rows: list[Row]) -> list[FlexCell]:
    return [c for row in rows for c in row.cells if c.impl == "torch_flex"]


def run_torch(argv: list[str], args, rows: list[Row]) -> tuple[dict, dict]:
    """The torch_flex cells, by key, and {"torch_device", "torch"}: from benchmarks/torch_flex.py
    in a subprocess, or recorded "unavailable"/"skipped"/"error" with the reason."""
    cells = torch_cells(rows)
    if not cells:
        return {}, {}

    def all_cells(status, reason):
        return {c.key: benchmark.record(c, status, error=reason, case=c.config) for c in cells}, {}

    if args.torch == "off":
        return all_cells("skipped", "--torch off")
    if importlib.util.find_spec("torch") is None:
        return all_cells("unavailable", f"torch is not installed for {sys.executable}")
    budget = args.torch_budget_s if args.torch_budget_s is not None else args.budget_s * TORCH_SHARE
    script = Path(__file__).resolve().parent / "torch_flex.py"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "torch.json"
        cmd = [sys.executable, str(script), *argv, "--json", str(out), "--torch-budget-s", str(budget)]
        tail = collections.deque(maxlen=5)
        with subprocess.Popen(cmd, text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as proc:
            for line in proc.stderr:  # progress, passed through as it comes
                sys.stderr.write(line)
                tail.append(line.strip())
        if not out.exists():
            return all_cells("error", f"torch subprocess failed (rc={proc.returncode}): {' | '.join(tail)[-240:]}")
        data = json.loads(out.read_text())
    return data["cells"], {"torch_device": data.get("device"), "torch": data.get("torch")}


# ---- the report ------------------------------------------------------------------------------------
MARKS = {"unsupported": "n/a", "unavailable": "n/a", "error": "err", "mismatch": "MISMATCH", "oom": "oom", "skipped": "skip"}


def summarise(cells: dict, rows: list[Row]) -> list[dict]:
    """Per (case, T, mode) of the rows: the times, TFLOP/s and ratios the bars are about."""
    def ok(key):
        e = cells.get(key)
        return e if e is not None and e.get("status") == "ok" else None

    def plain(seq, mode, impl="flashjax_builtin"):
        return benchmark.cell_key(PLAIN, seq, True, mode, impl)

    out = []
    for row in rows:
        case = row.case
        if row.kind in ("plain", "build_baseline"):  # shown beside the rows they are the baseline of
            continue
        for mode in dict.fromkeys(c.mode for c in row.cells):
            def key(impl, mode=mode):
                return benchmark.cell_key(case.name, row.seq, case.causal, mode, impl)

            if row.kind == "build":
                fwd = ok(plain(row.seq, "fwd"))
                line = dict(case=case.name, seq=row.seq, mode=mode, kind="build", causal_fwd_ms=fwd and fwd["median_ms"])
                for impl in BUILD_IMPLS:
                    e = ok(key(impl))
                    line[f"{impl}_ms"] = e and e["median_ms"]
                    line[f"{impl}_share"] = e and fwd and e["median_ms"] / fwd["median_ms"]
                out.append(line)
                continue
            for backend, (mod_impl, builtin_impl) in BACKEND_IMPLS.items():
                if not any(c.impl in (mod_impl, builtin_impl) and c.mode == mode for c in row.cells):
                    continue
                base_key = key(builtin_impl) if case.baseline == "builtin" else plain(row.seq, mode, builtin_impl)
                if not any(cells.get(k) for k in (key(mod_impl), base_key)):
                    continue  # neither was run
                mine, base, torch = ok(key(mod_impl)), ok(base_key), ok(key("torch_flex"))
                line = dict(case=case.name, seq=row.seq, mode=mode, kind=case.baseline, backend=backend,
                            visible=next((e.get("visible") for e in (mine, base, torch) if e), None),
                            flashjax_ms=mine and mine["median_ms"], flashjax_tflops=mine and mine["tflops"],
                            baseline_ms=base and base["median_ms"], baseline_tflops=base and base["tflops"],
                            torch_ms=torch and torch["median_ms"],
                            statuses={impl: (cells.get(k) or {}).get("status") for impl, k in
                                      (("flashjax", key(mod_impl)), ("baseline", base_key), ("torch_flex", key("torch_flex")))})
                if case.baseline == "builtin":
                    line["mod_over_builtin"] = mine and base and mine["median_ms"] / base["median_ms"]
                    line["torch_over_flashjax"] = mine and torch and torch["median_ms"] / mine["median_ms"]
                else:
                    line["tflops_vs_plain"] = mine and base and mine["tflops"] / base["tflops"]
                out.append(line)
    return out


def stored_rows(cells: dict, args) -> list[Row]:
    """The rows of every case at every T the results file holds, with every implementation: what
    the summary covers after a run merged into earlier ones (`summarise` leaves out the
    lines where neither flashjax nor its baseline was run)."""
    build_seqs = sorted({e["seq"] for e in cells.values() if e.get("mode") == "build"})
    seqs = sorted({e["seq"] for e in cells.values() if e.get("mode") in MODES} - set(build_seqs))
    full = argparse.Namespace(**{**vars(args), "cases": ",".join(CASES), "impls": ",".join(IMPLS),
                                 "seqlens": ",".join(map(str, seqs)) or ",".join(map(str, SEQLENS)),
                                 "modes": ",".join(MODES)})
    if build_seqs:
        full.block_mask_seq = str(build_seqs[-1])
    return plan(full)


def _fmt(x, digits=3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _tflops(x) -> str:
    return "-" if x is None else f"{x:.0f}" if x >= 10 else f"{x:.2g}"


def _mark(line: dict, which: str) -> str:
    status = line["statuses"].get(which)
    return MARKS.get(status, "-") if status else "-"


def _table(header: list[str], lines: list[list[str]], note: str) -> str:
    lines = [header] + lines
    widths = [max(len(line[c]) for line in lines) for c in range(len(header))]
    text = ["  ".join(s.rjust(w) if i else s.ljust(w) for i, (s, w) in enumerate(zip(line, widths))) for line in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(text + [note])


def report(summary: list[dict]) -> str:
    """The tables: mods, sinks/MLA, block-mask builds; then the bars."""
    def ms(line, field, which):
        return _fmt(line[field]) if line[field] is not None else _mark(line, which)

    mods = [s for s in summary if s["kind"] == "builtin"]
    features = [s for s in summary if s["kind"] == "plain"]
    builds = [s for s in summary if s["kind"] == "build"]
    parts = []
    if mods:
        parts.append(_table(
            ["case", "T", "mode", "backend", "flashjax ms", "built-in ms", "mod/built-in", "torch ms", "torch/flashjax",
             "TFLOP/s", "visible"],
            [[s["case"], str(s["seq"]), s["mode"], s.get("backend", "triton"), ms(s, "flashjax_ms", "flashjax"),
              ms(s, "baseline_ms", "baseline") if CASES[s["case"]].builtin else "none",
              _fmt(s["mod_over_builtin"], 2), ms(s, "torch_ms", "torch_flex"), _fmt(s["torch_over_flashjax"], 2),
              _tflops(s["flashjax_tflops"]), _fmt(s["visible"], 3)] for s in mods],
            f"mod/built-in: time ratio, same backend (bar <= {MOD_VS_BUILTIN_MAX:.2f}); torch/flashjax: FlexAttention time "
            f"/ flashjax time (bar >= {TORCH_OVER_FLASHJAX_MIN} fwd+bwd); TFLOP/s of visible pairs"))
    if features:
        parts.append(_table(
            ["case", "T", "mode", "flashjax ms", "TFLOP/s", "plain ms", "plain TFLOP/s", "TFLOP/s ratio"],
            [[s["case"], str(s["seq"]), s["mode"], ms(s, "flashjax_ms", "flashjax"), _tflops(s["flashjax_tflops"]),
              ms(s, "baseline_ms", "baseline"), _tflops(s["baseline_tflops"]), _fmt(s["tflops_vs_plain"], 2)]
             for s in features],
            f"plain: the built-in causal call, no sinks, Dqk = Dv = the problem's head dim (bar: ratio >= "
            f"{FEATURE_VS_PLAIN_MIN}); MLA's FLOPs count each product with its own head dim"))
    if builds:
        parts.append(_table(
            ["block mask", "T", "jit ms", "eager ms", "causal fwd ms", "jit/fwd", "eager/fwd"],
            [[s["case"], str(s["seq"]), _fmt(s["block_mask_jit_ms"]), _fmt(s["block_mask_eager_ms"]),
              _fmt(s["causal_fwd_ms"]), _fmt(s["block_mask_jit_share"]), _fmt(s["block_mask_eager_share"])] for s in builds],
            f"flashjax.block_mask build time / one causal forward at that T (bar <= {BUILD_SHARE_MAX})"))
    parts.append(bars(summary))
    return "\n\n".join(parts)


def bars(summary: list[dict]) -> str:
    """One line per bar: how many measured lines meet it, and those that do not."""
    checks = [
        ("mod within 10% of its built-in", "mod_over_builtin", lambda s: True, lambda r: r <= MOD_VS_BUILTIN_MAX),
        ("fwd+bwd >= 1.2x torch FlexAttention", "torch_over_flashjax", lambda s: s["mode"] == "fwdbwd",
         lambda r: r >= TORCH_OVER_FLASHJAX_MIN),
        ("block mask build <= 5% of a causal fwd (jit)", "block_mask_jit_share", lambda s: True, lambda r: r <= BUILD_SHARE_MAX),
        ("sinks, MLA >= 0.95x the plain call's TFLOP/s", "tflops_vs_plain", lambda s: True, lambda r: r >= FEATURE_VS_PLAIN_MIN),
    ]
    lines = ["bars:"]
    for title, field, applies, meets in checks:
        measured = [s for s in summary if applies(s) and s.get(field) is not None]
        misses = [s for s in measured if not meets(s[field])]
        detail = "; misses: " + ", ".join(f"{s['case']} T{s['seq']} {s['mode']} {s.get('backend', 'triton')} {s[field]:.2f}"
                                          for s in misses) if misses else ""
        lines.append(f"  {title}: {len(measured) - len(misses)}/{len(measured)} meet it{detail}")
    return "\n".join(lines)


# ---- main ------------------------------------------------------------------------------------------
def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """Command-line flags, shared by this benchmark and benchmarks/torch_flex.py."""
    epilog = "cases (flashjax's mod form | the built-in it is compared with):\n"
    epilog += "\n".join(f"  {n:16s} {c.description}" for n, c in CASES.items())
    epilog += "\n\nThe protocol, the FLOP count and the bars: the module docstring of benchmarks/flex.py."
    p = argparse.ArgumentParser(prog=prog, description="\n\n".join(__doc__.split("\n\n")[:2]), epilog=epilog,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES), help="subset of the cases listed below")
    p.add_argument("--seqlens", default=",".join(map(str, SEQLENS)), help="e.g. 4k,8192,16k")
    p.add_argument("--modes", default=",".join(MODES), help="fwd,fwdbwd")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"subset of {','.join(IMPLS)}")
    p.add_argument("--block-mask-seq", default=str(BLOCK_MASK_SEQ),
                   help="T of the block-mask build row (0: no such row)")
    p.add_argument("--tokens", type=int, default=benchmark.TOKENS, help="tokens per batch (B = tokens // T)")
    p.add_argument("--reps", type=int, default=10, help="timed repetitions per cell (>= 10 for the protocol)")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="stop starting new rows after this many seconds (torch's share included)")
    p.add_argument("--torch-budget-s", type=float, default=None,
                   help=f"the torch subprocess's own budget (default {TORCH_SHARE} x --budget-s)")
    p.add_argument("--torch", choices=("auto", "on", "off"), default="auto",
                   help="PyTorch FlexAttention in a subprocess (auto/on: if torch imports; off: cells 'skipped')")
    p.add_argument("--torch-compile", choices=("auto", "on", "off"), default="auto",
                   help="torch.compile flex_attention (auto: on CUDA only; the CPU runs it eagerly)")
    p.add_argument("--compile-workers", type=int, default=8, help="threads preparing (compiling) one T's rows")
    p.add_argument("--cache-dir", default=None, help="JAX persistent compilation cache (speeds up re-runs)")
    p.add_argument("--out", default=None, help="results directory or .json file (default benchmarks/results/)")
    p.add_argument("--fresh", action="store_true", help="do not merge into an existing results file")
    p.add_argument("--resume", action="store_true", help="skip cells already measured (status ok) in the results file")
    p.add_argument("--smoke", action="store_true",
                   help=f"tiny CPU run of every code path (H=2, D=32, T={SMOKE_SEQLENS[0]}, interpret mode, 2 reps)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.smoke:
        args.reps = min(args.reps, 2)
    start = time.perf_counter()
    deadline = start + args.budget_s
    sizes = sizes_of(args)
    rows = plan(args)

    # PyTorch first, while JAX has not yet claimed the GPU (as in benchmarks/attention.py).
    torch_entries, torch_info = run_torch(argv, args, rows)

    import jax

    import flashjax

    if args.cache_dir:
        jax.config.update("jax_compilation_cache_dir", args.cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    device = benchmark.device_name()
    path = benchmark.results_path(RESULTS_DIR, args.out, device, prefix="flex-", smoke=args.smoke)
    results = {"cells": {}} if args.fresh else benchmark.load_results(path)
    results.update(
        device=device, platform=jax.default_backend(), jax=jax.__version__, flashjax=flashjax.__version__,
        date=datetime.date.today().isoformat(), **{k: v for k, v in torch_info.items() if v},
        sizes=dataclasses.asdict(sizes),
        protocol=dict(dtype="bfloat16", reps=args.reps, check_rows=benchmark.CHECK_ROWS, check_heads=CHECK_HEADS,
                      tolerance=benchmark.TOLERANCE, backend="triton (flashjax, flashjax_builtin), mosaic (flashjax_mosaic*)",
                      flops="4*B*H*T*T*D fwd x visible fraction of pairs, x3.5 fwd+bwd; MLA: per product's head dim"),
    )
    new_entries = []

    def merge(entries):
        for e in entries:
            key = benchmark.cell_key(e["config"], e["seq"], e["causal"], e["mode"], e["impl"])
            if e["status"] != "skipped" or key not in results["cells"]:  # a skip never hides a measurement
                results["cells"][key] = e
        new_entries.extend(entries)

    merge(list(torch_entries.values()))
    done = {k for k, e in results["cells"].items() if e.get("status") == "ok"} if args.resume else set()
    jax_rows = []
    for row in rows:
        cells = [c for c in row.cells if c.impl != "torch_flex" and c.key not in done]
        if cells:
            jax_rows.append(dataclasses.replace(row, cells=cells))

    def on_row(row, entries):
        merge(entries)
        benchmark.save_results(path, results)  # after every row: an interrupted run keeps what it measured
        print(f"{row.case.name} T={row.seq}: " + ", ".join(
            f"{e['mode']}/{e['impl']} {_fmt(e.get('median_ms')) + ' ms' if e['status'] == 'ok' else e['status']}"
            for e in entries), file=sys.stderr, flush=True)

    run_jax(jax_rows, args, sizes, deadline, on_row)
    results["summary"] = summarise(results["cells"], stored_rows(results["cells"], args))
    benchmark.save_results(path, results)

    print(f"\n{device} | jax {jax.__version__} | torch {results.get('torch', '-')} | bf16, H={sizes.heads}, "
          f"D={sizes.head_dim}, {sizes.tokens} tokens per batch | {time.perf_counter() - start:.0f} s")
    print(report(results["summary"]))
    issues = benchmark.problems(new_entries)
    if issues:
        print("not measured:\n" + issues)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

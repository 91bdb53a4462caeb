"""Forward kernel (Pallas, lowered through Triton): FlashAttention-2 partitioning.

One program per (query tile, batch, head). The query tile stays on chip while
the loop walks the key/value tiles the mask lets it meet, keeping the running
row max `m`, row sum `l` and unnormalised output `acc` in float32. Writes the
output and the row logsumexp (base 2) that the backward recomputes P from.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flashjax import masks
from flashjax.kernels.common import LOG2E, ROW_MAX_START
from flashjax.kernels.triton import scoring
from flashjax.kernels.triton.config import KernelConfig
from flashjax.kernels.triton.scoring import Scorer
from flashjax.params import Extras
from flashjax.vma import out_types


def _forward_kernel(q_ref, k_ref, v_ref, x: Extras, o_ref, lse_ref, *, scorer: Scorer, block_k: int, heads: int):
    block_q, head_dim = q_ref.shape[0], v_ref.shape[1]  # the output's head dim is v's
    num_k_blocks = k_ref.shape[0] // block_k
    spec = scorer.spec
    # Tiles run in reverse order: under a causal mask the last query tiles do the
    # most work, and starting them first balances the tail of the grid.
    own = scoring.query_tile(scorer, x, block_q=block_q, heads=heads)
    q_block, rows, kv_length, q_seg, slope, drop_base = (
        own.q_block, own.rows, own.kv_length, own.q_seg, own.slope, own.drop_base)
    precision = scoring.dot_precision(q_ref.dtype)
    mod = scorer.mod_args(x, own.batch, own.head)
    q = q_ref[...]

    def step(k_block, carry, masked):
        acc, m, l = carry
        start = pl.multiple_of(k_block * block_k, block_k)
        tile = pl.ds(start, block_k)
        k = k_ref[tile, :]
        v = v_ref[tile, :]
        cols = start + jnp.arange(block_k, dtype=jnp.int32)[None, :]
        qk = scoring.dot(q, k, trans_b=True, precision=precision)
        bias = scoring.pair_tile(x.bias, (), None, tile) if x.bias is not None else None
        s, _ = scorer.logits(qk, rows, cols, bias=bias, slope=slope, mod=mod)
        if masked:
            s = scorer.mask(
                s, rows, cols, kv_length=kv_length,
                q_seg=q_seg, kv_seg=x.kv_segment_ids[tile] if x.kv_segment_ids is not None else None,
                dense=scoring.pair_tile(x.mask, (), None, tile) if x.mask is not None else None, mod=mod,
            )
        keep = scorer.keep(drop_base, rows, cols) if drop_base is not None else None
        return scoring.online_softmax_step(acc, m, l, s, v, keep=keep, precision=precision)

    m = jnp.full((block_q,), ROW_MAX_START, jnp.float32)
    l = jnp.zeros((block_q,), jnp.float32)
    if x.sinks is not None:
        # The sink starts every row as a key of weight exp(sink) and no value: m = sink, l = 1
        # (l = 0 for a sink of -inf, which is no key).
        sink = x.sinks[own.head] * LOG2E
        m = jnp.maximum(m, sink)
        l = jnp.exp2(sink - m)
    carry = (jnp.zeros((block_q, head_dim), jnp.float32), m, l)
    tiles = spec.kv_range(q_block, block_q, block_k, num_k_blocks)
    if x.ranges is not None:
        tiles = masks.intersect(tiles, x.ranges)
    acc, m, l = scoring.visit_tiles(
        tiles, step, carry,
        *((True, True) if x.ranges is not None else spec.kv_boundaries(k_ref.shape[0])),
    )
    # Rows that met no key (l = 0; with sinks l >= 1), and padded query rows, output 0 and
    # report lse = -inf.
    empty = l == 0.0
    if x.ranges is not None:
        empty = empty | (rows[:, 0] >= x.ranges[masks.Q_LENGTH])
    inv_l = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l))
    if scorer.dropout_rate:
        inv_l = inv_l * scorer.keep_scale
    out = acc * inv_l[:, None]
    if x.ranges is not None:
        # A padded row may hold NaN (its q, or a key it was not masked from): 0 * NaN is NaN.
        out = jnp.where(empty[:, None], 0.0, out)
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, -jnp.inf, m + jnp.log2(jnp.where(empty, 1.0, l)))


def extra_specs(x: Extras, *, block_q: int, seq_k: int, num_q_blocks: int) -> Extras:
    """BlockSpecs of the optional inputs for a grid of (query tile, batch, head)."""

    def q_tile(i):
        return num_q_blocks - 1 - i

    def pair_spec(a):
        bm, hm, tq, tk = a.shape
        return pl.BlockSpec(
            (None, None, block_q if tq > 1 else 1, tk),
            lambda i, b, h: (b if bm > 1 else 0, h if hm > 1 else 0, q_tile(i) if tq > 1 else 0, 0),
        )

    def whole(a):
        return pl.BlockSpec(a.shape, lambda i, b, h: (0,) * a.ndim)

    def ranges_spec(a):
        if a.ndim == 4:  # per head (a block mask that depends on the head)
            return pl.BlockSpec((None, None, None, masks.RANGE_FIELDS), lambda i, b, h: (b, h, q_tile(i), 0))
        return pl.BlockSpec((None, None, masks.RANGE_FIELDS), lambda i, b, h: (b, q_tile(i), 0))

    return Extras(
        ranges=None if x.ranges is None else ranges_spec(x.ranges),
        q_segment_ids=None if x.q_segment_ids is None else pl.BlockSpec((None, block_q), lambda i, b, h: (b, q_tile(i))),
        kv_segment_ids=None if x.kv_segment_ids is None else pl.BlockSpec((None, seq_k), lambda i, b, h: (b, 0)),
        mask=None if x.mask is None else pair_spec(x.mask),
        bias=None if x.bias is None else pair_spec(x.bias),
        alibi_slopes=None if x.alibi_slopes is None else whole(x.alibi_slopes),
        dropout_seed=None if x.dropout_seed is None else whole(x.dropout_seed),
        **whole_flex_specs(x, whole),
    )


def whole_flex_specs(x: Extras, whole) -> dict:
    """Whole-array BlockSpecs of the sinks and of the arrays the user functions close over."""
    consts = lambda cs: None if cs is None else tuple(whole(c) for c in cs)
    return dict(
        sinks=None if x.sinks is None else whole(x.sinks),
        score_consts=consts(x.score_consts),
        mask_consts=consts(x.mask_consts),
    )


def forward(q, k, v, x: Extras, *, scorer: Scorer, config: KernelConfig, interpret: bool = False, out_dtype=None):
    """Runs the forward kernel on tile-aligned inputs.

    Args:
      q: [B, Tq, H, D] with Tq a multiple of config.block_q and D a power of two.
      k: [B, Tk, Hkv, D] with Tk a multiple of config.block_k; v: [B, Tk, Hkv, Dv] (Dv a power of two).
      x: optional inputs, already padded to the tiles (lengths folded into `ranges`).
      scorer: the static scoring (mask spec in true lengths, scale, softcap, dropout).
      out_dtype: of o (default q's).

    Returns:
      o [B, Tq, H, Dv] (in `out_dtype`) and lse2 [B, H, Tq] (float32, base 2).
    """
    batch, seq_q, heads, head_dim = q.shape
    v_head_dim = v.shape[3]
    seq_k, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    block_q, block_k = config.block_q, config.block_k
    num_q_blocks = seq_q // block_q

    def q_tile(i, b, h):
        return (b, num_q_blocks - 1 - i, h, 0)

    def kv_whole(i, b, h):
        return (b, 0, h // group, 0)

    kernel = functools.partial(_forward_kernel, scorer=scorer, block_k=block_k, heads=heads)
    return pl.pallas_call(
        kernel,
        grid=(num_q_blocks, batch, heads),
        in_specs=[
            pl.BlockSpec((None, block_q, None, head_dim), q_tile),
            pl.BlockSpec((None, seq_k, None, head_dim), kv_whole),
            pl.BlockSpec((None, seq_k, None, v_head_dim), kv_whole),
            extra_specs(x, block_q=block_q, seq_k=seq_k, num_q_blocks=num_q_blocks),
        ],
        out_specs=[
            pl.BlockSpec((None, block_q, None, v_head_dim), q_tile),
            pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, num_q_blocks - 1 - i)),
        ],
        out_shape=out_types([
            jax.ShapeDtypeStruct((batch, seq_q, heads, v_head_dim), out_dtype or q.dtype),
            jax.ShapeDtypeStruct((batch, heads, seq_q), jnp.float32),
        ], q, k, v, x),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="flashjax_fwd",
    )(q, k, v, x)

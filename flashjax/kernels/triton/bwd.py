"""Backward kernels (Pallas, lowered through Triton): recompute P, never store it.

Three kernels, all deterministic (no atomics):

* dK/dV: one program per (key tile, batch, kv_head). It keeps its K, V tile and
  the dK, dV accumulators on chip and walks every query tile of every query head
  in its group, recomputing `P = exp2(S - lse)`; the sum over the group happens
  in registers, so GQA never materialises repeated K/V or per-head dK/dV.
* dQ: one program per (query tile, batch, head), walking key tiles like the forward.
* dBias (only when a bias is given and its gradient is used): one program per
  tile of the bias, summing dS over the axes the bias broadcasts along.

All take `delta = rowsum(dO * O) - dlse` (float32), computed beforehand; the
`- dlse` term makes the logsumexp output differentiable at no cost, since
d lse / d S = P.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flashjax import masks
from flashjax.kernels.triton import scoring
from flashjax.kernels.triton.config import KernelConfig
from flashjax.kernels.triton.fwd import extra_specs, whole_flex_specs
from flashjax.kernels.triton.scoring import Scorer
from flashjax.params import Extras
from flashjax.vma import out_types


def _tile_grad_logits(scorer: Scorer, q, k, v, do, lse, delta, rows, cols, *, masked, precision,
                      padded_rows: bool, transposed=False, bias=None, slope=None, kv_length=None, q_seg=None,
                      kv_seg=None, dense=None, drop_base=None, mod=None):
    """Recomputes a tile and returns (P with dropout applied, dS w.r.t. the logits, what
    `Scorer.logit_grad` needs to take dS back to the scores).

    dS = P * (dP - delta), where dP = dO V^T passes back through dropout's mask and
    scaling. With `transposed` the tile is computed as [block_k, block_q] (S^T = K Q^T,
    dP^T = V dO^T): the dK/dV kernel then multiplies P^T and dS^T as left operands
    without a register transpose; rows must be [1, bq] and cols [bk, 1]. `padded_rows`: the
    kernel's query arrays extend past the true q_len (static).
    """
    if transposed:
        qk = scoring.dot(k, q, trans_b=True, precision=precision)
        lse, delta = lse[None, :], delta[None, :]
        bias = None if bias is None else bias.T
        dense = None if dense is None else dense.T
    else:
        qk = scoring.dot(q, k, trans_b=True, precision=precision)
        lse, delta = lse[:, None], delta[:, None]
    s, chain = scorer.logits(qk, rows, cols, bias=bias, slope=slope, mod=mod, grad=True)
    if masked:
        s = scorer.mask(s, rows, cols, kv_length=kv_length, q_seg=q_seg, kv_seg=kv_seg, dense=dense, mod=mod)
    # S and the lse are recomputed in another order than the forward's: with huge
    # logits S can exceed the lse by rounding; P is a probability, so it is capped at 1.
    p = jnp.exp2(jnp.minimum(s - lse, 0.0))
    dp = scoring.dot(v, do, trans_b=True, precision=precision) if transposed else scoring.dot(do, v, trans_b=True, precision=precision)
    if drop_base is not None:
        keep = scorer.keep(drop_base, rows, cols)
        p_dropped = jnp.where(keep, p * scorer.keep_scale, 0.0)
        dp = jnp.where(keep, dp * scorer.keep_scale, 0.0)
    else:
        p_dropped = p
    ds = p * (dp - delta)
    if kv_length is not None or (padded_rows and (scorer.score_mod is not None or bias is not None)):
        # Padded query rows (lse2 = +inf: rows past q_len, or past a length) are computed too;
        # P = exp2(S - inf) is 0 only when S is finite, and their q may hold anything with
        # lengths, a score_mod may be non-finite past q_len (log(1 - q_idx / q_len)), and their
        # bias tile entries are padding. Without lengths, calls whose q_len fills the tiles
        # have no such rows and skip the selects.
        live = lse != jnp.inf
        p_dropped, ds = jnp.where(live, p_dropped, 0.0), jnp.where(live, ds, 0.0)
    return p_dropped, ds, chain


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, x: Extras, dk_ref, dv_ref, *,
                scorer: Scorer, block_q: int, padded_seq_k: int, heads: int):
    block_k, head_dim, v_head_dim = k_ref.shape[0], k_ref.shape[1], v_ref.shape[1]
    seq_q, group = q_ref.shape[0], q_ref.shape[1]
    num_q_blocks = seq_q // block_q
    spec = scorer.spec
    k_block, batch, kv_head = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    precision = scoring.dot_precision(q_ref.dtype)

    k = k_ref[...]
    v = v_ref[...]
    # Tiles are computed transposed here: [block_k, block_q].
    cols = k_block * block_k + jnp.arange(block_k, dtype=jnp.int32)[:, None]
    # Ranges per head (a head-dependent block mask) come as [group, RANGE_FIELDS].
    per_head = x.ranges is not None and len(x.ranges.shape) == 2
    kv_length = None
    if x.ranges is not None:
        kv_length = x.ranges[0, masks.KV_LENGTH] if per_head else x.ranges[masks.KV_LENGTH]
    kv_seg = x.kv_segment_ids[...] if x.kv_segment_ids is not None else None

    structural = spec.q_range(k_block, block_q, block_k, num_q_blocks)
    tiles = structural
    if x.ranges is not None and not per_head:
        tiles = masks.intersect(tiles, x.ranges)

    def over_head(g, carry):
        head = kv_head * group + g
        slope = x.alibi_slopes[head] if x.alibi_slopes is not None else None
        drop_base = scorer.dropout_base(x.dropout_seed, batch, head, heads)
        mod = scorer.mod_args(x, batch, head, grad=True)

        def step(q_block, carry, masked):
            dk, dv = carry
            start = pl.multiple_of(q_block * block_q, block_q)
            tile = pl.ds(start, block_q)
            q = q_ref[tile, g, :]
            do = do_ref[tile, g, :]
            rows = start + jnp.arange(block_q, dtype=jnp.int32)[None, :]
            p, ds, chain = _tile_grad_logits(
                scorer, q, k, v, do, lse_ref[g, tile], delta_ref[g, tile], rows, cols,
                masked=masked, precision=precision, padded_rows=seq_q != spec.seq_q, transposed=True,
                bias=scoring.pair_tile(x.bias, (g,), tile, None) if x.bias is not None else None,
                slope=slope, kv_length=kv_length,
                q_seg=x.q_segment_ids[tile] if x.q_segment_ids is not None else None, kv_seg=kv_seg,
                dense=scoring.pair_tile(x.mask, (g,), tile, None) if x.mask is not None else None,
                drop_base=drop_base, mod=mod,
            )
            dv = dv + scoring.dot(p.astype(do.dtype), do, precision=precision)
            ds = scorer.logit_grad(ds, chain)
            dk = dk + scoring.dot(ds.astype(q.dtype), q, precision=precision)
            return dk, dv

        return scoring.visit_tiles(
            masks.intersect(structural, masks.RangeRow(x.ranges, g)) if per_head else tiles, step, carry,
            *((True, True) if x.ranges is not None else spec.q_boundaries(padded_seq_k)),
        )

    zeros = jnp.zeros((block_k, head_dim), jnp.float32)
    # (one zero tile serves both accumulators when the head dims agree)
    zeros_v = zeros if v_head_dim == head_dim else jnp.zeros((block_k, v_head_dim), jnp.float32)
    if group == 1:
        dk, dv = over_head(0, (zeros, zeros_v))
    else:
        dk, dv = lax.fori_loop(0, group, over_head, (zeros, zeros_v))
    # S = scale * q.k, so dK carries the scale once, at the end.
    dk_ref[...] = (dk * scorer.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, x: Extras, dq_ref, *,
               scorer: Scorer, block_k: int, heads: int, padded_rows: bool):
    block_q, head_dim = q_ref.shape
    num_k_blocks = k_ref.shape[0] // block_k
    spec = scorer.spec
    own = scoring.query_tile(scorer, x, block_q=block_q, heads=heads)  # heavy causal tiles first
    q_block, rows, kv_length, q_seg, slope, drop_base = (
        own.q_block, own.rows, own.kv_length, own.q_seg, own.slope, own.drop_base)
    precision = scoring.dot_precision(q_ref.dtype)
    mod = scorer.mod_args(x, own.batch, own.head, grad=True)
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]

    def step(k_block, dq, masked):
        start = pl.multiple_of(k_block * block_k, block_k)
        tile = pl.ds(start, block_k)
        k = k_ref[tile, :]
        v = v_ref[tile, :]
        cols = start + jnp.arange(block_k, dtype=jnp.int32)[None, :]
        _, ds, chain = _tile_grad_logits(
            scorer, q, k, v, do, lse, delta, rows, cols, masked=masked, precision=precision, padded_rows=padded_rows,
            bias=scoring.pair_tile(x.bias, (), None, tile) if x.bias is not None else None,
            slope=slope, kv_length=kv_length, q_seg=q_seg,
            kv_seg=x.kv_segment_ids[tile] if x.kv_segment_ids is not None else None,
            dense=scoring.pair_tile(x.mask, (), None, tile) if x.mask is not None else None,
            drop_base=drop_base, mod=mod,
        )
        ds = scorer.logit_grad(ds, chain)
        return dq + scoring.dot(ds.astype(k.dtype), k, precision=precision)

    tiles = spec.kv_range(q_block, block_q, block_k, num_k_blocks)
    if x.ranges is not None:
        tiles = masks.intersect(tiles, x.ranges)
    dq = scoring.visit_tiles(
        tiles, step, jnp.zeros((block_q, head_dim), jnp.float32),
        *((True, True) if x.ranges is not None else spec.kv_boundaries(k_ref.shape[0])),
    )
    dq_ref[...] = (dq * scorer.scale).astype(dq_ref.dtype)


def _dbias_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, x: Extras, dbias_ref, *,
                  scorer: Scorer, block_q: int, block_k: int, group: int):
    """dS summed over every (batch, head, tile) that one tile of the broadcast bias feeds."""
    batch, seq_q, heads, _ = q_ref.shape
    seq_k = k_ref.shape[1]
    bias_batch, bias_heads, bias_q, bias_k = x.bias.shape
    precision = scoring.dot_precision(q_ref.dtype)
    # What this program owns, and the broadcast axes it loops over.
    own_q, own_k, own_bh = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    loops = (
        batch if bias_batch == 1 else 1,
        heads if bias_heads == 1 else 1,
        seq_q // block_q if bias_q == 1 else 1,
        seq_k // block_k if bias_k == 1 else 1,
    )
    total = loops[0] * loops[1] * loops[2] * loops[3]

    def body(t, acc):
        b, rest = divmod_(t, loops[1] * loops[2] * loops[3])
        h, rest = divmod_(rest, loops[2] * loops[3])
        qi, ki = divmod_(rest, loops[3])
        b = b if bias_batch == 1 else own_bh // bias_heads
        h = h if bias_heads == 1 else own_bh % bias_heads
        qi = qi if bias_q == 1 else own_q
        ki = ki if bias_k == 1 else own_k
        q_start, k_start = _tile_start(qi, block_q), _tile_start(ki, block_k)
        q_tile, k_tile = pl.ds(q_start, block_q), pl.ds(k_start, block_k)
        rows = q_start + jnp.arange(block_q, dtype=jnp.int32)[:, None]
        cols = k_start + jnp.arange(block_k, dtype=jnp.int32)[None, :]
        kv_head = h // group
        _, ds, _ = _tile_grad_logits(
            scorer, q_ref[b, q_tile, h, :], k_ref[b, k_tile, kv_head, :], v_ref[b, k_tile, kv_head, :],
            do_ref[b, q_tile, h, :], lse_ref[b, h, q_tile], delta_ref[b, h, q_tile], rows, cols,
            masked=True, precision=precision, padded_rows=seq_q != scorer.spec.seq_q,
            bias=scoring.pair_tile(x.bias, (b, h), q_tile, k_tile),
            slope=x.alibi_slopes[h] if x.alibi_slopes is not None else None,
            kv_length=_kv_length(x.ranges, b, qi),
            q_seg=x.q_segment_ids[b, q_tile] if x.q_segment_ids is not None else None,
            kv_seg=x.kv_segment_ids[b, k_tile] if x.kv_segment_ids is not None else None,
            dense=scoring.pair_tile(x.mask, (b, h), q_tile, k_tile) if x.mask is not None else None,
            drop_base=scorer.dropout_base(x.dropout_seed, b, h, heads), mod=scorer.mod_args(x, b, h, grad=True),
        )
        if bias_q == 1:
            ds = jnp.sum(ds, axis=0, keepdims=True)
        if bias_k == 1:
            ds = jnp.sum(ds, axis=1, keepdims=True)
        return acc + ds

    shape = (1 if bias_q == 1 else block_q, 1 if bias_k == 1 else block_k)
    acc = lax.fori_loop(0, total, body, jnp.zeros(shape, jnp.float32))
    dbias_ref[...] = acc.astype(dbias_ref.dtype)


def _kv_length(ranges, b, qi):
    """The kv length of batch row `b` from whole `dynamic_ranges` (with or without a head axis)."""
    if ranges is None:
        return None
    return ranges[b, 0, qi, masks.KV_LENGTH] if len(ranges.shape) == 4 else ranges[b, qi, masks.KV_LENGTH]


def _tile_start(index, block: int):
    """index * block, marked a multiple of `block` for Triton where traced: a static index
    (`divmod_` by 1) gives a constant, which `pl.multiple_of` cannot mark on the GPU."""
    start = index * block
    return start if isinstance(start, int) else pl.multiple_of(start, block)


def divmod_(a, b: int):
    if b == 1:
        return a, 0
    return masks.int32_div(a, b), masks.int32_rem(a, b)


def _group_extra_specs(x: Extras, *, block_k: int, seq_q: int, group: int) -> Extras:
    """BlockSpecs of the optional inputs for the dK/dV grid of (key tile, batch, kv_head)."""

    def pair_spec(a):
        bm, hm, tq, tk = a.shape
        return pl.BlockSpec(
            (None, group if hm > 1 else 1, tq, block_k if tk > 1 else 1),
            lambda j, b, g: (b if bm > 1 else 0, g if hm > 1 else 0, 0, j if tk > 1 else 0),
        )

    def whole(a):
        return pl.BlockSpec(a.shape, lambda j, b, g: (0,) * a.ndim)

    def ranges_spec(a):
        if a.ndim == 4:  # per head: the group's rows
            return pl.BlockSpec((None, group, None, masks.RANGE_FIELDS), lambda j, b, g: (b, g, j, 0))
        return pl.BlockSpec((None, None, masks.RANGE_FIELDS), lambda j, b, g: (b, j, 0))

    return Extras(
        ranges=None if x.ranges is None else ranges_spec(x.ranges),
        q_segment_ids=None if x.q_segment_ids is None else pl.BlockSpec((None, seq_q), lambda j, b, g: (b, 0)),
        kv_segment_ids=None if x.kv_segment_ids is None else pl.BlockSpec((None, block_k), lambda j, b, g: (b, j)),
        mask=None if x.mask is None else pair_spec(x.mask),
        bias=None if x.bias is None else pair_spec(x.bias),
        alibi_slopes=None if x.alibi_slopes is None else whole(x.alibi_slopes),
        dropout_seed=None if x.dropout_seed is None else whole(x.dropout_seed),
        **whole_flex_specs(x, whole),
    )


def _whole_specs(arrays):
    return jax.tree.map(lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim), arrays)


def backward(q, k, v, do, lse2, delta, x_dkv: Extras, x_dq: Extras, *, scorer: Scorer,
             dkv_config: KernelConfig, dq_config: KernelConfig, interpret: bool = False):
    """Runs the dK/dV and dQ kernels on tile-aligned inputs.

    Args:
      q: [B, Tq, H, D], do: [B, Tq, H, Dv]; k: [B, Tk, Hkv, D], v: [B, Tk, Hkv, Dv]
        (lengths multiples of the tiles).
      lse2: [B, H, Tq] base-2 logsumexp from the forward, with +inf for empty rows
        (so that P = exp2(S - lse2) is 0 there).
      delta: [B, H, Tq] float32, rowsum(dO * O) minus the logsumexp's cotangent.
      x_dkv, x_dq: optional inputs, with ranges by key tile and by query tile.

    Returns:
      dq [B, Tq, H, D], dk [B, Tk, Hkv, D] and dv [B, Tk, Hkv, Dv], in the inputs' dtypes.
    """
    batch, seq_q, heads, head_dim = q.shape
    seq_k, kv_heads, v_head_dim = k.shape[1], k.shape[2], v.shape[3]
    group = heads // kv_heads

    # ---- dK, dV: grid over key tiles; each program owns all heads of its group.
    bq, bk = dkv_config.block_q, dkv_config.block_k
    group_rows = pl.BlockSpec((None, seq_q, group, head_dim), lambda j, b, g: (b, 0, g, 0))
    group_do = pl.BlockSpec((None, seq_q, group, v_head_dim), lambda j, b, g: (b, 0, g, 0))
    group_stats = pl.BlockSpec((None, group, seq_q), lambda j, b, g: (b, g, 0))
    k_tile = pl.BlockSpec((None, bk, None, head_dim), lambda j, b, g: (b, j, g, 0))
    v_tile = pl.BlockSpec((None, bk, None, v_head_dim), lambda j, b, g: (b, j, g, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, scorer=scorer, block_q=bq, padded_seq_k=seq_k, heads=heads),
        grid=(seq_k // bk, batch, kv_heads),
        in_specs=[group_rows, k_tile, v_tile, group_do, group_stats, group_stats,
                  _group_extra_specs(x_dkv, block_k=bk, seq_q=seq_q, group=group)],
        out_specs=[k_tile, v_tile],
        out_shape=out_types([k, v], q, k, v, do, lse2, delta, x_dkv),
        compiler_params=plgpu.CompilerParams(num_warps=dkv_config.num_warps, num_stages=dkv_config.num_stages),
        interpret=interpret,
        name="flashjax_bwd_dkv",
    )(q, k, v, do, lse2, delta, x_dkv)

    # ---- dQ: grid over query tiles, like the forward.
    bq, bk = dq_config.block_q, dq_config.block_k
    num_q_blocks = seq_q // bq
    q_tile = pl.BlockSpec((None, bq, None, head_dim), lambda i, b, h: (b, num_q_blocks - 1 - i, h, 0))
    do_tile = pl.BlockSpec((None, bq, None, v_head_dim), lambda i, b, h: (b, num_q_blocks - 1 - i, h, 0))
    kv_whole = pl.BlockSpec((None, seq_k, None, head_dim), lambda i, b, h: (b, 0, h // group, 0))
    v_whole = pl.BlockSpec((None, seq_k, None, v_head_dim), lambda i, b, h: (b, 0, h // group, 0))
    stats_tile = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, num_q_blocks - 1 - i))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, scorer=scorer, block_k=bk, heads=heads, padded_rows=seq_q != scorer.spec.seq_q),
        grid=(num_q_blocks, batch, heads),
        in_specs=[q_tile, kv_whole, v_whole, do_tile, stats_tile, stats_tile,
                  extra_specs(x_dq, block_q=bq, seq_k=seq_k, num_q_blocks=num_q_blocks)],
        out_specs=q_tile,
        out_shape=out_types(jax.ShapeDtypeStruct(q.shape, q.dtype), q, k, v, do, lse2, delta, x_dq),
        compiler_params=plgpu.CompilerParams(num_warps=dq_config.num_warps, num_stages=dq_config.num_stages),
        interpret=interpret,
        name="flashjax_bwd_dq",
    )(q, k, v, do, lse2, delta, x_dq)
    return dq, dk, dv


def bias_grad(q, k, v, do, lse2, delta, x_dq: Extras, *, scorer: Scorer, config: KernelConfig,
              interpret: bool = False):
    """dBias [Bb, Hb, Tqb, Tkb] (float32) for a bias broadcast along its size-1 axes.

    A separate kernel so that XLA drops it when the bias gradient is not used; it
    recomputes dS for every tile (boundary-masked), so it costs about a forward.
    """
    bias_batch, bias_heads, bias_q, bias_k = x_dq.bias.shape
    loops = ((bias_batch == 1 and q.shape[0] > 1) or (bias_heads == 1 and q.shape[2] > 1)
             or bias_q == 1 or bias_k == 1)
    if loops:
        # A program loops over the bias's broadcast axes, and Triton pipelines that loop:
        # each stage holds Q and dO tiles as well as K, V and the bias/mask tiles.
        itemsize = jnp.dtype(q.dtype).itemsize
        pair_bytes = sum(jnp.dtype(a.dtype).itemsize for a in (x_dq.bias, x_dq.mask) if a is not None)
        config = config.fit_shared_memory((k.shape[3] + v.shape[3]) * itemsize, pair_bytes,
                                          streamed_bytes_per_query=(q.shape[3] + do.shape[3]) * itemsize)
    bq, bk = config.block_q, config.block_k
    group = q.shape[2] // k.shape[2]
    grid = (
        bias_q // bq if bias_q > 1 else 1,
        bias_k // bk if bias_k > 1 else 1,
        bias_batch * bias_heads,
    )
    out_block = (None, None, bq if bias_q > 1 else 1, bk if bias_k > 1 else 1)

    def out_index(i, j, bh):
        return (bh // bias_heads, bh % bias_heads, i, j)

    return pl.pallas_call(
        functools.partial(_dbias_kernel, scorer=scorer, block_q=bq, block_k=bk, group=group),
        grid=grid,
        in_specs=_whole_specs([q, k, v, do, lse2, delta, x_dq]),
        out_specs=pl.BlockSpec(out_block, out_index),
        out_shape=out_types(jax.ShapeDtypeStruct(x_dq.bias.shape, jnp.float32), q, k, v, do, lse2, delta, x_dq),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="flashjax_bwd_dbias",
    )(q, k, v, do, lse2, delta, x_dq)

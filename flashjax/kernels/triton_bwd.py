"""Backward kernels (Pallas, lowered through Triton): recompute P, never store it.

Two kernels, both deterministic (no atomics):

* dK/dV: one program per (key tile, batch, kv_head). It keeps its K, V tile and
  the dK, dV accumulators on chip and walks every query tile of every query head
  in its group, recomputing `P = exp2(S - lse)`; the sum over the group happens
  in registers, so GQA never materialises repeated K/V or per-head dK/dV.
* dQ: one program per (query tile, batch, head), walking key tiles like the forward.

Both take `delta = rowsum(dO * O) - dlse` (float32), computed beforehand; the
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

from flashjax.config import KernelConfig
from flashjax.kernels import common
from flashjax.masks import MaskSpec


def _tile_probs(q, k, lse, rows, cols, *, spec, qk_scale, masked, precision):
    """P for a tile, recomputed from the saved base-2 logsumexp."""
    s = common.dot(q, k, trans_b=True, precision=precision) * qk_scale
    if masked:
        s = jnp.where(spec.allowed(rows, cols), s, -jnp.inf)
    return jnp.exp2(s - lse[:, None])


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *,
                spec: MaskSpec, scale: float, block_q: int, padded_seq_k: int):
    block_k, head_dim = k_ref.shape
    seq_q, group = q_ref.shape[0], q_ref.shape[1]
    num_q_blocks = seq_q // block_q
    k_block = pl.program_id(0)
    precision = common.dot_precision(q_ref.dtype)
    qk_scale = scale * common.LOG2E

    k = k_ref[...]
    v = v_ref[...]
    cols = k_block * block_k + jnp.arange(block_k, dtype=jnp.int32)[None, :]

    def step(q_block, carry, masked, head):
        dk, dv = carry
        start = pl.multiple_of(q_block * block_q, block_q)
        q = q_ref[pl.ds(start, block_q), head, :]
        do = do_ref[pl.ds(start, block_q), head, :]
        lse = lse_ref[head, pl.ds(start, block_q)]
        delta = delta_ref[head, pl.ds(start, block_q)]
        rows = start + jnp.arange(block_q, dtype=jnp.int32)[:, None]
        p = _tile_probs(q, k, lse, rows, cols, spec=spec, qk_scale=qk_scale, masked=masked, precision=precision)
        dv = dv + common.dot(p.astype(do.dtype), do, trans_a=True, precision=precision)
        dp = common.dot(do, v, trans_b=True, precision=precision)
        ds = p * (dp - delta[:, None])
        dk = dk + common.dot(ds.astype(q.dtype), q, trans_a=True, precision=precision)
        return dk, dv

    tiles = spec.q_range(k_block, block_q, block_k, num_q_blocks)

    def over_head(head, carry):
        return common.visit_tiles(
            tiles, functools.partial(step, head=head), carry,
            lower_boundary=spec.right is not None,
            upper_boundary=spec.left is not None or spec.seq_k != padded_seq_k,
        )

    zeros = jnp.zeros((block_k, head_dim), jnp.float32)
    if group == 1:
        dk, dv = over_head(0, (zeros, zeros))
    else:
        dk, dv = lax.fori_loop(0, group, over_head, (zeros, zeros))
    # S = scale * q.k, so dK carries the scale once, at the end.
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *,
               spec: MaskSpec, scale: float, block_k: int):
    block_q, head_dim = q_ref.shape
    num_k_blocks = k_ref.shape[0] // block_k
    q_block = pl.num_programs(0) - 1 - pl.program_id(0)  # heavy causal tiles first
    precision = common.dot_precision(q_ref.dtype)
    qk_scale = scale * common.LOG2E

    q = q_ref[...]
    do = do_ref[...]
    lse = lse_ref[...]
    delta = delta_ref[...]
    rows = q_block * block_q + jnp.arange(block_q, dtype=jnp.int32)[:, None]

    def step(k_block, dq, masked):
        start = pl.multiple_of(k_block * block_k, block_k)
        k = k_ref[pl.ds(start, block_k), :]
        v = v_ref[pl.ds(start, block_k), :]
        cols = start + jnp.arange(block_k, dtype=jnp.int32)[None, :]
        p = _tile_probs(q, k, lse, rows, cols, spec=spec, qk_scale=qk_scale, masked=masked, precision=precision)
        dp = common.dot(do, v, trans_b=True, precision=precision)
        ds = p * (dp - delta[:, None])
        return dq + common.dot(ds.astype(k.dtype), k, precision=precision)

    tiles = spec.kv_range(q_block, block_q, block_k, num_k_blocks)
    dq = common.visit_tiles(
        tiles, step, jnp.zeros((block_q, head_dim), jnp.float32),
        lower_boundary=spec.left is not None,
        upper_boundary=spec.right is not None or spec.seq_k != k_ref.shape[0],
    )
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def backward(q, k, v, do, lse2, delta, *, spec: MaskSpec, scale: float,
             dkv_config: KernelConfig, dq_config: KernelConfig, interpret: bool = False):
    """Runs the dK/dV and dQ kernels on tile-aligned inputs.

    Args:
      q, do: [B, Tq, H, D]; k, v: [B, Tk, Hkv, D] (lengths multiples of the tiles).
      lse2: [B, H, Tq] base-2 logsumexp from the forward, with +inf for empty rows
        (so that P = exp2(S - lse2) is 0 there).
      delta: [B, H, Tq] float32, rowsum(dO * O) minus the logsumexp's cotangent.

    Returns:
      dq [B, Tq, H, D], dk and dv [B, Tk, Hkv, D], in the inputs' dtypes.
    """
    batch, seq_q, heads, head_dim = q.shape
    seq_k, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads

    # ---- dK, dV: grid over key tiles; each program owns all heads of its group.
    bq, bk = dkv_config.block_q, dkv_config.block_k
    group_rows = pl.BlockSpec((None, seq_q, group, head_dim), lambda j, b, g: (b, 0, g, 0))
    group_stats = pl.BlockSpec((None, group, seq_q), lambda j, b, g: (b, g, 0))
    k_tile = pl.BlockSpec((None, bk, None, head_dim), lambda j, b, g: (b, j, g, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, spec=spec, scale=scale, block_q=bq, padded_seq_k=seq_k),
        grid=(seq_k // bk, batch, kv_heads),
        in_specs=[group_rows, k_tile, k_tile, group_rows, group_stats, group_stats],
        out_specs=[k_tile, k_tile],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=plgpu.CompilerParams(num_warps=dkv_config.num_warps, num_stages=dkv_config.num_stages),
        interpret=interpret,
        name="flashjax_bwd_dkv",
    )(q, k, v, do, lse2, delta)

    # ---- dQ: grid over query tiles, like the forward.
    bq, bk = dq_config.block_q, dq_config.block_k
    num_q_blocks = seq_q // bq
    q_tile = pl.BlockSpec((None, bq, None, head_dim), lambda i, b, h: (b, num_q_blocks - 1 - i, h, 0))
    kv_whole = pl.BlockSpec((None, seq_k, None, head_dim), lambda i, b, h: (b, 0, h // group, 0))
    stats_tile = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, num_q_blocks - 1 - i))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, spec=spec, scale=scale, block_k=bk),
        grid=(num_q_blocks, batch, heads),
        in_specs=[q_tile, kv_whole, kv_whole, q_tile, stats_tile, stats_tile],
        out_specs=q_tile,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=dq_config.num_warps, num_stages=dq_config.num_stages),
        interpret=interpret,
        name="flashjax_bwd_dq",
    )(q, k, v, do, lse2, delta)
    return dq, dk, dv

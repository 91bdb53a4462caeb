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

from flashjax.config import KernelConfig
from flashjax.kernels import common
from flashjax.masks import MaskSpec


def _forward_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, spec: MaskSpec, scale: float, block_k: int):
    block_q, head_dim = q_ref.shape
    num_k_blocks = k_ref.shape[0] // block_k
    # Tiles run in reverse order: under a causal mask the last query tiles do the
    # most work, and starting them first balances the tail of the grid.
    q_block = pl.num_programs(0) - 1 - pl.program_id(0)
    precision = common.dot_precision(q_ref.dtype)
    qk_scale = scale * common.LOG2E

    q = q_ref[...]
    rows = q_block * block_q + jnp.arange(block_q, dtype=jnp.int32)[:, None]

    def step(k_block, carry, masked):
        acc, m, l = carry
        start = pl.multiple_of(k_block * block_k, block_k)
        k = k_ref[pl.ds(start, block_k), :]
        v = v_ref[pl.ds(start, block_k), :]
        s = common.dot(q, k, trans_b=True, precision=precision) * qk_scale
        if masked:
            cols = start + jnp.arange(block_k, dtype=jnp.int32)[None, :]
            s = jnp.where(spec.allowed(rows, cols), s, -jnp.inf)
        return common.online_softmax_step(acc, m, l, s, v, masked=masked, precision=precision)

    carry = (
        jnp.zeros((block_q, head_dim), jnp.float32),
        jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    tiles = spec.kv_range(q_block, block_q, block_k, num_k_blocks)
    acc, m, l = common.visit_tiles(
        tiles, step, carry,
        lower_boundary=spec.left is not None,
        upper_boundary=spec.right is not None or spec.seq_k != k_ref.shape[0],
    )
    # Rows that met no key (l = 0) output 0 and report lse = -inf.
    empty = l == 0.0
    inv_l = 1.0 / jnp.where(empty, 1.0, l)
    o_ref[...] = (acc * inv_l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, -jnp.inf, m + jnp.log2(jnp.where(empty, 1.0, l)))


def forward(q, k, v, *, spec: MaskSpec, scale: float, config: KernelConfig, interpret: bool = False):
    """Runs the forward kernel on tile-aligned inputs.

    Args:
      q: [B, Tq, H, D] with Tq a multiple of config.block_q and D a power of two.
      k, v: [B, Tk, Hkv, D] with Tk a multiple of config.block_k.
      spec: the structural mask, in true (unpadded) lengths.

    Returns:
      o [B, Tq, H, D] in q's dtype and lse2 [B, H, Tq] (float32, base 2).
    """
    batch, seq_q, heads, head_dim = q.shape
    seq_k, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    block_q, block_k = config.block_q, config.block_k
    num_q_blocks = seq_q // block_q

    def q_tile(i, b, h):
        return (b, num_q_blocks - 1 - i, h, 0)

    def kv_whole(i, b, h):
        return (b, 0, h // group, 0)

    kernel = functools.partial(_forward_kernel, spec=spec, scale=scale, block_k=block_k)
    return pl.pallas_call(
        kernel,
        grid=(num_q_blocks, batch, heads),
        in_specs=[
            pl.BlockSpec((None, block_q, None, head_dim), q_tile),
            pl.BlockSpec((None, seq_k, None, head_dim), kv_whole),
            pl.BlockSpec((None, seq_k, None, head_dim), kv_whole),
        ],
        out_specs=[
            pl.BlockSpec((None, block_q, None, head_dim), q_tile),
            pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, num_q_blocks - 1 - i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((batch, heads, seq_q), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="flashjax_fwd",
    )(q, k, v)

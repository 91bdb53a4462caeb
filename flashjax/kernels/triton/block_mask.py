"""The block-mask builder as a Triton kernel: `flex.classify` on a GPU (unless
`flex.KERNEL_BUILDER` is False).

One program per (batch x head, query tile, chunk of key tiles) evaluates the traced
mask_mod on each of its tiles with the attention kernels' own evaluation
(`flex.Mod.at`, the closed-over arrays read through refs) and writes one int8 class
per tile: EMPTY, PARTIAL or FULL. Nothing of [q_len, kv_len] is stored; the XLA
builder (`flex.classify`'s map over tile rows) stages every pair's result through
memory, which made a 32k block mask cost about 0.6 of a causal forward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flashjax import flex
from flashjax.vma import out_types

# Key tiles per program: enough work per program to hide its launch, few enough that a
# short row still spreads over the GPU.
TILES_PER_PROGRAM = 8
# A tile is evaluated in strips of SUB_ROWS query rows: on an H100 a 32k build took 2.0-2.3 ms
# in strips of 16-64 rows at 4 or 8 warps, 2.3-3.6 ms a whole 128-row tile at a time
# (a whole tile of int32 values is 128 registers per thread at 4 warps).
SUB_ROWS = 32
NUM_WARPS = 4


def _classify_kernel(*refs, mod, n_heads: int, q_len: int, kv_len: int, block_q: int, block_k: int, tiles: int,
                     sub_rows: int):
    *const_refs, out_ref = refs
    bh, qi, chunk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    batch, head = bh // n_heads, bh % n_heads
    program = mod.at(const_refs, batch, head, lowering="triton")

    def one_tile(t, codes):
        # Rows [sub_rows, 1] and columns [1, bk]: mask_mod's values of one side alone (a
        # row's document id read from a closed-over array) load once per row or column
        # (`flex.TileProgram.tile`), not once per pair.
        cols = (chunk * tiles + t) * block_k + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        col_valid = cols < kv_len

        def strip(r, found):
            seen, missed = found
            rows = qi * block_q + r * sub_rows + lax.broadcasted_iota(jnp.int32, (sub_rows, 1), 0)
            valid = (rows < q_len) & col_valid
            attend = program.tile(rows, cols)
            # Reductions over int32: Triton has no boolean any/all.
            seen = jnp.maximum(seen, jnp.max(jnp.where(attend & valid, 1, 0)))
            missed = jnp.maximum(missed, jnp.max(jnp.where(attend | ~valid, 0, 1)))
            return seen, missed

        seen, missed = lax.fori_loop(0, block_q // sub_rows, strip, (jnp.int32(0), jnp.int32(0)))
        code = flex.tile_class(seen > 0, missed == 0)
        return jnp.where(lax.broadcasted_iota(jnp.int32, (tiles,), 0) == t, code, codes)

    codes = lax.fori_loop(0, tiles, one_tile, jnp.zeros((tiles,), jnp.int32))
    out_ref[...] = codes.astype(jnp.int8)


def classify(mod: flex.Mod, consts, n_batch: int, n_heads: int, q_len: int, kv_len: int, block_q: int,
             block_k: int, *, interpret: bool = False):
    """The int8 [n_batch, n_heads, n_q, n_k] classes of `flex.BlockMask.blocks` (n_batch and
    n_heads are 1 for a mask_mod that does not read that axis)."""
    n_q, n_k = -(-q_len // block_q), -(-kv_len // block_k)
    tiles = min(TILES_PER_PROGRAM, pl.next_power_of_2(n_k))
    n_chunks = -(-n_k // tiles)
    operands = flex.kernel_operands(consts)
    kernel = functools.partial(_classify_kernel, mod=mod, n_heads=n_heads, q_len=q_len, kv_len=kv_len,
                               block_q=block_q, block_k=block_k, tiles=tiles, sub_rows=min(SUB_ROWS, block_q))
    whole = lambda a: pl.BlockSpec(a.shape, lambda bh, qi, c: (0,) * a.ndim)
    codes = pl.pallas_call(
        kernel,
        grid=(n_batch * n_heads, n_q, n_chunks),
        in_specs=[whole(a) for a in operands],
        out_specs=pl.BlockSpec((None, None, tiles), lambda bh, qi, c: (bh, qi, c)),
        out_shape=out_types(jax.ShapeDtypeStruct((n_batch * n_heads, n_q, n_chunks * tiles), jnp.int8), operands),
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS),
        interpret=interpret,
        name="flashjax_block_mask",
    )(*operands)
    return codes[:, :, :n_k].reshape(n_batch, n_heads, n_q, n_k)

"""Which (query, key) pairs attend, elementwise and block by block.

A `MaskSpec` is the static part of the mask (sequence lengths, causal, sliding
window); it is hashable so kernels specialise on it. It answers two questions
the kernels ask:

* `allowed(rows, cols)`: the elementwise mask of a tile (True = attend);
* `kv_range(q_block)` / `q_range(k_block)`: which tiles of the other operand a
  tile meets at all, split into the tiles that are entirely visible (computed
  without any mask) and those on a boundary (computed with `allowed`). Tiles
  outside the range are never loaded: that is what makes causal attention cost
  half of full attention, and a sliding window cost linear in the length.

Causal and windowed masks are aligned to the bottom right when the query and
key lengths differ (FlashAttention-2's convention): query `i` sits at key
position `i + seq_k - seq_q`, so the last query sees every key and a decode
step against a KV cache sees the whole cache.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax

__all__ = ["MaskSpec", "BlockRange"]


class BlockRange(NamedTuple):
    """Tiles [lo, hi) are visited; [full_lo, full_hi) of them need no mask."""

    lo: jnp.ndarray
    full_lo: jnp.ndarray
    full_hi: jnp.ndarray
    hi: jnp.ndarray


def _cdiv_nonneg(x, d: int):
    # lax.div truncates toward zero; callers clamp x >= 0 first so this is a ceiling.
    return lax.div(x + (d - 1), d)


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """Static description of the structural mask.

    Attributes:
      seq_q: the true (unpadded) number of queries.
      seq_k: the true number of keys; keys at or past it are padding.
      causal: query i attends keys j <= i + seq_k - seq_q.
      window_left: if not None, query i attends keys j >= i + offset - window_left.
      window_right: if not None, query i attends keys j <= i + offset + window_right.
    """

    seq_q: int
    seq_k: int
    causal: bool = False
    window_left: int | None = None
    window_right: int | None = None

    @property
    def offset(self) -> int:
        """Key position of query 0 (bottom-right alignment)."""
        return self.seq_k - self.seq_q

    @property
    def right(self) -> int | None:
        """The effective right bound: causal is a window with right = 0."""
        if self.causal:
            return 0 if self.window_right is None else min(self.window_right, 0)
        return self.window_right

    @property
    def left(self) -> int | None:
        return self.window_left

    # ---- elementwise ---------------------------------------------------------------
    def allowed(self, rows, cols, kv_length=None):
        """Elementwise mask of a tile: rows [bq, 1] and cols [1, bk] int32 positions."""
        mask = cols < (self.seq_k if kv_length is None else kv_length)
        shifted = rows + self.offset
        if self.right is not None:
            mask = mask & (cols <= shifted + self.right)
        if self.left is not None:
            mask = mask & (cols >= shifted - self.left)
        return mask

    # ---- block ranges --------------------------------------------------------------
    def kv_range(self, q_block, block_q: int, block_k: int, num_k_blocks: int, kv_length=None) -> BlockRange:
        """Key tiles met by query tile `q_block` (forward and dQ kernels)."""
        length = self.seq_k if kv_length is None else kv_length
        first_row = q_block * block_q + self.offset
        last_row = first_row + block_q - 1
        hi = _cdiv_nonneg(jnp.minimum(length, num_k_blocks * block_k), block_k)
        full_hi = lax.div(length, block_k)  # a tile holding padding keys needs the mask
        lo = jnp.int32(0)
        full_lo = jnp.int32(0)
        if self.right is not None:
            hi = jnp.minimum(hi, _cdiv_nonneg(jnp.maximum(last_row + self.right + 1, 0), block_k))
            full_hi = jnp.minimum(full_hi, lax.div(jnp.maximum(first_row + self.right + 1, 0), block_k))
        if self.left is not None:
            lo = lax.div(jnp.maximum(first_row - self.left, 0), block_k)
            full_lo = _cdiv_nonneg(jnp.maximum(last_row - self.left, 0), block_k)
        return _ordered(lo, full_lo, full_hi, hi)

    def q_range(self, k_block, block_q: int, block_k: int, num_q_blocks: int, kv_length=None) -> BlockRange:
        """Query tiles met by key tile `k_block` (dK/dV kernel)."""
        length = self.seq_k if kv_length is None else kv_length
        first_col = k_block * block_k - self.offset
        last_col = first_col + block_k - 1
        lo = jnp.int32(0)
        full_lo = jnp.int32(0)
        hi = jnp.int32(num_q_blocks)
        full_hi = jnp.int32(num_q_blocks)
        if self.right is not None:
            # Rows i with i + right >= col for some col of the tile.
            lo = lax.div(jnp.maximum(first_col - self.right, 0), block_q)
            full_lo = _cdiv_nonneg(jnp.maximum(last_col - self.right, 0), block_q)
        if self.left is not None:
            hi = jnp.minimum(hi, _cdiv_nonneg(jnp.maximum(last_col + self.left + 1, 0), block_q))
            full_hi = jnp.minimum(full_hi, lax.div(jnp.maximum(first_col + self.left + 1, 0), block_q))
        # A key tile that reaches past the keys' length is a boundary tile for every row;
        # one that starts past it is met by no row at all.
        has_padding = (k_block + 1) * block_k > length
        full_hi = jnp.where(has_padding, full_lo, full_hi)
        hi = jnp.where(k_block * block_k >= length, lo, hi)
        return _ordered(lo, full_lo, full_hi, hi)


def _ordered(lo, full_lo, full_hi, hi) -> BlockRange:
    """Clamps so that lo <= full_lo <= full_hi <= hi."""
    lo = jnp.minimum(lo, hi)
    full_lo = jnp.clip(full_lo, lo, hi)
    full_hi = jnp.clip(full_hi, full_lo, hi)
    return BlockRange(lo, full_lo, full_hi, hi)

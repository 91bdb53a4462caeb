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


# Bias values at or below this mask their key, as -inf does. Flax masks with a bias of
# finfo.min; kept finite, such a logit would overflow to -inf in the kernels' base-2
# logits (x log2(e) > 1) or swamp the row's logsumexp, so every backend reads it as a
# mask: a row of them outputs 0 with lse -inf and zero gradients.
MASKING_BIAS = -float(jnp.finfo(jnp.float32).max) / 2


def bias_logits(bias):
    """`bias` with the values at or below MASKING_BIAS replaced by -inf."""
    return jnp.where(bias <= MASKING_BIAS, -jnp.inf, bias)


class BlockRange(NamedTuple):
    """Tiles [lo, hi) are visited; [full_lo, full_hi) of them need no mask."""

    lo: jnp.ndarray
    full_lo: jnp.ndarray
    full_hi: jnp.ndarray
    hi: jnp.ndarray


def int32_div(x, d):
    """lax.div (truncating: a floor for x >= 0) of int32 index values, also under
    ``jax_enable_x64``, where a Python int becomes int64 and lax.div will not mix the two."""
    return lax.div(jnp.asarray(x, jnp.int32), jnp.asarray(d, jnp.int32))


def int32_rem(x, d):
    """lax.rem of int32 index values (see `int32_div`)."""
    return lax.rem(jnp.asarray(x, jnp.int32), jnp.asarray(d, jnp.int32))


def _cdiv_nonneg(x, d: int):
    # lax.div truncates toward zero; callers clamp x >= 0 first so this is a ceiling.
    return int32_div(jnp.asarray(x, jnp.int32) + (d - 1), d)


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
    def key_bounds(self, rows, kv_length=None):
        """The keys query positions `rows` attend: (first, last), int32 like rows (last a
        scalar without a right bound), first None without a left window; a row attends key
        j iff first <= j <= last. `rows` is read only with a window bound (causal
        included). A kernel computes the bounds once per row and compares each score's
        key position against them (two comparisons a score at most)."""
        last = (self.seq_k if kv_length is None else kv_length) - 1
        if self.right is not None:
            last = jnp.minimum(last, rows + (self.offset + self.right))
        first = None if self.left is None else rows + (self.offset - self.left)
        return first, last

    def allowed(self, rows, cols, kv_length=None):
        """Elementwise mask of a tile: rows [bq, 1] and cols [1, bk] int32 positions."""
        first, last = self.key_bounds(rows, kv_length)
        mask = cols <= last
        return mask if first is None else mask & (cols >= first)

    # ---- block ranges --------------------------------------------------------------
    def kv_boundaries(self, padded_seq_k: int) -> tuple[bool, bool]:
        """Whether `kv_range`'s lower and upper boundary parts can hold tiles at all (static):
        below the band (a left window), and above it (causal or a right window, or keys
        padded past seq_k). A kernel emits no loop for a part that cannot."""
        return self.left is not None, self.right is not None or self.seq_k != padded_seq_k

    def q_boundaries(self, padded_seq_k: int) -> tuple[bool, bool]:
        """The same for `q_range`: its lower part (causal or a right window) and its upper
        part (a left window, or a key tile holding padding)."""
        return self.right is not None, self.left is not None or self.seq_k != padded_seq_k

    def kv_range(self, q_block, block_q: int, block_k: int, num_k_blocks: int) -> BlockRange:
        """Key tiles met by query tile `q_block` (forward and dQ kernels)."""
        first_row = q_block * block_q + self.offset
        return self.kv_range_at(first_row, first_row + block_q - 1, self.seq_k, block_k, num_k_blocks)

    def kv_range_at(self, first_row, last_row, length, block_k: int, num_k_blocks: int) -> BlockRange:
        """Key tiles met by queries at key positions [first_row, last_row] among `length` keys.

        `kv_range` with the positions given rather than derived from the static offset:
        the decode kernel aligns each sequence to its own (dynamic) length, so its rows
        sit at positions ``length - q_len + i`` and `length` may be traced (>= 0).
        """
        hi = _cdiv_nonneg(jnp.minimum(length, num_k_blocks * block_k), block_k)
        full_hi = int32_div(length, block_k)  # a tile holding padding keys needs the mask
        lo = jnp.int32(0)
        full_lo = jnp.int32(0)
        if self.right is not None:
            hi = jnp.minimum(hi, _cdiv_nonneg(jnp.maximum(last_row + self.right + 1, 0), block_k))
            full_hi = jnp.minimum(full_hi, int32_div(jnp.maximum(first_row + self.right + 1, 0), block_k))
        if self.left is not None:
            lo = int32_div(jnp.maximum(first_row - self.left, 0), block_k)
            full_lo = _cdiv_nonneg(jnp.maximum(last_row - self.left, 0), block_k)
        return _ordered(lo, full_lo, full_hi, hi)

    def q_range(self, k_block, block_q: int, block_k: int, num_q_blocks: int) -> BlockRange:
        """Query tiles met by key tile `k_block` (dK/dV kernel)."""
        length = self.seq_k
        first_col = k_block * block_k - self.offset
        last_col = first_col + block_k - 1
        lo = jnp.int32(0)
        full_lo = jnp.int32(0)
        hi = jnp.int32(num_q_blocks)
        full_hi = jnp.int32(num_q_blocks)
        if self.right is not None:
            # Rows i with i + right >= col for some col of the tile.
            lo = int32_div(jnp.maximum(first_col - self.right, 0), block_q)
            full_lo = _cdiv_nonneg(jnp.maximum(last_col - self.right, 0), block_q)
        if self.left is not None:
            hi = jnp.minimum(hi, _cdiv_nonneg(jnp.maximum(last_col + self.left + 1, 0), block_q))
            full_hi = jnp.minimum(full_hi, int32_div(jnp.maximum(first_col + self.left + 1, 0), block_q))
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


# ---- data-dependent ranges (lengths, segments), computed once per call in XLA ----------
# The fields of a row of `dynamic_ranges`, by index: the tile range as in BlockRange,
# then the batch row's q and kv lengths.
LO, FULL_LO, FULL_HI, HI, Q_LENGTH, KV_LENGTH = range(6)
# A row is padded to 8 int32: the Triton kernels read it as one block, and Triton
# block shapes are powers of two.
RANGE_FIELDS = 8


def _block_extent(ids, block: int):
    """Per-block min and max of segment ids [B, T] (T a multiple of block) -> [B, T // block] x 2."""
    tiles = ids.reshape(ids.shape[0], -1, block)
    return tiles.min(axis=2), tiles.max(axis=2)


def _hull(flags, n: int):
    """First and one-past-last True along the last axis (n, 0 when none)."""
    idx = jnp.arange(flags.shape[-1], dtype=jnp.int32)
    first = jnp.min(jnp.where(flags, idx, n), axis=-1)
    last = jnp.max(jnp.where(flags, idx + 1, 0), axis=-1)
    return first, last


def dynamic_ranges(
    *,
    batch: int,
    seq_q: int,
    seq_k: int,
    block_q: int,
    block_k: int,
    padded_q: int,
    padded_k: int,
    q_lengths=None,
    kv_lengths=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    dense_mask: bool = False,
    by_key_block: bool = False,
    blocks=None,
):
    """Tile ranges implied by lengths, segment ids and a block mask, as int32 [B, n_blocks, RANGE_FIELDS]
    (or [B, H, n_blocks, RANGE_FIELDS] when the block mask differs per head).

    For each query tile (or, with `by_key_block`, each key tile) gives the range
    [lo, hi) of tiles of the other operand that can hold a visible pair, and
    [full_lo, full_hi) of those that are visible everywhere (as far as lengths and
    segments go; the kernel intersects this with the causal/window ranges). With
    packed documents (sorted segment ids) a tile meets only its own document's tiles,
    so a row of four documents costs about a quarter of the full row. Segment ids
    need not be sorted: the range is then the hull of the tiles that may match.

    Also carries each row's q and kv lengths (fields Q_LENGTH, KV_LENGTH) for the
    kernels' elementwise masks.
    Segment ids must already be padded to `padded_q` / `padded_k` (by repeating the
    last id, which keeps the extents tight). `blocks`, a pair (meets, full) of bool
    [B or 1, H or 1, nq, nk] at this tiling (`flex.tile_flags`), narrows the ranges to the
    tiles a mask_mod leaves non-empty, and the unmasked part to those it leaves full.
    """
    nq, nk = padded_q // block_q, padded_k // block_k
    q_len = jnp.full((batch,), seq_q, jnp.int32) if q_lengths is None else jnp.minimum(q_lengths.astype(jnp.int32), seq_q)
    kv_len = jnp.full((batch,), seq_k, jnp.int32) if kv_lengths is None else jnp.minimum(kv_lengths.astype(jnp.int32), seq_k)
    q_tile = jnp.arange(nq, dtype=jnp.int32)[None, :]  # [1, nq]
    k_tile = jnp.arange(nk, dtype=jnp.int32)[None, :]
    q_visible_rows = (q_tile * block_q < q_len[:, None])  # tile holds a real query row
    k_tiles_in = -(-kv_len // block_k)  # [B]
    k_full_tiles = kv_len // block_k
    if q_segment_ids is not None:
        q_min, q_max = _block_extent(q_segment_ids, block_q)
        k_min, k_max = _block_extent(kv_segment_ids, block_k)
        # [B, nq, nk]: block-level, never element-level (T / block per side).
        meets = (k_max[:, None, :] >= q_min[:, :, None]) & (k_min[:, None, :] <= q_max[:, :, None])
        same = (q_min == q_max)[:, :, None] & (k_min == k_max)[:, None, :] & (k_min[:, None, :] == q_min[:, :, None])
    else:
        meets = jnp.ones((batch, nq, nk), bool)
        same = meets
    # Lengths: tiles wholly past a length meet nothing; a tile straddling it is a boundary tile.
    meets = meets & q_visible_rows[:, :, None] & (k_tile[:, None, :] < k_tiles_in[:, None, None])
    same = same & (k_tile[:, None, :] < k_full_tiles[:, None, None])
    if dense_mask:
        same = jnp.zeros_like(same)
    if blocks is not None:
        block_meets, block_full = blocks
        if block_meets.shape[1] == 1:  # one mask for every head: ranges stay [B, n, ...]
            block_meets, block_full = block_meets[:, 0], block_full[:, 0]
        else:
            meets, same = meets[:, None], same[:, None]
        meets, same = meets & block_meets, same & block_full
    if by_key_block:
        meets, same = jnp.swapaxes(meets, -2, -1), jnp.swapaxes(same, -2, -1)
    n_other = meets.shape[-1]
    lo, hi = _hull(meets, n_other)
    full_lo, full_hi = _hull(same & meets, n_other)
    # The fully visible tiles must be contiguous to be looped over without a mask.
    contiguous = jnp.sum(same & meets, axis=-1) == (full_hi - full_lo)
    full_hi = jnp.where(contiguous & (full_hi > full_lo), full_hi, full_lo)
    empty = hi <= lo
    lo = jnp.where(empty, 0, lo)
    hi = jnp.where(empty, 0, hi)
    lengths = jnp.stack([q_len, kv_len], -1).reshape((batch,) + (1,) * (lo.ndim - 1) + (2,))
    lengths = jnp.broadcast_to(lengths, lo.shape + (2,))
    fields = [lo, full_lo, full_hi, hi]
    padding = jnp.zeros(lo.shape + (RANGE_FIELDS - KV_LENGTH - 1,), jnp.int32)
    return jnp.concatenate([jnp.stack(fields, -1).astype(jnp.int32), lengths, padding], -1)


def restrict(block_range: BlockRange, lo, hi) -> BlockRange:
    """`block_range` cut to the tiles [lo, hi) (e.g. one split of a split-KV decode)."""
    return _ordered(
        jnp.maximum(block_range.lo, lo), jnp.maximum(block_range.full_lo, lo),
        jnp.minimum(block_range.full_hi, hi), jnp.minimum(block_range.hi, hi),
    )


class RangeRow:
    """Row `index` (an index or a tuple of them) of a ranges ref with leading axes, read one
    field at a time: Triton lowers `ref[g, field]`, not a view `ref.at[g]` indexed again, and
    the Hopper kernels read the fields as scalars from global memory."""

    def __init__(self, ref, index):
        self.ref, self.index = ref, index if isinstance(index, tuple) else (index,)

    def __getitem__(self, field):
        return self.ref[(*self.index, field)]


def intersect(structural: BlockRange, ranges_ref) -> BlockRange:
    """Intersects a structural range with a row of `dynamic_ranges` (a ref of RANGE_FIELDS, or a `RangeRow`)."""
    lo, full_lo, full_hi, hi = structural
    return _ordered(
        jnp.maximum(lo, ranges_ref[LO]),
        jnp.maximum(full_lo, ranges_ref[FULL_LO]),
        jnp.minimum(full_hi, ranges_ref[FULL_HI]),
        jnp.minimum(hi, ranges_ref[HI]),
    )

"""Split-KV decoding (flash-decoding) in Pallas, lowered through Triton: a few new queries
against a long KV cache, contiguous or paged, bfloat16/float16/float32 or float8.

With one or a few queries per sequence, FlashAttention's parallelism over query tiles
vanishes: a grid of (batch, kv head) programs is far smaller than the GPU. The kernel
therefore also splits each sequence's keys into `num_splits` parts: one program per
(batch, kv head, split, query tile) walks its part of the keys with the online softmax
and writes a partial output and its logsumexp; the partials are merged exactly in XLA
(`common.merge`, the merge of ring attention).

* **One K/V read per kv head.** The query tile of a program holds every query head of
  its kv group at once: row ``r`` is query ``r // group`` of head ``r % group`` (q_len x
  group rows, padded to a power of two >= 16, Triton's smallest dot). Each K/V byte is
  read once per kv head and query tile, not once per query head.
* **Per-sequence alignment.** Query ``i`` of a sequence holding ``L`` tokens sits at key
  position ``L - q_len + i``: the rows are passed to `MaskSpec` (offset 0) as these
  positions, with ``L`` as the keys' length, so causal and window masks, and the tile
  ranges of `MaskSpec.kv_range_at`, are those of `flash_attention` per sequence. Key
  tiles past ``L`` or outside the window are never read.
* **Balanced splits.** A program's split is its share of the tiles its query tile meets
  in *its* sequence (``cdiv(tiles, num_splits)`` each): short and long sequences of one
  batch each spread over all splits.
* **Any cache length.** A contiguous cache whose length is no multiple of the key tile
  ends in a ragged tile: the last tile is read as the tile's worth of keys ending at the
  cache's end, and the keys it shares with the tile before it are masked. Only that tile
  (always on the length boundary, so always a masked step) pays for it.
* **Paged caches** are read through the page table in the kernel: a key tile is a slice
  of one page (pages >= the tile) or a gather of whole pages (smaller pages); the cache
  is never copied or gathered in HBM.
* **float8 caches** (float8_e4m3fn) are converted in the kernel (exactly) and dequantised
  in float32: the k scale multiplies q.k, the v scale the weights of P.V (not the softmax
  sum), per kv head or per page. The products run in float16 for bfloat16 and float16
  queries: float8 converts to float16 in one instruction per pair of values, to bfloat16
  in four (through float16 and float32), and at small batches those conversions, not HBM,
  bound the step. bfloat16 queries enter float16 scaled by a power of two per row, computed
  in the kernel (`float16_factors`), and the weights of P.V are rounded to float16 (10 mantissa bits
  rather than bfloat16's 7).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from flashjax import masks
from flashjax.kernels import common
from flashjax.kernels.triton import scoring
from flashjax.kernels.triton.config import DecodeConfig, next_power_of_two
from flashjax.kernels.triton.scoring import Scorer
from flashjax.params import DecodeCall, DecodeParams, KVCache
from flashjax.vma import out_types

__all__ = ["supports", "decode", "num_splits", "DecodeTiling", "DecodeConfig"]

DTYPES = ("bfloat16", "float16", "float32")
FLOAT8 = "float8_e4m3fn"
# Head dims the kernel takes: keys up to MLA's latent 576, values up to 512 (the float32
# accumulator of a query tile's rows is block_q x v_head_dim). At these widths a key tile is
# 32 keys: two pipeline stages of K and V stay within 140 KB of shared memory.
MAX_DECODE_HEAD_DIM = 576
MAX_DECODE_V_HEAD_DIM = 512
# Query rows (q_len x group) per program; longer chunks get several query tiles.
MAX_BLOCK_Q = 64
# A split reads at least this many key tiles: below it the per-program prologue and the
# partials' write and merge cost more than the parallelism gains.
MIN_TILES_PER_SPLIT = 2
MAX_SPLITS = 128
# Waves of programs the splits aim for: with more than one, a program that finishes early
# (a short sequence, a partial last split) leaves no SM idle for long.
TARGET_WAVES = 2
# Without a GPU (interpret mode, tests): enough splits to run the split path and the merge.
CPU_SPLITS = 2


def float16_factors(magnitude):
    """The power of two that scales a bfloat16 row of largest magnitude `magnitude` (float32
    [...]) into float16, and its inverse: (scale, unscale), float32 [...].

    The scaled row's largest magnitude lies in [2**14, 2**15): every value within 2**-28 of
    it converts exactly (bfloat16's 8 significant bits fit float16's 11), smaller ones round
    to float16's subnormals, a change far below the rounding of the row's largest term of
    q.k. Rows whose largest magnitude is below 2**-111 (zero rows and float32 subnormals
    included) are scaled by 2**126 only, so that both factors stay normal float32. Plain
    bit arithmetic (no `frexp`), so that the Triton kernel computes it too.
    """
    shift = jnp.clip(15 - scoring.exponent_above(magnitude), -113, 126)
    return scoring.power_of_two(shift), scoring.power_of_two(-shift)


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def column_blocks(start: int, width: int) -> tuple[tuple[int, int], ...]:
    """Features [start, start + width) as (offset, size) blocks, sizes the powers of two of
    width's binary expansion, largest first (576 -> 512 + 64): Triton's tiles are powers of two."""
    blocks = []
    for bit in reversed(range(width.bit_length())):
        if width >> bit & 1:
            blocks.append((start, 1 << bit))
            start += 1 << bit
    return tuple(blocks)


def supports(call: DecodeCall) -> list[str]:
    """Why the Triton decode kernel cannot run `call` (empty when it can)."""
    reasons = []
    if jnp.dtype(call.dtype).name not in DTYPES:
        reasons.append(f"{jnp.dtype(call.dtype).name} queries (the kernel takes bfloat16, float16 or float32)")
    v_head_dim = call.v_head_dim or call.head_dim
    dims = [("head_dim", call.head_dim, MAX_DECODE_HEAD_DIM), ("v head_dim", v_head_dim, MAX_DECODE_V_HEAD_DIM)]
    if call.latent and call.head_dim > v_head_dim:
        dims.append(("the keys' features past the values", call.head_dim - v_head_dim, MAX_DECODE_HEAD_DIM))
    for name, dim, most in dims:
        if dim % 16 or not 16 <= dim <= most:
            reasons.append(
                f"{name} {dim} (the kernel reads the cache in place, in column blocks of powers of two >= 16: "
                f"a multiple of 16 up to {most}; padding it would copy the cache)"
            )
    if call.page_size is None and call.capacity < 16:
        reasons.append(f"a contiguous cache of max_len {call.capacity} (the kernel reads tiles of 16 keys or more)")
    if call.page_size is not None and not _is_power_of_two(call.page_size):
        reasons.append(f"page_size {call.page_size} (the kernel needs a power of two)")
    if jnp.dtype(call.cache_dtype).name == FLOAT8 and call.platform == "gpu":
        major, _, minor = call.compute_capability.partition(".")
        if major.isdigit() and (int(major), int(minor or 0)) < (8, 9):
            reasons.append(f"a float8 cache on compute capability {call.compute_capability} (Triton converts float8_e4m3fn on sm89+)")
    return reasons


def num_splits(*, programs: int, key_tiles: int, sm_count: int) -> int:
    """How many parts each sequence's keys are split into.

    Args:
      programs: programs of the grid without splits (batch x kv heads x query tiles).
      key_tiles: key tiles of the longest sequence the cache holds (capacity / block_k).
      sm_count: streaming multiprocessors of the GPU; 0 without one.

    Returns:
      1 when the programs already fill ``TARGET_WAVES`` waves of the GPU (large batches);
      else at least enough splits for that many waves, each split reading at least
      ``MIN_TILES_PER_SPLIT`` tiles, at most ``MAX_SPLITS``. Within a quarter more than
      that least count, the one whose programs spread most evenly over the SMs (the
      busiest SM holds ``ceil(programs * splits / sm_count)`` of them): the step ends with
      its busiest SM. Without a GPU, ``CPU_SPLITS`` (interpret mode runs the programs one
      by one: more splits only cost time).
      E.g. on an H100 (132 SMs) with 8 kv heads and one query tile: batch 1 at 32k keys
      (256 tiles of 128) takes 33 splits (264 programs, 2 per SM), batch 8 takes 6 (384
      programs, 3 on all but 12 SMs, where 5 would leave 96 SMs with 2 and 36 with 3),
      batch 64 takes 1.
    """
    most = max(1, min(MAX_SPLITS, key_tiles // MIN_TILES_PER_SPLIT))
    if sm_count <= 0:
        return min(CPU_SPLITS, most)
    least = max(1, min(math.ceil(TARGET_WAVES * sm_count / programs), most))
    if least == 1:
        return 1
    candidates = range(least, min(most, least + max(1, least // 4)) + 1)
    # The SMs' mean load over the busiest SM's (1.0: even); ties go to fewer splits.
    evenness = lambda s: programs * s / (sm_count * math.ceil(programs * s / sm_count))
    return max(candidates, key=lambda s: (round(evenness(s), 2), -s))


@dataclasses.dataclass(frozen=True)
class DecodeTiling:
    """The static shape of one decode launch (the kernel specialises on it).

    Attributes:
      q_len, group: queries per sequence and query heads per kv head.
      block_q: query rows (q_len x group, query-major) per program.
      block_k: keys per step of the key loop.
      page_size: keys per page; None for a contiguous cache.
      num_splits: parts of each sequence's keys, one program each.
      num_warps, num_stages: Triton's launch and pipelining parameters.
      head_dim, v_head_dim: of the keys and of the values.
      latent: the values are the keys' first v_head_dim features (one cache, read once).
    """

    q_len: int
    group: int
    block_q: int
    block_k: int
    page_size: int | None
    num_splits: int
    num_warps: int = 4
    num_stages: int = 2
    head_dim: int = 128
    v_head_dim: int = 128
    latent: bool = False

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            if not (_is_power_of_two(getattr(self, name)) and getattr(self, name) >= 16):
                raise ValueError(f"DecodeTiling.{name} must be a power of two >= 16, got {getattr(self, name)}.")
        if self.page_size is not None and not _is_power_of_two(self.page_size):
            raise ValueError(f"DecodeTiling.page_size must be a power of two, got {self.page_size}.")

    @property
    def rows(self) -> int:
        return self.q_len * self.group

    @property
    def q_tiles(self) -> int:
        return -(-self.rows // self.block_q)

    @property
    def pages_per_tile(self) -> int:
        """Pages gathered into one key tile (pages smaller than a tile)."""
        return max(1, self.block_k // self.page_size)

    @property
    def tiles_per_page(self) -> int:
        """Key tiles in one page (pages larger than a tile)."""
        return max(1, self.page_size // self.block_k)

    @property
    def v_blocks(self) -> tuple[tuple[int, int], ...]:
        """The values' features in column blocks (Triton tiles are powers of two)."""
        return column_blocks(0, self.v_head_dim)

    @property
    def k_blocks(self) -> tuple[tuple[int, int], ...]:
        """The keys' features in column blocks; a latent cache's start with the values' own."""
        if self.latent:
            return self.v_blocks + column_blocks(self.v_head_dim, self.head_dim - self.v_head_dim)
        return column_blocks(0, self.head_dim)


def tiling(q, cache: KVCache, splits: int | None, sm_count: int, config: DecodeConfig | None = None,
           v_head_dim: int | None = None) -> DecodeTiling:
    """The tiles of a call (`v_head_dim`: a latent cache's, whose `cache.v` is None).

    block_k from `config`, by default by the features loaded per key (the mean of the key's
    and value's head dims; a latent cache's key alone): 128 up to 64 features, 64 up to 256,
    else 32, halved for float32 past 128; then at most a contiguous cache's length (whose
    last tile may be ragged), or the page size of a paged cache with pages of >= 64 keys.
    block_q: the rows rounded up to a power of two, at most MAX_BLOCK_Q (fewer for values
    wider than 128: its float32 accumulator is block_q x v_head_dim). The splits by
    `num_splits`; num_warps as `DecodeConfig` documents.
    """
    config = config or DecodeConfig()
    batch, q_len, heads, head_dim = q.shape
    kv_heads = cache.k.shape[2]
    group = heads // kv_heads
    latent = cache.v is None
    v_head_dim = v_head_dim if latent else cache.v.shape[3]
    block_k = config.block_k
    if block_k is None:
        # Features loaded per key (a latent cache's values are inside its keys).
        features = max(head_dim, v_head_dim if latent else (head_dim + v_head_dim) // 2)
        # 64-key tiles past 64 features: measured 2-7% faster than 128-key tiles at batch
        # >= 8 and at batch 1 x 128k (H100, bf16, D = 128; benchmarks/results/decode-notes.md).
        block_k = 128 if features <= 64 else 64 if features <= 256 else 32
        if jnp.dtype(q.dtype) == jnp.float32 and features > 128:
            block_k //= 2
    capacity = cache.capacity
    if cache.page_table is None:
        block_k = min(block_k, 1 << (capacity.bit_length() - 1))  # >= 16 by `supports`
        page_size = None
    else:
        page_size = cache.k.shape[1]
        if config.block_k is None and page_size >= 64:
            # A tile within one page is a plain slice; a tile of several pages is a gather,
            # which reads HBM at about two thirds of the rate (64-key pages, H100).
            block_k = min(block_k, page_size)
    # A query tile's float32 accumulator holds block_q x v_head_dim: narrower tiles for wide values
    # (a power of two: 32 rows at v_head_dim 192).
    fitting = MAX_BLOCK_Q * 128 // max(v_head_dim, 128)
    most_rows = max(16, 1 << (fitting.bit_length() - 1))
    block_q = min(most_rows, max(16, next_power_of_two(q_len * group)))
    t = DecodeTiling(q_len=q_len, group=group, block_q=block_q, block_k=block_k, page_size=page_size, num_splits=1,
                     num_warps=config.num_warps or 4, num_stages=config.num_stages, head_dim=head_dim,
                     v_head_dim=v_head_dim, latent=latent)
    key_tiles = -(-capacity // block_k)
    if splits is None:
        splits = num_splits(programs=batch * kv_heads * t.q_tiles, key_tiles=key_tiles, sm_count=sm_count)
    splits = min(splits, key_tiles)  # a split past the last tile would read nothing
    if config.num_warps is None and splits == 1 and jnp.dtype(cache.k.dtype).name == FLOAT8:
        t = dataclasses.replace(t, num_warps=2)
    return dataclasses.replace(t, num_splits=splits)


class _CacheRefs(NamedTuple):
    """The kernel's cache inputs (absent ones None)."""

    k: object
    v: object
    page_table: object = None
    k_scale: object = None
    v_scale: object = None


def _decode_kernel(lengths_ref, q_ref, c: _CacheRefs, o_ref, lse_ref, *, scorer: Scorer,
                   t: DecodeTiling, num_k_tiles: int, scales: str | None):
    batch, head, split, q_tile = (pl.program_id(i) for i in range(4))
    block_q, head_dim = q_ref.shape
    block_k = t.block_k
    capacity = c.k.shape[0] if t.page_size is None else None
    ragged = capacity is not None and capacity % block_k != 0
    spec = scorer.spec
    length = lengths_ref[batch]
    # Row r holds query r // group; bottom-right aligned to this sequence's own length.
    first = q_tile * block_q
    offset = length - t.q_len
    rows = offset + masks.int32_div(first + jnp.arange(block_q, dtype=jnp.int32)[:, None], t.group)
    last = jnp.minimum(first + block_q, t.rows) - 1  # padded rows do not widen the range
    tiles = spec.kv_range_at(offset + masks.int32_div(first, t.group), offset + masks.int32_div(last, t.group), length, block_k, num_k_tiles)
    per_split = masks.int32_div(tiles.hi - tiles.lo + (t.num_splits - 1), t.num_splits)
    lo = tiles.lo + split * per_split
    tiles = masks.restrict(tiles, lo, lo + per_split)
    whole = t.k_blocks == ((0, head_dim),)
    # Features in column blocks (576 = 512 + 64): q.k sums a product per block.
    q_blocks = [q_ref[...]] if whole else [q_ref[:, pl.ds(start, size)] for start, size in t.k_blocks]
    q_unscale = None
    if jnp.dtype(c.k.dtype).name == FLOAT8 and q_ref.dtype == jnp.bfloat16:
        # float16 rows of bfloat16 queries: each row's power of two, undone on q.k.
        q_blocks = [b.astype(jnp.float32) for b in q_blocks]
        magnitude = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(b), axis=1) for b in q_blocks])
        q_scale, q_unscale = float16_factors(magnitude)
        q_blocks = [(b * q_scale[:, None]).astype(jnp.float16) for b in q_blocks]
        q_unscale = q_unscale[:, None]
    # The products' dtype: float8 tiles convert exactly to it.
    compute_dtype = q_blocks[0].dtype
    precision = scoring.dot_precision(compute_dtype)
    # Scales per kv head are one number for the whole loop.
    k_scale = c.k_scale[head] if scales == "head" else None
    v_scale = c.v_scale[head] if scales == "head" else None

    def tile_start(j):
        """The first key of tile j: j * block_k, except a ragged last tile, which ends at the
        cache's end (its keys before j * block_k are masked in `step`)."""
        if ragged:
            return jnp.minimum(j * block_k, capacity - block_k)
        return pl.multiple_of(j * block_k, block_k)

    def load(ref, scale_ref, j, blocks):
        """Key tile j (keys tile_start(j) ...) of a cache ref in column blocks ([block_k,
        size] each), and its per-page scales if any."""
        features = lambda start, size: slice(None) if len(blocks) == 1 and size == ref.shape[-1] else pl.ds(start, size)
        if t.page_size is None:
            keys = pl.ds(tile_start(j), block_k)
            return [ref[keys, features(*b)] for b in blocks], None
        if t.page_size >= block_k:  # a slice of one page
            page = c.page_table[masks.int32_div(j, t.tiles_per_page)]
            start = pl.multiple_of(masks.int32_rem(j, t.tiles_per_page) * block_k, block_k)
            scale = scale_ref[page] if scales == "page" else None
            return [ref[page, pl.ds(start, block_k), features(*b)] for b in blocks], scale
        n = t.pages_per_tile  # whole pages gathered
        pages = c.page_table[pl.ds(pl.multiple_of(j * n, n), n)]
        scale = None
        if scales == "page":
            scale = jnp.broadcast_to(scale_ref[pages][:, None], (n, t.page_size)).reshape(1, block_k)
        return [ref[pages, :, features(*b)].reshape(block_k, b[1]) for b in blocks], scale

    def step(j, carry, masked):
        acc, m, l = carry
        k_blocks, k_page_scale = load(c.k, c.k_scale, j, t.k_blocks)
        if not t.latent:
            v_blocks, v_page_scale = load(c.v, c.v_scale, j, t.v_blocks)
        cols = (tile_start(j) if t.page_size is None else j * block_k) + jnp.arange(block_k, dtype=jnp.int32)[None, :]
        # A float8 tile converts exactly to the products' dtype; its scale is applied in float32.
        k_blocks = [k.astype(compute_dtype) for k in k_blocks]
        qk = scoring.dot(q_blocks[0], k_blocks[0], trans_b=True, precision=precision)
        for q, k in zip(q_blocks[1:], k_blocks[1:]):
            qk = qk + scoring.dot(q, k, trans_b=True, precision=precision)
        if q_unscale is not None:
            qk = qk * q_unscale
        k_factor = k_scale if k_page_scale is None else k_page_scale
        if k_factor is not None:
            qk = qk * k_factor
        s, _ = scorer.logits(qk, rows, cols)
        if masked:
            s = scorer.mask(s, rows, cols, kv_length=length)
            if ragged:  # the last tile's keys already seen in tile j - 1 (a tile on the length boundary)
                s = jnp.where(cols >= j * block_k, s, -jnp.inf)
        if t.latent:  # the values are the keys' leading blocks, already loaded
            v_blocks, v_page_scale = k_blocks[: len(t.v_blocks)], k_page_scale
        else:
            v_blocks = [v.astype(compute_dtype) for v in v_blocks]
        if masked:
            # Slots past the length (stale cache slots, pages the table's padding names) may
            # hold anything, NaN included: their weight is 0, and 0 * NaN would not be.
            filled = jnp.transpose(cols) < length
            v_blocks = [jnp.where(filled, v, jnp.zeros_like(v)) for v in v_blocks]
        v_factor = v_page_scale
        if masked and v_factor is not None and jnp.ndim(v_factor) == 2:
            # Pages past the length (the table's padding, its -1 entries) may have any scale,
            # NaN included: the tile's scale unit (`online_softmax_step`) is of filled slots'.
            v_factor = jnp.where(cols < length, v_factor, 0.0)
        values = v_blocks[0] if len(v_blocks) == 1 else tuple(v_blocks)
        return scoring.online_softmax_step(acc, m, l, s, values, v_scale=v_factor, precision=precision)

    v_zeros = [jnp.zeros((block_q, size), jnp.float32) for _, size in t.v_blocks]
    carry = (
        v_zeros[0] if len(v_zeros) == 1 else tuple(v_zeros),
        jnp.full((block_q,), common.ROW_MAX_START, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    # The upper boundary always exists: the last tile of a sequence may be partial.
    acc, m, l = scoring.visit_tiles(tiles, step, carry, spec.left is not None, True)
    # Rows that met no key in this split output 0 with lse -inf (weight 0 in the merge).
    empty = l == 0.0
    inv_l = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l))
    if v_scale is not None:  # a scale per kv head applies to the output, in float32
        inv_l = inv_l * v_scale
    if len(t.v_blocks) == 1:
        o_ref[...] = acc * inv_l[:, None]
    else:
        for (start, size), part in zip(t.v_blocks, acc):
            o_ref[:, pl.ds(start, size)] = part * inv_l[:, None]
    lse_ref[...] = jnp.where(empty, -jnp.inf, m + jnp.log2(jnp.where(empty, 1.0, l)))


def _scales_kind(cache: KVCache) -> str | None:
    if cache.k_scale is None:
        return None
    return "head" if cache.k_scale.ndim == 1 else "page"


def partials(q, cache: KVCache, params: DecodeParams, t: DecodeTiling):
    """Runs the kernel: per split, the normalised partial output and its base-2 lse.

    Args:
      q: [B, q_len, H, D]; cache: as `KVCache` documents it, lengths within the capacity.

    Returns:
      o float32 [B, Hkv, num_splits, q_tiles * block_q, Dv] and lse2 float32
      [B, Hkv, num_splits, q_tiles * block_q]; row r is query r // group, head r % group.
    """
    batch, q_len, heads, head_dim = q.shape
    kv_heads = cache.k.shape[2]
    padded_rows = t.q_tiles * t.block_q
    q_rows = q.reshape(batch, q_len, kv_heads, t.group, head_dim).transpose(0, 2, 1, 3, 4)
    q_rows = q_rows.reshape(batch, kv_heads, t.rows, head_dim)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, padded_rows - t.rows), (0, 0)))
    scales = _scales_kind(cache)
    if cache.page_table is None:
        capacity = cache.k.shape[1]
        cache_spec = lambda dim: pl.BlockSpec((None, capacity, None, dim), lambda b, h, s, i: (b, 0, h, 0))
        table = table_spec = None
    else:
        num_pages, page_size = cache.k.shape[:2]
        # Whole tiles of table entries (the padding entries, page 0, lie past every length).
        pages = common.round_up(cache.page_table.shape[1], t.pages_per_tile)
        table = jnp.pad(cache.page_table, ((0, 0), (0, pages - cache.page_table.shape[1])))
        capacity = pages * page_size
        cache_spec = lambda dim: pl.BlockSpec((num_pages, page_size, None, dim), lambda b, h, s, i: (0, 0, h, 0))
        table_spec = pl.BlockSpec((None, pages), lambda b, h, s, i: (b, 0))
    if scales == "head":
        scale_spec = pl.BlockSpec((kv_heads,), lambda b, h, s, i: (0,))
    elif scales == "page":
        scale_spec = pl.BlockSpec((cache.k_scale.shape[0], None), lambda b, h, s, i: (0, h))
    else:
        scale_spec = None
    kernel = functools.partial(
        _decode_kernel, scorer=Scorer(spec=params.mask_spec(q_len), scale=params.scale, softcap=params.softcap),
        t=t, num_k_tiles=-(-capacity // t.block_k), scales=scales,
    )
    refs = _CacheRefs(cache.k, cache.v, table, cache.k_scale, cache.v_scale)
    v_spec = None if cache.v is None else cache_spec(t.v_head_dim)
    ref_specs = _CacheRefs(cache_spec(head_dim), v_spec, table_spec, scale_spec, scale_spec)
    out_index = lambda b, h, s, i: (b, h, s, i)
    return pl.pallas_call(
        kernel,
        grid=(batch, kv_heads, t.num_splits, t.q_tiles),
        in_specs=[
            pl.BlockSpec((batch,), lambda b, h, s, i: (0,)),
            pl.BlockSpec((None, None, t.block_q, head_dim), lambda b, h, s, i: (b, h, i, 0)),
            ref_specs,
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, t.block_q, t.v_head_dim), lambda b, h, s, i: (*out_index(b, h, s, i), 0)),
            pl.BlockSpec((None, None, None, t.block_q), out_index),
        ],
        out_shape=out_types([
            jax.ShapeDtypeStruct((batch, kv_heads, t.num_splits, padded_rows, t.v_head_dim), jnp.float32),
            jax.ShapeDtypeStruct((batch, kv_heads, t.num_splits, padded_rows), jnp.float32),
        ], cache.lengths, q_rows, refs),
        compiler_params=plgpu.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
        interpret=params.interpret,
        name="flashjax_decode",
    )(cache.lengths, q_rows, refs)


def decode(q, cache: KVCache, params: DecodeParams):
    """The Triton decode path: o float32 [B, q_len, H, Dv] (the caller rounds it to q's dtype once,
    after folding any sinks in) and the natural-log lse [B, H, q_len]."""
    batch, q_len, heads, _ = q.shape
    kv_heads = cache.k.shape[2]
    t = tiling(q, cache, params.num_splits, params.sm_count, params.config, params.v_head_dim)
    o, lse2 = partials(q, cache, params, t)
    # Rows back to [split, B, q_len, H, ...] (head h * group + g), the layout `merge` takes.
    dv = t.v_head_dim
    o = o[:, :, :, : t.rows].reshape(batch, kv_heads, t.num_splits, q_len, t.group, dv)
    o = o.transpose(2, 0, 3, 1, 4, 5).reshape(t.num_splits, batch, q_len, heads, dv)
    lse = lse2[:, :, :, : t.rows].reshape(batch, kv_heads, t.num_splits, q_len, t.group) * common.LN2
    lse = lse.transpose(2, 0, 1, 4, 3).reshape(t.num_splits, batch, heads, q_len)
    return common.merge_splits(o, lse)

"""The Hopper decode path: split-KV decoding on the Hopper forward kernel.

No kernel of its own. A contiguous cache [B, L, Hkv, D] is read in place as
[B * S, L / S, Hkv, D] (a free reshape): split s of sequence b becomes batch row
b * S + s, its keys [s L/S, (s + 1) L/S), with kv length clip(len_b - s L/S, 0, L/S),
so key tiles past a sequence's length are never loaded (`masks.dynamic_ranges`). A paged
cache's page table [B, P] is cut the same way, [B * S, P / S] (padded with page 0 to a
multiple of S pages, past every length): the forward's producer reads each key tile's
page from it and copies the tile by TMA from its page in the pool, in place. The query
heads of a kv head become its query rows ([B * S, q_len * group, Hkv, D]): each split
reads each K/V byte once for the whole group, and the splits merge exactly through their
lse (`kernels.common.merge`, as the Triton decode path and the ring do).

Serves the decode step itself (q_len 1; or any q_len without a causal mask): a causal
mask aligned to each sequence's own length, a window, a float8 cache or pages that are
no multiple of 64 keys go to the Triton decode kernel. Forward only, like every decode
path.
"""

from __future__ import annotations

import jax.numpy as jnp

from flashjax.kernels import common
from flashjax.kernels.mosaic.config import HEAD_DIMS, MosaicConfig, device_reasons
from flashjax.kernels.triton.decode import num_splits as triton_num_splits
from flashjax.params import AttentionParams, DecodeCall, DecodeParams, Extras, KVCache

__all__ = ["supports", "declines", "decode", "splits"]

# The cache is split into whole key tiles of this many keys (the forward's key tile): a
# split that is no multiple of it would make the forward pad, that is copy, the cache.
SPLIT_MULTIPLE = 128
# A paged cache's key tile lies within one page (a TMA copy of a slice of it) and is 64 or
# 128 keys: pages of a multiple of 64 keys.
PAGE_MULTIPLE = 64


def supports(call: DecodeCall) -> list[str]:
    """Why the Hopper decode path cannot run `call` (empty when it can)."""
    reasons = device_reasons(call.platform, call.compute_capability, call.dtype, "queries")
    if jnp.dtype(call.cache_dtype) != jnp.dtype(call.dtype):
        reasons.append(f"a {jnp.dtype(call.cache_dtype).name} cache with {jnp.dtype(call.dtype).name} queries")
    if call.page_size is not None and call.page_size % PAGE_MULTIPLE:
        reasons.append(f"page_size {call.page_size} (key tiles of 64 or 128 keys lie within one page: a multiple of "
                       f"{PAGE_MULTIPLE})")
    if call.head_dim not in HEAD_DIMS:
        reasons.append(f"head_dim {call.head_dim} (the cache is read in place: {', '.join(map(str, HEAD_DIMS))})")
    if call.latent:
        reasons.append("a latent cache (values inside the keys)")
    elif call.v_head_dim not in (None, call.head_dim):
        reasons.append(f"v head_dim {call.v_head_dim} != head_dim {call.head_dim}")
    if call.page_size is None and call.capacity % SPLIT_MULTIPLE:
        reasons.append(f"a cache of max_len {call.capacity}, no multiple of {SPLIT_MULTIPLE} (it is read in place "
                       "in whole key tiles)")
    if call.causal and call.q_len > 1:
        reasons.append(f"causal with q_len {call.q_len} > 1 (rows aligned to each sequence's own length)")
    if call.window is not None:
        reasons.append("a window")
    return reasons


def declines(call: DecodeCall) -> list[str]:
    """Why `auto` passes the Hopper decode path by although it could run `call`: the Triton
    split-KV kernel is as fast at every size measured (H100, bf16, 32 query over 8 kv heads,
    D = 128: on contiguous caches within 2% either way from 4 to 16 GiB of cache, faster
    below; on caches of 64-key pages 1.03-1.23x faster; benchmarks/results/decode-notes.md),
    and one kernel then serves every cache. ``backend="mosaic"`` still runs it."""
    return ["the Triton split-KV kernel is as fast or faster at every cache size measured (H100)"]


def splits(batch: int, kv_heads: int, rows: int, capacity: int, requested: int | None, sm_count: int,
           block_q: int, *, paged: bool = False, multiple: int = SPLIT_MULTIPLE) -> int:
    """The number of splits: `requested` or the Triton path's choice for this grid (`rows`
    query rows in pairs of `block_q`-row tiles per CTA), at most one per `multiple` keys
    (a paged cache's page); for a contiguous cache lowered to the nearest count that cuts it
    into whole multiples of `multiple` keys (a paged cache's table is padded instead)."""
    tiles = capacity // multiple
    pairs = -(-rows // (2 * block_q))
    if requested is None:
        requested = triton_num_splits(programs=batch * kv_heads * pairs, key_tiles=tiles, sm_count=sm_count)
    count = max(1, min(requested, tiles))
    while tiles % count and not paged:
        count -= 1
    return count


def decode(q, cache: KVCache, params: DecodeParams, *, forward):
    """o float32 [B, q_len, H, D] (the caller rounds it to q's dtype once, after folding any
    sinks in) and the natural-log lse [B, H, q_len].

    Args:
      q: [B, q_len, H, D]; cache: a `KVCache`, contiguous (k, v [B, L, Hkv, D]) or paged (k, v
        [num_pages, page_size, Hkv, D], page_table [B, P]), with lengths [B].
      params: the decode call's static options.
      forward: the attention forward run on the splits, ``forward(q, k, v, extras, params,
        config, page_table=None) -> (o, lse)``: the Hopper backend's (bound in its `Decoder`);
        tests pass the reference's.
    """
    batch, q_len, heads, head_dim = q.shape
    kv_heads = cache.k.shape[2]
    paged = cache.page_table is not None
    page_size = cache.k.shape[1] if paged else None
    capacity = cache.capacity
    assert page_size % PAGE_MULTIPLE == 0 if paged else capacity % SPLIT_MULTIPLE == 0, \
        "supports() declines these caches"
    assert params.window is None and not (params.causal and q_len > 1), "supports() declines these options"
    group = heads // kv_heads
    rows = q_len * group
    config = MosaicConfig.default(head_dim)
    count = splits(batch, kv_heads, rows, capacity, params.num_splits, params.sm_count, config.block_q, paged=paged,
                   multiple=page_size or SPLIT_MULTIPLE)
    # Row (t, g) of kv head k is query t of head k * group + g.
    q_rows = q.reshape(batch, q_len, kv_heads, group, head_dim).transpose(0, 1, 3, 2, 4)
    q_rows = jnp.repeat(q_rows.reshape(batch, rows, kv_heads, head_dim), count, axis=0)
    if paged:
        # Each split takes pages_per_split pages of the table; the padding pages lie past
        # every length (never read).
        pages = cache.page_table.shape[1]
        pages_per_split = -(-pages // count)
        table = jnp.pad(cache.page_table.astype(jnp.int32), ((0, 0), (0, count * pages_per_split - pages)))
        table = table.reshape(batch * count, pages_per_split)
        split_k, split_v, chunk = cache.k, cache.v, pages_per_split * page_size
    else:
        table, chunk = None, capacity // count
        split_k = cache.k.reshape(batch * count, chunk, kv_heads, head_dim)
        split_v = cache.v.reshape(batch * count, chunk, kv_heads, head_dim)
    starts = jnp.arange(count, dtype=jnp.int32) * chunk
    lengths = jnp.clip(cache.lengths.astype(jnp.int32)[:, None] - starts[None, :], 0, chunk).reshape(batch * count)
    attention = AttentionParams(scale=params.scale, softcap=params.softcap, backend="mosaic")
    o, lse = forward(q_rows, split_k, split_v, Extras(kv_lengths=lengths), attention, config, page_table=table)
    # Back to [split, B, q_len, H, ...], the layout `merge` takes.
    o = o.reshape(batch, count, q_len, group, kv_heads, head_dim).transpose(1, 0, 2, 4, 3, 5)
    o = o.reshape(count, batch, q_len, heads, head_dim).astype(jnp.float32)
    lse = lse.reshape(batch, count, kv_heads, q_len, group).transpose(1, 0, 2, 4, 3).reshape(count, batch, heads, q_len)
    return common.merge_splits(o, lse)

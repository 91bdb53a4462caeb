"""`flashjax.decode_attention` against the reference: contiguous and paged caches, GQA/MQA,
one and several new queries, causal, window and softcap, float8 caches, the split-KV
merge, jit/vmap, the choice of backend, the gradient error and the argument errors.

The oracle is `flashjax.reference.attention` in float32 on the dequantised cache with each
sequence's keys moved to the end of the key axis (a roll by ``capacity - L``) and the keys
before them masked out: the reference's bottom-right alignment by array lengths is then
the per-sequence alignment decode_attention promises (query i at key position
``L - q_len + i``), with no mask code shared with the implementations under test.

On the CPU the Triton kernel runs in interpret mode; sizes are small (head dim 32,
capacities of a few hundred keys), so the whole file takes about a minute.
"""

from __future__ import annotations

import functools
import os
import zlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from flashjax import backends, reference
from flashjax.kernels.triton import decode as triton_decode
from flashjax.params import KVCache, DecodeCall

from conftest import check_close, check_lse
from multidevice import gpus_or_skip, run_on_devices

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

F32, BF16, F16, FP8 = jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn
D = 32


class Cache(NamedTuple):
    """What decode_attention takes (k, v, page_table, scales) and the dense float32 truth."""

    k: jax.Array
    v: jax.Array | None  # None: a latent cache, values = k's first v_head_dim features
    page_table: jax.Array | None
    k_scale: jax.Array | None
    v_scale: jax.Array | None
    dense_k: np.ndarray  # [B, capacity, Hkv, D], dequantised
    dense_v: np.ndarray
    v_head_dim: int | None = None

    def kwargs(self):
        latent = dict(v_head_dim=self.v_head_dim) if self.v is None else {}
        return dict(page_table=self.page_table, k_scale=self.k_scale, v_scale=self.v_scale, **latent)


def make_cache(rng, batch, capacity, kv_heads, dtype, *, page_size=None, scales=None, head_dim=D, v_head_dim=None,
               latent=False) -> Cache:
    """Random caches; paged ones through a random page table over a pool with spare pages.

    ``scales``: None, "head" or "page": a float8 cache storing value / scale.
    ``v_head_dim``: the values' own head dim (default head_dim); with ``latent`` there is
    no v cache, the values being k's first v_head_dim features.
    """
    v_head_dim = v_head_dim or head_dim
    if page_size is None:
        table, pages, shape = None, None, (batch, capacity, kv_heads)
    else:
        per_seq = capacity // page_size
        pages = batch * per_seq + 3
        table = rng.permutation(pages)[: batch * per_seq].reshape(batch, per_seq).astype(np.int32)
        shape = (pages, page_size, kv_heads)
    arrays, scale_arrays, dense = [], [], []
    for dim in (head_dim,) if latent else (head_dim, v_head_dim):
        store = rng.standard_normal((*shape, dim), dtype=np.float32)
        scale = None
        if scales is not None:
            scale = rng.uniform(0.25, 4.0, (kv_heads,) if scales == "head" else (pages, kv_heads)).astype(np.float32)
            per_row = scale[:, None, :, None] if scales == "page" else scale[:, None]
            stored = np.asarray(jnp.asarray(store / per_row).astype(FP8).astype(F32))
            arrays.append(jnp.asarray(stored).astype(FP8))
            store = stored * per_row  # dequantised
            scale = jnp.asarray(scale)
        else:
            store = np.asarray(jnp.asarray(store).astype(dtype).astype(F32))
            arrays.append(jnp.asarray(store).astype(dtype))
        scale_arrays.append(scale)
        dense.append(store if table is None else store[table].reshape(batch, capacity, kv_heads, dim))
    if latent:
        arrays.append(None)
        scale_arrays.append(None)
        dense.append(dense[0][..., :v_head_dim])
    return Cache(arrays[0], arrays[1], None if table is None else jnp.asarray(table), scale_arrays[0], scale_arrays[1],
                 dense[0], dense[1], v_head_dim)


@functools.partial(jax.jit, static_argnames=("causal", "window", "softcap"))
def _oracle(q, k, v, lengths, sinks, *, causal, window, softcap):
    capacity = k.shape[1]
    # Sequence b's L keys moved to the end: key j of the array is key j - (capacity - L).
    shift = capacity - lengths
    index = (jnp.arange(capacity)[None, :] - shift[:, None]) % capacity
    take = lambda x: jnp.take_along_axis(x, index[:, :, None, None], axis=1)
    valid = jnp.arange(capacity)[None, :] >= shift[:, None]
    return reference.attention(
        q.astype(F32), take(k), take(v), causal=causal, window=window, softcap=softcap,
        mask=valid[:, None, None, :], sinks=sinks, return_lse=True,
    )


def oracle(q, cache: Cache, lengths, *, causal=True, window=None, softcap=None, sinks=None):
    return _oracle(q, jnp.asarray(cache.dense_k), jnp.asarray(cache.dense_v), jnp.asarray(lengths), sinks,
                   causal=causal, window=window, softcap=softcap)


def draw_q(rng, batch, q_len, heads, dtype, head_dim=D):
    return jnp.asarray(rng.standard_normal((batch, q_len, heads, head_dim), dtype=np.float32)).astype(dtype)


def check(q, cache: Cache, lengths, *, backend="triton", num_splits=None, config=None, **options):
    got_o, got_lse = flashjax.decode_attention(
        q, cache.k, cache.v, jnp.asarray(lengths, jnp.int32), return_lse=True, backend=backend,
        num_splits=num_splits, config=config, **cache.kwargs(), **options,
    )
    want_o, want_lse = oracle(q, cache, lengths, **options)
    assert got_o.dtype == q.dtype and got_o.shape == (*q.shape[:3], cache.dense_v.shape[-1])
    check_close(got_o, want_o, q.dtype, "o")
    check_lse(got_lse, want_lse, q.dtype)


# (batch, q_len, heads, kv_heads, capacity, dtype, causal, lengths)
CONTIGUOUS = [
    pytest.param(3, 1, 4, 2, 96, F32, True, [0, 37, 96], id="gqa-q1-f32"),
    pytest.param(3, 7, 4, 1, 128, BF16, True, [3, 1, 100], id="mqa-q7-bf16"),  # L < q_len: early queries see nothing
    pytest.param(2, 1, 2, 2, 48, F16, False, [1, 47], id="mha-q1-f16-full"),
    pytest.param(2, 33, 2, 1, 160, F32, True, [40, 160], id="mqa-q33-f32"),  # 66 rows: two query tiles
    pytest.param(4, 3, 4, 2, 101, BF16, True, [101, 70, 64, 65], id="ragged-101-bf16"),  # 64-key tiles, the last ragged
]


@pytest.mark.parametrize("v_head_dim", [192, 320])
def test_wide_values_with_many_rows_per_kv_head(rng, v_head_dim):
    """Value head dims that are no power of two (192, 320) with more query rows per kv head
    than one tile holds (64 heads over one kv head): the query tile's rows are cut to a
    power of two (32 at 192, 16 at 320), over several tiles."""
    cache = make_cache(rng, 1, 64, 1, BF16, head_dim=v_head_dim)
    check(draw_q(rng, 1, 1, 64, BF16, v_head_dim), cache, [50])


def test_ragged_cache_tiles(rng):
    """A contiguous cache of any length keeps its tile: the last one is ragged (it ends at the
    cache's end; the keys it shares with the tile before are masked), in every split, with a
    window, and through the Flax module's cache sizes (prompt + new tokens)."""
    for capacity, lengths in ((101, [101, 70, 37, 0]), (8 * 128 + 33, [1057, 1000, 1024, 999])):
        cache = make_cache(rng, 4, capacity, 2, BF16)
        kv = KVCache(cache.k, cache.v, jnp.asarray(lengths, jnp.int32))
        assert triton_decode.tiling(draw_q(rng, 4, 1, 4, BF16), kv, None, 0).block_k == (64 if capacity < 128 else 128)
        for num_splits, window in ((None, None), (3, None), (2, (40, None)), (1, (None, 0))):
            check(draw_q(rng, 4, 2, 4, BF16), cache, lengths, num_splits=num_splits, window=window)


@pytest.mark.parametrize("batch,q_len,heads,kv_heads,capacity,dtype,causal,lengths", CONTIGUOUS)
def test_contiguous(rng, batch, q_len, heads, kv_heads, capacity, dtype, causal, lengths):
    cache = make_cache(rng, batch, capacity, kv_heads, dtype)
    check(draw_q(rng, batch, q_len, heads, dtype), cache, lengths, causal=causal)


# (page_size, pages_per_seq, q_len, heads, kv_heads, dtype, causal, lengths)
PAGED = [
    pytest.param(16, 9, 1, 4, 2, BF16, True, [0, 1, 77, 144], id="p16-q1-gqa-bf16"),  # 8 pages per key tile, sliced
    pytest.param(8, 20, 2, 4, 2, BF16, True, [0, 33, 160], id="p8-q2-gqa-bf16"),  # 16 pages per key tile, gathered
    pytest.param(64, 3, 7, 4, 1, F32, True, [65, 6, 192], id="p64-q7-mqa-f32"),
    pytest.param(256, 2, 1, 2, 2, F16, False, [300, 1], id="p256-q1-f16-full"),  # 2 key tiles per page
]


@pytest.mark.parametrize("page_size,pages_per_seq,q_len,heads,kv_heads,dtype,causal,lengths", PAGED)
def test_paged(rng, page_size, pages_per_seq, q_len, heads, kv_heads, dtype, causal, lengths):
    batch = len(lengths)
    cache = make_cache(rng, batch, page_size * pages_per_seq, kv_heads, dtype, page_size=page_size)
    check(draw_q(rng, batch, q_len, heads, dtype), cache, lengths, causal=causal)


@pytest.mark.parametrize(
    "page_size,q_len,causal,window,softcap",
    [
        pytest.param(None, 7, True, (20, None), None, id="contiguous-causal-left20"),
        pytest.param(16, 5, False, (9, 3), 5.0, id="p16-window-softcap"),
        pytest.param(64, 1, True, None, 2.0, id="p64-softcap"),
    ],
)
def test_window_and_softcap(rng, page_size, q_len, causal, window, softcap):
    lengths = [150, 13, 192]
    cache = make_cache(rng, 3, 192, 2, BF16, page_size=page_size)
    check(draw_q(rng, 3, q_len, 4, BF16), cache, lengths, causal=causal, window=window, softcap=softcap)


@pytest.mark.parametrize(
    "page_size,scales,q_len,dtype",
    [
        pytest.param(None, "head", 1, BF16, id="contiguous-per-head-bf16"),
        pytest.param(16, "page", 3, BF16, id="p16-per-page-bf16"),
        pytest.param(64, "page", 1, F32, id="p64-per-page-f32"),
        pytest.param(64, "head", 2, F16, id="p64-per-head-f16"),
    ],
)
def test_float8_cache(rng, page_size, scales, q_len, dtype):
    """Against the reference on the dequantised cache (float8 values times their scales)."""
    lengths = [128, 29]
    cache = make_cache(rng, 2, 128, 2, dtype, page_size=page_size, scales=scales)
    check(draw_q(rng, 2, q_len, 4, dtype), cache, lengths)


def test_float8_cache_queries_far_outside_float16(rng):
    """bfloat16 queries against a float8 cache run their products in float16: rows whose
    magnitudes float16 cannot hold (1e30, 1e-30, 0) still give the reference's attention."""
    cache = make_cache(rng, 2, 128, 2, BF16, scales="head")
    q = np.array(draw_q(rng, 2, 3, 4, F32))
    q[0, 0] *= 1e30 / np.abs(q[0, 0]).max()  # logits ~1e30: one key takes all the weight
    q[0, 1] *= 1e-30
    q[1, 2] = 0.0
    q[1, 0, 1] *= 300.0  # one head past float16's range, the group's others not
    check(jnp.asarray(q).astype(BF16), cache, [128, 77])


@pytest.mark.parametrize("scales", ["head", "page"])
@pytest.mark.parametrize("magnitude", [1e-8, 1e5, -2.0])
def test_float8_cache_scales_far_from_one(rng, scales, magnitude):
    """bfloat16 queries against a float8 cache whose value scales lie far outside float16's
    range (the products run in float16), or are negative: the scales still apply exactly,
    per kv head and per page (16-key pages, several in one key tile, each with its own)."""
    cache = make_cache(rng, 2, 128, 2, BF16, page_size=None if scales == "head" else 16, scales=scales)
    cache = cache._replace(v_scale=cache.v_scale * magnitude, dense_v=cache.dense_v * np.float32(magnitude))
    check(draw_q(rng, 2, 2, 4, BF16), cache, [128, 45])


@pytest.mark.parametrize("backend", ["triton", "xla"])
@pytest.mark.parametrize("page_size", [None, 16, 64])
def test_slots_past_the_lengths_may_hold_nan(rng, backend, page_size):
    """Slots past each length, spare pages and the pages named by table entries past a
    sequence's last page (-1 here) hold NaN: the output is the reference's on the filled
    slots. The key tile that holds a length is read whole, and 16-key pages are gathered
    into 128-key tiles through the -1 entries."""
    lengths = [29, 0, 70]
    cache = make_cache(rng, 3, 128, 2, BF16, page_size=page_size)
    k, v = np.array(cache.k.astype(F32)), np.array(cache.v.astype(F32))
    table = None
    if page_size is None:
        for b, length in enumerate(lengths):
            k[b, length:] = v[b, length:] = np.nan
    else:
        table = np.array(cache.page_table)
        filled = np.zeros(k.shape[:2], bool)  # [pages, page_size]
        for b, length in enumerate(lengths):
            for p in range(table.shape[1]):
                n = int(np.clip(length - p * page_size, 0, page_size))
                filled[table[b, p], :n] = True
                if n == 0:
                    table[b, p] = -1
        k[~filled] = v[~filled] = np.nan
        table = jnp.asarray(table)
    poisoned = cache._replace(k=jnp.asarray(k).astype(BF16), v=jnp.asarray(v).astype(BF16), page_table=table)
    check(draw_q(rng, 3, 2, 4, BF16), poisoned, lengths, backend=backend)


@pytest.mark.parametrize("backend", ["triton", "xla"])
def test_page_scales_of_unfilled_pages_may_hold_anything(rng, backend):
    """A float8 cache's per-page value scales of the pages no sequence fills (spare pages, and
    page 0, which the table's -1 entries past each sequence's last page name) hold NaN, inf
    and 1e30. 16-key pages are gathered eight to a key tile, so these pages share tiles with
    filled ones: the output is the reference's."""
    lengths = [29, 0, 70]
    cache = make_cache(rng, 3, 128, 2, BF16, page_size=16, scales="page")
    table = np.array(cache.page_table)
    table[np.arange(table.shape[1])[None, :] * 16 >= np.array(lengths)[:, None]] = -1
    k, v, k_scale, v_scale = (np.array(x.astype(F32) if x.dtype == FP8 else x)
                              for x in (cache.k, cache.v, cache.k_scale, cache.v_scale))
    filled = set(table[table >= 0].tolist())
    if 0 in filled:  # relabel so that page 0 is unfilled (the dense reference is per sequence)
        spare = next(p for p in range(len(v_scale)) if p not in filled)
        for x in (k, v, k_scale, v_scale):
            x[[0, spare]] = x[[spare, 0]]
        table = np.where(table == 0, spare, np.where(table == spare, 0, table))
        filled = set(table[table >= 0].tolist())
    unfilled = [p for p in range(len(v_scale)) if p not in filled]
    assert 0 in unfilled and len(unfilled) >= 3
    for i, page in enumerate(unfilled):
        v_scale[page] = (np.nan, np.inf, 1e30)[i % 3]
    poisoned = cache._replace(k=jnp.asarray(k).astype(FP8), v=jnp.asarray(v).astype(FP8), k_scale=jnp.asarray(k_scale),
                              v_scale=jnp.asarray(v_scale), page_table=jnp.asarray(table))
    check(draw_q(rng, 3, 2, 4, BF16), poisoned, lengths, backend=backend)


@pytest.mark.parametrize("shift", [0, 20, -20, 120, -120])
def test_float16_factors(rng, shift):
    """Rows scaled by their own power of two: exact for bfloat16 values within 2**-28 of the
    row's largest, the largest in [2**14, 2**15), and the factor undoes the scaling (rows
    below 2**-111 are only scaled by 2**126: the -120 case checks them to an absolute bound)."""
    rows = jnp.asarray(rng.standard_normal((3, 5, 64)) * 2.0**shift, jnp.float32).astype(BF16)
    rows = rows.at[1, 2].set(0.0)
    scale, unscale = triton_decode.float16_factors(jnp.max(jnp.abs(rows.astype(F32)), axis=-1))
    scaled = (rows.astype(F32) * scale[..., None]).astype(F16)
    assert scaled.dtype == F16 and unscale.shape == rows.shape[:-1]
    back = np.asarray(scaled, np.float64) * np.asarray(unscale, np.float64)[..., None]
    want = np.asarray(rows, np.float64)
    largest = np.abs(want).max(-1, keepdims=True)
    if shift > -111:
        within = np.abs(want) >= largest * 2.0**-28
        np.testing.assert_array_equal(back[within], want[within])
        top = np.abs(np.asarray(scaled, np.float64)).max(-1)
        assert np.all((top >= 2.0**14) & (top < 2.0**15) | (largest[..., 0] == 0))
    # float32 subnormals (below 2**-126) may be flushed to zero by XLA's arithmetic.
    np.testing.assert_allclose(back, want, rtol=0, atol=max(float(largest.max()) * 2.0**-38, 2.0**-126))


# (head_dim, v_head_dim, latent, page_size, scales, dtype, q_len, heads, kv_heads)
HEAD_DIMS = [
    pytest.param(96, None, False, None, None, BF16, 1, 4, 2, id="d96-contiguous"),  # blocks 64 + 32
    pytest.param(48, 32, False, 64, None, F16, 3, 4, 1, id="mla-like-48-32-paged"),
    pytest.param(16, 128, False, None, "head", BF16, 1, 4, 2, id="narrow-keys-wide-values-fp8"),  # 64 / 512 in small
    pytest.param(80, 64, True, None, None, BF16, 1, 8, 1, id="latent-80-64-mqa"),  # blocks 64 | 16: values, then rope
    pytest.param(80, 64, True, 16, "page", BF16, 2, 4, 1, id="latent-fp8-per-page-16-pages"),
    pytest.param(48, 48, True, 32, None, F32, 1, 2, 2, id="latent-values-are-all-of-k"),
]


@pytest.mark.parametrize("head_dim,v_head_dim,latent,page_size,scales,dtype,q_len,heads,kv_heads", HEAD_DIMS)
def test_head_dims(rng, head_dim, v_head_dim, latent, page_size, scales, dtype, q_len, heads, kv_heads):
    """Head dims that are no power of two (read in column blocks), values with their own head
    dim, and latent caches (absorbed MLA: the values are the keys' first features, one cache)."""
    cache = make_cache(rng, 3, 128, kv_heads, dtype, page_size=page_size, scales=scales, head_dim=head_dim,
                       v_head_dim=v_head_dim, latent=latent)
    check(draw_q(rng, 3, q_len, heads, dtype, head_dim), cache, [128, 0, 45], num_splits=2)


@pytest.mark.parametrize("backend", ["triton", "xla"])
def test_sinks(rng, backend):
    """Attention sinks (a logit per query head in every row's denominator) against the
    reference: a window, a sequence without keys (its rows: 0, lse = the sink), extreme sinks
    (one that takes almost all the weight, one of -inf that is no sink)."""
    cache = make_cache(rng, 3, 128, 2, BF16, page_size=32)
    sinks = jnp.asarray([0.5, -1.0, 30.0, -jnp.inf], jnp.float32)
    check(draw_q(rng, 3, 2, 4, BF16), cache, [128, 0, 45], backend=backend, window=(40, None), sinks=sinks)


def test_latent_cache_matches_separate_values(rng):
    """A latent cache gives the attention of the same cache passed as keys with its leading
    features as a separate value cache (and the reference backend agrees)."""
    cache = make_cache(rng, 2, 64, 1, BF16, head_dim=80, v_head_dim=64, latent=True)
    q, lengths = draw_q(rng, 2, 1, 4, BF16, 80), jnp.asarray([64, 20], jnp.int32)
    latent = flashjax.decode_attention(q, cache.k, None, lengths, v_head_dim=64, backend="triton")
    separate = flashjax.decode_attention(q, cache.k, cache.k[..., :64], lengths, backend="triton")
    reference_path = flashjax.decode_attention(q, cache.k, None, lengths, v_head_dim=64, backend="xla")
    np.testing.assert_array_equal(np.asarray(latent, np.float32), np.asarray(separate, np.float32))
    check_close(latent, reference_path, BF16, "o")


def test_column_blocks():
    assert triton_decode.column_blocks(0, 576) == ((0, 512), (512, 64))
    assert triton_decode.column_blocks(512, 64) == ((512, 64),)
    assert triton_decode.column_blocks(0, 208) == ((0, 128), (128, 64), (192, 16))
    t = triton_decode.DecodeTiling(q_len=1, group=16, block_q=16, block_k=32, page_size=None, num_splits=1,
                                   head_dim=576, v_head_dim=512, latent=True)
    assert t.k_blocks == ((0, 512), (512, 64)) and t.v_blocks == ((0, 512),)


@pytest.mark.parametrize("num_splits", [1, 3, 7])
def test_num_splits(rng, num_splits):
    """Any number of splits merges to the same attention, splits without tiles included
    (the long sequence meets 5 key tiles of 128, the short one 3)."""
    cache = make_cache(rng, 2, 1024, 2, F32, page_size=64)
    check(draw_q(rng, 2, 2, 4, F32), cache, [1000, 300], num_splits=num_splits, window=(600, None))


def test_num_splits_cut_to_the_key_tiles(rng):
    """More splits than key tiles (1000 for 1024 keys in 64-key tiles, the pages) run as one split per tile."""
    cache = make_cache(rng, 2, 1024, 2, F32, page_size=64)
    q, lengths = draw_q(rng, 2, 1, 4, F32), jnp.asarray([1000, 300], jnp.int32)
    kv = KVCache(cache.k, cache.v, lengths, cache.page_table)
    t = triton_decode.tiling(q, kv, 1000, sm_count=0)
    assert (t.block_k, t.num_splits) == (64, 1024 // 64)
    check(q, cache, lengths, num_splits=1000)


@pytest.mark.parametrize(
    "config,page_size",
    [
        pytest.param(flashjax.DecodeConfig(block_k=16, num_stages=3), 64, id="k16-slices-of-pages"),
        pytest.param(flashjax.DecodeConfig(block_k=64, num_warps=8), 16, id="k64-gathers-4-pages"),
        pytest.param(flashjax.DecodeConfig(block_k=32), None, id="k32-contiguous"),
    ],
)
def test_decode_config(rng, config, page_size):
    """A DecodeConfig tiles the kernel (tiles slicing pages, gathering several, or contiguous)
    and the result is the same attention; it selects the Triton backend."""
    cache = make_cache(rng, 2, 256, 2, BF16, page_size=page_size)
    check(draw_q(rng, 2, 3, 4, BF16), cache, [256, 77], config=config, window=(90, None))
    with pytest.raises(ValueError, match="decode config of backend 'triton', not of 'xla'"):
        check(draw_q(rng, 2, 3, 4, BF16), cache, [256, 77], backend="xla", config=config)


def test_decode_config_sets_the_tiling(rng):
    cache = make_cache(rng, 2, 256, 2, BF16, page_size=16)
    kv = KVCache(cache.k, cache.v, jnp.asarray([256, 77], jnp.int32), cache.page_table)
    t = triton_decode.tiling(draw_q(rng, 2, 3, 4, BF16), kv, None, 0, flashjax.DecodeConfig(64, num_warps=8, num_stages=3))
    assert (t.block_k, t.num_warps, t.num_stages, t.pages_per_tile) == (64, 8, 3, 4)
    assert triton_decode.tiling(draw_q(rng, 2, 3, 4, BF16), kv, None, 0).block_k == 128


def test_decode_config_fields_are_checked():
    with pytest.raises(ValueError, match="block_k must be None or a power of two >= 16"):
        flashjax.DecodeConfig(block_k=24)
    with pytest.raises(ValueError, match="num_warps"):
        flashjax.DecodeConfig(num_warps=3)
    with pytest.raises(ValueError, match="decode config must be one of DecodeConfig"):
        backends.choose_decode(_call(), config=flashjax.TritonConfig.default(64, BF16, device_kind=""))


def test_xla_backend(rng):
    """The reference path: pages gathered, float8 dequantised, masked by the lengths."""
    cache = make_cache(rng, 3, 64, 2, BF16, page_size=16, scales="page")
    check(draw_q(rng, 3, 3, 4, BF16), cache, [0, 2, 50], backend="xla", window=(7, None))


def test_jit_vmap_and_traced_lengths(rng):
    cache = make_cache(rng, 2, 64, 1, F32, page_size=16)
    q = draw_q(rng, 2, 1, 2, F32)
    lengths = jnp.array([64, 9], jnp.int32)
    want = flashjax.decode_attention(q, cache.k, cache.v, lengths, page_table=cache.page_table)
    check_close(want, oracle(q, cache, lengths)[0], F32, "o")  # the eager call is the oracle's

    @jax.jit
    def step(q, lengths, table):
        return flashjax.decode_attention(q, cache.k, cache.v, lengths, page_table=table)

    np.testing.assert_allclose(step(q, lengths, cache.page_table), want, rtol=1e-6, atol=1e-6)
    # Traced lengths past the capacity are clamped to it (documented; not checkable).
    np.testing.assert_allclose(step(q, lengths.at[0].set(1000), cache.page_table), want, rtol=1e-6, atol=1e-6)
    # vmap over an extra leading axis of queries and lengths (the cache shared).
    qs, ls = jnp.stack([q, q[::-1]]), jnp.stack([lengths, lengths[::-1]])
    tables = jnp.stack([cache.page_table, cache.page_table[::-1]])
    got = jax.vmap(lambda q, l, t: flashjax.decode_attention(q, cache.k, cache.v, l, page_table=t))(qs, ls, tables)
    np.testing.assert_allclose(got[0], want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got[1], want[::-1], rtol=1e-6, atol=1e-6)


def test_latent_cache_under_jit_and_vmap(rng):
    """A latent cache (v_cache None) under jit, and vmapped over a leading axis of the cache."""
    caches = [make_cache(rng, 2, 64, 1, F32, page_size=16, head_dim=48, v_head_dim=32, latent=True) for _ in range(2)]
    q = draw_q(rng, 2, 1, 2, F32, 48)
    lengths = jnp.array([64, 9], jnp.int32)
    call = lambda q, k, table: flashjax.decode_attention(q, k, None, lengths, page_table=table, v_head_dim=32)
    want = [call(q, c.k, c.page_table) for c in caches]
    assert want[0].shape == (2, 1, 2, 32)
    for w, c in zip(want, caches):  # the eager calls are the oracle's
        check_close(w, oracle(q, c, lengths)[0], F32, "o")
    np.testing.assert_allclose(jax.jit(call)(q, caches[0].k, caches[0].page_table), want[0], rtol=1e-6, atol=1e-6)
    got = jax.vmap(call, in_axes=(None, 0, 0))(q, jnp.stack([c.k for c in caches]),
                                               jnp.stack([c.page_table for c in caches]))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


def check_decode_on_explicit_meshes(*, seed, mesh_shape=(2, 2)):
    """decode_attention on arrays typed on a mesh of Explicit axes (`jax.make_mesh`'s default):
    contiguous and paged, bfloat16 and float8 caches (scales per kv head and per page), with
    sinks and lengths 0 .. capacity, laid out along the batch, the kv heads, both, neither,
    or q and the cache differently: out and lse equal the oracle's, eagerly and under jit,
    the output keeps the cache's batch and head split, the sinks' gradient is the oracle's,
    and a cache laid out as the step runs is never gathered. MQA with q's heads split
    gathers the heads. Runs on 4 CPU devices (tests/multidevice.py) or on the GPUs."""
    P, NamedSharding = jax.sharding.PartitionSpec, jax.sharding.NamedSharding
    mesh = jax.make_mesh(tuple(mesh_shape), ("data", "model"))
    place = lambda x, spec: None if x is None else jax.device_put(x, NamedSharding(mesh, spec))
    rng = np.random.default_rng(seed)
    lengths = jnp.asarray([0, 37, 64, 5], jnp.int32)
    sinks = jnp.asarray(rng.standard_normal(4), F32)
    layouts = [(P("data"), P("data")), (P(None, None, "model"), P(None, None, "model")),
               (P("data", None, "model"), P("data", None, "model")), (P(), P()),
               (P("data"), P(None, None, "model")), (P("data"), P(None, None, "data"))]  # (q's, the cache's)
    configs = ((None, None, BF16, layouts), (16, None, F32, layouts[2:5]), (16, "page", BF16, layouts[2::2]),
               (None, "head", F16, layouts[1::3]))
    for page_size, scales, dtype, config_layouts in configs:
        cache = make_cache(rng, 4, 64, 2, FP8 if scales else dtype, page_size=page_size, scales=scales)
        if page_size is not None:  # a pool of 20 pages (one spare more), to split in two
            grow = lambda x: None if x is None or x.ndim == 1 else jnp.concatenate([x, x[:1]])
            cache = cache._replace(k=grow(cache.k), v=grow(cache.v), k_scale=grow(cache.k_scale) if scales == "page"
                                   else cache.k_scale, v_scale=grow(cache.v_scale) if scales == "page" else cache.v_scale)
        q = draw_q(rng, 4, 2, 4, dtype)
        want_o, want_lse = oracle(q, cache, lengths, sinks=sinks)
        want_dsinks = jax.grad(lambda s: jnp.sum(oracle(q, cache, lengths, sinks=s)[0] * q[..., :1]))(sinks)
        for q_spec, cache_spec in config_layouts:
            batch_spec = P(tuple(q_spec)[0] if tuple(q_spec) else None)
            args = (place(q, q_spec), place(cache.k, cache_spec), place(cache.v, cache_spec),
                    place(lengths, batch_spec))
            options = dict(page_table=place(cache.page_table, P(*batch_spec, None)), k_scale=cache.k_scale,
                           v_scale=cache.v_scale, sinks=sinks, backend="triton")
            step = lambda q, k, v, lengths, **kw: flashjax.decode_attention(q, k, v, lengths, return_lse=True,
                                                                             **(options | kw))
            eager = [step(*args)] if q_spec == config_layouts[0][0] else []
            for got_o, got_lse in (*eager, jax.jit(step)(*args)):
                check_close(got_o, want_o, dtype, f"o {q_spec} {cache_spec} pages {page_size} scales {scales}")
                check_lse(got_lse, want_lse, dtype)
            spec = tuple(jax.typeof(got_o).sharding.spec) + (None,) * 4
            cache_spec = tuple(cache_spec) + (None,) * 4
            # The cache's axes, then q's where the cache has none and does not use them otherwise.
            q_axes = tuple(q_spec) + (None,) * 4
            kept_batch = cache_spec[0] if page_size is None else None
            kept_heads = cache_spec[2]
            kept_batch = kept_batch or (q_axes[0] if q_axes[0] not in (kept_heads,) else None)
            kept_heads = kept_heads or (q_axes[2] if q_axes[2] not in (kept_batch,) else None)
            assert (spec[0], spec[2]) == (kept_batch, kept_heads), (q_spec, cache_spec, spec)
        dsinks = jax.jit(jax.grad(lambda s: jnp.sum(step(*args, sinks=s)[0].astype(F32) * q[..., :1])))(sinks)
        check_close(dsinks, want_dsinks, dtype, "dsinks")
    # A contiguous cache laid out as the step runs: no collective moves it.
    cache = make_cache(rng, 4, 64, 2, BF16)
    spec = P("data", None, "model")
    hlo = jax.jit(lambda q, k, v: flashjax.decode_attention(q, k, v, lengths, backend="triton")).lower(
        place(draw_q(rng, 4, 1, 4, BF16), spec), place(cache.k, spec), place(cache.v, spec)).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo
    # MQA: one kv head cannot be split with q's heads, so the heads are gathered.
    cache = make_cache(rng, 4, 64, 1, F32)
    q = draw_q(rng, 4, 1, 4, F32)
    got = flashjax.decode_attention(place(q, P("data", None, "model")), place(cache.k, P("data")),
                                    place(cache.v, P("data")), lengths, backend="triton")
    check_close(got, oracle(q, cache, lengths)[0], F32, "o mqa")
    assert flashjax.explain_decode(place(q, P("data", None, "model")), place(cache.k, P("data")),
                                   place(cache.v, P("data")), lengths).backend == "triton"


def test_decode_on_explicit_meshes(request):
    run_on_devices(__file__, "check_decode_on_explicit_meshes", seed=zlib.crc32(request.node.nodeid.encode()))


@pytest.mark.gpu
def test_decode_on_explicit_meshes_on_gpus(request):
    """The same over the visible GPUs (2 or more: a 2 x (GPUs / 2) mesh, or GPUs x 1)."""
    gpus = gpus_or_skip("the caches")
    check_decode_on_explicit_meshes(seed=zlib.crc32(request.node.nodeid.encode()),
                                    mesh_shape=(2, gpus // 2) if gpus % 2 == 0 and gpus >= 4 else (gpus, 1))


def test_explain_decode():
    """explain_decode names the backend decode_attention takes and why the ones before it do
    not, from shapes alone; it checks the arguments as decode_attention does (with concrete
    arrays, the lengths' range too)."""
    S = jax.ShapeDtypeStruct
    q, latent = S((2, 1, 16, 80), BF16), S((40, 16, 1, 80), BF16)
    table, lengths = S((2, 20), jnp.int32), S((2,), jnp.int32)
    choice = flashjax.explain_decode(q, latent, None, lengths, page_table=table, v_head_dim=64, return_lse=True)
    assert choice.backend in ("triton", "xla") and str(choice).startswith(f"forward: {choice.backend}")
    assert flashjax.explain_decode(q, latent, None, lengths, page_table=table, v_head_dim=64, backend="xla").backend == "xla"
    odd = S((2, 64, 1, 40), BF16)  # no multiple of 16: the Triton kernel passes, with its reason
    choice = flashjax.explain_decode(S((2, 1, 4, 40), BF16), odd, odd, lengths)
    assert choice.backend == "xla" and any("head_dim 40" in r for name, reasons in choice.passed for r in reasons)
    with pytest.raises(ValueError, match="pass v_head_dim"):
        flashjax.explain_decode(q, latent, None, lengths, page_table=table)
    with pytest.raises(TypeError, match="unexpected keyword"):
        flashjax.explain_decode(q, latent, None, lengths, page_table=table, v_head_dim=64, windw=(1, 1))
    # Concrete arrays: the lengths' range is checked as decode_attention checks it.
    q, cache = jnp.ones((2, 1, 2, 16), BF16), jnp.ones((2, 8, 2, 16), BF16)
    assert flashjax.explain_decode(q, cache, cache, np.array([8, 1])).backend in ("triton", "xla")
    with pytest.raises(ValueError, match=r"kv_lengths must lie in \[0, 8\]"):
        flashjax.explain_decode(q, cache, cache, np.array([9, 1]))
    # The value passed is named, not a clamped one (int64 past int32, negative).
    for bad in (2**40, -5):
        with pytest.raises(ValueError, match=rf"sequence 0 has {bad}\."):
            flashjax.decode_attention(q, cache, cache, np.array([bad, 1]))
    # NumPy scalars are static options, for explain_decode as for decode_attention; sinks are checked.
    numpy_options = dict(scale=np.float32(0.3), softcap=np.float32(5.0), causal=np.True_, num_splits=np.int64(2))
    assert flashjax.explain_decode(q, cache, cache, np.array([8, 1]), **numpy_options).backend in ("triton", "xla")
    with pytest.raises(ValueError, match="sinks must have shape"):
        flashjax.explain_decode(q, cache, cache, np.array([8, 1]), sinks=jnp.zeros(3))


def test_gradient_raises(rng):
    cache = make_cache(rng, 1, 32, 1, F32)
    q = draw_q(rng, 1, 1, 2, F32)
    lengths = jnp.array([5], jnp.int32)
    decode = lambda q: flashjax.decode_attention(q, cache.k, cache.v, lengths, backend="xla")
    with pytest.raises(NotImplementedError, match="decode_attention is forward only.*flash_attention"):
        jax.grad(lambda q: decode(q).sum())(q)
    # Under stop_gradient (a teacher's or a sampler's output inside a differentiated loss) the
    # step runs and no gradient is asked of it.
    w = jnp.float32(3.0)
    grad = jax.grad(lambda w: w * jax.lax.stop_gradient(decode(q * w)).sum())(w)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(jnp.sum(decode(q * w))), rtol=1e-6)


def _call(**overrides) -> DecodeCall:
    fields = dict(batch=1, q_len=1, heads=8, kv_heads=2, head_dim=64, dtype=jnp.dtype(BF16), cache_dtype=jnp.dtype(BF16),
                  capacity=1024, platform="cpu")
    return DecodeCall(**{**fields, **overrides})


def test_choice():
    """auto takes the Triton kernel where it can (on an H100 too: the Hopper decode path,
    as fast, is passed by with its reason), else the reference; a named backend that cannot
    raises with its reasons."""
    hopper = dict(platform="gpu", compute_capability="9.0", kv_heads=8, head_dim=128)
    for capacity in (1 << 16, 1 << 17):  # 2 and 4 GiB
        choice = backends.choose_decode(_call(**hopper, batch=8, capacity=capacity))
        ((passed, reasons),) = choice.passed
        assert choice.backend == "triton" and passed == "mosaic" and "as fast" in reasons[0]
    assert backends.choose_decode(_call()).backend == "triton"
    assert backends.choose_decode(_call(capacity=1000)).backend == "triton"  # a ragged last key tile
    for unsupported in (dict(head_dim=40), dict(capacity=12), dict(page_size=24), dict(dtype=jnp.dtype(jnp.float64))):
        assert backends.choose_decode(_call(**unsupported)).backend == "xla", unsupported
        with pytest.raises(NotImplementedError, match="backend='triton'"):
            backends.choose_decode(_call(**unsupported), "triton")
    fp8_on_ampere = _call(platform="gpu", compute_capability="8.0", cache_dtype=jnp.dtype(FP8))
    assert backends.choose_decode(fp8_on_ampere).backend == "xla"
    # Without a GPU, auto passes interpret mode by for large calls; a named triton still runs.
    big = _call(batch=64, heads=32, capacity=1 << 17)
    assert backends.choose_decode(big).backend == "xla"
    assert backends.choose_decode(big, "triton").backend == "triton"
    with pytest.raises(NotImplementedError, match="sm90"):
        backends.choose_decode(_call(), "mosaic")
    assert backends.choose_decode(_call(platform="gpu", compute_capability="9.0"), "mosaic").backend == "mosaic"


HOPPER_DECODE_REFUSALS = [
    (dict(page_size=16), "page_size 16"), (dict(page_size=96), "page_size 96"),
    (dict(cache_dtype=jnp.dtype(FP8)), "float8_e4m3fn cache"),
    (dict(window=(64, None)), "a window"), (dict(q_len=4, causal=True), "causal with q_len 4"),
    (dict(capacity=1000), "no multiple of 128"), (dict(head_dim=96), "head_dim 96"),
    (dict(v_head_dim=32), "v head_dim 32 != head_dim 64"), (dict(v_head_dim=32, latent=True), "a latent cache"),
    (dict(dtype=jnp.dtype(F32), cache_dtype=jnp.dtype(F32)), "float32 queries"),
]


@pytest.mark.parametrize("overrides,reason", HOPPER_DECODE_REFUSALS)
def test_hopper_decode_refusals(overrides, reason):
    """What the Hopper decode path (the forward kernel on a split cache) cannot take."""
    from flashjax.kernels.mosaic import decode as mosaic_decode

    call = _call(platform="gpu", compute_capability="9.0", **overrides)
    assert any(reason in r for r in mosaic_decode.supports(call)), mosaic_decode.supports(call)
    assert mosaic_decode.supports(_call(platform="gpu", compute_capability="9.0", q_len=4, causal=False)) == []
    for page_size in (64, 192, 256):
        assert mosaic_decode.supports(_call(platform="gpu", compute_capability="9.0", page_size=page_size)) == []


# (batch, q_len, heads, kv_heads, capacity, page_size, causal, softcap, lengths, num_splits)
HOPPER_DECODE = [
    pytest.param(4, 1, 8, 2, 512, None, True, None, [0, 1, 300, 512], None, id="gqa4-q1-cpu-splits"),
    pytest.param(2, 1, 4, 1, 512, None, True, 30.0, [129, 384], 4, id="mqa-q1-softcap-4-splits"),
    pytest.param(2, 3, 4, 2, 256, None, False, None, [2, 255], 2, id="gqa2-q3-full"),
    pytest.param(1, 1, 2, 2, 384, None, True, None, [383], 3, id="mha-q1-3-splits"),
    # Paged: 7 pages a sequence in 3 splits of 3 (the table padded by 2 pages), and one split.
    pytest.param(3, 1, 8, 2, 448, 64, True, None, [0, 65, 448], 3, id="paged64-gqa4-3-splits-padded-table"),
    pytest.param(2, 2, 4, 1, 512, 128, False, 20.0, [1, 300], 1, id="paged128-mqa-q2-softcap-1-split"),
]


@pytest.mark.parametrize("batch,q_len,heads,kv_heads,capacity,page_size,causal,softcap,lengths,num_splits",
                         HOPPER_DECODE)
def test_hopper_decode_splits_and_merges(rng, batch, q_len, heads, kv_heads, capacity, page_size, causal, softcap,
                                         lengths, num_splits):
    """The Hopper decode path's own work, on every machine: the cache split into batch rows in
    place (a paged cache's table cut into rows of pages), the group's query heads as rows, the
    kv lengths per split, the merge. The forward it runs on the splits is the reference here,
    reading the pages through the table it is given (tests/test_mosaic.py runs the kernel on
    a GPU); against the oracle, with empty splits and sequences of length 0."""
    check_hopper_decode(rng, batch, q_len, heads, kv_heads, capacity, page_size, causal, softcap, lengths, num_splits)


def _reference_forward(q, k, v, extras, params, config, page_table=None):
    """The Hopper backend's forward as the reference computes it, for the decode path's own
    tests: with `page_table`, batch row r's keys are the pages page_table[r] in order."""
    up = lambda x: x.astype(F32)
    if page_table is not None:
        rows, pages = page_table.shape
        k, v = (x[page_table].reshape(rows, pages * x.shape[1], *x.shape[2:]) for x in (k, v))
    return reference.attention(up(q), up(k), up(v), kv_lengths=extras.kv_lengths, scale=params.scale,
                               softcap=params.softcap, causal=params.causal, return_lse=True)


def check_hopper_decode(rng, batch, q_len, heads, kv_heads, capacity, page_size, causal, softcap, lengths, num_splits):
    """The Hopper decode path (`kernels/mosaic/decode.py`) on `_reference_forward` against the
    oracle: output and lse, bf16."""
    from flashjax.kernels.mosaic import decode as mosaic_decode
    from flashjax.params import DecodeParams, KVCache

    cache = make_cache(rng, batch, capacity, kv_heads, BF16, page_size=page_size)
    q = draw_q(rng, batch, q_len, heads, BF16)
    lengths = jnp.asarray(lengths, jnp.int32)
    params = DecodeParams(scale=D**-0.5, causal=causal, softcap=softcap, num_splits=num_splits, backend="mosaic")
    got_o, got_lse = mosaic_decode.decode(q, KVCache(cache.k, cache.v, lengths, cache.page_table), params,
                                          forward=_reference_forward)
    want_o, want_lse = oracle(q, cache, lengths, causal=causal, softcap=softcap)
    # float32: decode_attention rounds it to q's dtype after folding any sinks in.
    assert got_o.dtype == F32 and got_o.shape == q.shape
    check_close(got_o, want_o, BF16, "o")
    check_lse(got_lse, want_lse, BF16)


def test_num_splits_heuristic():
    # An H100 (132 SMs), 8 kv heads, one query tile, tiles of 128 keys.
    splits = lambda batch, keys: triton_decode.num_splits(programs=batch * 8, key_tiles=keys // 128, sm_count=132)
    assert splits(1, 32768) == 33 and splits(64, 32768) == 1
    # 5 splits would make 320 programs: 36 SMs with 3, 96 with 2; 6 make 384, 3 on 120 SMs.
    assert splits(8, 32768) == 6
    assert splits(1, 512) == 2  # each split reads at least MIN_TILES_PER_SPLIT tiles
    assert triton_decode.num_splits(programs=8, key_tiles=1000, sm_count=0) == triton_decode.CPU_SPLITS
    assert triton_decode.num_splits(programs=1, key_tiles=1, sm_count=0) == 1


# ---- argument errors ----------------------------------------------------------------------
def _args(paged=False, **overrides):
    q = jnp.zeros((2, 1, 4, D), F32)
    cache = jnp.zeros((5, 16, 2, D), F32) if paged else jnp.zeros((2, 64, 2, D), F32)
    args = dict(q=q, k_cache=cache, v_cache=cache, kv_lengths=jnp.array([3, 4], jnp.int32))
    if paged:
        args["page_table"] = jnp.array([[0, 1], [2, 3]], jnp.int32)
    return {**args, **overrides}


FP8_PAGES = jnp.zeros((5, 16, 2, D), FP8)
BAD = [
    pytest.param(dict(q=jnp.zeros((2, 4, D), F32)), "q must have rank 4", id="q-rank"),
    pytest.param(dict(k_cache=jnp.zeros((2, 64, 2, 16), F32), v_cache=jnp.zeros((2, 64, 2, 16), F32)), "same head_dim", id="head-dim"),
    pytest.param(dict(v_cache=jnp.zeros((2, 32, 2, D), F32)), "must have the same shape but for the head dim", id="kv-shape"),
    pytest.param(dict(v_cache=None), "pass v_head_dim", id="latent-no-v-head-dim"),
    pytest.param(dict(v_cache=None, v_head_dim=D + 1), r"v_head_dim must be an int in \[1, k_cache's head_dim = 32\]", id="latent-too-wide"),
    pytest.param(dict(v_cache=None, v_head_dim=16.0), "v_head_dim must be an int", id="latent-float-dim"),
    pytest.param(dict(v_head_dim=16), "is for a latent cache", id="v-head-dim-with-v-cache"),
    pytest.param(dict(v_cache=jnp.zeros((2, 64, 2, 16), BF16)), "must share one dtype", id="kv-dtype"),
    pytest.param(dict(k_cache=jnp.zeros((2, 64, 3, D), F32), v_cache=jnp.zeros((2, 64, 3, D), F32)), "multiple of the caches' kv_heads", id="heads"),
    pytest.param(dict(k_cache=jnp.zeros((3, 64, 2, D), F32), v_cache=jnp.zeros((3, 64, 2, D), F32)), "pass page_table", id="batch"),
    pytest.param(dict(k_cache=jnp.zeros((2, 64, 2, D), BF16), v_cache=jnp.zeros((2, 64, 2, D), BF16)), "q's dtype", id="dtype"),
    pytest.param(dict(q=jnp.zeros((2, 1, 4, D), jnp.int32)), "unsupported dtype", id="q-int"),
    pytest.param(dict(kv_lengths=None), "kv_lengths is required", id="no-lengths"),
    pytest.param(dict(kv_lengths=jnp.array([3], jnp.int32)), r"kv_lengths must have shape \(2,\)", id="lengths-shape"),
    pytest.param(dict(kv_lengths=jnp.array([3.0, 4.0])), "kv_lengths must be integers", id="lengths-float"),
    pytest.param(dict(kv_lengths=jnp.array([3, 65], jnp.int32)), r"in \[0, 64\].*sequence 1 has 65", id="lengths-long"),
    pytest.param(dict(kv_lengths=jnp.array([-1, 4], jnp.int32)), r"sequence 0 has -1", id="lengths-negative"),
    pytest.param(dict(window=(3,)), "window must be a pair", id="window"),
    pytest.param(dict(softcap=-1.0), "softcap must be", id="softcap"),
    pytest.param(dict(num_splits=0), "num_splits must be", id="splits"),
    pytest.param(dict(causal="yes"), "causal must be a bool", id="causal"),
    pytest.param(dict(k_scale=jnp.ones(2)), "k_scale is for a float8_e4m3fn cache", id="scale-not-fp8"),
    pytest.param(dict(sinks=jnp.zeros(3)), r"sinks must have shape \(4,\)", id="sinks-shape"),
]
BAD_PAGED = [
    pytest.param(dict(page_table=jnp.array([0, 1], jnp.int32)), "page_table must have shape", id="table-rank"),
    pytest.param(dict(page_table=jnp.zeros((3, 2), jnp.int32)), r"page_table must have shape \(batch=2", id="table-batch"),
    pytest.param(dict(page_table=jnp.zeros((2, 2), F32)), "page_table must be integers", id="table-float"),
    pytest.param(dict(kv_lengths=jnp.array([3, 33], jnp.int32)), r"in \[0, 32\] \(the cache's pages_per_seq \* page_size\)", id="lengths-paged"),
    pytest.param(dict(page_table=jnp.array([[0, 1], [5, 3]], jnp.int32)), r"page_table\[1, 0\] = 5 is not a page", id="table-range"),
    pytest.param(dict(k_cache=FP8_PAGES, v_cache=FP8_PAGES), "needs k_scale", id="fp8-no-scale"),
    pytest.param(dict(k_cache=FP8_PAGES, v_cache=FP8_PAGES, k_scale=jnp.ones(3), v_scale=jnp.ones(2)), r"k_scale must have shape \(2,\) or \(5, 2\)", id="fp8-scale-shape"),
    pytest.param(dict(k_cache=FP8_PAGES, v_cache=FP8_PAGES, k_scale=jnp.ones(2), v_scale=jnp.ones((5, 2))), "must both be per kv head or both per page", id="fp8-scale-mix"),
    pytest.param(dict(k_cache=FP8_PAGES, v_cache=None, v_head_dim=16, k_scale=jnp.ones(2), v_scale=jnp.ones(2)), "share k_scale", id="latent-v-scale"),
]


@pytest.mark.parametrize("overrides,message", BAD)
def test_bad_arguments(overrides, message):
    with pytest.raises(ValueError, match=message):
        flashjax.decode_attention(**_args(**overrides))


def test_sinks_round_the_output_once(rng):
    """With sinks, a bf16 output is rounded once, after the sinks are folded in (in the layer
    every backend shares): each element of the exact backend within half a bf16 ulp (plus
    float32 noise) of the float32 result; folding the sinks into an output already rounded to
    bf16 errs by up to a whole ulp. (The kernels' own error, from probabilities rounded to
    bf16 for the tensor cores, is relative to a row's values, not to each element.)"""
    backend = "xla"
    cache = make_cache(rng, 4, 64, 2, BF16)
    q, lengths = draw_q(rng, 4, 4, 8, BF16), [64, 40, 17, 5]
    sinks = jnp.asarray(rng.normal(0.0, 2.0, 8), F32)
    got = flashjax.decode_attention(q, cache.k, cache.v, jnp.asarray(lengths, jnp.int32), sinks=sinks, backend=backend)
    want = np.asarray(oracle(q, cache, lengths, sinks=sinks)[0])
    ulp = 2.0 ** (np.floor(np.log2(np.abs(want) + 1e-30)) - 7)  # bf16: 8 significant bits
    ulps = np.abs(np.asarray(got.astype(F32)) - want) / ulp
    assert got.dtype == BF16 and ulps.max() <= 0.55, ulps.max()


def test_traced_page_table_entries_clamp_before_the_int32_cast(rng):
    """Under x64 a traced int64 page-table entry past int32's range is clamped to the last
    page, as the docstring says, not wrapped into range by the cast to int32."""
    with jax.enable_x64(True):
        cache = make_cache(rng, 2, 64, 2, F32, page_size=16)
        q = draw_q(rng, 2, 1, 4, F32)
        step = jax.jit(lambda table: flashjax.decode_attention(q, cache.k, cache.v, jnp.asarray([64, 64]),
                                                              page_table=table))
        table = cache.page_table.astype(jnp.int64)
        last = cache.k.shape[0] - 1
        got = step(table.at[1, 0].set(2**32))  # wraps to page 0 if cast first
        np.testing.assert_array_equal(np.asarray(got), np.asarray(step(table.at[1, 0].set(last))))
        assert not np.array_equal(np.asarray(got), np.asarray(step(table.at[1, 0].set(0))))


@pytest.mark.parametrize("overrides,message", BAD_PAGED)
def test_bad_paged_arguments(overrides, message):
    with pytest.raises(ValueError, match=message):
        flashjax.decode_attention(**_args(paged=True, **overrides))


def test_unused_page_table_entries_are_not_checked(rng):
    """Entries past a sequence's last page may hold anything (e.g. -1): they are not checked."""
    args = _args(paged=True, page_table=jnp.array([[0, -1], [2, 3]], jnp.int32), kv_lengths=jnp.array([16, 20], jnp.int32))
    assert flashjax.decode_attention(**args).shape == (2, 1, 4, D)


# ---- random combinations (hypothesis) -----------------------------------------------------
from hypothesis import HealthCheck, Phase, given, note, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_EXAMPLES = 25 * (10 if os.environ.get("FLASHJAX_HYPOTHESIS_PROFILE") == "thorough" else 1)


@st.composite
def decode_cases(draw):
    """A decode call: cache kind and page size, dtype, head dims (values of their own, or a
    latent cache), q_len, GQA ratio, lengths (0 and the capacity included), causal, window,
    softcap, sinks, splits and tiling, all drawn together."""
    kind = draw(st.sampled_from(["contiguous", "paged", "fp8-head", "fp8-page"]))
    head_dim, v_head_dim, latent = draw(st.sampled_from(
        [(D, None, False), (D, None, False), (48, 16, False), (16, 64, False), (48, 32, True), (32, 32, True)]))
    dtype = draw(st.sampled_from([F32, BF16, F16]))
    page_size = None if kind == "contiguous" else draw(st.sampled_from([16, 32, 64, 128]))
    # A contiguous cache of any length (a ragged last key tile); pages hold whole tiles.
    capacity = draw(st.sampled_from([128, 101, 83])) if page_size is None else 128
    heads, kv_heads = draw(st.sampled_from([(4, 2), (4, 1), (2, 2)]))
    batch = draw(st.integers(1, 3))
    lengths = draw(st.lists(st.sampled_from([0, 1, 17, 64, 100, 127, 128]), min_size=batch, max_size=batch))
    lengths = [min(length, capacity) for length in lengths]
    causal = draw(st.booleans())
    left = draw(st.sampled_from([None, 0, 9, 50]))
    right = 0 if causal else draw(st.sampled_from([None, 0, 3]))
    window = None if (left is None and right in (None, 0) and draw(st.booleans())) else (left, right)
    return dict(
        kind=kind, dtype=dtype, capacity=capacity, page_size=page_size, heads=heads, kv_heads=kv_heads,
        head_dim=head_dim, v_head_dim=v_head_dim, latent=latent,
        batch=batch, lengths=lengths, q_len=draw(st.sampled_from([1, 2, 5])), causal=causal, window=window,
        softcap=draw(st.sampled_from([None, 20.0])), num_splits=draw(st.sampled_from([None, 1, 3])),
        sinks=draw(st.booleans()),
        config=draw(st.sampled_from([None, flashjax.DecodeConfig(block_k=16), flashjax.DecodeConfig(block_k=32)])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@settings(max_examples=_EXAMPLES, deadline=None, derandomize=True, database=None,
          phases=(Phase.explicit, Phase.generate), suppress_health_check=[HealthCheck.too_slow])
@given(case=decode_cases())
def test_random_combinations_match_reference(case):
    """The Triton decode kernel on random combinations of every option: output and lse equal
    the reference on the dequantised cache (queries without keys: 0 and lse -inf)."""
    note(repr(case))
    rng = np.random.default_rng(case["seed"])
    scales = {"fp8-head": "head", "fp8-page": "page"}.get(case["kind"])
    cache = make_cache(rng, case["batch"], case["capacity"], case["kv_heads"], case["dtype"],
                       page_size=case["page_size"], scales=scales, head_dim=case["head_dim"],
                       v_head_dim=case["v_head_dim"], latent=case["latent"])
    q = draw_q(rng, case["batch"], case["q_len"], case["heads"], case["dtype"], case["head_dim"])
    sinks = jnp.asarray(rng.normal(0.0, 2.0, case["heads"]), jnp.float32) if case["sinks"] else None
    check(q, cache, case["lengths"], num_splits=case["num_splits"], config=case["config"],
          causal=case["causal"], window=case["window"], softcap=case["softcap"], sinks=sinks)


@st.composite
def hopper_decode_cases(draw):
    """A call the Hopper decode path takes: a contiguous cache of whole 128-key tiles or a
    paged one (pages of 64-256 keys, 192 among them, 1-7 a sequence), lengths (0, 1 and the capacity
    included), q_len 1 (causal or not) or more without a causal mask, the GQA ratio, softcap
    and the number of splits (at most one a page; a count that does not divide the pages
    pads the table), drawn together."""
    page_size = draw(st.sampled_from([None, 64, 128, 192, 256]))
    capacity = 128 * draw(st.integers(1, 4)) if page_size is None else page_size * draw(st.integers(1, 7))
    batch = draw(st.integers(1, 3))
    lengths = draw(st.lists(st.one_of(st.sampled_from([0, 1, capacity]), st.integers(0, capacity)),
                            min_size=batch, max_size=batch))
    q_len = draw(st.sampled_from([1, 1, 3]))
    heads, kv_heads = draw(st.sampled_from([(4, 2), (4, 1), (2, 2), (8, 2)]))
    return dict(batch=batch, q_len=q_len, heads=heads, kv_heads=kv_heads, capacity=capacity, page_size=page_size,
                causal=q_len == 1 and draw(st.booleans()), softcap=draw(st.sampled_from([None, 20.0])),
                lengths=lengths, num_splits=draw(st.sampled_from([None, 1, 2, 3, 5, 9])),
                seed=draw(st.integers(0, 2**31 - 1)))


@settings(max_examples=_EXAMPLES, deadline=None, derandomize=True, database=None,
          phases=(Phase.explicit, Phase.generate), suppress_health_check=[HealthCheck.too_slow])
@given(case=hopper_decode_cases())
def test_hopper_decode_random_splits(case):
    """The Hopper decode path's splitting, table cutting and merge on random caches, lengths
    and split counts, against the oracle (the forward on the splits is the reference)."""
    note(repr(case))
    case = dict(case)
    check_hopper_decode(np.random.default_rng(case.pop("seed")), **case)

"""Counter-based dropout: the keep mask is a pure function of (seed, batch, head, row, col).

FlashAttention (Algorithm 2 of the paper) never stores the N x N dropout mask:
the forward draws it tile by tile and the backward regenerates exactly the same
bits from the same counters. These functions use only integer multiplies, xors
and logical shifts on uint32, so the same code runs inside the Pallas kernels
and in the reference, and both see bit-identical masks.

The hash is "lowbias32" (Chris Wellons' integer hash, a MurmurHash3-style
finaliser with better avalanche); a row hash and a column hash are chained so
that every (row, pair of columns) gets an independent 32-bit draw without a 64-bit
counter. Keys k and k + 64 of each 128-key block share a draw and take one 16-bit
half each (`PAIR_BLOCK`): a kernel whose tile holds both keys in one thread's
registers (the Hopper forward and dQ kernels, 128-key tiles) hashes once per two
weights; the others draw per key and pick the half, the same bits. The drop rate
is rounded to a multiple of 2**-16, and kept weights are scaled by the reciprocal of
the probability of keeping one (`keep_scale`), so that dropout leaves every weight's
expectation unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["seed_words", "keep_mask", "tile_keep", "keep_threshold", "keep_scale", "PAIR_BLOCK"]

_GOLDEN = 0x9E3779B9
# Keys k and k + PAIR_BLOCK // 2 of each PAIR_BLOCK-key block (aligned) share a 32-bit draw:
# the first takes its low 16 bits, the second its high 16 bits.
PAIR_BLOCK = 128


def _u32(x):
    return jnp.asarray(x, jnp.uint32) if not hasattr(x, "dtype") else x.astype(jnp.uint32)


def _fold(x):
    """x ^ (x >> 16): lowbias32's first step. It distributes over xor, _fold(a ^ b) =
    _fold(a) ^ _fold(b), so a row key and a column position can each be folded once and
    the pair's fold is one xor (`keep_bits`)."""
    return x ^ (x >> 16)


def _mix(x):
    """lowbias32's steps after the first fold."""
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    x = x ^ (x >> 16)
    return x


def hash32(x):
    """lowbias32: a bijective avalanche hash of uint32."""
    return _mix(_fold(x))


def keep_threshold(rate: float) -> int:
    """An element is kept when its 16 random bits are >= this (P(keep) = 1 - rate, the rate
    rounded to a multiple of 2**-16, at most 1 - 2**-16)."""
    return min(int(round(rate * (1 << 16))), (1 << 16) - 1)


def keep_scale(rate: float) -> float:
    """The factor of a kept weight: 1 / P(keep) for the rate as drawn (`keep_threshold`), so
    the expectation of a weight is unchanged; 1 / (1 - rate) to within 2**-17 / (1 - rate)."""
    return float(1 << 16) / ((1 << 16) - keep_threshold(rate))


def seed_words(rng):
    """Two uint32 words derived from a jax.random key (typed or raw uint32[2])."""
    return jax.random.bits(rng, (2,), jnp.uint32)


def stream_base(seed0, seed1, batch_head):
    """The per-(batch, head) stream: mixes the seed with the flattened batch*heads index."""
    return hash32(_u32(seed0) ^ hash32(_u32(batch_head) * jnp.uint32(_GOLDEN) + _u32(seed1)))


def row_keys(base, rows):
    """The per-row keys of one (batch, head) stream for query positions `rows` (int32),
    folded (`_fold`) for `keep_bits`."""
    return _fold(hash32(base ^ (_u32(rows) * jnp.uint32(_GOLDEN))))


def column_words(cols):
    """Key positions `cols` (int32) as their pair's column, (k // 128) * 64 + k % 64,
    folded (`_fold`) for `keep_bits`."""
    cols = _u32(cols)
    half = PAIR_BLOCK // 2
    return _fold((cols >> 1) & jnp.uint32(-half & 0xFFFFFFFF) | cols & jnp.uint32(half - 1))


def column_shifts(cols):
    """Per key position: 16 for the low half of its pair's draw, 0 for the high half."""
    return jnp.where(_u32(cols) & jnp.uint32(PAIR_BLOCK // 2) == 0, jnp.uint32(16), jnp.uint32(0))


def keep_bits(row_key, column_word, column_shift, threshold: int):
    """Keep mask for `row_keys`, `column_words` and `column_shifts` that broadcast together:
    the key's 16 bits of hash32(row hash ^ pair column) against the threshold, the hash's
    first fold done per row and per column. The key's half is shifted to the top, where
    comparing the whole word compares its 16 bits."""
    bits = _mix(row_key ^ column_word)
    return bits << column_shift >= jnp.uint32(threshold << 16)


def keep_pair(row_key, column_word, threshold: int):
    """(keep of the pair's first key, keep of its second) for `row_keys` and the pair's
    `column_words`: one hash for both."""
    bits = _mix(row_key ^ column_word)
    top = jnp.uint32(threshold << 16)
    return bits << 16 >= top, bits >= top


def tile_keep(base, rows, cols, threshold: int):
    """Keep mask for positions rows [bq, 1] x cols [1, bk] (int32) of one (batch, head) stream."""
    return keep_bits(row_keys(base, rows), column_words(cols), column_shifts(cols), threshold)


def keep_mask(seed, rate: float, batch: int, heads: int, seq_q: int, seq_k: int, *, broadcast: bool = False,
              rows=None):
    """The full keep mask [B, H, Tq, Tk] (or [1, 1, Tq, Tk] with `broadcast`) for the
    uint32 [2] `seed_words`, or only the query rows at positions `rows`: XLA use only."""
    nb, nh = (1, 1) if broadcast else (batch, heads)
    batch_head = jnp.arange(nb * nh, dtype=jnp.uint32).reshape(nb, nh, 1, 1)
    base = stream_base(seed[0], seed[1], batch_head)
    rows = jnp.arange(seq_q, dtype=jnp.int32)[:, None] if rows is None else rows.astype(jnp.int32)[:, None]
    cols = jnp.arange(seq_k, dtype=jnp.int32)[None, :]
    return tile_keep(base, rows, cols, keep_threshold(rate))

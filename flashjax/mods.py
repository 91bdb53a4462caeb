"""Ready score_mod and mask_mod builders for `flash_attention` (docs/flex.md shows each).

Each builder returns a new function. The arrays a mod closes over (slopes, a bias table,
document ids, prefix lengths) are operands of the kernels and the compiled call is keyed
by the traced program, so rebuilding a mod per step with new arrays of the same shapes
reuses the compilation; a float table gets its gradient.

Positions ``q_idx`` and ``kv_idx`` are the plain indices in the call's arrays; with
``q_len != kv_len`` pass ``offset = kv_len - q_len`` to align queries to the bottom
right as the built-in options do.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

__all__ = [
    "alibi", "t5_relative_bucket", "t5_relative_bias", "tanh_softcap",
    "causal", "prefix_lm", "document_window", "chunked",
]


# ---- score_mods ------------------------------------------------------------------------------
def alibi(slopes, offset: int = 0):
    """ALiBi: ``score - slopes[head] * |q_idx + offset - kv_idx|`` (slopes float [heads]).

    The same logits as ``alibi_slopes=slopes`` with ``offset = kv_len - q_len``. The positions
    are converted to float32 before they are subtracted (exact below 2**24): in the kernels a
    conversion per row and per column rather than per score.
    """

    slopes = jnp.asarray(slopes)  # NumPy arrays too (a mod indexes with traced positions)

    def score_mod(score, batch, head, q_idx, kv_idx):
        distance = jnp.abs((q_idx + offset).astype(jnp.float32) - kv_idx.astype(jnp.float32))
        return score - slopes[head] * distance

    return score_mod


def t5_relative_bucket(relative_position, *, bidirectional: bool = True, num_buckets: int = 32,
                       max_distance: int = 128):
    """T5's bucket of ``kv_idx - q_idx``: exact up to num_buckets / 4 (per side), then logarithmic
    up to max_distance (as in T5's ``_relative_position_bucket``)."""
    bucket = 0
    n = -relative_position
    if bidirectional:
        num_buckets //= 2
        bucket = jnp.where(n < 0, num_buckets, 0)
        n = jnp.abs(n)
    else:
        n = jnp.maximum(n, 0)
    max_exact = num_buckets // 2
    # log of at least max_exact: the large branch is only taken there (no log(0)).
    large = max_exact + (
        jnp.log(jnp.maximum(n, max_exact).astype(jnp.float32) / max_exact)
        / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).astype(jnp.int32)
    large = jnp.minimum(large, num_buckets - 1)
    return bucket + jnp.where(n < max_exact, n, large)


def t5_relative_bias(table, *, bidirectional: bool = True, max_distance: int = 128):
    """T5 relative position bias: ``score + table[head, bucket(kv_idx - q_idx)]``.

    ``table`` is float [heads, num_buckets], typically a learned parameter: its gradient
    is returned like any input's.
    """
    table = jnp.asarray(table)
    num_buckets = table.shape[1]

    def score_mod(score, batch, head, q_idx, kv_idx):
        bucket = t5_relative_bucket(kv_idx - q_idx, bidirectional=bidirectional, num_buckets=num_buckets,
                                    max_distance=max_distance)
        return score + table[head, bucket]

    return score_mod


def tanh_softcap(cap: float):
    """``cap * tanh(score / cap)`` (Gemma 2): the built-in ``softcap=cap``, as a score_mod."""

    def score_mod(score, batch, head, q_idx, kv_idx):
        return cap * jnp.tanh(score / cap)

    return score_mod


# ---- mask_mods -------------------------------------------------------------------------------
def causal(offset: int = 0):
    """``kv_idx <= q_idx + offset``: the built-in ``causal=True`` with ``offset = kv_len - q_len``."""

    def mask_mod(batch, head, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    return mask_mod


def prefix_lm(prefix_lengths):
    """Prefix LM: every query sees the first ``prefix_lengths[batch]`` keys (the prefix, attended
    bidirectionally) and the keys up to itself (causal after it). ``prefix_lengths``: int [batch]."""

    prefix_lengths = jnp.asarray(prefix_lengths)

    def mask_mod(batch, head, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (kv_idx < prefix_lengths[batch])

    return mask_mod


def document_window(document_ids, left: int):
    """Packed documents with a causal sliding window: a query sees the keys of its own document
    among the ``left`` before it and itself (self-attention; ``document_ids``: int [batch, seq]).

    The same pairs as ``segment_ids=document_ids, causal=True, window=(left, 0)``.
    """

    document_ids = jnp.asarray(document_ids)

    def mask_mod(batch, head, q_idx, kv_idx):
        same = document_ids[batch, q_idx] == document_ids[batch, kv_idx]
        return same & (kv_idx <= q_idx) & (q_idx - kv_idx <= left)

    return mask_mod


def chunked(chunk_size: int):
    """Chunked attention (Llama 4's local layers): causal within chunks of ``chunk_size`` tokens."""

    def mask_mod(batch, head, q_idx, kv_idx):
        return (q_idx // chunk_size == kv_idx // chunk_size) & (kv_idx <= q_idx)

    return mask_mod

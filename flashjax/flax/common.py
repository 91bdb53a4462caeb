"""Helpers shared by the linen and nnx modules: head sizes and the KV cache update."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

__all__ = ["head_dim_of", "update_cache"]


def head_dim_of(num_heads: int, kv_heads: int, head_dim: int | None, qkv_features: int) -> int:
    """The per-head size: ``head_dim`` if given, else ``qkv_features // num_heads`` (checked)."""
    if num_heads % kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({kv_heads}).")
    if head_dim is not None:
        return head_dim
    if qkv_features % num_heads:
        raise ValueError(f"qkv_features ({qkv_features}) must be divisible by num_heads ({num_heads}).")
    return qkv_features // num_heads


def update_cache(cached_key, cached_value, index, key, value):
    """Write one step's K/V at ``index`` into the caches ``[batch..., max_len, kv_heads, head_dim]``.

    Returns the updated caches and the number of filled slots (``index + 1``).
    """
    *batch_dims, _, kv_heads, head_dim = cached_key.shape
    expected = tuple(batch_dims) + (1, kv_heads, head_dim)
    if key.shape != expected:
        raise ValueError(
            f"decode feeds one position at a time: expected key/value of shape {expected} "
            f"(from the cache {cached_key.shape}), got {key.shape}."
        )
    zero = jnp.zeros((), index.dtype)
    start = (zero,) * len(batch_dims) + (index, zero, zero)
    key = lax.dynamic_update_slice(cached_key, key.astype(cached_key.dtype), start)
    value = lax.dynamic_update_slice(cached_value, value.astype(cached_value.dtype), start)
    return key, value, index + 1

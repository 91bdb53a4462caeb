"""The call flow shared by the linen and nnx modules: head sizes, the KV-cache step and the attention call."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

__all__ = ["head_dim_of", "update_cache", "default_inputs", "attend"]


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


def default_inputs(inputs_q, inputs_k, inputs_v):
    """Self-attention defaults: keys from the queries' input, values from the keys'."""
    inputs_k = inputs_q if inputs_k is None else inputs_k
    return inputs_q, inputs_k, inputs_k if inputs_v is None else inputs_v


def attend(module, query, key, value, *, mask, bias, dropout_rng, deterministic, cache=None):
    """Attention of projected ``query`` [batch..., q_len, heads, head_dim] over ``key``/``value``,
    with the module's options (causal, dropout, dtype, backend, config).

    ``cache``: ``(cached_key, cached_value, index)`` in decode mode: this step's K/V are
    written at ``index`` and the query attends the filled part of the cache (kv_length
    bounds the keys, so the kernels skip the empty slots instead of reading a mask).

    Returns:
      (output [batch..., q_len, heads, head_dim], the updated cache or None).
    """
    from flashjax.flax.attention_fn import _attention_fn

    kv_length, causal, new_cache = None, module.causal, None
    if cache is not None:
        key, value, kv_length = update_cache(*cache, key, value)
        new_cache = (key, value, kv_length)
        causal = False  # one query against the filled part of the cache
    out = _attention_fn(
        query, key, value, bias=bias, mask=mask, broadcast_dropout=module.broadcast_dropout,
        dropout_rng=dropout_rng, dropout_rate=module.dropout_rate, deterministic=deterministic,
        dtype=module.dtype, causal=causal, backend=module.backend, config=module.config, kv_length=kv_length,
    )
    return out, new_cache

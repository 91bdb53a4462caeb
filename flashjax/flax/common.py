"""The call flow shared by the linen and nnx modules: head sizes, the KV cache, the decode step and the attention call."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from flashjax.decode import decode_attention, explain_decode
from flashjax.flax.attention_fn import _attention_fn, check_dropout_rate

__all__ = ["head_dim_of", "update_cache", "paged_cache_layout", "update_paged_cache", "decode_step", "default_inputs", "attend"]


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
    """Write ``steps`` new positions' K/V at ``index`` into the caches ``[batch..., max_len, kv_heads, head_dim]``.

    ``key``/``value``: ``[batch..., steps, kv_heads, head_dim]`` (one position per decode
    step; a prompt chunk at once for prefill). Returns the updated caches and the number of
    filled slots (``index + steps``). A concrete ``index + steps`` past ``max_len`` raises;
    under ``jit`` the write is clamped into the cache by XLA (keep ``index + steps <=
    max_len``).
    """
    *batch_dims, max_len, kv_heads, head_dim = cached_key.shape
    steps = key.shape[-3] if key.ndim >= 3 else 0
    expected = (*batch_dims, steps, kv_heads, head_dim)
    if key.shape != expected or value.shape != expected or steps < 1:
        raise ValueError(
            f"decode feeds new positions [batch..., steps, kv_heads, head_dim] = {expected} with steps >= 1 "
            f"(from the cache {cached_key.shape}), got key {key.shape} and value {value.shape}."
        )
    _check_fits(index, steps, max_len, "the KV cache holds")
    zero = jnp.zeros((), index.dtype)
    start = (zero,) * len(batch_dims) + (index, zero, zero)
    key = lax.dynamic_update_slice(cached_key, key.astype(cached_key.dtype), start)
    value = lax.dynamic_update_slice(cached_value, value.astype(cached_value.dtype), start)
    return key, value, index + steps


def _check_fits(index, steps: int, capacity: int, what: str):
    """Raises when a concrete ``index + steps`` exceeds the capacity (a traced index cannot be checked)."""
    try:
        filled = int(index) + steps
    except (TypeError, jax.errors.ConcretizationTypeError):
        return
    if filled > capacity:
        raise ValueError(f"{what} {capacity} positions per sequence: {int(index)} filled + {steps} new do not fit.")


def paged_cache_layout(cache_shape, page_size):
    """A paged cache for ``cache_shape`` ``[batch, max_len, kv_heads, head_dim]``: the pools'
    shape ``[batch * pages_per_seq, page_size, kv_heads, head_dim]`` and the initial page
    table, int32 ``[batch, pages_per_seq]`` of consecutive pages."""
    if len(cache_shape) != 4 or not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        raise ValueError(f"a paged cache takes one batch dim ([batch, max_len, ...]) and an int page_size >= 1, "
                         f"got a cache of {tuple(cache_shape)} and page_size {page_size!r}.")
    batch, max_len, kv_heads, head_dim = cache_shape
    pages_per_seq = -(-max_len // page_size)
    table = jnp.arange(batch * pages_per_seq, dtype=jnp.int32).reshape(batch, pages_per_seq)
    return (batch * pages_per_seq, page_size, kv_heads, head_dim), table


def update_paged_cache(key_pages, value_pages, page_table, index, key, value):
    """Write ``steps`` new positions' K/V at ``index`` into paged caches.

    ``key_pages``/``value_pages``: ``[num_pages, page_size, kv_heads, head_dim]``; position
    ``p`` of sequence ``b`` lives in page ``page_table[b, p // page_size]`` at row ``p %
    page_size``. ``key``/``value``: ``[batch, steps, kv_heads, head_dim]``. Returns the
    updated pools and ``index + steps``; a concrete ``index + steps`` past the table's
    capacity raises (under ``jit`` keep it within ``pages_per_seq * page_size``).
    """
    num_pages, page_size, kv_heads, head_dim = key_pages.shape
    batch, pages_per_seq = page_table.shape
    steps = key.shape[1] if key.ndim == 4 else 0
    expected = (batch, steps, kv_heads, head_dim)
    if key.shape != expected or value.shape != expected or steps < 1:
        raise ValueError(
            f"a paged cache takes new positions [batch, steps, kv_heads, head_dim] = {expected} with steps >= 1 "
            f"(one batch dim; pages {key_pages.shape}, table {page_table.shape}), got key {key.shape} and value {value.shape}."
        )
    _check_fits(index, steps, pages_per_seq * page_size, "the paged KV cache holds")
    positions = index + jnp.arange(steps, dtype=jnp.int32)
    pages = page_table[:, positions // page_size]  # [batch, steps]
    rows = jnp.broadcast_to(positions % page_size, pages.shape)
    key_pages = key_pages.at[pages, rows].set(key.astype(key_pages.dtype))
    value_pages = value_pages.at[pages, rows].set(value.astype(value_pages.dtype))
    return key_pages, value_pages, index + steps


def decode_step(module, query, cached_key, cached_value, kv_length, page_table=None):
    """The queries of a decode step (or a prefill chunk) over the filled part of the cache,
    through `flashjax.decode_attention` (split-KV: the keys of each sequence spread over
    many programs, each K/V byte read once per kv group).

    ``query`` ``[batch..., steps, heads, head_dim]``; caches ``[batch..., max_len, kv_heads,
    head_dim]``, or paged ``[num_pages, page_size, kv_heads, head_dim]`` with ``page_table``
    ``[batch, pages_per_seq]``, already holding this step's K/V; ``kv_length``: filled
    slots (a scalar).
    Query ``i`` sits at position ``kv_length - steps + i`` and sees the keys up to its own
    position: a chunk of several positions needs ``module.causal`` (without it, one
    position per call, which sees every filled key). The query is cast to
    the cache's dtype (the cache is read in place, never converted) and the output to
    ``module.dtype`` (default: the query's dtype).

    Returns:
      ``[batch..., steps, heads, head_dim]``.
    """
    *batch_dims, steps, heads, head_dim = query.shape
    if steps > 1 and not module.causal:
        # Flax's own modules take one position per decode call, their causality coming from
        # the training mask: a chunk here would see its own later positions, silently.
        raise ValueError(
            f"decode with a prompt chunk of {steps} positions needs a module built with causal=True "
            "(without it every position of the chunk would attend to the chunk's later ones); "
            "build it with causal=True, or feed one position per call."
        )
    out_dtype = module.dtype or query.dtype
    q = query.reshape(-1, steps, heads, head_dim).astype(cached_key.dtype)
    if page_table is None:
        k = cached_key.reshape(-1, *cached_key.shape[-3:])
        v = cached_value.reshape(-1, *cached_value.shape[-3:])
    else:
        k, v = cached_key, cached_value
    lengths = jnp.broadcast_to(jnp.asarray(kv_length, jnp.int32), (q.shape[0],))
    options = dict(page_table=page_table, causal=bool(module.causal))
    # A backend named for training that cannot run this decode call (no decode path, or the
    # Hopper one's limits: a causal prompt chunk, a float32 cache) leaves the choice to auto,
    # so that one module serves both.
    backend = module.backend
    if backend != "auto":
        try:
            explain_decode(q, k, v, lengths, backend=backend, **options)
        except NotImplementedError:
            backend = "auto"
    out = decode_attention(q, k, v, lengths, backend=backend, **options)
    return out.reshape(*batch_dims, steps, heads, head_dim).astype(out_dtype)


def default_inputs(inputs_q, inputs_k, inputs_v):
    """Self-attention defaults: keys from the queries' input, values from the keys'. Values
    without keys are refused, as Flax refuses them (they would pair the queries' input as
    keys with other values)."""
    if inputs_k is None and inputs_v is not None:
        raise ValueError("`inputs_k` cannot be None if `inputs_v` is not None: pass the keys' input too.")
    inputs_k = inputs_q if inputs_k is None else inputs_k
    return inputs_q, inputs_k, inputs_k if inputs_v is None else inputs_v


def attend(module, query, key, value, *, mask, bias, dropout_rng, deterministic, cache=None, is_causal=False):
    """Attention of projected ``query`` [batch..., q_len, heads, head_dim] over ``key``/``value``,
    with the module's options (causal, dropout, dtype, backend, config).

    ``cache``: ``(cached_key, cached_value, index)`` in decode mode, or ``(key_pages,
    value_pages, index, page_table)`` for a paged cache: this step's K/V (``q_len``
    positions) are written at ``index`` and the queries attend the filled part of the
    cache. Without a mask, bias or dropout this is `decode_step`
    (`flashjax.decode_attention`); with one of them (contiguous caches only) it is
    `flashjax.flash_attention` with ``kv_length`` bounding the keys, one position per step.
    ``is_causal``: Flax's top-left aligned causal flag (`_attention_fn`), without a cache.

    Returns:
      (output [batch..., q_len, heads, head_dim], the updated cache or None).
    """
    check_dropout_rate(module.dropout_rate)
    kv_length, causal, new_cache = None, module.causal, None
    if cache is not None and len(cache) == 4:  # paged
        if not (mask is None and bias is None and deterministic):
            raise NotImplementedError("a paged KV cache decodes without a mask, bias or dropout (use a contiguous cache).")
        key_pages, value_pages, index, page_table = cache
        key, value, kv_length = update_paged_cache(key_pages, value_pages, page_table, index, key, value)
        return decode_step(module, query, key, value, kv_length, page_table), (key, value, kv_length, page_table)
    if cache is not None:
        key, value, kv_length = update_cache(*cache, key, value)
        new_cache = (key, value, kv_length)
        if mask is None and bias is None and deterministic:
            return decode_step(module, query, key, value, kv_length), new_cache
        if query.shape[-3] != 1:
            raise ValueError(
                "decode with a mask, bias or dropout feeds one position per call "
                f"(got {query.shape[-3]}); without them a prompt chunk can be fed at once."
            )
        causal = False  # one query against the filled part of the cache
    out = _attention_fn(
        query, key, value, bias=bias, mask=mask, broadcast_dropout=module.broadcast_dropout,
        dropout_rng=dropout_rng, dropout_rate=module.dropout_rate, deterministic=deterministic,
        dtype=module.dtype, causal=causal, backend=module.backend, config=module.config, kv_length=kv_length,
        is_causal=is_causal,
    )
    return out, new_cache

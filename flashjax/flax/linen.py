"""Flax linen: the `attention_fn` drop-in and `FlashMultiHeadAttention` (with GQA)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import linen as nn

from flashjax.flax.attention_fn import attention_fn, make_attention_fn
from flashjax.flax.common import attend, default_inputs, head_dim_of, paged_cache_layout

__all__ = ["attention_fn", "make_attention_fn", "FlashMultiHeadAttention"]


class FlashMultiHeadAttention(nn.Module):
    """Multi-head attention with grouped-query K/V, computed by flashjax.

    Parameters mirror `flax.linen.MultiHeadDotProductAttention`: ``query``,
    ``key``, ``value`` are `DenseGeneral` to ``(heads, head_dim)`` (``key`` and
    ``value`` to ``(num_kv_heads, head_dim)``) and ``out`` maps
    ``(heads, head_dim)`` back to ``out_features``, with the same initialisers.
    With ``num_kv_heads == num_heads`` a Flax checkpoint loads as is and gives the
    same outputs.

    Example::

      layer = FlashMultiHeadAttention(num_heads=8, num_kv_heads=2, causal=True)
      x = jnp.ones((4, 256, 512))                       # [batch, seq, features]
      params = layer.init(jax.random.key(0), x)
      y = layer.apply(params, x)                        # [4, 256, 512]

    Decoding (as with Flax): ``decode=True``; ``init`` with a full-length input
    creates the cache (``cached_key``/``cached_value`` hold ``num_kv_heads``
    heads), then ``apply(..., mutable=["cache"])`` with new positions ``[batch,
    steps, features]``: one token per step, or (``causal=True``) a prompt chunk at once. Without a
    mask, bias or dropout a step is `flashjax.decode_attention` (split-KV over the
    cache, read in place in its dtype); with one of them it is one position per call.

    Attributes:
      num_heads: query heads.
      num_kv_heads: key/value heads (divides ``num_heads``); ``None`` = ``num_heads``.
      qkv_features: ``num_heads * head_dim``; defaults to the input features.
      head_dim: per-head size; overrides ``qkv_features`` when given.
      out_features: output features; defaults to the input features.
      causal: causal self-attention (tiles above the diagonal are skipped).
      dropout_rate: dropout on the attention probabilities.
      broadcast_dropout: one dropout mask across batch and heads (Flax's default).
      deterministic: default for the call's ``deterministic``.
      qk_norm: RMSNorm over ``head_dim`` on queries and keys (learned scale shared
        by heads), as in Gemma 3 (ViT-22B and Flax's ``normalize_qk`` use LayerNorm); params
        ``query_norm``, ``key_norm``.
      dtype, param_dtype: computation and parameter dtypes.
      kernel_init, bias_init, use_bias: as in Flax.
      decode: autoregressive decoding with a KV cache.
      page_size: with ``decode``, a paged cache: ``cached_key``/``cached_value`` page pools
        ``[num_pages, page_size, kv_heads, head_dim]`` and ``page_table`` int32 ``[batch,
        pages_per_seq]`` in the "cache" collection (consecutive pages at init; may be
        rewritten). Decodes without a mask, bias or dropout.
      backend, config: forwarded to `flashjax.flash_attention`.
    """

    num_heads: int
    num_kv_heads: int | None = None
    qkv_features: int | None = None
    head_dim: int | None = None
    out_features: int | None = None
    causal: bool = False
    dropout_rate: float = 0.0
    broadcast_dropout: bool = True
    deterministic: bool | None = None
    qk_norm: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Any = nn.linear.default_kernel_init
    bias_init: Any = nn.initializers.zeros_init()
    use_bias: bool = True
    decode: bool = False
    page_size: int | None = None
    backend: str = "auto"
    config: Any = None

    @nn.compact
    def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, mask=None, bias=None,
                 deterministic: bool | None = None, dropout_rng=None, sow_weights: bool = False):
        """Attention of ``inputs_q`` over ``inputs_k``/``inputs_v`` (self-attention if omitted).

        Args:
          inputs_q: ``[batch..., q_len, features]``.
          inputs_k, inputs_v: ``[batch..., kv_len, kv_features]``; default to
            ``inputs_q`` (and ``inputs_v`` to ``inputs_k``).
          mask: broadcastable to ``[batch..., heads, q_len, kv_len]``; True = attend.
          bias: additive, broadcastable to ``[batch..., heads, q_len, kv_len]``.
          deterministic: disables dropout; merged with the attribute.
          dropout_rng: key for dropout; defaults to ``make_rng("dropout")``.
          sow_weights: accepted as False only (as `nn.MultiHeadDotProductAttention` takes
            it): the weights are never materialised.

        Returns:
          ``[batch..., q_len, out_features]``.
        """
        if sow_weights:
            raise NotImplementedError("flashjax never materialises the attention weights, so they cannot be sown "
                                      "(sow_weights=True); use nn.MultiHeadDotProductAttention for the layers to inspect.")
        inputs_q, inputs_k, inputs_v = default_inputs(inputs_q, inputs_k, inputs_v)
        kv_heads = self.num_kv_heads or self.num_heads
        head_dim = head_dim_of(self.num_heads, kv_heads, self.head_dim, self.qkv_features or inputs_q.shape[-1])
        dense = lambda heads, name: nn.DenseGeneral(  # noqa: E731
            features=(heads, head_dim), axis=-1, dtype=self.dtype, param_dtype=self.param_dtype,
            kernel_init=self.kernel_init, bias_init=self.bias_init, use_bias=self.use_bias, name=name,
        )
        query = dense(self.num_heads, "query")(inputs_q)
        key = dense(kv_heads, "key")(inputs_k)
        value = dense(kv_heads, "value")(inputs_v)
        if self.qk_norm:
            norm = lambda name: nn.RMSNorm(dtype=self.dtype, param_dtype=self.param_dtype, name=name)  # noqa: E731
            query, key = norm("query_norm")(query), norm("key_norm")(key)

        cache = None
        if self.decode:
            is_initialized = self.has_variable("cache", "cached_key")
            shape = key.shape
            if self.page_size is not None:
                shape, table = paged_cache_layout(key.shape, self.page_size)
                page_table = self.variable("cache", "page_table", lambda: table)
            cached_key = self.variable("cache", "cached_key", jnp.zeros, shape, key.dtype)
            cached_value = self.variable("cache", "cached_value", jnp.zeros, shape, value.dtype)
            cache_index = self.variable("cache", "cache_index", lambda: jnp.array(0, dtype=jnp.int32))
            if is_initialized:  # init with a full-length input only creates the cache
                cache = (cached_key.value, cached_value.value, cache_index.value)
                if self.page_size is not None:
                    cache += (page_table.value,)

        if self.dropout_rate > 0.0:
            deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
            if not deterministic and dropout_rng is None:
                dropout_rng = self.make_rng("dropout")
        else:
            deterministic = True

        x, cache = attend(self, query, key, value, mask=mask, bias=bias, dropout_rng=dropout_rng,
                          deterministic=deterministic, cache=cache)
        if cache is not None:
            cached_key.value, cached_value.value, cache_index.value = cache[:3]
        return nn.DenseGeneral(
            features=self.out_features or inputs_q.shape[-1], axis=(-2, -1), dtype=self.dtype,
            param_dtype=self.param_dtype, kernel_init=self.kernel_init, bias_init=self.bias_init,
            use_bias=self.use_bias, name="out",
        )(x)

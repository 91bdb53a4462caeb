"""Flax nnx: the `attention_fn` drop-in and `FlashMultiHeadAttention` (with GQA)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import jax.numpy as jnp
from flax import nnx

from flashjax.flax.attention_fn import attention_fn, make_attention_fn
from flashjax.flax.common import attend, default_inputs, head_dim_of, paged_cache_layout

__all__ = ["attention_fn", "make_attention_fn", "FlashMultiHeadAttention"]


class FlashMultiHeadAttention(nnx.Module):
    """Multi-head attention with grouped-query K/V, computed by flashjax.

    Parameters mirror `flax.nnx.MultiHeadAttention` (``query``, ``key``,
    ``value``, ``out`` `LinearGeneral` layers with the same shapes, initialisers
    and creation order), so with the same ``rngs`` both modules start from the
    same weights, and a Flax checkpoint loads with ``nnx.update``.

    Example::

      layer = FlashMultiHeadAttention(num_heads=8, in_features=512, num_kv_heads=2,
                                      causal=True, rngs=nnx.Rngs(0))
      y = layer(jnp.ones((4, 256, 512)))               # [4, 256, 512]

      layer.init_cache((4, 256, 512))                  # decoding: the cache holds kv heads
      y_t = layer(jnp.ones((4, 1, 512)), decode=True)  # one token (or, causal, a prompt chunk) per call

    Args:
      num_heads: query heads.
      in_features: input features of the queries.
      qkv_features: ``num_heads * head_dim``; defaults to ``in_features``.
      out_features: output features; defaults to ``in_features``.
      num_kv_heads: key/value heads (divides ``num_heads``); ``None`` = ``num_heads``.
      in_kv_features: input features of keys/values; defaults to ``in_features``.
      head_dim: per-head size; overrides ``qkv_features`` when given.
      causal: causal self-attention (tiles above the diagonal are skipped).
      dropout_rate, broadcast_dropout, deterministic: attention dropout, as in Flax.
      qk_norm: RMSNorm over ``head_dim`` on queries and keys (``query_norm``,
        ``key_norm``; created after ``out`` so the projections' init is unchanged).
      dtype, param_dtype, kernel_init, bias_init, use_bias: as in Flax.
      out_kernel_init, out_bias_init: the output projection's initialisers (default: kernel_init,
        bias_init), as in Flax.
      kernel_metadata, bias_metadata, out_kernel_metadata, out_bias_metadata: the
        projections' parameter metadata (e.g. ``out_sharding``, the parameters'
        partitioning), as in Flax: the output projection's default to the others'.
      decode: default for the call's ``decode``.
      backend, config: forwarded to `flashjax.flash_attention`.
      rngs: `nnx.Rngs` for the initialisers (and dropout, kept as ``self.rngs``).
    """

    def __init__(
        self,
        num_heads: int,
        in_features: int,
        qkv_features: int | None = None,
        out_features: int | None = None,
        num_kv_heads: int | None = None,
        in_kv_features: int | None = None,
        *,
        head_dim: int | None = None,
        causal: bool = False,
        dropout_rate: float = 0.0,
        broadcast_dropout: bool = True,
        deterministic: bool | None = None,
        qk_norm: bool = False,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        kernel_init: Any = nnx.nn.linear.default_kernel_init,
        out_kernel_init: Any = None,
        bias_init: Any = nnx.initializers.zeros_init(),
        out_bias_init: Any = None,
        use_bias: bool = True,
        decode: bool = False,
        backend: str = "auto",
        config: Any = None,
        rngs: nnx.Rngs,
        kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
        out_kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
        bias_metadata: Mapping[str, Any] = MappingProxyType({}),
        out_bias_metadata: Mapping[str, Any] = MappingProxyType({}),
    ):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.in_features = in_features
        self.head_dim = head_dim_of(num_heads, self.num_kv_heads, head_dim, qkv_features or in_features)
        self.out_features = out_features or in_features
        self.causal = causal
        self.dropout_rate = dropout_rate
        self.broadcast_dropout = broadcast_dropout
        self.deterministic = deterministic
        self.qk_norm = qk_norm
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.decode = decode
        self.backend = backend
        self.config = config

        def linear(in_features, out_features, **kw):
            params = {"kernel_init": kernel_init, "bias_init": bias_init, "kernel_metadata": kernel_metadata,
                      "bias_metadata": bias_metadata, **kw}
            return nnx.LinearGeneral(in_features, out_features, dtype=dtype, param_dtype=param_dtype, use_bias=use_bias,
                                     rngs=rngs, **params)

        kv_in = in_kv_features or in_features
        self.query = linear(in_features, (num_heads, self.head_dim))
        self.key = linear(kv_in, (self.num_kv_heads, self.head_dim))
        self.value = linear(kv_in, (self.num_kv_heads, self.head_dim))
        self.out = linear((num_heads, self.head_dim), self.out_features, axis=(-2, -1),
                          kernel_init=out_kernel_init or kernel_init, bias_init=out_bias_init or bias_init,
                          kernel_metadata=out_kernel_metadata or kernel_metadata,
                          bias_metadata=out_bias_metadata or bias_metadata)
        if qk_norm:
            self.query_norm = nnx.RMSNorm(self.head_dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
            self.key_norm = nnx.RMSNorm(self.head_dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        else:
            self.query_norm = self.key_norm = nnx.data(None)
        # As in nnx.MultiHeadAttention: a dropout stream of our own, forked after the params.
        self.rngs = rngs.dropout.fork() if dropout_rate > 0 else nnx.data(None)
        self.cached_key = self.cached_value = self.cache_index = self.page_table = nnx.data(None)

    def init_cache(self, input_shape, dtype=jnp.float32, *, page_size: int | None = None):
        """Allocate the KV cache for decoding inputs of shape ``[batch..., max_len, features]``.

        The cache is ``[batch..., max_len, num_kv_heads, head_dim]``: grouped-query
        attention shrinks it by ``num_heads / num_kv_heads``. With ``page_size`` (one batch
        dim) it is paged, as serving systems hold it: pools ``cached_key``/``cached_value``
        ``[num_pages, page_size, num_kv_heads, head_dim]`` and ``page_table`` int32 ``[batch,
        pages_per_seq]`` (``pages_per_seq = ceil(max_len / page_size)``), which starts as
        consecutive pages and may be rewritten (pages shared between sequences, a larger
        pool) as long as each sequence's filled positions map to its own data.

        Args:
          input_shape: ``[batch..., max_len, features]``, the shape of the longest input the
            decode steps will have fed in all (only its batch dims and ``max_len`` are used).
          dtype: the cache's dtype (K/V are cast to it as they are written).
          page_size: keys per page of a paged cache, or None for a contiguous one. A paged
            cache holds ``pages_per_seq * page_size`` positions (``max_len`` rounded up to
            whole pages).
        """
        shape = (*input_shape[:-1], self.num_kv_heads, self.head_dim)
        self.page_table = nnx.data(None)
        if page_size is not None:
            shape, table = paged_cache_layout(shape, page_size)
            self.page_table = nnx.Cache(table)
        self.cached_key = nnx.Cache(jnp.zeros(shape, dtype))
        self.cached_value = nnx.Cache(jnp.zeros(shape, dtype))
        self.cache_index = nnx.Cache(jnp.array(0, dtype=jnp.int32))

    def set_view(self, deterministic: bool | None = None, decode: bool | None = None,
                 batch_size: int | tuple[int, ...] | None = None, max_length: int | None = None):
        """Used by ``nnx.view`` (as `flax.nnx.MultiHeadAttention.set_view`): sets the
        ``deterministic`` and ``decode`` attributes; switching to decode without a cache
        allocates one (`init_cache`) of ``batch_size`` x ``max_length`` positions, in the
        module's ``dtype`` (``param_dtype`` if None), so both must be given then."""
        if deterministic is not None:
            self.deterministic = deterministic
        if decode is not None:
            self.decode = decode
            if decode and self.cached_key is None:
                if batch_size is None or max_length is None:
                    raise TypeError("nnx.view(decode=True) allocates the KV cache: pass batch_size and max_length "
                                    "(or call init_cache first).")
                batch = (batch_size,) if isinstance(batch_size, int) else tuple(batch_size)
                self.init_cache((*batch, max_length, self.in_features),
                                self.dtype if self.dtype is not None else self.param_dtype)

    def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, mask=None, bias=None,
                 deterministic: bool | None = None, rngs=None, decode: bool | None = None, is_causal: bool = False,
                 sow_weights: bool = False, out_sharding=None, qkv_sharding=None, input_positions=None):
        """Attention of ``inputs_q`` over ``inputs_k``/``inputs_v`` (self-attention if omitted).

        Args:
          inputs_q: ``[batch..., q_len, in_features]``.
          inputs_k, inputs_v: ``[batch..., kv_len, in_kv_features]``; default to
            ``inputs_q`` (and ``inputs_v`` to ``inputs_k``).
          mask: broadcastable to ``[batch..., heads, q_len, kv_len]``; True = attend.
          bias: additive, broadcastable to ``[batch..., heads, q_len, kv_len]``.
          deterministic: disables dropout; overrides the attribute.
          rngs: `nnx.Rngs` or a stream for dropout; defaults to ``self.rngs``.
          decode: new positions ``[batch..., steps, features]`` through the KV cache
            (``init_cache`` first; one token per step, or with ``causal=True`` a prompt
            chunk at once; a mask, bias or dropout allows one position per call). Without a mask, bias or
            dropout this is `flashjax.decode_attention` (split-KV over the cache, read in
            place in its dtype: give ``init_cache(..., dtype=)`` the compute dtype).
            Overrides the attribute.
          is_causal: `nnx.MultiHeadAttention`'s flag, aligned to the top left (query ``i``
            attends keys ``j <= i``), joined to ``mask``; the ``causal`` attribute is the
            kernels' own causal mask (aligned to the bottom right, tiles skipped), the
            same where the lengths are equal. Not with ``decode``.
          sow_weights: accepted as False only: the weights are never materialised.
          out_sharding, qkv_sharding: the output's and the projected q/k/v's sharding, passed
            to the projections, as in Flax.
          input_positions: accepted as None only: Flax forwards it to an ``attention_fn``
            that applies RoPE; apply RoPE in the model before this module.

        Returns:
          ``[batch..., q_len, out_features]``.
        """
        if sow_weights:
            raise NotImplementedError("flashjax never materialises the attention weights, so they cannot be sown "
                                      "(sow_weights=True); use nnx.MultiHeadAttention for the layers to inspect.")
        if input_positions is not None:
            raise NotImplementedError("input_positions (RoPE inside Flax's attention_fn) is not taken: apply the "
                                      "rotary embedding to the inputs before this module.")
        if inputs_q.shape[-1] != self.in_features:
            raise ValueError(f"inputs_q has {inputs_q.shape[-1]} features, the module was built with in_features="
                             f"{self.in_features}.")
        inputs_q, inputs_k, inputs_v = default_inputs(inputs_q, inputs_k, inputs_v)
        project = lambda layer, x: layer(x, out_sharding=qkv_sharding)
        query, key, value = project(self.query, inputs_q), project(self.key, inputs_k), project(self.value, inputs_v)
        if self.qk_norm:
            query, key = self.query_norm(query), self.key_norm(key)

        cache = None
        if decode if decode is not None else self.decode:
            if is_causal:
                raise ValueError("is_causal with decode: the cache's positions decide what a step sees; build the "
                                 "module with causal=True instead.")
            if self.cached_key is None:
                raise ValueError("decode=True needs a KV cache: call init_cache(input_shape) first.")
            cache = (self.cached_key[...], self.cached_value[...], self.cache_index[...])
            if self.page_table is not None:
                cache += (self.page_table[...],)

        dropout_rng = None
        deterministic = True if self.dropout_rate == 0.0 else (
            deterministic if deterministic is not None else self.deterministic)
        if deterministic is None:
            raise ValueError("dropout_rate > 0: pass deterministic= to the call or the constructor.")
        if not deterministic:
            stream = rngs if rngs is not None else self.rngs
            if stream is None:
                raise ValueError("dropout needs rngs: pass rngs= to the call.")
            dropout_rng = stream.dropout() if isinstance(stream, nnx.Rngs) else stream()

        x, cache = attend(self, query, key, value, mask=mask, bias=bias, dropout_rng=dropout_rng,
                          deterministic=deterministic, cache=cache, is_causal=is_causal)
        if cache is not None:
            self.cached_key[...], self.cached_value[...], self.cache_index[...] = cache[:3]
        return self.out(x, out_sharding=out_sharding)

"""`attention_fn`: flashjax as a drop-in for Flax's `dot_product_attention`.

Flax's attention modules take the attention itself as a function argument:
`flax.linen.MultiHeadDotProductAttention(attention_fn=...)` and
`flax.nnx.MultiHeadAttention(attention_fn=...)`. This module provides a
function with the keywords they pass (Flax 0.12):

* linen inspects the signature and passes only the keywords it names, out of
  ``mask, dropout_rng, dropout_rate, broadcast_dropout, deterministic, dtype,
  precision, force_fp32_for_softmax, qk_attn_weights_einsum,
  attn_weights_value_einsum`` (and ``module=`` when asked to sow weights);
* nnx always passes ``mask, dropout_rng, dropout_rate, broadcast_dropout,
  deterministic, dtype, precision, module, is_causal`` (and
  ``input_positions`` when the caller gives them).

Only `flashjax.flash_attention` is imported from the package: the Flax layer
sits on top of the public function, nothing else.
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp

from flashjax import flash_attention

__all__ = ["attention_fn", "make_attention_fn"]


def make_attention_fn(
    *,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    backend: str = "auto",
    config=None,
):
    """An `attention_fn` for Flax with static flashjax options baked in.

    ``attention_fn`` (this module's default) is ``make_attention_fn()``. Use the
    factory to ask for a structural mask that the kernels skip tile by tile
    instead of reading a boolean mask array, or to force a backend.

    Example::

      layer = nnx.MultiHeadAttention(
          num_heads=8, in_features=512, decode=False, rngs=nnx.Rngs(0),
          attention_fn=flashjax.flax.make_attention_fn(causal=True))
      y = layer(x)                              # x: [batch, seq, 512]

    Args:
      causal: flashjax causal masking, aligned to the bottom right when the query
        and key lengths differ (so a one-token decode step against a Flax KV cache
        sees the whole cache, and the cache mask hides the empty slots). This
        differs from Flax's ``is_causal``, which is aligned to the top left; both
        agree when the lengths are equal.
      window: ``(left, right)`` sliding window, as in `flashjax.flash_attention`: aligned
        to the arrays' ends, so it cannot serve Flax's KV-cache decoding (a one-token
        query against the whole cache and its mask), which raises; put the window in
        the mask there.
      softcap: logit soft-capping, as in `flashjax.flash_attention`.
      backend: ``"auto"``, ``"triton"``, ``"mosaic"`` or ``"xla"``.
      config: a `flashjax.TritonConfig` or `flashjax.MosaicConfig` for the named backend's
        tiling, or ``None`` (the tuned default).

    Returns:
      A function ``f(query, key, value, *, bias, mask, ...)`` accepted as
      ``attention_fn`` by linen and nnx; see `attention_fn` for its arguments.
    """
    return _Options(_attention_fn, causal=causal, window=window, softcap=softcap, backend=backend, config=config)


class _Options(functools.partial):
    """`make_attention_fn`'s result: a partial that equals (and hashes as) any other with the
    same options. Flax keeps attention_fn as a static attribute of the module, part of jit's
    cache key: a plain partial is equal only to itself, so each model built with its own
    `make_attention_fn(...)` would trace its jitted step again."""

    def _key(self):
        return self.func, self.args, tuple(sorted(self.keywords.items()))

    def __eq__(self, other):
        return type(other) is type(self) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())


def _attention_fn(
    query,
    key,
    value,
    bias=None,
    mask=None,
    broadcast_dropout: bool = True,
    dropout_rng=None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype=None,
    precision=None,
    module=None,
    is_causal: bool = False,
    force_fp32_for_softmax: bool = False,
    qk_attn_weights_einsum=None,
    attn_weights_value_einsum=None,
    input_positions=None,
    *,
    causal: bool = False,
    window=None,
    softcap=None,
    backend: str = "auto",
    config=None,
    kv_length=None,
):
    """Flax-compatible attention computed by `flashjax.flash_attention`.

    Same contract as `flax.linen.dot_product_attention` /
    `flax.nnx.dot_product_attention`: ``softmax(q k^T / sqrt(d) + bias, masked) v``
    per head, without materialising the weights.

    Example::

      layer = nn.MultiHeadDotProductAttention(num_heads=8, attention_fn=flashjax.flax.attention_fn)
      q = jnp.ones((2, 128, 8, 64)); out = flashjax.flax.attention_fn(q, q, q)  # [2, 128, 8, 64]

    Args:
      query: ``[batch..., q_len, heads, head_dim]`` (any number of batch dims,
        including none).
      key, value: ``[batch..., kv_len, kv_heads, head_dim]``; ``kv_heads`` divides
        ``heads`` (grouped-query attention, as nnx allows).
      bias: additive bias broadcastable to ``[batch..., heads, q_len, kv_len]``.
      mask: broadcastable to ``[batch..., heads, q_len, kv_len]``; nonzero/True =
        attend (Flax's masks are float32 0/1 by default; they are converted).
      broadcast_dropout: one dropout mask shared across batch and heads (Flax's
        default).
      dropout_rng, dropout_rate, deterministic: dropout on the attention
        probabilities, applied when ``not deterministic and dropout_rate > 0``.
        The keep mask is drawn in the kernel from a hash of (key, batch, head,
        row, column), so it differs from Flax's `jax.random.bernoulli` draw with
        the same key (same distribution, different bits).
      dtype: cast q, k, v to this dtype (as Flax's ``promote_dtype`` does);
        ``None`` promotes them to their common dtype. The output has this dtype.
      precision: ignored: the kernels multiply in the input dtype and accumulate
        in float32 whatever the requested precision.
      module: Flax passes the module only when asked to sow the attention
        weights, which this function never materialises: a module raises.
      is_causal: Flax's (nnx) causal flag, aligned to the top left like Flax's
        default attention: query ``i`` attends keys ``j <= i``.
      force_fp32_for_softmax: accepted and ignored: the softmax is always float32.
      qk_attn_weights_einsum, attn_weights_value_einsum: custom (quantised)
        einsums of linen; not supported (raises if given).
      input_positions: RoPE positions that nnx forwards for
        `dot_product_attention_with_rope`; not supported (raises if given):
        apply the rotation to q and k before attention.
      causal, window, softcap, backend, config: flashjax options, set through
        `make_attention_fn`.
      kv_length: int scalar, keys at or past it get no weight (the filled part of
        a KV cache; used by this package's modules in decode mode, never by Flax).

    Returns:
      ``[batch..., q_len, heads, head_dim]`` in ``dtype`` (or the promoted dtype).

    Raises:
      NotImplementedError: when asked to sow weights, or given custom einsums or
        RoPE positions.
    """
    if module is not None:
        raise NotImplementedError(
            "flashjax never materialises the attention weights, so they cannot be sown "
            "(sow_weights=True). Call the module with sow_weights=False, or use Flax's "
            "default attention_fn for the layers whose weights you want to inspect."
        )
    if qk_attn_weights_einsum is not None or attn_weights_value_einsum is not None:
        raise NotImplementedError(
            "custom attention einsums (qk_attn_weights_einsum_cls / attn_weights_value_einsum_cls, "
            "e.g. AQT quantisation) are not supported by flashjax's attention_fn; leave them unset."
        )
    if input_positions is not None:
        raise NotImplementedError(
            "flashjax.flax.attention_fn does not apply RoPE: rotate q and k yourself "
            "(e.g. nnx.RoPE) before attention instead of passing input_positions."
        )
    del precision, force_fp32_for_softmax  # float32 accumulation and softmax always

    if dtype is None:
        dtype = jnp.result_type(query, key, value)
    query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
    if query.ndim < 3 or key.ndim != query.ndim or value.ndim != query.ndim:
        raise ValueError(
            "query, key and value must have the same rank >= 3 ([batch..., length, heads, head_dim]); "
            f"got {query.shape}, {key.shape}, {value.shape}."
        )
    batch_dims = query.shape[:-3]
    if key.shape[:-3] != batch_dims or value.shape[:-3] != batch_dims:
        raise ValueError(f"query, key and value batch dims must match; got {query.shape}, {key.shape}, {value.shape}.")
    seq_q, seq_k = query.shape[-3], key.shape[-3]
    heads = query.shape[-2]
    batch = math.prod(batch_dims)

    if window is not None and mask is not None and seq_q < seq_k and kv_length is None:
        # Flax's KV-cache decoding: a query at the cache index against the whole cache, the
        # filled slots in the mask. The window is aligned to the arrays' ends, not to that
        # index, which this function is not given: it would cover the empty last slots.
        raise ValueError(
            f"window={window} with a mask and q_len {seq_q} < kv_len {seq_k}, as in Flax's KV-cache decoding: the "
            "window is aligned to the arrays' ends, not to the query's position in the cache, which attention_fn is "
            "not given. For decoding, put the window in the mask (or use flashjax.decode_attention with window=); "
            "for another call of these shapes, call flashjax.flash_attention(q, k, v, window=..., mask=...), whose "
            "window is aligned to the keys' end (query i at key position i + kv_len - q_len)."
        )
    if mask is not None and mask.dtype != jnp.bool_:
        mask = mask != 0  # Flax's jnp.where(mask, ...) reads nonzero as "attend"
    if is_causal:
        if seq_q == seq_k:
            causal = True  # same alignment either way; the kernels skip the upper tiles
        else:
            # Flax's is_causal is jnp.tril((seq_q, seq_k)): top-left aligned, which the
            # kernels' bottom-right causal flag cannot express, so spell it out.
            tril = jnp.arange(seq_k)[None, :] <= jnp.arange(seq_q)[:, None]
            mask = tril if mask is None else jnp.logical_and(mask, tril)

    check_dropout_rate(dropout_rate)
    use_dropout = not deterministic and dropout_rate > 0.0
    if use_dropout and dropout_rng is None:
        raise ValueError("dropout_rng is required when dropout_rate > 0 and deterministic=False.")

    def to_4d(x):
        return x.reshape((batch,) + x.shape[-3:])

    out = flash_attention(
        to_4d(query),
        to_4d(key),
        to_4d(value),
        causal=bool(causal),
        bias=_pair_to_4d("bias", bias, batch_dims, heads, seq_q, seq_k),
        mask=_pair_to_4d("mask", mask, batch_dims, heads, seq_q, seq_k),
        window=window,
        softcap=softcap,
        dropout_rate=float(dropout_rate) if use_dropout else 0.0,
        dropout_rng=dropout_rng if use_dropout else None,
        broadcast_dropout=bool(broadcast_dropout),
        kv_lengths=None if kv_length is None else jnp.full((batch,), kv_length, jnp.int32),
        backend=backend,
        config=config,
    )
    return out.reshape(query.shape[:-1] + value.shape[-1:])  # values may have their own head dim


attention_fn = make_attention_fn()
attention_fn.__doc__ = _attention_fn.__doc__


def check_dropout_rate(dropout_rate) -> None:
    """Raises for a rate outside [0, 1), as Flax does, also where no dropout runs (a negative
    rate would otherwise pass as no dropout)."""
    if not 0.0 <= float(dropout_rate) < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}.")


def _pair_to_4d(name, x, batch_dims, heads, seq_q, seq_k):
    """[batch..., heads, q, kv] (broadcastable) -> [batch | 1, heads | 1, q | 1, kv | 1]."""
    if x is None:
        return None
    rank = len(batch_dims) + 3
    if x.ndim > rank:
        raise ValueError(f"{name} of shape {x.shape} has more dims than [batch..., heads, q_len, kv_len] ({rank}).")
    given = x.shape
    x = x.reshape((1,) * (rank - x.ndim) + x.shape)
    full = (*batch_dims, heads, seq_q, seq_k)
    if any(d not in (1, want) for d, want in zip(x.shape, full)):
        raise ValueError(f"{name} of shape {given} is not broadcastable to [batch..., heads, q_len, kv_len] = {full}.")
    lead = x.shape[: len(batch_dims)]
    if all(d == 1 for d in lead):
        return x.reshape((1,) + x.shape[len(batch_dims):])
    # Some batch axes vary: materialise them (only the batch axes, not heads or
    # the [q, kv] tile) so they fold into one batch axis.
    x = jnp.broadcast_to(x, tuple(batch_dims) + x.shape[len(batch_dims):])
    return x.reshape((math.prod(batch_dims),) + x.shape[len(batch_dims):])

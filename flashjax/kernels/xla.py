"""The "xla" backend: `flashjax.reference`, plain JAX that XLA compiles.

It materialises the [B, H, Tq, Tk] scores, so it is for checking, small problems and
what no kernel supports (float64 and complex inputs, head dims over 256). It runs in
float32, or in the inputs' dtype when that is wider. When it runs a whole call, JAX
differentiates it directly; `backward` serves ring attention, which hands it the
merged (o, lse) of several calls.

Its decode path (`decode`, for `flashjax.decode_attention`) gathers a paged cache into
a contiguous one, dequantises a float8 cache and masks each sequence by its length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flashjax import backends, flex, reference
from flashjax.params import AttentionParams, DecodeParams, Extras, KVCache


def _attend(q, k, v, extras: Extras, params: AttentionParams):
    segments = None if extras.q_segment_ids is None else (extras.q_segment_ids, extras.kv_segment_ids)
    return reference.attention(
        q, k, v, causal=params.causal, scale=params.scale, bias=extras.bias, mask=extras.mask,
        segment_ids=segments, q_lengths=extras.q_lengths, kv_lengths=extras.kv_lengths,
        window=params.window, softcap=params.softcap, alibi_slopes=extras.alibi_slopes,
        dropout_rate=params.dropout_rate, dropout_seed=extras.dropout_seed,
        broadcast_dropout=params.broadcast_dropout, return_lse=True,
        score_mod=None if params.score_mod is None else params.score_mod.bind(extras.score_consts),
        mask_mod=None if params.mask_mod is None else params.mask_mod.bind(extras.mask_consts),
        sinks=extras.sinks,
    )


def forward(q, k, v, extras: Extras, params: AttentionParams, config=None):
    """Returns o [B, Tq, H, D] in q's dtype and the natural-log lse [B, H, Tq]."""
    del config
    o, lse = _attend(q, k, v, extras, params)
    return o.astype(q.dtype), lse


def backward(q, k, v, o, lse, do, dlse, extras: Extras, params: AttentionParams, config=None):
    """(dq, dk, dv, Extras of the bias's, sinks' and score_mod arrays' gradients) of this call's
    share of an attention whose output is (o, lse).

    (o, lse) may merge this call with others over disjoint keys (ring attention):
    o = sum_s w_s o_s with w_s = exp(lse_s - lse). This call's (o_s, lse_s) is
    recomputed and differentiated by JAX with the cotangents that merge implies,
    do_s = w_s do and dlse_s = w_s (dlse + rowsum(do * (o_s - o))); for a call that is
    the whole attention, w_s = 1 and o_s = o.
    """
    del config

    floats = flex.float_consts(extras.score_consts)

    def own(q, k, v, bias, sinks, floats):
        consts = flex.merge_float_consts(extras.score_consts, floats)
        return _attend(q, k, v, extras._replace(bias=bias, sinks=sinks, score_consts=consts), params)

    (o_own, lse_own), pullback = jax.vjp(own, q, k, v, extras.bias, extras.sinks, floats)
    # Rows this call gives no weight (lse_s = -inf) get none of the cotangent.
    weight = jnp.where(lse_own == -jnp.inf, 0.0, jnp.exp(lse_own - jnp.where(lse == -jnp.inf, 0.0, lse)))
    do = do.astype(o_own.dtype)
    rows = jnp.einsum("bqhd,bqhd->bhq", do, o_own - o.astype(o_own.dtype))
    do_own = do * jnp.transpose(weight, (0, 2, 1))[..., None]
    dq, dk, dv, dbias, dsinks, dfloats = pullback((do_own, weight * (dlse + rows)))
    dconsts = flex.merge_float_consts(extras.score_consts, dfloats, others=None)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
            Extras(bias=dbias, sinks=dsinks, score_consts=dconsts))


def _dense(x, scale, page_table, dtype):
    """One side of the cache as a contiguous [B, capacity, Hkv, D] array in `dtype`, dequantised."""
    x = x.astype(dtype)
    if scale is not None:
        # [Hkv] per kv head, or [num_pages, Hkv] per page of [num_pages, page_size, Hkv, D].
        x = x * (scale[:, None, :, None] if scale.ndim == 2 else scale[:, None]).astype(dtype)
    if page_table is not None:
        x = x[page_table]  # [B, pages_per_seq, page_size, Hkv, D]
        x = x.reshape(x.shape[0], -1, *x.shape[3:])
    return x


def decode(q, cache: KVCache, params: DecodeParams):
    """o [B, q_len, H, Dv] (float32, float64 for a float64 q) and the lse [B, H, q_len] of a decode
    call, by the reference.

    Materialises the cache (gathered, in float32) and the [B, H, q_len, capacity] scores.
    """
    dtype = jnp.promote_types(q.dtype, jnp.float32)
    k = _dense(cache.k, cache.k_scale, cache.page_table, dtype)
    v = k[..., :params.v_head_dim] if cache.v is None else _dense(cache.v, cache.v_scale, cache.page_table, dtype)
    q_len, capacity = q.shape[1], k.shape[1]
    lengths = cache.lengths[:, None, None, None]
    # Slots past the length may hold anything (NaN included): their weight is 0, 0 * NaN is not.
    v = jnp.where(jnp.arange(capacity)[None, :, None, None] < lengths, v, 0.0)
    # Query i of a sequence of length L sits at key position L - q_len + i.
    rows = lengths - q_len + jnp.arange(q_len)[:, None]
    allowed = params.mask_spec(q_len).allowed(rows, jnp.arange(capacity)[None, :], kv_length=lengths)
    return reference.attention(q.astype(dtype), k, v, scale=params.scale, softcap=params.softcap, mask=allowed,
                               return_lse=True)


BACKEND = backends.Backend(
    name="xla",
    description="the pure-JAX reference (materialises the scores)",
    config_type=None,
    supports=lambda call: [],
    forward=forward,
    backward=backward,
    differentiable=True,
    decode=backends.Decoder(supports=lambda call: [], run=decode),
)

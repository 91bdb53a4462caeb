"""The "xla" backend: `flashjax.reference`, plain JAX that XLA compiles.

It materialises the [B, H, Tq, Tk] scores, so it is for checking, small problems and
what no kernel supports (float64 and complex inputs, head dims over 256). It runs in
float32, or in the inputs' dtype when that is wider. When it runs a whole call, JAX
differentiates it directly; `backward` serves ring attention, which hands it the
merged (o, lse) of several calls.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flashjax import backends, reference
from flashjax.params import AttentionParams, Extras


def _attend(q, k, v, extras: Extras, params: AttentionParams):
    segments = None if extras.q_segment_ids is None else (extras.q_segment_ids, extras.kv_segment_ids)
    return reference.attention(
        q, k, v, causal=params.causal, scale=params.scale, bias=extras.bias, mask=extras.mask,
        segment_ids=segments, q_lengths=extras.q_lengths, kv_lengths=extras.kv_lengths,
        window=params.window, softcap=params.softcap, alibi_slopes=extras.alibi_slopes,
        dropout_rate=params.dropout_rate, dropout_seed=extras.dropout_seed,
        broadcast_dropout=params.broadcast_dropout, return_lse=True,
    )


def forward(q, k, v, extras: Extras, params: AttentionParams, config=None):
    """Returns o [B, Tq, H, D] in q's dtype and the natural-log lse [B, H, Tq]."""
    del config
    o, lse = _attend(q, k, v, extras, params)
    return o.astype(q.dtype), lse


def backward(q, k, v, o, lse, do, dlse, extras: Extras, params: AttentionParams, config=None):
    """(dq, dk, dv, dbias) of this call's share of an attention whose output is (o, lse).

    (o, lse) may merge this call with others over disjoint keys (ring attention):
    o = sum_s w_s o_s with w_s = exp(lse_s - lse). This call's (o_s, lse_s) is
    recomputed and differentiated by JAX with the cotangents that merge implies,
    do_s = w_s do and dlse_s = w_s (dlse + rowsum(do * (o_s - o))); for a call that is
    the whole attention, w_s = 1 and o_s = o.
    """
    del config

    def own(q, k, v, bias):
        return _attend(q, k, v, extras._replace(bias=bias), params)

    (o_own, lse_own), pullback = jax.vjp(own, q, k, v, extras.bias)
    # Rows this call gives no weight (lse_s = -inf) get none of the cotangent.
    weight = jnp.where(lse_own == -jnp.inf, 0.0, jnp.exp(lse_own - jnp.where(lse == -jnp.inf, 0.0, lse)))
    do = do.astype(o_own.dtype)
    rows = jnp.einsum("bqhd,bqhd->bhq", do, o_own - o.astype(o_own.dtype))
    do_own = do * jnp.transpose(weight, (0, 2, 1))[..., None]
    dq, dk, dv, dbias = pullback((do_own, weight * (dlse + rows)))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbias


BACKEND = backends.Backend(
    name="xla",
    description="the pure-JAX reference (materialises the scores)",
    config_type=None,
    supports=lambda call: [],
    forward=forward,
    backward=backward,
    differentiable=True,
)

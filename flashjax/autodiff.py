"""`jax.custom_vjp` around a kernel backend.

The forward saves (q, k, v, o, lse) and the optional inputs; the backward hands
them to the backend's backward kernels, which recompute the attention
probabilities tile by tile. Both outputs, o and lse, are differentiable (ring
attention merges partial results through their lse), and so is the bias.
"""

from __future__ import annotations

import functools
import importlib

import jax

from flashjax.params import AttentionParams, Extras


def _backend(name: str):
    return importlib.import_module(f"flashjax.kernels.{name}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def attention(q, k, v, extras: Extras, params: AttentionParams):
    """Attention through the kernels of `params.backend`.

    Args:
      q: [B, Tq, H, D]; k, v: [B, Tk, Hkv, D].
      extras: optional arrays (bias, mask, segment ids, lengths, ALiBi slopes, dropout seed).
      params: static parameters of the call.

    Returns:
      (o [B, Tq, H, D] in q's dtype, lse [B, H, Tq] float32, natural log).
    """
    return _backend(params.backend).forward(q, k, v, extras, params)


def _attention_fwd(q, k, v, extras: Extras, params: AttentionParams):
    o, lse = _backend(params.backend).forward(q, k, v, extras, params)
    return (o, lse), (q, k, v, extras, o, lse)


def _attention_bwd(params: AttentionParams, residuals, cotangents):
    q, k, v, extras, o, lse = residuals
    do, dlse = cotangents
    dq, dk, dv, dbias = _backend(params.backend).backward(q, k, v, o, lse, do, dlse, extras, params)
    if dbias is not None:
        dbias = dbias.astype(extras.bias.dtype)
    # Only the bias is differentiable among the extras; None marks zero cotangents.
    return dq, dk, dv, Extras(bias=dbias)


attention.defvjp(_attention_fwd, _attention_bwd)

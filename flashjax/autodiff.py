"""`jax.custom_vjp` around a kernel backend.

The forward saves (q, k, v, o, lse); the backward hands them to the backend's
backward kernels, which recompute the attention probabilities tile by tile. Both
outputs, o and lse, are differentiable (ring attention merges partial results
through their lse).
"""

from __future__ import annotations

import functools
import importlib

import jax

from flashjax.params import AttentionParams


def _backend(name: str):
    return importlib.import_module(f"flashjax.kernels.{name}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def attention(q, k, v, params: AttentionParams):
    """Attention through the kernels of `params.backend`.

    Args:
      q: [B, Tq, H, D]; k, v: [B, Tk, Hkv, D].
      params: static parameters of the call.

    Returns:
      (o [B, Tq, H, D] in q's dtype, lse [B, H, Tq] float32, natural log).
    """
    return _backend(params.backend).forward(q, k, v, params)


def _attention_fwd(q, k, v, params: AttentionParams):
    o, lse = _backend(params.backend).forward(q, k, v, params)
    return (o, lse), (q, k, v, o, lse)


def _attention_bwd(params: AttentionParams, residuals, cotangents):
    q, k, v, o, lse = residuals
    do, dlse = cotangents
    return _backend(params.backend).backward(q, k, v, o, lse, do, dlse, params)


attention.defvjp(_attention_fwd, _attention_bwd)

"""One `jax.custom_vjp` over any backend.

The forward saves (q, k, v, o, lse) and the optional inputs; the backward hands
them to the backward backend's kernels, which recompute the attention
probabilities tile by tile. Both outputs, o and lse, are differentiable (ring
attention merges partial results through their lse), and so are the bias, the sinks
and the float arrays a score_mod closes over.

A backend whose forward is plain JAX (`Backend.differentiable`, the reference) is
differentiated by JAX instead, when it also runs the backward. The kernels are
differentiated once: a second derivative (grad of grad, a Hessian-vector product)
would differentiate the kernels themselves, and raises a clear error instead.
"""

from __future__ import annotations

import functools

import jax

from flashjax import backends
from flashjax.vma import vary_alike
from flashjax.params import AttentionParams, Extras


def attention(q, k, v, extras: Extras, params: AttentionParams):
    """Attention on the backends `params` names.

    Args:
      q: [B, Tq, H, D]; k, v: [B, Tk, Hkv, D].
      extras: optional arrays (bias, mask, segment ids, lengths, ALiBi slopes, dropout seed).
      params: static parameters of the call, with its backends and their configs.

    Returns:
      (o [B, Tq, H, D] in q's dtype, lse [B, H, Tq], natural log).
    """
    forward = backends.get(params.backend)
    if forward.differentiable and params.backward_backend == params.backend:
        return forward.forward(q, k, v, extras, params, params.config)
    # Inside jax.shard_map, every input varies over the same mesh axes (see vary_alike).
    q, k, v, extras = vary_alike((q, k, v, prepare(q, k, v, extras, params)))
    return _attention(q, k, v, extras, params)


def prepare(q, k, v, extras: Extras, params: AttentionParams) -> Extras:
    """The forward backend's `prepare` (what its kernels derive from the inputs, shared by
    the forward and the backward); the extras unchanged without one. Idempotent."""
    forward = backends.get(params.backend)
    if forward.prepare is None or (forward.differentiable and params.backward_backend == params.backend):
        return extras
    return forward.prepare(q, k, v, extras, params, params.config)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, extras: Extras, params: AttentionParams):
    o, lse = backends.get(params.backend).forward(q, k, v, extras, params, params.config)
    return o.astype(q.dtype), lse


def first_order_only(fn, backend_name: str):
    """`fn` (a kernel call inside the VJP's forward or backward) as is, or, for a kernel
    backend, behind a JVP rule that raises: differentiating the VJP itself (a second
    derivative) would differentiate the Pallas kernels, which have no derivative rules."""
    if backends.get(backend_name).differentiable:
        return fn

    def refuse(primals, tangents):
        raise NotImplementedError(
            f"second derivatives of attention (grad of grad, jvp of grad, Hessians) are not available on "
            f"backend={backend_name!r}: its kernels are differentiated once, by flashjax's custom VJP. Use "
            "backend='xla' (the reference, differentiable to any order) for higher-order derivatives.")

    wrapped = jax.custom_jvp(fn)
    wrapped.defjvp(refuse)
    return wrapped


def _attention_fwd(q, k, v, extras: Extras, params: AttentionParams):
    # With params.float32_residual the forward's o is float32: the backward's delta =
    # rowsum(dO * O) then does not see O's rounding to the input dtype.
    forward = functools.partial(backends.get(params.backend).forward, params=params, config=params.config)
    o, lse = first_order_only(forward, params.backend)(q, k, v, extras)
    return (o.astype(q.dtype), lse), (q, k, v, extras, o, lse)


def _attention_bwd(params: AttentionParams, residuals, cotangents):
    q, k, v, extras, o, lse = residuals
    do, dlse = cotangents
    backward = functools.partial(backends.get(params.backward_backend).backward, params=params,
                                 config=params.backward_config)
    dq, dk, dv, dextras = first_order_only(backward, params.backward_backend)(q, k, v, o, lse, do, dlse, extras)
    # The differentiable extras: the bias, the sinks and the float arrays score_mod closes
    # over; None marks zero cotangents (and those of every other input).
    cast = lambda g, x: None if g is None else g.astype(x.dtype)
    consts = None
    if dextras.score_consts is not None:
        consts = tuple(cast(g, x) for g, x in zip(dextras.score_consts, extras.score_consts))
    return dq, dk, dv, Extras(bias=cast(dextras.bias, extras.bias), sinks=cast(dextras.sinks, extras.sinks),
                              score_consts=consts)


_attention.defvjp(_attention_fwd, _attention_bwd)

"""`flash_attention`: argument checking, normalisation and the choice of backend."""

from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp

from flashjax import autodiff, reference
from flashjax.config import Config
from flashjax.params import AttentionParams

__all__ = ["flash_attention", "BACKENDS"]

BACKENDS = ("auto", "triton", "mosaic", "xla")
SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
MAX_HEAD_DIM = 256
# On a machine without a GPU, "auto" runs the Pallas kernels in interpret mode up
# to this many score entries (B * H * Tq * Tk) and the reference beyond it: the
# interpreter is exact but slow, the reference is fast but materialises the scores.
INTERPRET_LIMIT = 1 << 22


def flash_attention(
    q,
    k,
    v,
    *,
    causal: bool = False,
    scale: float | None = None,
    bias=None,
    mask=None,
    segment_ids=None,
    q_lengths=None,
    kv_lengths=None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng=None,
    return_lse: bool = False,
    backend: str = "auto",
    config: Config | None = None,
):
    """Exact attention, computed tile by tile without materialising the scores.

    Computes ``softmax(scale * q @ k^T + mask) @ v`` per head, with FlashAttention-2
    kernels on a GPU. Differentiable in ``q``, ``k``, ``v`` (and through the
    logsumexp when ``return_lse=True``); works under ``jit``, ``grad``, ``vmap``
    and ``jax.checkpoint``.

    Example::

      q = jax.random.normal(key, (2, 1024, 8, 64), jnp.bfloat16)
      out = flashjax.flash_attention(q, q, q, causal=True)   # [2, 1024, 8, 64]

    Args:
      q: queries [batch, q_len, heads, head_dim].
      k: keys [batch, kv_len, kv_heads, head_dim]; ``kv_heads`` divides ``heads``
        (multi-query and grouped-query attention share K/V across a group of
        query heads without copying them).
      v: values, same shape as ``k``.
      causal: query ``i`` attends keys ``j <= i + kv_len - q_len``. With
        ``q_len != kv_len`` the mask is aligned to the bottom right, as in
        FlashAttention-2: the last query sees every key, so a decode step against
        a KV cache sees the whole cache. Query rows that see no key output 0.
      scale: logit scale; defaults to ``1 / sqrt(head_dim)``.
      bias, mask, segment_ids, q_lengths, kv_lengths, window, softcap,
      dropout_rate, dropout_rng: attention variants (see the README's feature
        table). ``window=(left, right)`` is a sliding window around the aligned
        diagonal (``None`` for an unbounded side) and runs in the kernels; the
        others currently run on the ``"xla"`` backend only.
      return_lse: also return the row logsumexp ``[batch, heads, q_len]``
        (float32, natural log, ``-inf`` for rows that see no key).
      backend: ``"auto"`` (the Pallas kernels on a CUDA GPU; elsewhere interpret
        mode for small problems and the reference beyond), ``"triton"`` (the
        Pallas Triton kernels; interpret mode without a GPU), ``"xla"`` (the
        pure-JAX reference, differentiated by JAX) or ``"mosaic"`` (Hopper).
      config: kernel tiling (`flashjax.Config`); ``None`` picks the tuned default.

    Returns:
      The attention output ``[batch, q_len, heads, head_dim]`` in ``q``'s dtype,
      and with ``return_lse=True`` a pair ``(output, lse)``.

    Raises:
      ValueError: for inconsistent shapes, unsupported dtypes or head dims, or bad
        option values; the message names the argument.
      NotImplementedError: when a backend forced by name lacks a requested feature.
    """
    _check_arrays(q, k, v)
    head_dim = q.shape[-1]
    scale = _check_scale(scale, head_dim)
    window = _check_window(window)
    _check_options(causal, softcap, dropout_rate, dropout_rng, backend, config)
    variants = {
        "bias": bias, "mask": mask, "segment_ids": segment_ids, "q_lengths": q_lengths,
        "kv_lengths": kv_lengths, "softcap": softcap, "dropout_rate": dropout_rate or None,
    }
    kernel_unsupported = sorted(name for name, value in variants.items() if value is not None)

    chosen = _choose_backend(backend, q, k, kernel_unsupported)
    if chosen == "xla":
        out = reference.attention(
            q, k, v, causal=causal, scale=scale, bias=bias, mask=mask, segment_ids=segment_ids,
            q_lengths=q_lengths, kv_lengths=kv_lengths, window=window, softcap=softcap,
            dropout_rate=dropout_rate, dropout_rng=dropout_rng, return_lse=return_lse,
        )
        if return_lse:
            return out[0].astype(q.dtype), out[1]
        return out.astype(q.dtype)

    params = AttentionParams(
        scale=scale,
        causal=bool(causal),
        window=window,
        config=config if config is not None else Config.default(head_dim, q.dtype),
        backend="triton",
        interpret=_platform() != "gpu",
    )
    out, lse = _kernel_attention(q, k, v, params)
    return (out, lse) if return_lse else out


@functools.partial(jax.jit, static_argnums=3)
def _kernel_attention(q, k, v, params):
    return autodiff.attention(q, k, v, params)


# ---- backend choice -------------------------------------------------------------------
def _platform() -> str:
    return jax.default_backend()


def _choose_backend(backend: str, q, k, kernel_unsupported: list[str]) -> str:
    if backend == "xla":
        return "xla"
    if backend == "mosaic":
        raise NotImplementedError(
            "backend='mosaic' (Hopper wgmma/TMA kernels) is not available yet; use backend='triton' or 'auto'."
        )
    if backend == "triton":
        if kernel_unsupported:
            raise NotImplementedError(
                f"backend='triton' does not support {', '.join(kernel_unsupported)} yet; "
                "use backend='xla' or backend='auto' (which falls back to it)."
            )
        return "triton"
    # auto
    if kernel_unsupported:
        return "xla"
    if _platform() == "gpu":
        return "triton"
    batch, seq_q, heads, _ = q.shape
    return "triton" if batch * heads * seq_q * k.shape[1] <= INTERPRET_LIMIT else "xla"


# ---- argument checks ------------------------------------------------------------------
def _shape_str(q, k, v) -> str:
    return f"q{tuple(q.shape)}, k{tuple(k.shape)}, v{tuple(v.shape)}"


def _check_arrays(q, k, v):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ValueError(f"{name} must be an array, got {type(x).__name__}.")
        if x.ndim != 4:
            raise ValueError(
                f"{name} must have rank 4 [batch, seq, heads, head_dim], got shape {tuple(x.shape)} "
                f"({_shape_str(q, k, v)}). Use jax.vmap for extra batch dimensions."
            )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {_shape_str(q, k, v)}.")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {_shape_str(q, k, v)}.")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must have the same head_dim, got {_shape_str(q, k, v)}.")
    if min(q.shape[1], k.shape[1]) < 1:
        raise ValueError(f"sequence lengths must be >= 1, got {_shape_str(q, k, v)}.")
    heads, kv_heads = q.shape[2], k.shape[2]
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(
            f"the number of query heads ({heads}) must be a multiple of the key/value heads ({kv_heads}); "
            f"got {_shape_str(q, k, v)}."
        )
    head_dim = q.shape[3]
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {head_dim} ({_shape_str(q, k, v)}).")
    dtypes = {jnp.dtype(x.dtype) for x in (q, k, v)}
    if len(dtypes) != 1:
        raise ValueError(
            f"q, k and v must share one dtype, got q:{q.dtype}, k:{k.dtype}, v:{v.dtype}."
        )
    (dtype,) = dtypes
    if dtype not in {jnp.dtype(d) for d in SUPPORTED_DTYPES}:
        raise ValueError(f"unsupported dtype {dtype} for q, k, v; use bfloat16, float16 or float32.")


def _check_scale(scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise ValueError(f"scale must be a positive Python number (static), got {scale!r}.")
    scale = float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be finite and > 0, got {scale}.")
    return scale


def _check_window(window):
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(f"window must be a pair (left, right) of ints >= 0 or None, got {window!r}.")
    checked = []
    for side, value in zip(("left", "right"), window):
        if value is None:
            checked.append(None)
        elif isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0:
            checked.append(int(value))
        else:
            raise ValueError(f"window {side} must be an int >= 0 or None, got {value!r}.")
    return tuple(checked) if checked != [None, None] else None


def _check_options(causal, softcap, dropout_rate, dropout_rng, backend, config):
    if not isinstance(causal, (bool, jnp.bool_)):
        raise ValueError(f"causal must be a bool, got {causal!r}.")
    if softcap is not None and not (isinstance(softcap, numbers.Real) and softcap > 0):
        raise ValueError(f"softcap must be a number > 0 or None, got {softcap!r}.")
    if not isinstance(dropout_rate, numbers.Real) or not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate!r}.")
    if dropout_rate > 0.0 and dropout_rng is None:
        raise ValueError("dropout_rate > 0 needs a dropout_rng (a jax.random key).")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}.")
    if config is not None and not isinstance(config, Config):
        raise ValueError(f"config must be a flashjax.Config or None, got {type(config).__name__}.")

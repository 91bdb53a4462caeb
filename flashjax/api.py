"""`flash_attention`: argument checking, normalisation and the choice of backend."""

from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp

from flashjax import autodiff, dropout, reference
from flashjax.config import Config
from flashjax.params import AttentionParams, Extras

__all__ = ["flash_attention", "BACKENDS"]

BACKENDS = ("auto", "triton", "mosaic", "xla")
SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
MAX_HEAD_DIM = 256
# On a machine without a GPU, "auto" runs the Pallas kernels in interpret mode up
# to this many score entries (B * H * Tq * Tk) and the reference beyond it: the
# interpreter is exact but slow, the reference is fast but materialises the scores.
INTERPRET_LIMIT = 1 << 22
# Whether backend="auto" runs the Hopper (Mosaic GPU) kernels on an sm90 GPU when the
# call's features allow it. Measured on an H100 (benchmarks/results/mosaic-notes.md):
# faster than the Triton kernels in every cell, forward (1.1-1.4x) and forward+backward
# (1.0-1.2x; head dim 256 runs the Triton backward), head dims 64/128/256, T = 1k-16k.
MOSAIC_AUTO = True


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
    alibi_slopes=None,
    dropout_rate: float = 0.0,
    dropout_rng=None,
    broadcast_dropout: bool = False,
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
      bias: additive float bias broadcastable to ``[batch, heads, q_len, kv_len]``,
        read tile by tile (never expanded); added after the softcap. Differentiable:
        its gradient is reduced over the axes it broadcasts along.
      mask: boolean, broadcastable to ``[batch, heads, q_len, kv_len]``; True = attend
        (the convention of ``jax.nn.dot_product_attention`` and Flax).
      segment_ids: int ``[batch, seq]`` (self-attention) or a pair
        ``([batch, q_len], [batch, kv_len])``: a query attends only keys of its own
        segment (packed sequences). Tiles that share no segment are skipped.
      q_lengths, kv_lengths: int ``[batch]``, right padding: keys at or past
        ``kv_lengths`` get no weight; query rows at or past ``q_lengths`` output 0
        (and get 0 gradient). Tiles past a length are not loaded.
      window: ``(left, right)`` sliding window: query ``i`` attends keys ``j`` with
        ``i' - left <= j <= i' + right``, ``i' = i + kv_len - q_len``; ``None`` for an
        unbounded side; combine with ``causal=True`` for ``right = 0``. Tiles
        outside the band are skipped, so the cost is linear in the length.
      softcap: if set, ``logits = softcap * tanh(logits / softcap)`` (Gemma-2 style).
      alibi_slopes: float ``[heads]``: ALiBi, adds ``-slope * |i' - j|`` to the
        logits, computed in the kernel (no bias array). Not differentiated.
      dropout_rate, dropout_rng: dropout on the attention probabilities, drawn in
        the kernel from a counter-based hash of (seed, batch, head, row, column), so
        the backward regenerates the same mask and nothing N x N is stored.
      broadcast_dropout: one dropout mask shared by every batch row and head
        (Flax's ``broadcast_dropout=True``).
      return_lse: also return the row logsumexp ``[batch, heads, q_len]``
        (float32, natural log, ``-inf`` for rows that see no key).
      backend: ``"auto"`` (on an sm90 GPU, H100/H200, the Mosaic GPU kernels for
        bf16/fp16 calls without bias, mask, segments, lengths, window, softcap,
        ALiBi or dropout, the Triton kernels otherwise; on other CUDA GPUs the
        Triton kernels; without a GPU, interpret mode for small problems and the
        reference beyond), ``"triton"`` (the Pallas Triton kernels; interpret mode
        without a GPU), ``"mosaic"`` (the Hopper kernels: wgmma, TMA, warp
        specialisation; raises ``NotImplementedError`` naming what they lack) or
        ``"xla"`` (the pure-JAX reference, differentiated by JAX).
      config: kernel tiling (`flashjax.Config`, whose ``mosaic`` field is a
        `flashjax.MosaicConfig`); ``None`` picks the tuned default.

    Returns:
      The attention output ``[batch, q_len, heads, head_dim]`` in ``q``'s dtype,
      and with ``return_lse=True`` a pair ``(output, lse)``.

    Raises:
      ValueError: for inconsistent shapes, unsupported dtypes or head dims, or bad
        option values; the message names the argument.
      NotImplementedError: when a backend forced by name lacks a requested feature.
    """
    _check_arrays(q, k, v)
    batch, seq_q, heads, head_dim = q.shape
    seq_k = k.shape[1]
    scale = _check_scale(scale, head_dim)
    window = _check_window(window)
    _check_options(causal, softcap, dropout_rate, dropout_rng, backend, config)
    shape = (batch, heads, seq_q, seq_k)
    q_segments, kv_segments = check_segment_ids(segment_ids, batch, seq_q, seq_k)
    extras = Extras(
        bias=_check_pair_array("bias", bias, shape, floating=True),
        mask=_check_pair_array("mask", mask, shape, floating=False),
        q_segment_ids=q_segments,
        kv_segment_ids=kv_segments,
        q_lengths=_check_lengths("q_lengths", q_lengths, batch),
        kv_lengths=_check_lengths("kv_lengths", kv_lengths, batch),
        alibi_slopes=_check_slopes(alibi_slopes, heads),
        dropout_seed=dropout.seed_words(dropout_rng) if dropout_rate > 0.0 else None,
    )

    unsupported = _mosaic_unsupported(q, extras, window, softcap, dropout_rate)
    backend = _choose_backend(backend, q, k, unsupported)
    if backend == "xla":
        out = reference.attention(
            q, k, v, causal=causal, scale=scale, bias=bias, mask=mask, segment_ids=segment_ids,
            q_lengths=q_lengths, kv_lengths=kv_lengths, window=window, softcap=softcap,
            alibi_slopes=alibi_slopes, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
            broadcast_dropout=broadcast_dropout, return_lse=return_lse,
        )
        if return_lse:
            return out[0].astype(q.dtype), out[1]
        return out.astype(q.dtype)

    params = AttentionParams(
        scale=scale,
        causal=bool(causal),
        window=window,
        softcap=None if softcap is None else float(softcap),
        dropout_rate=float(dropout_rate),
        broadcast_dropout=bool(broadcast_dropout),
        config=config if config is not None else Config.default(head_dim, q.dtype),
        backend=backend,
        interpret=_platform() != "gpu",
    )
    out, lse = _kernel_attention(q, k, v, extras, params)
    return (out, lse) if return_lse else out


@functools.partial(jax.jit, static_argnums=4)
def _kernel_attention(q, k, v, extras, params):
    return autodiff.attention(q, k, v, extras, params)


# ---- backend choice -------------------------------------------------------------------
def _platform() -> str:
    return jax.default_backend()


def _is_hopper() -> bool:
    """True when the default device is an sm90 (H100/H200) GPU: the Mosaic GPU kernels' target."""
    if _platform() != "gpu":
        return False
    return str(getattr(jax.devices()[0], "compute_capability", "")) == "9.0"


def _mosaic_unsupported(q, extras: Extras, window, softcap, dropout_rate) -> list[str]:
    """The features of a call that the Hopper kernels lack (empty when they cover it)."""
    missing = []
    if jnp.dtype(q.dtype) == jnp.float32:
        missing.append("float32 inputs (use bfloat16 or float16)")
    optional = {
        "bias": extras.bias, "mask": extras.mask, "segment_ids": extras.q_segment_ids,
        "q_lengths": extras.q_lengths, "kv_lengths": extras.kv_lengths, "alibi_slopes": extras.alibi_slopes,
    }
    missing += [name for name, value in optional.items() if value is not None]
    if window is not None:
        missing.append("window")
    if softcap is not None:
        missing.append("softcap")
    if dropout_rate > 0.0:
        missing.append("dropout")
    return missing


def _choose_backend(backend: str, q, k, mosaic_unsupported: list[str] = ()) -> str:
    if backend == "xla":
        return "xla"
    if backend == "mosaic":
        if mosaic_unsupported:
            raise NotImplementedError(
                f"backend='mosaic' (Hopper kernels) does not support {', '.join(mosaic_unsupported)}; "
                "use backend='triton' or 'auto'."
            )
        if not _is_hopper():
            raise NotImplementedError(
                "backend='mosaic' needs an sm90 (Hopper: H100/H200) GPU, found "
                f"{jax.devices()[0].device_kind!r}; JAX cannot run Mosaic GPU kernels in interpret mode. "
                "Use backend='triton' or 'auto'."
            )
        return "mosaic"
    if backend == "triton" or _platform() == "gpu":
        if backend == "auto" and not mosaic_unsupported and _is_hopper() and MOSAIC_AUTO:
            return "mosaic"
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


def _check_pair_array(name: str, x, shape: tuple[int, ...], *, floating: bool):
    """A bias or mask: broadcastable to [B, H, Tq, Tk]; returned 4-D with size-1 broadcast axes."""
    if x is None:
        return None
    if not hasattr(x, "shape"):
        raise ValueError(f"{name} must be an array broadcastable to {shape}, got {type(x).__name__}.")
    if x.ndim > 4:
        raise ValueError(f"{name} must have at most 4 dims [batch, heads, q_len, kv_len], got shape {tuple(x.shape)}.")
    full = (1,) * (4 - x.ndim) + tuple(x.shape)
    if any(d not in (1, s) for d, s in zip(full, shape)):
        raise ValueError(f"{name} of shape {tuple(x.shape)} is not broadcastable to [batch, heads, q_len, kv_len] = {shape}.")
    if floating and not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name} must be a floating array, got dtype {x.dtype}.")
    if not floating and x.dtype != jnp.bool_:
        raise ValueError(f"{name} must be a boolean array (True = attend), got dtype {x.dtype}.")
    return x.reshape(full)


def check_segment_ids(segment_ids, batch: int, seq_q: int, seq_k: int):
    """(q_ids int32 [B, Tq], kv_ids int32 [B, Tk]) from one array or a pair; (None, None) without ids.

    Shared with `flashjax.ring`, which takes the same argument.
    """
    if segment_ids is None:
        return None, None
    if isinstance(segment_ids, (tuple, list)):
        if len(segment_ids) != 2:
            raise ValueError("segment_ids must be an array [batch, seq] or a pair (q_segment_ids, kv_segment_ids).")
        q_ids, kv_ids = segment_ids
    else:
        if seq_q != seq_k:
            raise ValueError(
                f"segment_ids as one array needs q_len == kv_len (got {seq_q} and {seq_k}); "
                "pass a pair (q_segment_ids [batch, q_len], kv_segment_ids [batch, kv_len])."
            )
        q_ids = kv_ids = segment_ids
    for name, ids, length in (("q segment_ids", q_ids, seq_q), ("kv segment_ids", kv_ids, seq_k)):
        if not hasattr(ids, "shape") or tuple(ids.shape) != (batch, length):
            raise ValueError(f"{name} must have shape {(batch, length)}, got {getattr(ids, 'shape', type(ids).__name__)}.")
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(f"{name} must be integers, got dtype {ids.dtype}.")
    return q_ids.astype(jnp.int32), kv_ids.astype(jnp.int32)


def _check_lengths(name: str, lengths, batch: int):
    if lengths is None:
        return None
    if not hasattr(lengths, "shape") or tuple(lengths.shape) != (batch,):
        raise ValueError(f"{name} must have shape ({batch},) [batch], got {getattr(lengths, 'shape', type(lengths).__name__)}.")
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"{name} must be integers, got dtype {lengths.dtype}.")
    return lengths.astype(jnp.int32)


def _check_slopes(slopes, heads: int):
    if slopes is None:
        return None
    if not hasattr(slopes, "shape") or tuple(slopes.shape) != (heads,):
        raise ValueError(f"alibi_slopes must have shape ({heads},) [heads], got {getattr(slopes, 'shape', type(slopes).__name__)}.")
    return jax.lax.stop_gradient(slopes.astype(jnp.float32))

"""The pure-JAX oracle: attention written out plainly, in float32.

Every test compares the kernels against this function; it is also the `"xla"`
backend of `flash_attention`. It materialises the full [B, H, Tq, Tk] logits,
so it is meant for checking and for small problems, not for speed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from flashjax import dropout, masks
from flashjax.params import bias_logits

__all__ = ["attention", "logits_mask"]


def logits_mask(
    batch: int,
    seq_q: int,
    seq_k: int,
    *,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    segment_ids=None,
    q_lengths=None,
    kv_lengths=None,
    mask=None,
):
    """The boolean mask [B, 1 or H, Tq, Tk] (True = attend) that all structural options imply."""
    left, right = window if window is not None else (None, None)
    spec = masks.MaskSpec(seq_q, seq_k, causal=causal, window_left=left, window_right=right)
    rows = jnp.arange(seq_q)[:, None]
    cols = jnp.arange(seq_k)[None, :]
    allowed = jnp.broadcast_to(spec.allowed(rows, cols), (batch, 1, seq_q, seq_k))
    if segment_ids is not None:
        q_seg, kv_seg = segment_ids if isinstance(segment_ids, tuple) else (segment_ids, segment_ids)
        allowed = allowed & (q_seg[:, None, :, None] == kv_seg[:, None, None, :])
    if kv_lengths is not None:
        allowed = allowed & (cols[None, None] < kv_lengths[:, None, None, None])
    if q_lengths is not None:
        allowed = allowed & (rows[None, None] < q_lengths[:, None, None, None])
    if mask is not None:
        allowed = allowed & mask
    return allowed


def attention(
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
    dropout_seed=None,
):
    """Reference attention, computed in float32 (or in the inputs' dtype when it is wider:
    float64, complex).

    Args:
      q: queries [B, Tq, H, D].
      k: keys [B, Tk, Hkv, D]; Hkv divides H (grouped-query attention).
      v: values [B, Tk, Hkv, D].
      causal: query i attends keys j <= i + Tk - Tq (bottom-right aligned).
      scale: logit scale, default 1/sqrt(D).
      bias: additive bias broadcastable to [B, H, Tq, Tk], added after the softcap;
        -inf and values at or below `flashjax.params.MASKING_BIAS` (-1.7e38, e.g.
        finfo.min) mask the key.
      mask: boolean, broadcastable to [B, H, Tq, Tk]; True = attend.
      segment_ids: int [B, T] (self-attention) or a pair ([B, Tq], [B, Tk]).
      q_lengths, kv_lengths: int [B]; positions at or past them are padding.
      window: (left, right) sliding window around the (aligned) diagonal; None = unbounded side.
      softcap: if set, logits = softcap * tanh(logits / softcap).
      alibi_slopes: float [H]; adds -slope * |i + Tk - Tq - j| to the logits.
      dropout_rate, dropout_rng: dropout on the attention probabilities, with the
        keep mask of `flashjax.dropout` (the same bits the kernels draw).
      broadcast_dropout: one dropout mask for all batch rows and heads.
      return_lse: also return the row logsumexp [B, H, Tq] (natural log; -inf for empty rows).
      dropout_seed: uint32 [2], the words `flashjax.dropout.seed_words` derives from
        `dropout_rng`; give one or the other.

    Returns:
      The output [B, Tq, H, D] in the computation dtype (and the logsumexp if asked).
      Rows that attend no key are 0.
    """
    batch, seq_q, heads, head_dim = q.shape
    seq_k, kv_heads = k.shape[1], k.shape[2]
    if scale is None:
        scale = 1.0 / np.sqrt(head_dim)
    group = heads // kv_heads
    dtype = jnp.promote_types(q.dtype, jnp.float32)
    qf = q.astype(dtype).reshape(batch, seq_q, kv_heads, group, head_dim)
    kf = k.astype(dtype)
    vf = v.astype(dtype)
    hp = jax.lax.Precision.HIGHEST
    logits = jnp.einsum("bqhgd,bkhd->bhgqk", qf, kf, precision=hp).reshape(batch, heads, seq_q, seq_k)
    logits = logits * scale
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    if bias is not None:
        logits = logits + bias_logits(bias.astype(dtype))
    if alibi_slopes is not None:
        distance = jnp.abs(jnp.arange(seq_q)[:, None] + (seq_k - seq_q) - jnp.arange(seq_k)[None, :])
        logits = logits - alibi_slopes.astype(dtype)[None, :, None, None] * distance
    allowed = logits_mask(
        batch, seq_q, seq_k, causal=causal, window=window, segment_ids=segment_ids,
        q_lengths=q_lengths, kv_lengths=kv_lengths, mask=mask,
    )
    allowed = jnp.broadcast_to(allowed, logits.shape)
    logits = jnp.where(allowed, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    # The shift cancels out of softmax and lse, so it carries no gradient; empty rows
    # (max = -inf) shift by 0 to avoid inf - inf.
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    unnormalised = jnp.exp(logits - row_max)
    denom = jnp.sum(unnormalised, axis=-1, keepdims=True)
    probs = unnormalised / jnp.where(denom == 0.0, 1.0, denom)
    if dropout_rate > 0.0:
        seed = dropout.seed_words(dropout_rng) if dropout_seed is None else dropout_seed
        keep = dropout.keep_mask(seed, dropout_rate, batch, heads, seq_q, seq_k, broadcast=broadcast_dropout)
        probs = jnp.where(keep, probs / (1.0 - dropout_rate), 0.0)
    out = jnp.einsum(
        "bhgqk,bkhd->bqhgd", probs.reshape(batch, kv_heads, group, seq_q, seq_k), vf, precision=hp
    ).reshape(batch, seq_q, heads, head_dim)
    if not return_lse:
        return out
    lse = jnp.where(denom[..., 0] == 0.0, -jnp.inf, jnp.log(jnp.where(denom[..., 0] == 0, 1.0, denom[..., 0])) + row_max[..., 0])
    return out, lse

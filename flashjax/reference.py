"""The pure-JAX oracle: attention written out plainly, in float32.

Every test compares the kernels against this function; it is also the `"xla"`
backend of `flash_attention`. It materialises the full [B, H, Tq, Tk] logits,
so it is meant for checking and for small problems, not for speed.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from flashjax import dropout, flex, masks

__all__ = ["after_score_mod", "attention", "logits_mask", "scores"]


def index_grid(batch: int, heads: int, rows, seq_k: int):
    """Index arrays (batch, head, q_idx, kv_idx) broadcasting to [B, H, len(rows), Tk]."""
    return (
        jnp.arange(batch, dtype=jnp.int32)[:, None, None, None],
        jnp.arange(heads, dtype=jnp.int32)[None, :, None, None],
        jnp.asarray(rows, jnp.int32)[None, None, :, None],
        jnp.arange(seq_k, dtype=jnp.int32)[None, None, None, :],
    )


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
    mask_mod=None,
    heads: int = 1,
    rows=None,
):
    """The boolean mask [B, 1 or H, Tq, Tk] (True = attend) that all structural options imply.

    `mask_mod(batch, head, q_idx, kv_idx)` is evaluated on every pair (over ``heads`` heads).
    With `rows` (int positions), only those query rows: `mask` and the query segment ids
    then hold those rows only.
    """
    left, right = window if window is not None else (None, None)
    spec = masks.MaskSpec(seq_q, seq_k, causal=causal, window_left=left, window_right=right)
    rows = jnp.arange(seq_q) if rows is None else rows
    n_rows = rows.shape[0]
    rows = rows[:, None]
    cols = jnp.arange(seq_k)[None, :]
    allowed = jnp.broadcast_to(spec.allowed(rows, cols), (batch, 1, n_rows, seq_k))
    if segment_ids is not None:
        q_seg, kv_seg = segment_ids if isinstance(segment_ids, tuple) else (segment_ids, segment_ids)
        allowed = allowed & (q_seg[:, None, :, None] == kv_seg[:, None, None, :])
    if kv_lengths is not None:
        allowed = allowed & (cols[None, None] < kv_lengths[:, None, None, None])
    if q_lengths is not None:
        allowed = allowed & (rows[None, None] < q_lengths[:, None, None, None])
    if mask is not None:
        allowed = allowed & mask
    if mask_mod is not None:
        allowed = allowed & flex.elementwise(mask_mod, *index_grid(batch, heads, rows[:, 0], seq_k))
    return allowed


def scores(q, k, *, scale: float, softcap=None, bias=None, alibi_slopes=None, score_mod=None, rows=None,
           seq_q: int | None = None, allowed=None):
    """The logits [B, H, Tq, Tk] before masking, in float32 (or the inputs' dtype when wider).

    ``score_mod(scale * q.k, batch, head, q_idx, kv_idx)`` (in float32), then the softcap,
    then bias and ALiBi. With `rows` (int positions of q's rows among `seq_q` queries) q and `bias` hold
    those rows only. `allowed` (bool, broadcastable to the logits): the pairs that will be
    masked pass no gradient into score_mod's score, so that a mod whose derivative is
    non-finite there (s * log(q_idx) at row 0) gives zero gradients, not 0 * inf = NaN.
    """
    batch, n_rows, heads, head_dim = q.shape
    seq_k, kv_heads = k.shape[1], k.shape[2]
    seq_q = n_rows if seq_q is None else seq_q
    group = heads // kv_heads
    dtype = jnp.promote_types(q.dtype, jnp.float32)
    qf = q.astype(dtype).reshape(batch, n_rows, kv_heads, group, head_dim)
    hp = jax.lax.Precision.HIGHEST
    logits = jnp.einsum("bqhgd,bkhd->bhgqk", qf, k.astype(dtype), precision=hp).reshape(batch, heads, n_rows, seq_k)
    logits = logits * scale
    positions = jnp.arange(seq_q) if rows is None else rows
    if score_mod is not None:
        # score_mod takes float32 scores (as in the kernels), also from float64 inputs.
        score = logits.astype(jnp.float32)
        if allowed is not None:
            score = jnp.where(allowed, score, jax.lax.stop_gradient(score))
        logits = flex.elementwise(score_mod, score, *index_grid(batch, heads, positions, seq_k)).astype(dtype)
    return after_score_mod(logits, softcap=softcap, bias=bias, alibi_slopes=alibi_slopes, rows=positions, seq_q=seq_q)


def after_score_mod(logits, *, softcap=None, bias=None, alibi_slopes=None, rows, seq_q: int):
    """What follows score_mod in `scores`: the softcap, then bias and ALiBi, on logits
    [B, H, len(rows), Tk] of the query rows `rows` (int positions among `seq_q` queries)."""
    seq_k = logits.shape[-1]
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    if bias is not None:
        logits = logits + masks.bias_logits(bias.astype(logits.dtype))
    if alibi_slopes is not None:
        distance = jnp.abs(rows[:, None] + (seq_k - seq_q) - jnp.arange(seq_k)[None, :])
        logits = logits - alibi_slopes.astype(logits.dtype)[None, :, None, None] * distance
    return logits


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
    score_mod=None,
    mask_mod=None,
    sinks=None,
    return_lse: bool = False,
    dropout_seed=None,
):
    """Reference attention, computed in float32 (or in the inputs' dtype when it is wider:
    float64, complex).

    Args:
      q: queries [B, Tq, H, D].
      k: keys [B, Tk, Hkv, D]; Hkv divides H (grouped-query attention).
      v: values [B, Tk, Hkv, Dv] (Dv may differ from D).
      causal: query i attends keys j <= i + Tk - Tq (bottom-right aligned).
      scale: logit scale, default 1/sqrt(D).
      bias: additive bias broadcastable to [B, H, Tq, Tk], added after the softcap;
        -inf and values at or below `flashjax.masks.MASKING_BIAS` (-1.7014e38, e.g.
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
      score_mod: ``score_mod(score, batch, head, q_idx, kv_idx) -> score`` on scalars (called
        at every element, as FlexAttention's vmap does), applied to ``scale * q.k`` before
        the softcap, bias and ALiBi.
      mask_mod: ``mask_mod(batch, head, q_idx, kv_idx) -> bool`` on scalars; True = attend.
      sinks: float [H]: a logit per head that joins the softmax denominator of every row
        before ``q_lengths`` and contributes no value (attention sinks).
      return_lse: also return the row logsumexp [B, H, Tq] (natural log; -inf for empty rows).
      dropout_seed: uint32 [2], the words `flashjax.dropout.seed_words` derives from
        `dropout_rng`; give one or the other.

    Returns:
      The output [B, Tq, H, Dv] in the computation dtype (and the logsumexp if asked).
      Rows that attend no key are 0 (their lse is the sink's logit with sinks, else -inf).
    """
    batch, seq_q, heads, head_dim = q.shape
    seq_k, kv_heads, v_head_dim = k.shape[1], k.shape[2], v.shape[3]
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)  # a Python float: no float64 promotion under x64
    group = heads // kv_heads
    dtype = jnp.promote_types(q.dtype, jnp.float32)
    vf = v.astype(dtype)
    hp = jax.lax.Precision.HIGHEST
    allowed = logits_mask(
        batch, seq_q, seq_k, causal=causal, window=window, segment_ids=segment_ids,
        q_lengths=q_lengths, kv_lengths=kv_lengths, mask=mask, mask_mod=mask_mod, heads=heads,
    )
    logits = scores(q, k, scale=scale, softcap=softcap, bias=bias, alibi_slopes=alibi_slopes, score_mod=score_mod,
                    allowed=allowed)
    allowed = jnp.broadcast_to(allowed, logits.shape)
    # The logits computed once: fused into each consumer, XLA may contract the scale's product
    # into an FMA with the subtraction below (rounded for the max, unrounded there), and past
    # ~1e9 a row's largest term then leaves [0, 1] by half an ulp: exp overflows, or every
    # term underflows and the row's sum is 0.
    logits = jax.lax.optimization_barrier(jnp.where(allowed, logits, -jnp.inf))
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    if sinks is not None:
        # The sink is one more logit in every real row (not in rows past q_lengths: padding).
        sink = jnp.broadcast_to(sinks.astype(dtype)[None, :, None, None], (batch, heads, seq_q, 1))
        if q_lengths is not None:
            real = jnp.arange(seq_q)[None, None, :, None] < q_lengths[:, None, None, None]
            sink = jnp.where(real, sink, -jnp.inf)
        row_max = jnp.maximum(row_max, sink)
    # The shift cancels out of softmax and lse, so it carries no gradient; empty rows
    # (max = -inf) shift by 0 to avoid inf - inf.
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    unnormalised = jnp.exp(logits - row_max)
    denom = jnp.sum(unnormalised, axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sink - row_max)
    probs = unnormalised / jnp.where(denom == 0.0, 1.0, denom)
    if dropout_rate > 0.0:
        seed = dropout.seed_words(dropout_rng) if dropout_seed is None else dropout_seed
        keep = dropout.keep_mask(seed, dropout_rate, batch, heads, seq_q, seq_k, broadcast=broadcast_dropout)
        probs = jnp.where(keep, probs * dropout.keep_scale(dropout_rate), 0.0)
    out = jnp.einsum(
        "bhgqk,bkhd->bqhgd", probs.reshape(batch, kv_heads, group, seq_q, seq_k), vf, precision=hp
    ).reshape(batch, seq_q, heads, v_head_dim)
    if not return_lse:
        return out
    lse = jnp.where(denom[..., 0] == 0.0, -jnp.inf, jnp.log(jnp.where(denom[..., 0] == 0, 1.0, denom[..., 0])) + row_max[..., 0])
    return out, lse

"""Pieces shared by every kernel backend: the base-2 constants, the online softmax's start,
token padding, the backward's per-row inputs, and the exact merge of partial results (ring
attention's steps, split-KV decoding's splits)."""

from __future__ import annotations

import math

import jax.numpy as jnp

# Kernels work in base 2: exp(x) = exp2(x * log2(e)), and exp2 is a single MUFU
# instruction on NVIDIA GPUs. The logit scale is folded into the same multiply,
# so the kernels' logsumexp is in log2 units (lse2 = lse / ln 2).
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# The online softmax's running row max starts here, not at -inf: at or below every finite
# logit (the first finite one replaces it) and finite itself, so a row whose logits so far
# are all -inf (masked, or from an infinite input) gets exp2(-inf - start) = 0 weights and a
# rescale of 1, never exp2(-inf - -inf) = NaN, without a select per row and tile.
ROW_MAX_START = float(jnp.finfo(jnp.float32).min)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pad_tokens(x, length: int, head_dim: int):
    """Zero-pads [B, T, H, D] to [B, length, H, head_dim] (no copy when already aligned)."""
    pad_t, pad_d = length - x.shape[1], head_dim - x.shape[3]
    if pad_t == 0 and pad_d == 0:
        return x
    return jnp.pad(x, ((0, 0), (0, pad_t), (0, 0), (0, pad_d)))


def pad_segment_ids(ids, length: int):
    """Segment ids [B, T] as int32 [B, length], padded by repeating the last id (which keeps
    each padded tile's id extent tight); written as a concatenation, where jnp.pad's edge
    mode builds zero-size temporaries."""
    ids = ids.astype(jnp.int32)
    if ids.shape[1] == length:
        return ids
    tail = jnp.broadcast_to(ids[:, -1:], (ids.shape[0], length - ids.shape[1]))
    return jnp.concatenate([ids, tail], axis=1)


def backward_rows(o, do, lse, dlse, q_len: int):
    """The backward kernels' per-row inputs: (lse2, delta), float32 [B, H, q_len].

    delta_i = sum_j P_ij dP_ij = rowsum(dO * O); subtracting the lse cotangent adds
    its path (d lse / d S = P) to dS = P * (dP - delta) for free. lse2 is the base-2
    logsumexp; rows that see no key (lse = -inf) and padded rows get +inf, so that
    P = exp2(S - lse2) = 0 there. Such a row's delta is 0: its output and lse are constants,
    and a non-finite cotangent there (d/d lse of ``where(isfinite(lse), f(lse), 0)`` is
    0 * f'(-inf), NaN for sin) would otherwise reach every key through 0 * NaN.
    """
    delta = jnp.einsum("bqhd,bqhd->bhq", o.astype(jnp.float32), do.astype(jnp.float32))
    if dlse is not None:
        delta = delta - dlse
    empty = lse == -jnp.inf
    delta = jnp.where(empty, 0.0, delta)
    lse2 = jnp.where(empty, jnp.inf, lse * LOG2E)
    rows = ((0, 0), (0, 0), (0, q_len - lse.shape[2]))
    return jnp.pad(lse2, rows, constant_values=jnp.inf), jnp.pad(delta, rows)


def merge(o_a, lse_a, o_b, lse_b):
    """Merge of two partial attentions over disjoint key sets (o float32 or wider [B,T,H,D],
    lse [B,H,T]), exact up to the rounding of the lse (a relative error of about |lse| times
    the lse's epsilon in the weights).

    With natural-log lse: ``lse = logaddexp(lse_a, lse_b)`` and
    ``o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b``. A part without keys (o = 0,
    lse = -inf) gets weight 0.
    """
    # Rows that no key reached yet keep lse = -inf and o = 0: logaddexp never sees -inf
    # twice (its derivative there is NaN, which would reach forward-mode and second-order
    # gradients), and the weights shift by 0, not by -inf.
    nothing = (lse_a == -jnp.inf) & (lse_b == -jnp.inf)
    lse = jnp.where(nothing, -jnp.inf, jnp.logaddexp(jnp.where(nothing, 0.0, lse_a), jnp.where(nothing, 0.0, lse_b)))
    safe = jnp.where(lse == -jnp.inf, 0.0, lse)
    weight = lambda part: jnp.transpose(jnp.exp(part - safe), (0, 2, 1))[..., None]
    return weight(lse_a) * o_a + weight(lse_b) * o_b, lse


def fold_sinks(out, lse, sinks):
    """Each row's sink logit added to its softmax denominator after the fact (sinks do not
    touch the keys' weights, only their normaliser): the lse becomes logaddexp(lse, sink)
    and the output is scaled by exp(lse - that) (0 for a row without keys, whose lse is then
    the sink's). Exact, and differentiable in all three (dsinks by autodiff).

    out [B, T, H, Dv], lse [B, H, T] (natural log), sinks [H]."""
    wide = jnp.promote_types(lse.dtype, jnp.float32)  # float32, float64 for float64 calls
    sink = jnp.broadcast_to(sinks.astype(wide)[None, :, None], lse.shape)
    empty = lse == -jnp.inf
    # The inner wheres keep -inf - -inf (a row without keys, a sink of -inf) out of
    # logaddexp, exp and their gradients.
    nothing = empty & (sink == -jnp.inf)
    with_sink = jnp.where(nothing, -jnp.inf, jnp.logaddexp(jnp.where(nothing, 0.0, lse), jnp.where(nothing, 0.0, sink)))
    weight = jnp.where(empty, 0.0, jnp.exp(jnp.where(empty, 0.0, lse - with_sink)))
    scaled = out.astype(wide) * jnp.transpose(weight, (0, 2, 1))[..., None]
    return scaled.astype(out.dtype), with_sink


def merge_splits(o, lse):
    """`merge` of S partial attentions over disjoint key sets: o float32 [S, B, T, H, D], lse
    [S, B, H, T] -> ([B, T, H, D], [B, H, T])."""
    out, out_lse = o[0], lse[0]
    for split in range(1, o.shape[0]):
        out, out_lse = merge(out, out_lse, o[split], lse[split])
    return out, out_lse

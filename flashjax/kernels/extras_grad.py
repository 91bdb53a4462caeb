"""The gradients of a call's differentiable extras that no kernel computes, in XLA, for every
backend: the sinks' (a reduction over the rows of lse and delta) and those of the float arrays
a score_mod closes over (a pass over chunks of query rows)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from flashjax import dropout, flex, reference
from flashjax.params import AttentionParams, Extras

# The gradient of the arrays a score_mod closes over is computed over chunks of query rows
# holding about this many scores.
CHUNK_SCORES = 1 << 22


def sinks_grad(sinks, lse, delta):
    """d loss / d sinks [H], float32, from the natural-log lse and delta = rowsum(dO * O) - dlse [B, H, Tq].

    With Z = sum_j exp(s_j) + exp(sink), P_j = exp(s_j) / Z and P_sink = exp(sink - lse):
    d P_j / d sink = -P_j P_sink and d lse / d sink = P_sink, so a row contributes
    sum_j dP_j (-P_j P_sink) + dlse P_sink = -P_sink (rowsum(dO * O) - dlse) = -P_sink delta.
    Padded rows (lse = -inf) contribute nothing.
    """
    weight = jnp.where(lse == -jnp.inf, 0.0, jnp.exp(sinks.astype(jnp.float32)[None, :, None] - lse))
    return -jnp.sum(weight * delta, axis=(0, 2))


def score_consts_grad(q, k, v, do, lse, delta, extras: Extras, params: AttentionParams):
    """The gradients of the float arrays score_mod closes over (None for the others), in XLA.

    Over chunks of about CHUNK_SCORES scores (a few query rows, every key), the scores are
    recomputed (one Q K^T and one dO V^T product, as the backward kernels do),
    dS = P (dP - delta) from the forward's lse, and dS is pulled back through score_mod
    with jax.vjp; the chunks' gradients are summed in a loop. Memory: one chunk; compute:
    about two matrix products per score pair, over every pair (masked ones included).
    A separate XLA computation, so XLA drops it when those gradients are unused.
    """
    consts = extras.score_consts
    floats = flex.float_consts(consts)
    if not floats:
        return None if consts is None else tuple(None for _ in consts)
    batch, seq_q, heads, _ = q.shape
    seq_k, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    rows_per = max(1, min(seq_q, CHUNK_SCORES // (batch * heads * seq_k)))
    n_chunks = -(-seq_q // rows_per)
    mod, mask_mod = params.score_mod, params.mask_mod
    bias, mask = extras.bias, extras.mask
    q_seg = extras.q_segment_ids
    hp = lax.Precision.HIGHEST

    def chunk(i, total):
        positions = i * rows_per + jnp.arange(rows_per, dtype=jnp.int32)
        real = positions < seq_q
        rows = jnp.minimum(positions, seq_q - 1)  # the chunk past the end repeats a row, weightless
        take = lambda x, axis: x if x is None or x.shape[axis] == 1 else jnp.take(x, rows, axis=axis)
        q_c, do_c = take(q, 1), take(do, 1).astype(jnp.float32)
        lse_c, delta_c = take(lse, 2), take(delta, 2)

        def scores(floats):
            bound = mod.bind(flex.merge_float_consts(consts, floats))
            return reference.scores(q_c, k, scale=params.scale, softcap=params.softcap, bias=take(bias, 2),
                                    alibi_slopes=extras.alibi_slopes, score_mod=bound, rows=rows, seq_q=seq_q)

        s, pullback = jax.vjp(scores, floats)
        allowed = reference.logits_mask(
            batch, seq_q, seq_k, causal=params.causal, window=params.window,
            segment_ids=None if q_seg is None else (take(q_seg, 1), extras.kv_segment_ids),
            q_lengths=extras.q_lengths, kv_lengths=extras.kv_lengths, mask=take(mask, 2),
            mask_mod=None if mask_mod is None else mask_mod.bind(extras.mask_consts), heads=heads, rows=rows,
        )
        live = allowed & real[:, None] & (lse_c != -jnp.inf)[..., None]
        p = jnp.where(live, jnp.exp(s - jnp.where(live, lse_c[..., None], 0.0)), 0.0)
        dp = jnp.einsum("bqhgd,bkhd->bhgqk", do_c.reshape(batch, rows_per, kv_heads, group, -1),
                        v.astype(jnp.float32), precision=hp).reshape(batch, heads, rows_per, seq_k)
        if params.dropout_rate > 0.0:
            keep = dropout.keep_mask(extras.dropout_seed, params.dropout_rate, batch, heads, seq_q, seq_k,
                                     broadcast=params.broadcast_dropout, rows=rows)
            dp = jnp.where(keep, dp / (1.0 - params.dropout_rate), 0.0)
        (grads,) = pullback(p * (dp - delta_c[..., None]))
        return jax.tree.map(jnp.add, total, grads)

    zeros = tuple(jnp.zeros(c.shape, jnp.float32) for c in floats)
    grads = lax.fori_loop(0, n_chunks, chunk, zeros)
    return flex.merge_float_consts(consts, grads, others=None)

"""The gradients of a call's differentiable extras that no kernel computes, in XLA, for every
backend: the sinks' (a reduction over the rows of lse and delta) and those of the float arrays
a score_mod closes over (a pass over chunks of query rows)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from flashjax import dropout, flex, reference
from flashjax.params import AttentionParams, Extras
from flashjax.vma import vary_alike

# The gradient of the arrays a score_mod closes over is computed over chunks of query rows
# holding about this many scores.
CHUNK_SCORES = 1 << 22
# At most this many float elements in the copies of those arrays that spread the pullback's
# additions over the keys (`_score_mod_by_key_lane`).
SPREAD_ELEMENTS = 1 << 22


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
    recomputed (one Q K^T and one dO V^T product, as the backward kernels do: products of
    the inputs' dtype, exact in float32 for 16-bit inputs),
    dS = P (dP - delta) from the forward's lse, and dS is pulled back through score_mod
    with jax.vjp, each lane of keys holding its own copy of the arrays
    (`_score_mod_by_key_lane`); the chunks' gradients are summed in a loop. Memory: one
    chunk; compute: about two matrix products per score pair, over every pair (masked ones
    included). A separate XLA computation, so XLA drops it when those gradients are unused.
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
    dtype = jnp.promote_types(q.dtype, jnp.float32)
    lanes = _key_lanes(seq_k, sum(c.size for c in floats))

    def product(x, y):  # [B, rows, H, D] x [B, Tk, Hkv, D] -> [B, H, rows, Tk] in `dtype`
        x = x.reshape(batch, rows_per, kv_heads, group, -1)
        out = jnp.einsum("bqhgd,bkhd->bhgqk", x, y, precision=lax.Precision.HIGHEST, preferred_element_type=dtype)
        return out.reshape(batch, heads, rows_per, seq_k)

    def chunk(i, total):
        positions = i * rows_per + jnp.arange(rows_per, dtype=jnp.int32)
        real = positions < seq_q
        rows = jnp.minimum(positions, seq_q - 1)  # the chunk past the end repeats a row, weightless
        take = lambda x, axis: x if x is None or x.shape[axis] == 1 else jnp.take(x, rows, axis=axis)
        q_c, do_c = take(q, 1), take(do, 1)
        lse_c, delta_c = take(lse, 2), take(delta, 2)
        raw = product(q_c, k) * params.scale

        def scores(floats):
            modded = _score_mod_by_key_lane(mod, consts, floats, raw.astype(jnp.float32), rows, lanes)
            return reference.after_score_mod(modded.astype(dtype), softcap=params.softcap, bias=take(bias, 2),
                                             alibi_slopes=extras.alibi_slopes, rows=rows, seq_q=seq_q)

        s, pullback = jax.vjp(scores, floats)
        allowed = reference.logits_mask(
            batch, seq_q, seq_k, causal=params.causal, window=params.window,
            segment_ids=None if q_seg is None else (take(q_seg, 1), extras.kv_segment_ids),
            q_lengths=extras.q_lengths, kv_lengths=extras.kv_lengths, mask=take(mask, 2),
            mask_mod=None if mask_mod is None else mask_mod.bind(extras.mask_consts), heads=heads, rows=rows,
        )
        live = allowed & real[:, None] & (lse_c != -jnp.inf)[..., None]
        p = jnp.where(live, jnp.exp(s - jnp.where(live, lse_c[..., None], 0.0)), 0.0)
        dp = product(do_c, v)
        if params.dropout_rate > 0.0:
            keep = dropout.keep_mask(extras.dropout_seed, params.dropout_rate, batch, heads, seq_q, seq_k,
                                     broadcast=params.broadcast_dropout, rows=rows)
            dp = jnp.where(keep, dp * dropout.keep_scale(params.dropout_rate), 0.0)
        (grads,) = pullback(p * (dp - delta_c[..., None]))
        return jax.tree.map(jnp.add, total, grads)

    # Typed as the chunks' gradients are inside jax.shard_map (varying over the inputs' axes);
    # summed in float32, or in the array's own dtype where it is wider (float64 under x64).
    zeros = vary_alike(tuple(jnp.zeros(c.shape, jnp.promote_types(c.dtype, jnp.float32)) for c in floats),
                       q, k, v, do, extras)
    grads = lax.fori_loop(0, n_chunks, chunk, zeros)
    return flex.merge_float_consts(consts, grads, others=None)


def _key_lanes(seq_k: int, const_elements: int) -> int:
    """How many copies of the float arrays `_score_mod_by_key_lane` spreads over: the largest
    divisor of seq_k whose copies hold at most SPREAD_ELEMENTS elements (1: no copies)."""
    lanes = max(1, min(seq_k, SPREAD_ELEMENTS // max(const_elements, 1)))
    while seq_k % lanes:
        lanes -= 1
    return lanes


def _score_mod_by_key_lane(mod, consts, floats, score, rows, lanes: int):
    """score_mod at every score of `score` float32 [B, H, len(rows), Tk] (query rows `rows`),
    with key j reading the float arrays `floats` through copy j % lanes.

    The same values as `flex.elementwise` with the arrays closed over; what differs is the
    pullback. A read of a small table at every score (a T5 bucket, a slope per head)
    transposes to a scatter-add of every score's cotangent into the table's few entries,
    and on a GPU those additions serialise on them. With a copy per lane of keys,
    neighbouring scores add into different copies, and the copies are summed once (the
    broadcast's transpose).
    """
    batch, heads, n_rows, seq_k = score.shape
    copies = tuple(jnp.broadcast_to(f, (lanes, *f.shape)) for f in floats)
    # Keys j = lanes * a + lane: the lane is the minor axis, so that consecutive keys differ in it.
    score = score.reshape(batch, heads, n_rows, seq_k // lanes, lanes)
    kv_idx = jnp.arange(seq_k, dtype=jnp.int32).reshape(seq_k // lanes, lanes)
    grid = reference.index_grid(batch, heads, rows, 1)[:3]

    def one_lane(floats_, score_, kv_idx_):
        bound = mod.bind(flex.merge_float_consts(consts, floats_))
        return flex.elementwise(bound, score_, *grid, kv_idx_)

    out = jax.vmap(one_lane, in_axes=(0, 4, 1), out_axes=4)(copies, score, kv_idx)
    return out.reshape(batch, heads, n_rows, seq_k)

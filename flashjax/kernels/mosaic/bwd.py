"""The Hopper backward kernels (Pallas Mosaic GPU): dK/dV, then a deterministic dQ.

Both recompute P = exp2(S * scale * log2(e) - lse2) tile by tile from the
forward's lse (log2 units; +inf for rows that see no key and for padded rows, so
their P is 0) and use delta_i = rowsum(dO_i * O_i) - dlse_i:
dS = P * (dP - delta), dP = dO V^T.

* dK/dV: one CTA per (kv head, pair of key tiles, batch row). Two consumer
  warpgroups each keep one `block_kv` key tile (K, V in shared memory; dK, dV
  accumulating in registers; at wide head dims the two share one key tile, one
  accumulating dV and the other dK) and walk the query tiles that see it; a producer
  warpgroup streams Q, dO, lse and delta tiles through a ring. GQA: the walk runs
  over every query head of the kv head's group, so dK/dV are written once per kv
  head (no per-query-head copies to sum). Works transposed (S^T = K Q^T) so that
  dV += P^T dO and dK += dS^T Q take P^T and dS^T from registers. Up to head dim
  128 a step issues S^T and dP^T together and computes P^T while dP^T is on the
  tensor cores, then issues dV and dK as one group (FlashAttention-3's order); wider
  head dims wait for S^T first and issue dP^T with dV (`DP_WITH_S_MAX_DIMS`).
* dQ: one CTA per (query head, pair of query tiles, batch row), the forward's
  structure: each consumer keeps Q, dO, lse, delta of its tile and walks the
  key tiles it sees, streamed by the producer; S and dP issued together up to head
  dim 128, as in the dK/dV kernel. No atomics: every dQ row is summed by one
  warpgroup in a fixed order, so results are bit-reproducible.

Tile ranges come from `MaskSpec.q_range` / `kv_range`: tiles that see nothing are
never loaded, and only the boundary tiles (the causal diagonal, the last partial
key tile) are masked.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from flashjax import masks
from flashjax.kernels.mosaic import common
from flashjax.kernels.mosaic.common import COMPUTE_WGS, OptionalInputs, Tiling, loop

# Up to this head-dim sum (q/k's plus v's) both kernels issue dP with S, in FlashAttention-3's
# order, and compute the softmax while dP runs; wider (MLA's 192 + 128, 256 + 256) they keep
# dP's accumulator out of the softmax's way. On an H100 the FlashAttention-3 order measured
# 1.04-1.08x at head dim 64 and 0.96-1.05x at 128 (runs of +-4% noise), but 0.87x at MLA's
# 8k causal, whose dK/dV accumulators (160 float32 registers a thread) leave no room for S^T
# and dP^T in flight (benchmarks/results/mosaic-notes.md).
DP_WITH_S_MAX_DIMS = 256


def _store_grads(grads, smems, dsts):
    """Writes float32 gradient tiles out through shared-memory tiles of their inputs (one
    TMA group, waited for)."""
    for grad, smem in zip(grads, smems):
        smem[...] = grad.astype(smem.dtype)
    plgpu.commit_smem()
    for smem, dst in zip(smems, dsts):
        plgpu.copy_smem_to_gmem(smem, dst, commit_group=False)
    plgpu.commit_smem_to_gmem_group()
    plgpu.wait_smem_to_gmem(0)


def _load_query_tile(gmem, smem, ready, slot, b, h, rows):
    """TMA of one query tile's Q, dO, lse and delta (gmem refs in that order) into ring `slot`."""
    (q_ref, do_ref, lse_ref, delta_ref), (q_smem, do_smem, lse_smem, delta_smem) = gmem, smem
    q_ready, do_ready, lse_ready, delta_ready = ready
    plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_smem.at[slot], q_ready.at[slot])
    plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h], do_smem.at[slot], do_ready.at[slot])
    plgpu.copy_gmem_to_smem(lse_ref.at[b, h, rows], lse_smem.at[slot], lse_ready.at[slot])
    plgpu.copy_gmem_to_smem(delta_ref.at[b, h, rows], delta_smem.at[slot], delta_ready.at[slot])


def _probs_t(s_t, i, slot, smem, *, k_start, masked: bool, t: Tiling, padded_rows: bool, slope=None, kv_length=None,
             q_seg=None, kv_seg=None, stream=None, bias_t=None, mod=None):
    """P^T of query tile i against the key tile from S^T = K Q^T (float32 [block_kv, block_q],
    keys [k_start, ...)): the logits, the mask on boundary tiles, exp2 against the lse in ring
    `slot` (smem as `_dv_and_ds` takes it). Returns (P^T, d logits / d s for `_ds_t` (None
    without a softcap or score_mod), dropout's keep bits (None without dropout)).

    `slope` is the query head's ALiBi slope, `kv_length` the batch row's kv length (with
    ranges), q_seg / kv_seg the tiles' segment ids (`common.segment_vector`, on masked
    tiles with segments), bias_t the tile's bias, transposed (float32 [block_kv, block_q]),
    `mod` the query head's `flex.KernelMods` (with score_mod or mask_mod), `stream` the
    query head's dropout stream. `padded_rows`: the query arrays extend past the true q_len
    (static)."""
    lse_smem = smem[4]
    block_q = smem[2].shape[1]
    s_t, dlogits_t = common.logits(s_t, t, slope=slope, q_start=i * block_q, k_start=k_start, transposed=True,
                                   bias=bias_t, mod=mod, grad=True)
    if masked:
        s_t = common.mask_tile(s_t, t.spec, i * block_q, k_start, transposed=True, kv_length=kv_length, q_seg=q_seg,
                               kv_seg=kv_seg, mask_mod=t.mask_mod, mod=mod)
    lse = lax.broadcast_in_dim(plgpu.load(lse_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0)), s_t.shape, [1])
    # Capped at 1: with huge logits the recomputed S can exceed the lse by rounding.
    p_t = jnp.exp2(jnp.minimum(s_t * t.exp2_scale - lse, 0.0))
    if t.score_mod is not None and padded_rows:
        # Query rows past q_len (lse2 = +inf; their Q and dO are zeros) get P = 0 only from a
        # finite logit, and a score_mod may be non-finite there (log(1 - q_idx / q_len)).
        # A q_len that fills the tiles has no such rows, and its steps skip the select.
        p_t = jnp.where(lse == jnp.inf, 0.0, p_t)
    # Dropout's keep bits, for P^T and dP^T alike.
    keep_t = None if stream is None else common.keep_mask(t, stream, s_t.shape, i * block_q, k_start, transposed=True)
    return p_t, dlogits_t, keep_t


def _scores_t(slot, smem):
    """S^T = K Q^T of the query tile in ring `slot`, waited for (float32 [block_kv, block_q])."""
    k_smem, _, q_smem = smem[:3]
    return common.product(k_smem, q_smem.at[slot].transpose((1, 0)), (k_smem.shape[0], q_smem.shape[1]))


def _ds_t(p_t, dp_t, dlogits_t, keep_t, delta_smem, slot, t: Tiling):
    """dS^T = P^T (dP^T - delta) (dP^T through dropout's keep mask), carried through the
    softcap and score_mod: d loss / d (scale * q.k); the scale enters dK and dQ once, at the end."""
    delta = plgpu.load(delta_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
    ds_t = p_t * common.dp_minus_delta(dp_t, lax.broadcast_in_dim(delta, dp_t.shape, [1]), t, keep_t)
    return common.logit_grad(ds_t, dlogits_t, t)


def _ds_and_dv_operand(i, slot, smem, *, k_start, masked: bool, t: Tiling, **scoring):
    """One query tile of a key tile's walk, up to dS, in FlashAttention-3's order: S^T = K Q^T
    and dP^T = V dO^T issued together, P^T (`_probs_t`, which takes `scoring`) computed while
    dP^T is still on the tensor cores, then dS^T (`_ds_t`). With dropout dP^T passes back
    through P^T's keep mask.

    smem: (k, v, q ring, dO ring, lse ring, delta ring); `slot` picks the ring entries of
    query tile i. Returns dS^T (float32 [block_kv, block_q]) and dV's operand, P^T (dropped
    with dropout) in the inputs' dtype, for the caller to issue dV += P^T dO beside dK."""
    k_smem, v_smem, q_smem, do_smem, _, delta_smem = smem
    block_kv, block_q = k_smem.shape[0], q_smem.shape[1]

    def scores_and_dp(s_ref, dp_ref):
        plgpu.wgmma(s_ref, k_smem, q_smem.at[slot].transpose((1, 0)))  # S^T = K Q^T
        plgpu.wgmma(dp_ref, v_smem, do_smem.at[slot].transpose((1, 0)))  # dP^T = V dO^T
        s_t = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)
        probs = _probs_t(s_t, i, slot, smem, k_start=k_start, masked=masked, t=t, **scoring)
        return probs, plgpu.wgmma_accumulator_load(dp_ref, wait_n=0)

    shape = (block_kv, block_q)
    (p_t, dlogits_t, keep_t), dp_t = pl.run_scoped(scores_and_dp, plgpu.ACC(shape, jnp.float32),
                                                   plgpu.ACC(shape, jnp.float32))
    ds_t = _ds_t(p_t, dp_t, dlogits_t, keep_t, delta_smem, slot, t)
    return ds_t, common.drop(p_t, keep_t).astype(q_smem.dtype)


def _dv_and_ds(dv, i, slot, smem, *, k_start, masked: bool, t: Tiling, **scoring):
    """One query tile of a key tile's walk, up to dS, with fewer accumulators live at once
    (wide head dims): S^T = K Q^T, P^T (`_probs_t`, which takes `scoring`), dV += P^T dO and
    dP^T = V dO^T, then dS^T (`_ds_t`). With dropout dV takes the dropped weights and dP^T
    passes back through the same keep mask.

    smem as `_ds_and_dv_operand` takes it. Returns dv and dS^T, float32 [block_kv, block_q]."""
    k_smem, v_smem, q_smem, do_smem, _, delta_smem = smem
    block_kv, block_q = k_smem.shape[0], q_smem.shape[1]
    p_t, dlogits_t, keep_t = _probs_t(_scores_t(slot, smem), i, slot, smem, k_start=k_start, masked=masked, t=t,
                                      **scoring)

    def dv_dp(refs):
        # One block for both products: a single wgmma wait.
        dv_ref, dp_ref = refs
        plgpu.wgmma(dv_ref, common.drop(p_t, keep_t).astype(q_smem.dtype), do_smem.at[slot])  # dV += P^T dO
        plgpu.wgmma(dp_ref, v_smem, do_smem.at[slot].transpose((1, 0)))  # dP^T = V dO^T

    dv, dp_t = pl.run_state(dv_dp)((plgpu.ACC.init(dv), plgpu.ACC.init(common.zeros((block_kv, block_q)))))
    return dv, _ds_t(p_t, dp_t, dlogits_t, keep_t, delta_smem, slot, t)


def _dv_and_pd(dv, i, slot, smem, pd_smem, pd_ready, *, k_start, masked: bool, t: Tiling, **scoring):
    """The dV consumer of a shared key tile (`dkv(split=True)`): S^T = K Q^T, P^T; P^T times
    d logits / d s into `pd_smem[slot]` (the inputs' dtype) for the dK consumer, arriving
    on `pd_ready[slot]`; then dV += P^T dO (dropped weights with dropout)."""
    q_smem, do_smem = smem[2], smem[3]
    p_t, dlogits_t, keep_t = _probs_t(_scores_t(slot, smem), i, slot, smem, k_start=k_start, masked=masked, t=t,
                                      **scoring)
    pd_smem[slot] = common.logit_grad(p_t, dlogits_t, t).astype(pd_smem.dtype)
    plgpu.commit_smem()
    plgpu.barrier_arrive(pd_ready.at[slot])

    def dv_(dv_ref):
        plgpu.wgmma(dv_ref, common.drop(p_t, keep_t).astype(q_smem.dtype), do_smem.at[slot])

    return pl.run_state(dv_)(plgpu.ACC.init(dv))


def _dk_from_pd(dk, i, slot, smem, pd_smem, pd_ready, *, k_start, t: Tiling, stream=None):
    """The dK consumer of a shared key tile (`dkv(split=True)`): dP^T = V dO^T (through
    dropout's keep mask, drawn here too), then, once the dV consumer has written P^T times
    d logits / d s, dS^T = that (dP^T - delta) and dK += dS^T Q."""
    k_smem, v_smem, q_smem, do_smem, _, delta_smem = smem
    block_kv, block_q = k_smem.shape[0], q_smem.shape[1]
    dp_t = common.product(v_smem, do_smem.at[slot].transpose((1, 0)), (block_kv, block_q))
    keep_t = None if stream is None else common.keep_mask(t, stream, dp_t.shape, i * block_q, k_start, transposed=True)
    delta = plgpu.load(delta_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
    plgpu.barrier_wait(pd_ready.at[slot])
    pd_t = plgpu.load(pd_smem.at[slot], layout=plgpu.Layout.WGMMA).astype(jnp.float32)
    ds_t = pd_t * common.dp_minus_delta(dp_t, lax.broadcast_in_dim(delta, dp_t.shape, [1]), t, keep_t)

    def dk_(dk_ref):
        plgpu.wgmma(dk_ref, ds_t.astype(q_smem.dtype), q_smem.at[slot])  # dK += dS^T Q

    return pl.run_state(dk_)(plgpu.ACC.init(dk))


def dkv(q, k, v, do, lse2, delta, t: Tiling, optional: OptionalInputs = OptionalInputs(), *, split: bool = False):
    """dK [B, Tkp, Hkv, D] and dV [B, Tkp, Hkv, Dv] in k's dtype. q [B, Tqp, H, D], do [B, Tqp, H, Dv]
    (Dv = v's head dim, MLA's differs); lse2, delta [B, H, Tqp] float32;
    `optional`: the ALiBi slopes, the ranges by key tile [B, Tkp // t.block_kv, ...], the
    segment ids, the bias [Bb, Hb, Tqp, Tkp] and the arrays the user functions close over.

    Without `split` each consumer owns one key tile and accumulates its dK and dV, (D + Dv) / 2
    float32 registers per thread. With `split` (wide head dims, whose two accumulators
    exceed the registers) a CTA takes one key tile and its consumers share it, two of the
    four products each: the first computes S^T and P^T and accumulates dV += P^T dO, the
    second dP^T = V dO^T and dK += dS^T Q, with dS^T from the first's P^T (times the
    softcap's or score_mod's derivative), handed over in shared memory each step (the
    ring's free barrier, which both consumers arrive at, guards its reuse)."""
    batch, q_len, heads, head_dim, k_len, kv_heads, group, dtype = common.shapes(q, k)
    v_head_dim = v.shape[3]
    block_q, block_kv = t.block_q, t.block_kv
    dp_with_s = head_dim + v_head_dim <= DP_WITH_S_MAX_DIMS
    tiles_per_cta = 1 if split else COMPUTE_WGS
    cta_keys = tiles_per_cta * block_kv
    assert q_len % block_q == 0 and k_len % cta_keys == 0, (q.shape, k.shape, t)
    n_q = q_len // block_q
    stages = t.stages

    def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, opt: OptionalInputs, dk_ref, dv_ref, bias_scratch, scoped):
        b = lax.axis_index("batch")
        hk = lax.axis_index("heads")

        def q_tiles(k_block):
            return opt.tile_range(t.spec.q_range(k_block, block_q, block_kv, n_q), b, k_block)

        (k_smem2, v_smem2, q_smem, do_smem, lse_smem, delta_smem, *hand_over), ready, free = scoped[:3]
        kv_ready, q_ready, do_ready, lse_ready, delta_ready, *split_barriers = ready
        # split: the ring of P^T tiles handed from the dV consumer to the dK consumer, their
        # barriers, and the barrier both pass before writing their gradients.
        pd_smem = hand_over[0] if split else None
        pd_ready, kv_done = split_barriers if split else (None, None)
        # With segments: the key tiles' ids, the ring of the query tiles' ids, their barriers.
        kv_seg_smem2, q_seg_smem, kv_seg_ready, q_seg_ready = scoped[3] if t.segments else (None,) * 4
        # With a bias: the ring of its tiles (this query tile's rows, the CTA's key
        # columns) and their barriers.
        bias_smem, bias_ready = bias_scratch
        ring_ready = (q_ready, do_ready, lse_ready, delta_ready) + ((q_seg_ready,) if t.segments else ())
        pair = lax.axis_index("pair")
        # The producer streams, for every query head of the group, the query tiles the
        # CTA's key tiles meet.
        ring_lo, ring_hi = common.hull(q_tiles(pair * tiles_per_cta), q_tiles(pair * tiles_per_cta + tiles_per_cta - 1))
        per_head = ring_hi - ring_lo
        steps = group * per_head

        def _consumer(wg):
            tile = masks.int32_rem(wg, tiles_per_cta)  # the CTA's key tile this consumer works on (traced: the lowering
            # fails on a static index of shared memory read in the loop)
            k_smem, v_smem = k_smem2.at[tile], v_smem2.at[tile]
            k_block = pair * tiles_per_cta + tile
            k_start = k_block * block_kv
            tiles = q_tiles(k_block)
            at = (b, pl.ds(k_start, block_kv), hk)

            def load_kv():
                plgpu.copy_gmem_to_smem(k_ref.at[at], k_smem, kv_ready.at[tile])
                plgpu.copy_gmem_to_smem(v_ref.at[at], v_smem, kv_ready.at[tiles_per_cta + tile])

            if split:  # one copy of the shared tile
                pl.when(wg == 0)(load_kv)
            else:
                load_kv()
            plgpu.barrier_wait(kv_ready.at[tile])
            plgpu.barrier_wait(kv_ready.at[tiles_per_cta + tile])
            kv_seg = None
            if t.segments:  # keys: dim 0 of S^T
                kv_seg = common.own_segment_ids(opt.kv_segment_ids.at[b, pl.ds(k_start, block_kv)],
                                                kv_seg_smem2.at[wg], kv_seg_ready.at[wg], 0)

            def wait_inputs(slot):
                for ready_ in ring_ready:
                    plgpu.barrier_wait(ready_.at[slot])

            kv_length = opt.kv_length(b, k_block)
            smem = (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem)

            def step(s, i, carry, masked: bool, role: str, slope, stream, mod):
                slot = masks.int32_rem(s, stages)
                wait_inputs(slot)
                if role == "dk":  # no scores: dS^T comes from the dV consumer's P^T
                    carry = _dk_from_pd(carry, i, slot, smem, pd_smem, pd_ready, k_start=k_start, t=t, stream=stream)
                    plgpu.barrier_arrive(free.at[slot])
                    return carry
                q_seg = common.segment_vector(q_seg_smem.at[slot], 1) if t.segments and masked else None
                bias_t = None if bias_smem is None else common.bias_tile_transposed(bias_smem, bias_ready, slot, tile,
                                                                                     block_kv)
                scoring = dict(k_start=k_start, masked=masked, t=t, padded_rows=q_len != t.spec.seq_q, slope=slope,
                               kv_length=kv_length, q_seg=q_seg, kv_seg=kv_seg, stream=stream, bias_t=bias_t, mod=mod)
                if role == "dv":
                    carry = _dv_and_pd(carry, i, slot, smem, pd_smem, pd_ready, **scoring)
                elif dp_with_s:
                    dk, dv = carry
                    ds_t, p16 = _ds_and_dv_operand(i, slot, smem, **scoring)

                    def dk_dv(refs):
                        # One wgmma group: a single wait for both accumulators.
                        dk_ref, dv_ref = refs
                        plgpu.wgmma(dv_ref, p16, do_smem.at[slot])  # dV += P^T dO
                        plgpu.wgmma(dk_ref, ds_t.astype(dtype), q_smem.at[slot])  # dK += dS^T Q

                    carry = pl.run_state(dk_dv)((plgpu.ACC.init(dk), plgpu.ACC.init(dv)))
                else:
                    dk, dv = carry
                    dv, ds_t = _dv_and_ds(dv, i, slot, smem, **scoring)

                    def dk_(acc_ref):
                        plgpu.wgmma(acc_ref, ds_t.astype(dtype), q_smem.at[slot])  # dK += dS^T Q

                    carry = pl.run_state(dk_)(plgpu.ACC.init(dk)), dv
                plgpu.barrier_arrive(free.at[slot])
                return carry

            def skip(s, _):
                # A query tile the CTA streams but this key tile does not meet: keep the
                # ring's barriers in step without computing.
                slot = masks.int32_rem(s, stages)
                wait_inputs(slot)
                if t.bias:
                    plgpu.barrier_wait(bias_ready.at[slot])
                plgpu.barrier_arrive(free.at[slot])

            def walk(role: str):
                """The consumer's accumulators (dK, dV; dV or dK alone for a split role) over
                every query head of the group and the query tiles that see its key tile."""

                def head(g, carry):
                    base = g * per_head - ring_lo  # ring step of query tile i is base + i
                    slope = None if opt.slopes is None else opt.slopes[hk * group + g]
                    stream = None if opt.dropout_seed is None else opt.dropout_stream(t, b, hk * group + g, heads)
                    mod = opt.mod_inputs(t, b, hk * group + g, grad=True)
                    lax.fori_loop(ring_lo, tiles.lo, lambda i, c: skip(base + i, c), None)
                    carry = common.visit(tiles, lambda i, c, masked: step(base + i, i, c, masked, role, slope, stream,
                                                                          mod),
                                         carry, t.q_boundaries(k_len))
                    lax.fori_loop(tiles.hi, ring_hi, lambda i, c: skip(base + i, c), None)
                    return carry

                dk0, dv0 = common.zeros((block_kv, head_dim)), common.zeros((block_kv, v_head_dim))
                return loop(0, group, head, {"dk": dk0, "dv": dv0, "both": (dk0, dv0)}[role])

            if not split:
                dk, dv = walk("both")
                # (Dropout's keep scale enters dV once, here, not with each kept weight.)
                _store_grads((dk * t.scale, common.scale_kept_sum(dv, t)), (k_smem, v_smem),
                             (dk_ref.at[at], dv_ref.at[at]))
                return
            for role_wg, role in enumerate(("dv", "dk")):

                @pl.when(wg == role_wg)
                def _(role=role):
                    grad = walk(role)
                    # The dV consumer reads K and the dK consumer V until their last step:
                    # each writes its gradient through the other's input tile after both.
                    plgpu.barrier_arrive(kv_done)
                    plgpu.barrier_wait(kv_done)
                    if role == "dv":
                        _store_grads((common.scale_kept_sum(grad, t),), (v_smem,), (dv_ref.at[at],))
                    else:
                        _store_grads((grad * t.scale,), (k_smem,), (dk_ref.at[at],))

        def _producer():

            def load(s):
                slot = masks.int32_rem(s, stages)
                h = hk * group + masks.int32_div(s, per_head)
                rows = pl.ds((ring_lo + masks.int32_rem(s, per_head)) * block_q, block_q)
                if t.segments:
                    plgpu.copy_gmem_to_smem(opt.q_segment_ids.at[b, rows], q_seg_smem.at[slot], q_seg_ready.at[slot])
                if t.bias:  # this query tile's rows, the CTA's key columns
                    keys = pl.ds(pair * cta_keys, cta_keys)
                    plgpu.copy_gmem_to_smem(opt.bias_plane(b, h).at[rows, keys], bias_smem.at[slot], bias_ready.at[slot])
                _load_query_tile(
                    (q_ref, do_ref, lse_ref, delta_ref), (q_smem, do_smem, lse_smem, delta_smem),
                    (q_ready, do_ready, lse_ready, delta_ready), slot, b, h, rows,
                )

            for i in range(stages):
                pl.when(i < steps)(lambda i=i: load(jnp.int32(i)))

            @pl.loop(stages, jnp.maximum(steps, stages))
            def _(s):
                plgpu.barrier_wait(free.at[masks.int32_rem(s, stages)])
                load(s)

        common.warp_specialized(_consumer, _producer)

    def entry(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs):
        opt, (dk_ref, dv_ref) = OptionalInputs.split(t, refs)
        tiles = common.smem_tiles()
        smem = (
            plgpu.SMEM((tiles_per_cta, block_kv, head_dim), dtype, transforms=tiles),  # K in, dK out
            plgpu.SMEM((tiles_per_cta, block_kv, v_head_dim), dtype, transforms=tiles),  # V in, dV out
            plgpu.SMEM((stages, block_q, head_dim), dtype, transforms=tiles),
            plgpu.SMEM((stages, block_q, v_head_dim), dtype, transforms=tiles),
            plgpu.SMEM((stages, block_q), jnp.float32),
            plgpu.SMEM((stages, block_q), jnp.float32),
        )
        ready = (plgpu.Barrier(num_barriers=2 * tiles_per_cta),) + (plgpu.Barrier(num_barriers=stages),) * 4
        if split:
            # P^T times d logits / d s, from the dV consumer to the dK consumer; its ready
            # barriers; kv_done: both consumers' last reads of K and V.
            smem += (plgpu.SMEM((stages, block_kv, block_q), dtype, transforms=tiles),)
            ready += (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_arrivals=COMPUTE_WGS))
        common.with_bias_scratch(
            lambda bias, scoped: kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, opt, dk_ref, dv_ref, bias, scoped),
            t, block_q, cta_keys, stages, dtype,
            smem, ready, plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
            *common.segment_scratch(t, block_kv, block_q, stages), collective_axes="wg",
        )

    return common.launch(
        entry, out_type=(k, v), pairs=k_len // cta_keys, heads=kv_heads, batch=batch,
        kernel_name="flashjax_mosaic_dkv",
    )(q, k, v, do, lse2, delta, *optional.inputs(t))


def dq(q, k, v, do, lse2, delta, t: Tiling, optional: OptionalInputs = OptionalInputs()):
    """dQ [B, Tqp, H, D] in q's dtype, summed in a fixed order (no atomics); do and v have v's head
    dim Dv; `optional` as the forward's (ranges by query tile)."""
    batch, q_len, heads, head_dim, k_len, kv_heads, group, dtype = common.shapes(q, k)
    v_head_dim = v.shape[3]
    block_q, block_kv = t.block_q, t.block_kv
    assert q_len % (COMPUTE_WGS * block_q) == 0 and k_len % block_kv == 0, (q.shape, k.shape, t)
    n_kv = k_len // block_kv
    n_pairs = q_len // (COMPUTE_WGS * block_q)
    stages = max(1, min(t.stages, n_kv))
    v_stages = max(1, min(t.v_stages or stages, stages))  # V's ring may be shallower (Tiling.v_stages)
    dp_with_s = head_dim + v_head_dim <= DP_WITH_S_MAX_DIMS
    scale_log2 = t.exp2_scale

    def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, opt: OptionalInputs, dq_ref, bias_scratch, scoped):
        b = lax.axis_index("batch")
        h = lax.axis_index("heads")
        slope = None if opt.slopes is None else opt.slopes[h]
        stream = opt.dropout_stream(t, b, h, heads)
        mod = opt.mod_inputs(t, b, h, grad=True)

        def kv_tiles(q_block):
            return opt.tile_range(t.spec.kv_range(q_block, block_q, block_kv, n_kv), b, q_block)

        (q_smem2, do_smem2, lse_smem2, delta_smem2, k_smem, v_smem), (k_ready, v_ready, own_ready), (k_free, v_free) = scoped[:3]
        # With segments: the query tiles' ids, the ring of the key tiles' ids, their barriers.
        q_seg_smem2, kv_seg_smem, q_seg_ready, kv_seg_ready = scoped[3] if t.segments else (None,) * 4
        # With a bias: the ring of its tiles (both consumers' query rows) and their barriers.
        bias_smem, bias_ready = bias_scratch
        # The ring's ready barriers, slotted as K's ring (the segment ids come with K) and as V's
        # (the bias comes with V).
        k_side = (k_ready,) + ((kv_seg_ready,) if t.segments else ())
        v_side = (v_ready,) + ((bias_ready,) if t.bias else ())
        pair = common.pair_index(n_pairs, longest_first=t.spec.causal, order=opt.pair_order)
        ring_lo, ring_hi = common.hull(kv_tiles(pair * COMPUTE_WGS), kv_tiles(pair * COMPUTE_WGS + 1))

        def _consumer(wg):
            q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
            q_block = pair * COMPUTE_WGS + wg
            q_start = q_block * block_q
            tiles = kv_tiles(q_block)
            kv_length = opt.kv_length(b, q_block)
            rows = pl.ds(q_start, block_q)
            own = [
                (q_ref.at[b, rows, h], q_smem), (do_ref.at[b, rows, h], do_smem),
                (lse_ref.at[b, h, rows], lse_smem2.at[wg]), (delta_ref.at[b, h, rows], delta_smem2.at[wg]),
            ]
            for n, (src, dst) in enumerate(own):
                plgpu.copy_gmem_to_smem(src, dst, own_ready.at[4 * wg + n])
            for n in range(4):
                plgpu.barrier_wait(own_ready.at[4 * wg + n])
            lse = plgpu.load(lse_smem2.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
            delta = plgpu.load(delta_smem2.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
            q_seg = None
            if t.segments:
                q_seg = common.own_segment_ids(opt.q_segment_ids.at[b, rows], q_seg_smem2.at[wg], q_seg_ready.at[wg], 0)

            def step(j, acc, masked: bool):
                slot, v_slot = masks.int32_rem(j - ring_lo, stages), masks.int32_rem(j - ring_lo, v_stages)
                plgpu.barrier_wait(k_ready.at[slot])
                kv_seg = common.ring_segment_ids(kv_seg_smem, kv_seg_ready, slot, 1, masked) if t.segments else None

                def probs(s, bias):
                    s, dlogits = common.logits(s, t, slope=slope, q_start=q_start, k_start=j * block_kv, bias=bias,
                                               mod=mod, grad=True)
                    if masked:
                        s = common.mask_tile(s, t.spec, q_start, j * block_kv, kv_length=kv_length, q_seg=q_seg,
                                             kv_seg=kv_seg, mask_mod=t.mask_mod, mod=mod)
                    # Capped at 1: with huge logits the recomputed S can exceed the lse by rounding.
                    return jnp.exp2(jnp.minimum(s * scale_log2 - lax.broadcast_in_dim(lse, s.shape, [0]), 0.0)), dlogits

                if dp_with_s:
                    bias = None if bias_smem is None else common.bias_tile(bias_smem, bias_ready, v_slot, wg, block_q)

                    def scores_and_dp(s_ref, dp_ref):
                        # S and dP issued together: the softmax of S runs while dP is on the tensor cores.
                        plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].transpose((1, 0)))  # S = Q K^T
                        plgpu.barrier_wait(v_ready.at[v_slot])
                        plgpu.wgmma(dp_ref, do_smem, v_smem.at[v_slot].transpose((1, 0)))  # dP = dO V^T
                        return probs(plgpu.wgmma_accumulator_load(s_ref, wait_n=1), bias), \
                            plgpu.wgmma_accumulator_load(dp_ref, wait_n=0)

                    shape = (block_q, block_kv)
                    (p, dlogits), dp = pl.run_scoped(scores_and_dp, plgpu.ACC(shape, jnp.float32),
                                                     plgpu.ACC(shape, jnp.float32))
                else:
                    s = common.product(q_smem, k_smem.at[slot].transpose((1, 0)), (block_q, block_kv))  # S = Q K^T
                    bias = None if bias_smem is None else common.bias_tile(bias_smem, bias_ready, v_slot, wg, block_q)
                    p, dlogits = probs(s, bias)
                    plgpu.barrier_wait(v_ready.at[v_slot])
                    # dP = dO V^T
                    dp = common.product(do_smem, v_smem.at[v_slot].transpose((1, 0)), (block_q, block_kv))
                plgpu.barrier_arrive(v_free.at[v_slot])
                keep = None if stream is None else common.keep_mask(t, stream, dp.shape, q_start, j * block_kv)
                ds = common.logit_grad(p * common.dp_minus_delta(dp, lax.broadcast_in_dim(delta, dp.shape, [0]), t, keep),
                                       dlogits, t)

                def dq_(acc_ref):
                    plgpu.wgmma(acc_ref, ds.astype(dtype), k_smem.at[slot])  # dQ += dS K

                acc = pl.run_state(dq_)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(k_free.at[slot])
                return acc

            free = (k_free, v_free)
            common.release_kv(free, lo=ring_lo, hi=tiles.lo, ring_lo=ring_lo, stages=stages, ready=k_side,
                              v_stages=v_stages, v_ready=v_side)
            acc = common.visit(tiles, step, common.zeros((block_q, head_dim)), t.kv_boundaries(k_len))
            wait = common.upper_skips_wait(t, lockstep=False)
            common.release_kv(free, lo=tiles.hi, hi=ring_hi, ring_lo=ring_lo, stages=stages,
                              ready=k_side if wait else (), v_stages=v_stages, v_ready=v_side if wait else ())
            q_smem[...] = (acc * t.scale).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[b, rows, h])
            plgpu.wait_smem_to_gmem(0)

        def _producer():
            kv_head = masks.int32_div(h, group)
            common.stream_kv(
                k_ref, v_ref, k_smem, v_smem, (k_ready, v_ready), (k_free, v_free),
                at=lambda j: (b, pl.ds(j * block_kv, block_kv), kv_head),
                lo=ring_lo, hi=ring_hi, stages=stages, block_kv=block_kv,
                segments=(opt.kv_segment_ids, kv_seg_smem, kv_seg_ready) if t.segments else None,
                bias=(bias_rows, bias_smem, bias_ready) if t.bias else None, v_stages=v_stages,
            )

        def bias_rows(j):
            rows = pl.ds(pair * COMPUTE_WGS * block_q, COMPUTE_WGS * block_q)
            return opt.bias_plane(b, h).at[rows, pl.ds(j * block_kv, block_kv)]

        common.warp_specialized(_consumer, _producer)

    def entry(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs):
        opt, (dq_ref,) = OptionalInputs.split(t, refs, pairs=True)
        tiles = common.smem_tiles()
        smem = (
            plgpu.SMEM((COMPUTE_WGS, block_q, head_dim), dtype, transforms=tiles),  # Q in, dQ out
            plgpu.SMEM((COMPUTE_WGS, block_q, v_head_dim), dtype, transforms=tiles),  # dO
            plgpu.SMEM((COMPUTE_WGS, block_q), jnp.float32),
            plgpu.SMEM((COMPUTE_WGS, block_q), jnp.float32),
            plgpu.SMEM((stages, block_kv, head_dim), dtype, transforms=tiles),
            plgpu.SMEM((v_stages, block_kv, v_head_dim), dtype, transforms=tiles),
        )
        ready = (
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=v_stages),
            plgpu.Barrier(num_barriers=4 * COMPUTE_WGS),
        )
        free = (plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
                plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=v_stages))
        common.with_bias_scratch(
            lambda bias, scoped: kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, opt, dq_ref, bias, scoped),
            t, COMPUTE_WGS * block_q, block_kv, v_stages, dtype,
            smem, ready, free, *common.segment_scratch(t, block_q, block_kv, stages), collective_axes="wg",
        )

    return common.launch(
        entry, out_type=q, pairs=n_pairs, heads=heads, batch=batch, kernel_name="flashjax_mosaic_dq",
    )(q, k, v, do, lse2, delta, *optional.inputs(t, pairs=True))

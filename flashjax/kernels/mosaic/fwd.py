"""The Hopper forward kernel (Pallas Mosaic GPU): wgmma, TMA and warp specialisation.

One CTA per (head, pair of query tiles, batch row), or a persistent grid of one CTA per
SM that walks those items (`MosaicConfig.fwd_persistent`), runs three warpgroups, in the
FlashAttention-3 arrangement:

* two consumer warpgroups, each owning a `block_q`-row query tile in registers
  (m, l, acc in float32) and walking the key tiles with `wgmma`: S = Q K^T into
  registers, the online softmax, then acc += P V with P fed from registers;
* one producer warpgroup that only issues TMA copies of K and V tiles into a ring
  of `stages` shared-memory slots (`common.stream_kv`).

Two key loops keep the tensor cores busy while a consumer runs its softmax (the
MUFU/FMA units), chosen by the `schedule` argument (MosaicConfig.fwd_schedule):

* `synchronous_loop` with a ping-pong barrier: each step waits for its products, and
  the barrier alternates the two consumers so that one's softmax runs under the other's
  products (JAX's FA3 example). Used with a causal mask.
* `overlapped_loop`: software-pipelined, each consumer's softmax of tile j runs under
  its own P V product of tile j-1 (FlashAttention-3's intra-warpgroup overlap).

The arrays arrive padded to whole tiles (see `backend.py`); the mask spec holds the
true lengths. Key tiles outside a query tile's range (`MaskSpec.kv_range`) are never
loaded, the fully visible ones run without a mask, and only the boundary tiles (the
causal diagonal, the last partial key tile) pay for the iota/where. Rows that see no
key keep l = 0 and finish as o = 0, lse = -inf (with sinks, lse = the
sink's logit: the sink starts every row's running max and sum).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from flashjax import masks
from flashjax.kernels.common import LOG2E, ROW_MAX_START
from flashjax.kernels.mosaic import common
from flashjax.kernels.mosaic.common import COMPUTE_WGS, OptionalInputs, Tiling
from flashjax.masks import BlockRange

SCHEDULES = ("pingpong", "overlap")


class _Consumer(NamedTuple):
    """What one consumer warpgroup's key loop reads: its query tile and the K/V ring."""

    q_smem: object
    q_start: object  # first query row of the tile
    k_smem: object
    v_smem: object
    k_ready: object
    v_ready: object
    k_free: object
    v_free: object
    ring_lo: object  # the key tile the ring started at (slot of tile j: (j - ring_lo) % stages)
    stages: int
    turn: object  # one turn of the ping-pong schedule (a no-op without it)
    t: Tiling
    boundaries: tuple[bool, bool]  # Tiling.kv_boundaries: which masked parts of a range can exist
    slope: object = None  # this head's ALiBi slope, if any
    kv_length: object = None  # this batch row's kv length, with ranges
    q_seg: object = None  # the query tile's segment ids (`common.segment_vector`), with segments
    kv_seg_smem: object = None  # the ring of the key tiles' segment ids, and its ready barriers
    kv_seg_ready: object = None
    drop_stream: object = None  # this (batch row, head)'s dropout stream, with dropout
    bias_smem: object = None  # the ring of bias tiles (both consumers' rows) and its ready barriers, with a bias
    bias_ready: object = None
    wg: object = None  # this consumer's index (its rows of a bias tile)
    mod: object = None  # the user functions' `flex.KernelMods`, with score_mod or mask_mod

    def slot(self, j):
        return masks.int32_rem(j - self.ring_lo, self.stages)

    def kv_segments(self, slot, masked: bool):
        """The segment ids of the key tile in `slot` (`common.ring_segment_ids`; None without
        segments), read before S = Q K^T, whose wait releases the slot."""
        if self.kv_seg_smem is None:
            return None
        return common.ring_segment_ids(self.kv_seg_smem, self.kv_seg_ready, slot, 1, masked)

    def scores(self, slot):
        """S = Q K^T for the key tile in `slot`, waited for, with the other consumer's
        turn on the tensor cores in between."""
        t = self.t

        def qk(s_ref):
            plgpu.wgmma(s_ref, self.q_smem, self.k_smem.at[slot].transpose((1, 0)))
            self.turn()
            return s_ref[...]

        return pl.run_scoped(qk, plgpu.ACC((t.block_q, t.block_kv), jnp.float32))

    def weights(self, p, j):
        """P V's operand: the softmax weights of key tile j through dropout (the row sums
        take them undropped), in the inputs' dtype."""
        if self.drop_stream is not None:
            keep = common.keep_mask(self.t, self.drop_stream, p.shape, self.q_start, j * self.t.block_kv)
            p = common.drop(p, keep)
        return p.astype(self.q_smem.dtype)

    def bias(self, slot):
        """This consumer's rows of the bias tile in `slot` (None without a bias)."""
        if self.bias_smem is None:
            return None
        return common.bias_tile(self.bias_smem, self.bias_ready, slot, self.wg, self.t.block_q)

    def logits(self, s, j, masked: bool, kv_seg=None, bias=None):
        s, _ = common.logits(s, self.t, slope=self.slope, q_start=self.q_start, k_start=j * self.t.block_kv, bias=bias,
                             mod=self.mod)
        if masked:
            s = common.mask_tile(s, self.t.spec, self.q_start, j * self.t.block_kv, kv_length=self.kv_length,
                                 q_seg=self.q_seg, kv_seg=kv_seg, mask_mod=self.t.mask_mod, mod=self.mod)
        return s


def _online_softmax(s, m, scale_log2: float):
    """(m_new, alpha, p) for the scores s of one key tile, m in log2 units so that
    p = exp2(s * scale_log2 - m) is one FMA + MUFU op.

    m starts at `ROW_MAX_START`, finite: a row of -inf logits needs no guard."""
    m_new = jnp.maximum(m, s.max(axis=1) * scale_log2)
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s * scale_log2 - lax.broadcast_in_dim(m_new, s.shape, [0]))
    return m_new, alpha, p


def synchronous_loop(c: _Consumer, tiles: BlockRange, carry, *, schedule_barrier):
    """Key tiles of `tiles`: each step waits for S = Q K^T, runs the softmax, then waits
    for acc += P V; the ping-pong barrier puts the other consumer's products under this
    one's softmax."""
    t = c.t
    scale_log2 = t.exp2_scale
    v_head_dim = c.v_smem.shape[-1]

    @pl.when(tiles.hi > tiles.lo)
    def _():
        plgpu.barrier_wait(c.k_ready.at[c.slot(tiles.lo)])

    def step(j, carry, masked: bool):
        acc, m, l = carry
        slot = c.slot(j)
        kv_seg = c.kv_segments(slot, masked)
        s = c.scores(slot)
        plgpu.barrier_arrive(c.k_free.at[slot])
        s = c.logits(s, j, masked, kv_seg, c.bias(slot))
        m_new, alpha, p = _online_softmax(s, m, scale_log2)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        l = l * alpha
        p16 = c.weights(p, j)

        def end_softmax():
            plgpu.barrier_arrive(schedule_barrier)  # softmax done: the other consumer may issue
            plgpu.barrier_wait(c.v_ready.at[slot])
            plgpu.barrier_wait(schedule_barrier)  # tensor cores free again

        # The order follows JAX's FA3 example, where it was measured to matter.
        if v_head_dim <= 128:
            l = l + p.sum(axis=1)
            acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
            end_softmax()
        else:
            end_softmax()
            l = l + p.sum(axis=1)

        def pv(acc_ref):
            plgpu.wgmma(acc_ref, p16, c.v_smem.at[slot])
            nxt = j + 1

            @pl.when(nxt < tiles.hi)
            def _():
                plgpu.barrier_wait(c.k_ready.at[c.slot(nxt)])

        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(c.v_free.at[slot])
        return acc, m_new, l

    return common.visit(tiles, step, carry, c.boundaries)


def overlapped_loop(c: _Consumer, tiles: BlockRange, carry):
    """Key tiles of `tiles` (at least one: hi > lo), software-pipelined: step j issues
    S_j = Q K_j^T and acc += P_{j-1} V_{j-1} together, then runs tile j's softmax while
    the P V product is still on the tensor cores, and only then waits for it to
    rescale acc. The first tile is always computed with the mask."""
    t = c.t
    scale_log2 = t.exp2_scale
    v_head_dim = c.v_smem.shape[-1]
    acc, m, l = carry

    first = c.slot(tiles.lo)
    plgpu.barrier_wait(c.k_ready.at[first])
    kv_seg = c.kv_segments(first, True)
    s = c.scores(first)
    plgpu.barrier_arrive(c.k_free.at[first])
    s = c.logits(s, tiles.lo, True, kv_seg, c.bias(first))
    m, alpha, p = _online_softmax(s, m, scale_log2)  # acc is 0: nothing to rescale
    l = l * alpha + p.sum(axis=1)  # l is 0, or 1 for the sink
    p16 = c.weights(p, tiles.lo)
    c.turn()

    def step(j, carry, masked: bool):
        acc, m, l, p16 = carry
        slot, prev = c.slot(j), c.slot(j - 1)
        plgpu.barrier_wait(c.k_ready.at[slot])
        plgpu.barrier_wait(c.v_ready.at[prev])
        kv_seg = c.kv_segments(slot, masked)

        def body(s_ref, acc_ref):
            acc_ref[...] = acc
            plgpu.wgmma(s_ref, c.q_smem, c.k_smem.at[slot].transpose((1, 0)))
            plgpu.wgmma(acc_ref, p16, c.v_smem.at[prev])
            c.turn()
            # Masked tiles (the diagonal, the tail) wait for P V first, so that the
            # mask's work does not hold registers beside P_{j-1} and the in-flight acc.
            # Unmasked tiles, the bulk, overlap.
            s = plgpu.wgmma_accumulator_load(s_ref, wait_n=0 if masked else 1)
            plgpu.barrier_arrive(c.k_free.at[slot])
            if masked:
                acc_new = plgpu.wgmma_accumulator_load(acc_ref, wait_n=None)
                plgpu.barrier_arrive(c.v_free.at[prev])
            s = c.logits(s, j, masked, kv_seg, c.bias(slot))
            m_new, alpha, p = _online_softmax(s, m, scale_log2)
            l_new = l * alpha + p.sum(axis=1)
            p16_new = c.weights(p, j)
            if not masked:
                acc_new = plgpu.wgmma_accumulator_load(acc_ref, wait_n=0)
                plgpu.barrier_arrive(c.v_free.at[prev])
            c.turn()
            return acc_new * lax.broadcast_in_dim(alpha, acc_new.shape, [0]), m_new, l_new, p16_new

        return pl.run_scoped(
            body, plgpu.ACC((t.block_q, t.block_kv), jnp.float32), plgpu.ACC((t.block_q, v_head_dim), jnp.float32)
        )

    start = tiles.lo + 1
    rest = BlockRange(start, jnp.maximum(tiles.full_lo, start), jnp.maximum(tiles.full_hi, start), tiles.hi)
    acc, m, l, p16 = common.visit(rest, step, (acc, m, l, p16), c.boundaries)

    last = c.slot(tiles.hi - 1)
    plgpu.barrier_wait(c.v_ready.at[last])
    acc = pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, p16, c.v_smem.at[last]))(plgpu.ACC.init(acc))
    plgpu.barrier_arrive(c.v_free.at[last])
    return acc, m, l


def _at_least_one_tile(tiles: BlockRange, n_kv: int) -> BlockRange:
    """The range, or its first tile alone when it is empty (the overlapped loop always
    computes one tile; outside the range it is fully masked, harmless)."""
    lo = jnp.minimum(tiles.lo, n_kv - 1)
    return BlockRange(lo, tiles.full_lo, tiles.full_hi, jnp.maximum(tiles.hi, lo + 1))


def _consumer_tiles(t: Tiling, opt: OptionalInputs, b, q_block, n_kv: int, overlap: bool) -> BlockRange:
    """The key tiles query tile `q_block` of batch row b visits: in the kernel, and at trace
    time on arrays of (b, q_block) for the persistent grid's table (`_item_tiles`)."""
    tiles = opt.tile_range(t.spec.kv_range(q_block, t.block_q, t.block_kv, n_kv), b, q_block)
    return _at_least_one_tile(tiles, n_kv) if overlap else tiles


def item_tiles(t: Tiling, opt: OptionalInputs, batch: int, n_pairs: int, n_kv: int, overlap: bool) -> np.ndarray:
    """int [n_pairs, batch]: the key tiles the producer streams for the item at each pair
    position of the schedule (`common.pair_index`) and batch row, at trace time: the
    persistent grid's cost of each item. `opt`'s ranges and pair order, if any, must be
    constants (not traced)."""
    with jax.ensure_compile_time_eval():
        position = jnp.arange(n_pairs, dtype=jnp.int32)[:, None]
        pairs = common.pair_index(n_pairs, longest_first=t.spec.causal, order=opt.pair_order, index=position)
        rows = jnp.arange(batch, dtype=jnp.int32)[None, :]
        tiles = [_consumer_tiles(t, opt, rows, COMPUTE_WGS * pairs + wg, n_kv, overlap) for wg in range(COMPUTE_WGS)]
        lo, hi = common.hull(*tiles)
        return np.broadcast_to(np.asarray(hi - lo), (n_pairs, batch))  # a range that ignores the rows is a scalar


def forward(q, k, v, t: Tiling, schedule: str, optional: OptionalInputs = OptionalInputs(), ctas: int | None = None,
            page_table=None, ranged_items=None):
    """Runs the forward kernel on padded inputs.

    Args:
      q: [B, Tqp, H, D] bf16/fp16, Tqp a multiple of 2 * t.block_q, D in (64, 128, 192, 256).
      k: [B, Tkp, Hkv, D], Tkp a multiple of t.block_kv; with `page_table`, a pool of pages
        [num_pages, page_size, Hkv, D], page_size a multiple of t.block_kv.
      v: [B, Tkp, Hkv, Dv] (or its pool of pages), Dv <= D (MLA: D = 192, Dv = 128).
      t: the tiling; t.spec holds the true lengths and the causal flag.
      schedule: "pingpong" (`synchronous_loop`) or "overlap" (`overlapped_loop`).
      optional: the ALiBi slopes (given exactly when t.alibi), the sinks (exactly when
        t.sinks) and the lengths' ranges
        [B, Tqp // t.block_q, RANGE_FIELDS] (exactly when t.ranges), the segment ids, the
        bias [Bb, Hb, Tqp, Tkp] (exactly when t.bias), the dropout seed (exactly when
        t.dropout_rate > 0), the arrays score_mod and mask_mod close over (exactly with them).
      ctas: None for one CTA per (head, pair of query tiles, batch row); else a persistent
        grid of that many CTAs (at most the number of items; with ranges, given
        `ranged_items`), each walking
        its items (`common.Items.table`) with the K/V ring running on across them, the next
        item's Q loaded while this one's output is written, and O stored from its own
        shared memory without waiting (so it must fit beside the rest:
        `backend.forward_ctas`).
      page_table: None, or int32 [B, pages] (the decode path's paged caches): batch row b's
        keys are the pages page_table[b] in order, Tkp = pages * page_size; the producer
        reads each key tile's page from it and copies the tile from its page in place.
        Entries must lie in [0, num_pages); with ranges (kv lengths), not persistent.
      ranged_items: with ranges and `ctas`, their `item_tiles` (computed where the ranges
        were constants: inside the custom_vjp they are traced).

    Returns:
      o [B, Tqp, H, Dv] in q's dtype, and lse2 [B, H, Tqp] float32 in log2 units (-inf for rows without keys;
      with sinks the sink's logit).
    """
    batch, q_len, heads, head_dim, k_len, kv_heads, group, dtype = common.shapes(q, k)
    v_head_dim = v.shape[3]
    block_q, block_kv = t.block_q, t.block_kv
    paged = page_table is not None
    if paged:
        page_size = k.shape[1]
        k_len, tiles_per_page = page_table.shape[1] * page_size, page_size // block_kv
        assert page_size % block_kv == 0 and page_table.shape[0] == batch and ctas is None, (k.shape, t, ctas)
        assert not (t.segments or t.bias), t  # their tiles are indexed by key position, not by page
    assert q_len % (COMPUTE_WGS * block_q) == 0 and k_len % block_kv == 0, (q.shape, k.shape, t)
    assert v_head_dim <= head_dim, (q.shape, v.shape)  # O is written through Q's shared memory
    assert schedule in SCHEDULES, schedule
    overlap = schedule == "overlap"
    n_kv = k_len // block_kv
    n_pairs = q_len // (COMPUTE_WGS * block_q)
    stages = max(1, min(t.stages, n_kv))
    persistent = ctas is not None
    if persistent:
        # The items' key tiles must be known here, to balance the table.
        assert (ranged_items is not None) == t.ranges, t
        items = common.Items(heads, n_pairs, batch, ctas)
        assert 0 < ctas <= items.total, (ctas, items)
        table = items.table(item_tiles(t, optional, batch, n_pairs, n_kv, overlap) if ranged_items is None
                            else ranged_items)

    def kernel(q_ref, k_ref, v_ref, table_ref, pages_ref, opt: OptionalInputs, o_ref, lse_ref, bias_scratch, scoped):
        (qo_smem2, k_smem, v_smem, lse_smem2), (k_ready, v_ready, q_ready), free, schedule_barrier = scoped[:4]
        # With segments: the query tiles' ids, the ring of the key tiles' ids, their barriers.
        q_seg_smem2, kv_seg_smem, q_seg_ready, kv_seg_ready = scoped[4] if t.segments else (None,) * 4
        # Persistent: O's own shared memory, so that an item's output store runs under the next item.
        o_smem2 = scoped[-1] if persistent else qo_smem2
        # With a bias: the ring of its tiles (both consumers' query rows) and their barriers.
        bias_smem, bias_ready = bias_scratch
        ring_ready = (k_ready, v_ready) + ((kv_seg_ready,) if t.segments else ()) + ((bias_ready,) if t.bias else ())
        take_turn = common.turn(schedule_barrier, not overlap)

        def kv_tiles(b, q_block):
            return _consumer_tiles(t, opt, b, q_block, n_kv, overlap)

        def ring_range(b, pair):
            """The key tiles the producer streams for a pair: those either consumer needs."""
            return common.hull(kv_tiles(b, pair * COMPUTE_WGS), kv_tiles(b, pair * COMPUTE_WGS + 1))

        def load_q(wg, b, h, pair):
            q_start = (pair * COMPUTE_WGS + wg) * block_q
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q_start, block_q), h], qo_smem2.at[wg], q_ready.at[wg])

        def consume(wg, b, h, pair, ring, origin, prefetch=None):
            """Consumer `wg`'s query tile of item (b, h, pair), whose Q load has been issued.
            ring: the item's (first, end) ring tiles (`ring_range`); origin: the tile the ring
            started at (tile j is in slot (j - origin) % stages); prefetch: issues the next
            item's Q load once this tile's products are done."""
            qo_smem, lse_smem, o_smem = qo_smem2.at[wg], lse_smem2.at[wg], o_smem2.at[wg]
            q_block = pair * COMPUTE_WGS + wg
            q_start = q_block * block_q
            tiles = kv_tiles(b, q_block)
            ring_lo, ring_hi = ring
            plgpu.barrier_wait(q_ready.at[wg])

            row_layout = plgpu.Layout.WGMMA.reduce(1)
            if opt.sinks is None:
                m = plgpu.layout_cast(jnp.full((block_q,), ROW_MAX_START, jnp.float32), row_layout)
                l = plgpu.layout_cast(jnp.full((block_q,), 0.0, jnp.float32), row_layout)
            else:
                # The sink is a key every row sees with logit sinks[h] and no value: the
                # running max starts at it (log2 units) and the running sum at its weight,
                # 1 (0 for a sink of -inf, which is no key).
                sink = opt.sinks[h] * LOG2E
                m = jnp.maximum(plgpu.layout_cast(jnp.full((block_q,), ROW_MAX_START, jnp.float32), row_layout), sink)
                l = jnp.exp2(sink - m)
            acc = common.zeros((block_q, v_head_dim))
            q_seg = None
            if t.segments:
                q_seg = common.own_segment_ids(opt.q_segment_ids.at[b, pl.ds(q_start, block_q)], q_seg_smem2.at[wg],
                                               q_seg_ready.at[wg], 0)
            consumer = _Consumer(
                qo_smem, q_start, k_smem, v_smem, k_ready, v_ready, free[0], free[1], origin, stages, take_turn, t,
                t.kv_boundaries(k_len), None if opt.slopes is None else opt.slopes[h], opt.kv_length(b, q_block),
                q_seg, kv_seg_smem, kv_seg_ready, opt.dropout_stream(t, b, h, heads), bias_smem, bias_ready, wg,
                opt.mod_inputs(t, b, h),
            )

            # The ring tiles this query tile does not read: release them in order, with
            # the two schedule turns a computed tile takes.
            def skip(lo, hi, ready=()):
                common.release_kv(free, lo=lo, hi=hi, ring_lo=origin, stages=stages, ready=ready,
                                  each=lambda: (take_turn(), take_turn()))

            # Offset the two consumers by half a step: wg 1 starts one turn late.
            pl.when(wg == 1)(take_turn)
            skip(ring_lo, tiles.lo, ready=ring_ready)
            if overlap:
                acc, m, l = overlapped_loop(consumer, tiles, (acc, m, l))
            else:
                acc, m, l = synchronous_loop(consumer, tiles, (acc, m, l), schedule_barrier=schedule_barrier)
            # Released without waiting only where the two ranges end in step (upper_skips_wait)
            # and no later item waits on these slots again (a thread counts a barrier's phases
            # by its own waits).
            upper_waits = persistent or common.upper_skips_wait(t, lockstep=not overlap)
            skip(tiles.hi, ring_hi, ready=ring_ready if upper_waits else ())
            pl.when(wg == 0)(take_turn)
            if prefetch is not None:
                prefetch()  # Q's shared memory is free: no product reads it any more

            # Rows that saw no key: l = 0 -> o = 0 and lse = m + log2(0) = -inf (with sinks
            # l = 1 and acc = 0: o = 0 and lse = the sink's logit).
            l_safe = jnp.where(l == 0.0, 1.0, l)
            # (Dropout's keep scale, 1 without dropout, applied here once, not to each kept weight.)
            acc = acc * lax.broadcast_in_dim(t.keep_scale / l_safe, acc.shape, [0])
            if persistent:
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last item's output is out of o_smem
            else:
                # O through the query tile's shared memory, which no product reads any more
                # (with a smaller v head dim, its first v_head_dim columns).
                o_smem = qo_smem if v_head_dim == head_dim else qo_smem.at[:, pl.ds(0, v_head_dim)]
            o_smem[...] = acc.astype(dtype)
            lse_smem[...] = m + jnp.log(l) * LOG2E
            plgpu.commit_smem()
            common.copy_rows_to_gmem(o_smem2.at[wg], o_ref.at[b, pl.ds(q_start, block_q), h])
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, pl.ds(q_start, block_q)])
            if not persistent:
                plgpu.wait_smem_to_gmem(0)

        def produce(b, h, pair, ring, origin):
            """The K/V tiles `ring` (first, end) of item (b, h, pair) into the ring, which
            started at tile `origin`."""
            kv_head = masks.int32_div(h, group)  # GQA: the query head's kv head; K/V never repeated
            ring_lo, ring_hi = ring

            def bias_rows(j):
                rows = pl.ds(pair * COMPUTE_WGS * block_q, COMPUTE_WGS * block_q)
                return opt.bias_plane(b, h).at[rows, pl.ds(j * block_kv, block_kv)]

            def at(j):
                """Key tile j of batch row b: a slice of its row, or of its page."""
                if not paged:
                    return b, pl.ds(j * block_kv, block_kv), kv_head
                page = pages_ref[b, masks.int32_div(j, tiles_per_page)]
                return page, pl.ds(masks.int32_rem(j, tiles_per_page) * block_kv, block_kv), kv_head

            common.stream_kv(
                k_ref, v_ref, k_smem, v_smem, (k_ready, v_ready), free,
                at=at,
                lo=ring_lo, hi=ring_hi, stages=stages, block_kv=block_kv,
                segments=(opt.kv_segment_ids, kv_seg_smem, kv_seg_ready) if t.segments else None,
                bias=(bias_rows, bias_smem, bias_ready) if t.bias else None,
                origin=origin if persistent else None,
            )

        def item(position, b, h):
            """(b, h, pair) of the item at a pair position of the schedule."""
            return b, h, common.pair_index(n_pairs, longest_first=t.spec.causal, order=opt.pair_order, index=position)

        if not persistent:
            b, h = lax.axis_index("batch"), lax.axis_index("heads")
            this = item(lax.axis_index("pair"), b, h)
            ring = ring_range(b, this[2])

            def _consumer(wg):
                load_q(wg, *this)
                consume(wg, *this, ring, ring[0])

            common.warp_specialized(_consumer, lambda: produce(*this, ring, ring[0]))
            return

        # Persistent: each CTA walks its items (`common.Items`), the ring running on across them.
        def walk(body):
            """Runs body(step, (b, h, pair), ring tiles, ring origin) over this CTA's items."""

            def step(n, streamed):  # streamed: the ring tiles of the earlier items
                h, position, b = items.at(table_ref, n)
                this = item(position, b, h)
                ring = ring_range(b, this[2])
                body(n, this, ring, ring[0] - streamed)
                return streamed + (ring[1] - ring[0])

            lax.fori_loop(0, items.count(table_ref), step, jnp.int32(0))

        def _consumer(wg):
            h, position, b = items.at(table_ref, 0)
            load_q(wg, *item(position, b, h))

            def body(n, this, ring, origin):
                def prefetch():
                    @pl.when(n + 1 < items.count(table_ref))
                    def _():
                        h, position, b = items.at(table_ref, n + 1)
                        load_q(wg, *item(position, b, h))

                consume(wg, *this, ring, origin, prefetch)

            walk(body)
            plgpu.wait_smem_to_gmem(0)

        common.warp_specialized(_consumer, lambda: walk(lambda n, this, ring, origin: produce(*this, ring, origin)))

    def entry(q_ref, k_ref, v_ref, *refs):
        table_ref, refs = (refs[0], refs[1:]) if persistent else (None, refs)
        pages_ref, refs = (refs[0], refs[1:]) if paged else (None, refs)
        opt, (o_ref, lse_ref) = OptionalInputs.split(t, refs, pairs=True)
        tiles = common.smem_tiles()
        smem = (
            plgpu.SMEM((COMPUTE_WGS, block_q, head_dim), dtype, transforms=tiles),  # Q in (and O out, not persistent)
            plgpu.SMEM((stages, block_kv, head_dim), dtype, transforms=tiles),
            plgpu.SMEM((stages, block_kv, v_head_dim), dtype, transforms=tiles),
            plgpu.SMEM((COMPUTE_WGS, block_q), jnp.float32),
        )
        ready = (
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=COMPUTE_WGS),
        )
        free = (plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),) * 2
        o_smem = (plgpu.SMEM((COMPUTE_WGS, block_q, v_head_dim), dtype, transforms=tiles),) if persistent else ()
        common.with_bias_scratch(
            lambda bias, scoped: kernel(q_ref, k_ref, v_ref, table_ref, pages_ref, opt, o_ref, lse_ref, bias, scoped),
            t, COMPUTE_WGS * block_q, block_kv, stages, dtype,
            smem, ready, free, plgpu.Barrier(num_arrivals=COMPUTE_WGS), *common.segment_scratch(t, block_q, block_kv, stages),
            *o_smem, collective_axes="wg",
        )

    return common.launch(
        entry, out_type=(jax.ShapeDtypeStruct((batch, q_len, heads, v_head_dim), dtype),
                         jax.ShapeDtypeStruct((batch, heads, q_len), jnp.float32)),
        pairs=n_pairs, heads=heads, batch=batch, kernel_name="flashjax_mosaic_fwd", ctas=ctas,
    )(q, k, v, *((jnp.asarray(table),) if persistent else ()), *((page_table,) if paged else ()),
      *optional.inputs(t, pairs=True))

"""Pieces shared by the Hopper kernels: the warpgroup split, the static tiling, the K/V
producer ring, the kernel launch, and the scoring of a wgmma score tile.

Every kernel is one CTA of three warpgroups (FlashAttention-3's warp specialisation):
two consumers that run `wgmma` on their own tile, and one producer that only issues
TMA copies into a ring of shared-memory slots and gives its registers to the
consumers. Tile ranges (which key tiles a query tile meets, and the reverse) and the
elementwise mask come from `flashjax.masks.MaskSpec`, the same code as the Triton
kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from flashjax import dropout, flex, masks, xla_semantics
from flashjax.kernels.common import LOG2E
from flashjax.vma import out_types
from flashjax.masks import BlockRange, MaskSpec

# Consumer warpgroups per CTA (each owns one tile of the walked operand).
COMPUTE_WGS = 2
# Registers per thread after `set_max_registers`: the producer, which only issues TMA,
# gives its share to the two consumers (2 * 232 + 40 warpgroup-threads' worth fits
# the 64K-register file).
CONSUMER_REGISTERS, PRODUCER_REGISTERS = 232, 40


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Static shape of one kernel call on inputs padded to whole tiles.

    Attributes:
      block_q: query rows per tile.
      block_kv: key rows per tile.
      stages: depth of the ring the producer streams through.
      spec: the structural mask in true (unpadded) lengths.
      scale: the logit scale.
      softcap: if set, logits = softcap * tanh(scale * q.k / softcap).
      alibi: the kernels take ALiBi slopes (float32 [H], an input after k and v) and add
        ``-slope * |q + offset - k|`` to the logits.
      ranges: the kernels take per-tile ranges (int32 [B, n_tiles, masks.RANGE_FIELDS]
        from `masks.dynamic_ranges`, for q/kv lengths and segment ids; the input after the
        slopes): each tile's range is cut to them and keys past a row's kv length masked.
      segments: the kernels take an int32 vector per query and per key position ([B, Tqp],
        [B, Tkp], after the ranges), streamed beside Q and K: the segment ids, whose pairs
        of different ids are masked on boundary tiles, or, for a mask_mod split by
        `sides.split` (`mask_mod.sides`), the values it reads per row and per column, which
        it takes after kv_idx.
      dropout_rate: if > 0, the kernels take the dropout seed (uint32 [2], the last input)
        and drop attention weights with `flashjax.dropout`'s counter-based keep mask, the
        Triton kernels' bits for the same seed.
      broadcast_dropout: one keep mask for every batch row and head.
      bias: the kernels take an additive bias in the inputs' dtype (the input before the
        dropout seed): [Bb, Hb, Tqp, Tkp] with Bb in (1, B) and Hb in (1, H), or for the
        dK/dV kernel its transpose [Bb, Hb, Tkp, Tqp]. A boolean mask arrives folded into it
        as -inf; values at or below `masks.MASKING_BIAS` mask, as in the Triton kernels.
      score_mod, mask_mod: the user functions (`flex.Mod`), or None; the arrays they close
        over are the last inputs (`OptionalInputs.score_consts` / `mask_consts`). score_mod
        applies to every tile, mask_mod on the boundary tiles (a block mask's partial ones).
        A mask_mod that reads closed-over arrays per position is the `sides.split` one.
      sinks: the forward kernel takes a sink logit per head (float32 [H], the input after
        the slopes) that starts every row's running max and sum (attention sinks). The
        backward kernels take none: the forward's lse includes the sink, so their
        P = exp(S - lse) is already the sink-normalised weight.
      v_stages: the depth of the V ring where it is shallower than K's (`stages`): the
        dQ kernel at head dim 256, whose shared memory holds two K tiles and one V tile.
    """

    block_q: int
    block_kv: int
    stages: int
    spec: MaskSpec
    scale: float
    softcap: float | None = None
    alibi: bool = False
    ranges: bool = False
    segments: bool = False
    dropout_rate: float = 0.0
    broadcast_dropout: bool = False
    bias: bool = False
    score_mod: flex.Mod | None = None
    mask_mod: flex.Mod | None = None
    sinks: bool = False
    v_stages: int | None = None

    @property
    def additive_mod(self) -> bool:
        """Whether the score_mod enters as a term added to q.k (`flex.term_as_bias`, no
        softcap after it), as a bias does, rather than a function of the scaled score."""
        return flex.term_as_bias(self.score_mod, self.softcap)

    @property
    def scaled_logits(self) -> bool:
        """Whether `logits` returns scale * q.k (the softcap and score_mod take the scaled
        score) rather than q.k with the scale left to `exp2_scale`."""
        return self.softcap is not None or (self.score_mod is not None and not self.additive_mod)

    @property
    def exp2_scale(self) -> float:
        """The factor from `score`'s logits to the base-2 exponent of the softmax: the
        scale is folded into it (one FMA per entry) unless the softcap or score_mod has
        applied it."""
        return LOG2E if self.scaled_logits else self.scale * LOG2E

    def kv_boundaries(self, padded_seq_k: int) -> tuple[bool, bool]:
        """`MaskSpec.kv_boundaries`; with ranges both parts can hold tiles."""
        return (True, True) if self.ranges else self.spec.kv_boundaries(padded_seq_k)

    def q_boundaries(self, padded_seq_k: int) -> tuple[bool, bool]:
        """`MaskSpec.q_boundaries`; with ranges both parts can hold tiles."""
        return (True, True) if self.ranges else self.spec.q_boundaries(padded_seq_k)

    @property
    def keep_scale(self) -> float:
        """The factor of a kept weight: `flashjax.dropout.keep_scale` (1 / P(keep))."""
        return dropout.keep_scale(self.dropout_rate)


class OptionalInputs(NamedTuple):
    """The kernels' optional inputs (refs inside a kernel, arrays outside), each None when
    the tiling does not take it: ALiBi slopes float32 [H], the sinks float32 [H], the tile ranges of lengths and
    segments, the segment ids int32 [B, Tqp] and [B, Tkp], the bias (`Tiling.bias`), the
    dropout seed uint32 [2], the tuples of arrays score_mod and mask_mod close over
    (`flex.kernel_operands`), and, for the kernels that walk pairs of query tiles with
    ranges and no causal mask, the order they take the pairs in (`pair_order`)."""

    slopes: object = None
    sinks: object = None
    ranges: object = None
    q_segment_ids: object = None
    kv_segment_ids: object = None
    bias: object = None
    dropout_seed: object = None
    score_consts: tuple | None = None
    mask_consts: tuple | None = None
    pair_order: object = None

    def inputs(self, t: Tiling, *, pairs: bool = False) -> tuple:
        """The arrays, in kernel-input order, checked against the tiling; `pairs`: for a kernel
        that walks pairs of query tiles (it takes their order with `takes_pair_order`)."""
        assert (self.slopes is not None) == t.alibi and (self.ranges is not None) == t.ranges, (t, self)
        assert (self.sinks is not None) == t.sinks, (t, self)
        assert (self.q_segment_ids is not None) == (self.kv_segment_ids is not None) == t.segments, (t, self)
        assert (self.dropout_seed is not None) == (t.dropout_rate > 0.0), (t, self)
        assert (self.bias is not None) == t.bias and (self.bias is None or self.bias.ndim == 4), (t, self)
        slopes = None if self.slopes is None else self.slopes.astype(jnp.float32)
        sinks = None if self.sinks is None else self.sinks.astype(jnp.float32)
        seed = None if self.dropout_seed is None else self.dropout_seed.astype(jnp.uint32)
        assert (self.score_consts is not None) == (t.score_mod is not None), (t, self)
        assert (self.mask_consts is not None) == (t.mask_mod is not None), (t, self)
        arrays = (slopes, sinks, self.ranges, self.q_segment_ids, self.kv_segment_ids, self.bias, seed)
        assert (self.pair_order is not None) == (pairs and takes_pair_order(t)), (t, self)
        mods = [flex.kernel_operands(c) for c in (self.score_consts, self.mask_consts) if c is not None]
        order = () if self.pair_order is None else (self.pair_order,)
        return tuple(x for x in arrays if x is not None) + sum(mods, ()) + order

    @classmethod
    def split(cls, t: Tiling, refs, *, pairs: bool = False) -> tuple["OptionalInputs", list]:
        """(the optional input refs, the remaining refs: the outputs) from a kernel entry's refs
        after its fixed inputs; `pairs`: the kernel walks pairs of query tiles (it takes
        their order with `takes_pair_order`)."""
        refs = list(refs)
        slopes = refs.pop(0) if t.alibi else None
        sinks = refs.pop(0) if t.sinks else None
        ranges = refs.pop(0) if t.ranges else None
        q_seg, kv_seg = (refs.pop(0), refs.pop(0)) if t.segments else (None, None)
        bias = refs.pop(0) if t.bias else None
        seed = refs.pop(0) if t.dropout_rate > 0.0 else None
        consts = []
        for mod in (t.score_mod, t.mask_mod):
            n = 0 if mod is None else len(mod.const_avals)
            consts.append(None if mod is None else tuple(refs[:n]))
            refs = refs[n:]
        order = refs.pop(0) if pairs and takes_pair_order(t) else None
        return cls(slopes, sinks, ranges, q_seg, kv_seg, bias, seed, *consts, order), refs

    def tile_range(self, structural: BlockRange, b, tile) -> BlockRange:
        """`structural` cut to row (b, tile) of the ranges (unchanged without them)."""
        if self.ranges is None:
            return structural
        return masks.intersect(structural, masks.RangeRow(self.ranges, (b, tile)))

    def dropout_stream(self, t: Tiling, b, h, heads: int):
        """The dropout stream of (batch row b, query head h) (`flashjax.dropout.stream_base`,
        as the Triton kernels draw it), or None without dropout."""
        if self.dropout_seed is None:
            return None
        stream = jnp.uint32(0) if t.broadcast_dropout else (b * heads + h).astype(jnp.uint32)
        return dropout.stream_base(self.dropout_seed[0], self.dropout_seed[1], stream)

    def mod_inputs(self, t: "Tiling", b, h, *, grad: bool = False) -> "flex.KernelMods | None":
        """The user functions at batch row b and query head h (`flex.kernel_mods`: what they
        read at (b, h) alone is evaluated here, before the caller's loop over tiles), for
        `logits(..., grad=grad)` and `mask_tile`; None without them."""
        return flex.kernel_mods(t.score_mod, self.score_consts, t.mask_mod, self.mask_consts, b, h, lowering="mosaic",
                                grad=grad, term_factor=1.0 / t.scale if t.additive_mod else None)

    def bias_plane(self, b, h):
        """The bias ref's [T, T] plane of batch row b and query head h (index 0 along a
        broadcast dim)."""
        bias_batch, bias_heads = self.bias.shape[:2]
        return self.bias.at[b if bias_batch > 1 else 0, h if bias_heads > 1 else 0]

    def kv_length(self, b, tile):
        """Batch row b's kv length (None without ranges: the mask spec's seq_k)."""
        return None if self.ranges is None else self.ranges[b, tile, masks.KV_LENGTH]


def smem_tiles():
    """128-byte swizzle on (8, 64) tiles: the layout wgmma reads without bank conflicts
    and TMA writes directly (64 two-byte elements = one 128-byte row)."""
    return (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def loop(lo, hi, body, carry):
    """fori_loop that emits nothing for a static empty range: the Mosaic GPU lowering of
    a zero-trip loop with constant bounds fails ("Shaped arrays must be represented by
    ir.Values")."""
    if isinstance(lo, int) and isinstance(hi, int):
        if hi <= lo:
            return carry
        return lax.fori_loop(jnp.int32(lo), jnp.int32(hi), body, carry)
    return lax.fori_loop(lo, hi, body, carry)


def visit(tiles: BlockRange, step, carry, boundaries: tuple[bool, bool] = (True, True)):
    """Runs ``step(i, carry, masked)`` over a range: the boundary tiles [lo, full_lo) and
    [full_hi, hi) with the elementwise mask, the tiles between without it. `boundaries`
    says (statically, `MaskSpec.kv_boundaries` / `q_boundaries`) which boundary part can
    hold tiles; no loop is emitted for the other."""
    lower, upper = boundaries
    if lower:
        carry = loop(tiles.lo, tiles.full_lo, lambda i, c: step(i, c, True), carry)
    carry = loop(tiles.full_lo, tiles.full_hi, lambda i, c: step(i, c, False), carry)
    if upper:
        carry = loop(tiles.full_hi, tiles.hi, lambda i, c: step(i, c, True), carry)
    return carry


def hull(a: BlockRange, b: BlockRange) -> tuple:
    """(lo, hi) of the tiles either range visits: what a CTA's producer streams for its two consumers."""
    return jnp.minimum(a.lo, b.lo), jnp.maximum(a.hi, b.hi)


def takes_pair_order(t: Tiling) -> bool:
    """Whether the kernels that walk pairs of query tiles take them in the order of an input
    (`pair_order`): with ranges (lengths, documents, a block mask) and no causal mask, whose
    static order (`pair_index`) already puts the longest first."""
    return t.ranges and not t.spec.causal


def pair_order(ranges, spec, block_q: int, block_kv: int, n_kv: int):
    """int32 [n_pairs]: the pairs of query tiles, the most key tiles first (summed over the
    batch rows, the two tiles' ranges cut to the structural range), so that the short CTAs
    fill the tail of the schedule. ranges: int32 [B, n_q, RANGE_FIELDS] (`masks.dynamic_ranges`)."""
    n_q = ranges.shape[1]
    structural = spec.kv_range(jnp.arange(n_q, dtype=jnp.int32), block_q, block_kv, n_kv)
    lo = jnp.maximum(ranges[:, :, masks.LO], structural.lo)
    hi = jnp.minimum(ranges[:, :, masks.HI], structural.hi)
    work = jnp.maximum(hi - lo, 0).sum(0).reshape(n_q // COMPUTE_WGS, COMPUTE_WGS).sum(1)
    return jnp.argsort(-work, stable=True).astype(jnp.int32)


def pair_index(num_pairs: int, longest_first: bool, order=None, index=None):
    """The pair of tiles at position `index` of the schedule (default: this CTA's "pair" grid
    index): at `order`'s entry for it (a ref of `pair_order`), or with a causal mask the
    last (longest) query rows first, so that the short CTAs fill the tail of the schedule
    instead of the long ones."""
    if index is None:
        index = lax.axis_index("pair")
    if order is not None:
        return order[index]
    return num_pairs - 1 - index if longest_first else index


def turn(barrier, enabled: bool):
    """One turn of a ping-pong between the two consumer warpgroups (a no-op when disabled)."""

    def take_turn():
        if enabled:
            plgpu.barrier_arrive(barrier)
            plgpu.barrier_wait(barrier)

    return take_turn


class Shapes(NamedTuple):
    """The static shape of a kernel's (padded) q [B, Tq, H, D] and k [B, Tk, Hkv, D]."""

    batch: int
    q_len: int
    heads: int
    head_dim: int
    k_len: int
    kv_heads: int
    group: int  # query heads per kv head
    dtype: object


def shapes(q, k) -> Shapes:
    batch, q_len, heads, head_dim = q.shape
    k_len, kv_heads = k.shape[1], k.shape[2]
    return Shapes(batch, q_len, heads, head_dim, k_len, kv_heads, heads // kv_heads, q.dtype)


def warp_specialized(consumer, producer):
    """Runs ``consumer(wg)`` on the COMPUTE_WGS consumer warpgroups, with the registers the
    producer gives up, and ``producer()`` on the last warpgroup."""
    wg = lax.axis_index("wg")

    @pl.when(wg < COMPUTE_WGS)
    def _():
        plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
        consumer(wg)

    @pl.when(wg == COMPUTE_WGS)
    def _():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
        producer()


def launch(entry, *, out_type, pairs: int, heads: int, batch: int, kernel_name: str, ctas: int | None = None):
    """Runs `entry` on CTAs of COMPUTE_WGS + 1 warpgroups: a grid of (head, pair of tiles,
    batch row) CTAs, or with `ctas` a persistent grid of that many (axis "cta") that walk
    the same items in the same order themselves (`Items`).

    The head is the slowest grid axis so that the CTAs of one head run together (Pallas
    launches the last grid axis fastest)."""
    grid, names = ((heads, pairs, batch), ("heads", "pair", "batch")) if ctas is None else ((ctas,), ("cta",))

    def call(*inputs):
        return plgpu.kernel(
            entry,
            out_type=out_types(out_type, *inputs),  # their mesh axes inside jax.shard_map
            grid=grid,
            grid_names=names,
            num_threads=COMPUTE_WGS + 1,
            thread_name="wg",
            kernel_name=kernel_name,  # what profilers show
            compiler_params=plgpu.CompilerParams(approx_math=True),
        )(*inputs)

    return call


class Items(NamedTuple):
    """The (head, pair of query tiles, batch row) items of a persistent kernel (`launch`'s
    `ctas`), indexed in the order of the per-item grid (the batch row fastest, then the
    pair's position, then the head), and which CTA takes which (`table`)."""

    heads: int
    pairs: int
    batch: int
    ctas: int

    @property
    def total(self) -> int:
        return self.heads * self.pairs * self.batch

    def table(self, item_tiles) -> np.ndarray:
        """int32 [ctas, 1 + most]: each CTA's count of items, then their indices in the order it
        runs them. item_tiles: int [pairs, batch] (or [pairs], the same for every batch row),
        the key tiles of the item at each pair position and batch row.

        Each item goes to the CTA that is free first, in index order, as the hardware hands
        out the CTAs of the per-item grid: the heads run one after another (their K/V tiles
        shared in L2) and the longest pairs first, so the CTAs finish together. A fixed
        round robin over the same order would give some CTAs only long pairs (the positions
        repeat with the period of the batch and pair counts): 1.4-1.6x the balanced time
        with a causal mask. An item costs its key tiles plus one for its Q load and output."""
        tiles = np.broadcast_to(np.asarray(item_tiles).reshape(self.pairs, -1), (self.pairs, self.batch))
        return _greedy_table(self, tuple(int(x) + 1 for x in tiles.reshape(-1)))

    def count(self, table):
        """How many items this CTA takes (`table`'s ref)."""
        return table[lax.axis_index("cta"), 0]

    def at(self, table, step):
        """(head, pair position, batch row) of this CTA's item `step`; the position as
        `pair_index` takes it."""
        index = table[lax.axis_index("cta"), 1 + step]
        return masks.int32_div(index, self.pairs * self.batch), masks.int32_rem(masks.int32_div(index, self.batch), self.pairs), \
            masks.int32_rem(index, self.batch)


@functools.lru_cache(maxsize=64)
def _greedy_table(items: Items, cost: tuple[int, ...]) -> np.ndarray:
    """`Items.table` for the items' costs by (pair position, batch row), flat (cached: a call's
    forward is traced again under grad and remat, and 100k items take a few tenths of a second)."""
    free = [(0, cta) for cta in range(items.ctas)]
    assigned = [[] for _ in range(items.ctas)]
    for index in range(items.total):
        busy, cta = heapq.heappop(free)
        assigned[cta].append(index)
        heapq.heappush(free, (busy + cost[index % (items.pairs * items.batch)], cta))
    table = np.zeros((items.ctas, 1 + max(len(a) for a in assigned)), np.int32)
    for cta, indices in enumerate(assigned):
        table[cta, 0] = len(indices)
        table[cta, 1:1 + len(indices)] = indices
    table.flags.writeable = False  # shared by the callers of the cache
    return table


def stream_kv(k_ref, v_ref, k_smem, v_smem, ready, free, *, at, lo, hi, stages: int, block_kv: int,
              segments=None, bias=None, v_stages: int | None = None, origin=None):
    """The producer's loop: TMA copies of the K and V tiles [lo, hi) into rings of
    `stages` slots (V: `v_stages` <= stages, default the same), tile j into slot (j - origin) % stages.
    `origin` (default lo) is where the ring starts: a persistent kernel's ring runs on
    across its items, and the tiles before the ring's first `stages` wait for their slot.

    ready: (k_ready, v_ready) barriers, one per slot; free: (k_free, v_free) barriers,
    arrived at by both consumers once they have read a slot. `at(j)` indexes the
    gmem refs at key tile j. segments: (ids [B, Tkp] int32 gmem ref, ring [stages,
    block_kv] int32, ready barriers): the key tile's segment ids (at at(j)'s batch row and
    keys), copied beside K (the consumers read them before they release K). bias:
    (tile(j): the gmem ref of key tile j's bias rows for both consumers' query tiles, ring
    [v_stages, rows, block_kv], ready barriers): copied with V into the slot that V's free
    barrier releases (the consumers read it before P V)."""
    k_ready, v_ready = ready
    k_free, v_free = free
    v_stages = v_stages or stages
    assert v_stages <= stages, (v_stages, stages)

    start = lo if origin is None else origin

    def load(j, wait_k, wait_v):
        slot, v_slot = masks.int32_rem(j - start, stages), masks.int32_rem(j - start, v_stages)
        if wait_k is True:
            plgpu.barrier_wait(k_free.at[slot])
        elif wait_k is not False:
            pl.when(wait_k)(lambda: plgpu.barrier_wait(k_free.at[slot]))
        if segments is not None:
            ids, ids_smem, ids_ready = segments
            plgpu.copy_gmem_to_smem(ids.at[at(j)[:2]], ids_smem.at[slot], ids_ready.at[slot])
        plgpu.copy_gmem_to_smem(k_ref.at[at(j)], k_smem.at[slot], k_ready.at[slot])
        if wait_v is True:
            plgpu.barrier_wait(v_free.at[v_slot])
        elif wait_v is not False:
            pl.when(wait_v)(lambda: plgpu.barrier_wait(v_free.at[v_slot]))
        plgpu.copy_gmem_to_smem(v_ref.at[at(j)], v_smem.at[v_slot], v_ready.at[v_slot])
        if bias is not None:
            tile, bias_smem, bias_ready = bias
            plgpu.copy_gmem_to_smem(tile(j), bias_smem.at[v_slot], bias_ready.at[v_slot])

    if origin is not None:
        @pl.loop(lo, hi)
        def _(j):
            load(j, j - origin >= stages, j - origin >= v_stages)

        return

    # The first `stages` tiles fill K's empty slots; V's ring, where shallower, waits for its
    # slots sooner.
    for i in range(stages):
        pl.when(lo + i < hi)(lambda i=i: load(lo + i, False, i >= v_stages))

    @pl.loop(lo + stages, jnp.maximum(hi, lo + stages))
    def _(j):
        load(j, True, True)


def upper_skips_wait(t: Tiling, *, lockstep: bool) -> bool:
    """Whether a consumer waits on the ring tiles after its own key range before releasing
    them (`release_kv`). The two consumers' ranges end at the same tile unless a causal
    mask, a right window or ranges cut them; where they differ, the consumer that ends first
    would otherwise arrive on a slot's free barrier twice while the other may still read
    the slot's earlier tile. Only the forward's ping-pong schedule (`lockstep`) keeps the
    consumers within a step of each other, and only without ranges or a window (which
    let one range end many tiles before the other's)."""
    if t.ranges or t.spec.window_left is not None or t.spec.window_right is not None:
        return True
    return t.spec.right is not None and not lockstep


def release_kv(free, *, lo, hi, ring_lo, stages: int, ready=(), each=None, v_stages: int | None = None, v_ready=()):
    """A consumer's arrivals on the free barriers of the ring tiles [lo, hi) it does not
    read, so that the producer's ring stays in step. `each()` runs once per tile
    (schedule turns).

    ready: the barriers to wait on first, slotted as K's ring (`stages`); v_ready: those
    slotted as V's (`v_stages`, default the same depth). A thread tracks each barrier's
    phase by counting its own waits, so a consumer that will wait on a slot again (the
    tiles *before* its own range) must first pass through the phases of the tiles it skips
    there. Waiting also keeps the arrivals from running a ring ahead of the other
    consumer's reads: without it, the other consumer must not lag (`upper_skips_wait`).
    """
    k_free, v_free = free
    v_stages = v_stages or stages

    def body(j, _):
        slot, v_slot = masks.int32_rem(j - ring_lo, stages), masks.int32_rem(j - ring_lo, v_stages)
        for barrier in ready:
            plgpu.barrier_wait(barrier.at[slot])
        for barrier in v_ready:
            plgpu.barrier_wait(barrier.at[v_slot])
        plgpu.barrier_arrive(k_free.at[slot])
        plgpu.barrier_arrive(v_free.at[v_slot])
        if each is not None:
            each()

    lax.fori_loop(lo, hi, body, None)


def logits(s, t: Tiling, *, slope=None, q_start=None, k_start=None, transposed: bool = False, bias=None,
           mod: flex.KernelMods | None = None, grad: bool = False):
    """The logits of a score tile s = Q K^T (float32, wgmma register layout) for queries
    [q_start, ...) and keys [k_start, ...) (`mask_tile`'s layout), in the units
    `Tiling.exp2_scale` takes.

    In the Triton kernels' order: the scaled score through score_mod (its batch row, head
    and arrays in `mod`), then the softcap ``softcap * tanh(score / softcap)``, then `bias`
    (the tile's bias, float32 in s's layout; -inf at or below `masks.MASKING_BIAS`), then
    with `slope` (this head's ALiBi slope) minus ``slope * |q + offset - k|``. Without a
    softcap, and without a score_mod or with an additive one (`Tiling.additive_mod`, whose
    term enters as a bias does), the logits stay in units of q.k (the scale is folded into
    `exp2_scale`).

    Returns (logits, and with `grad` d logits / d s divided by the scale: score_mod's
    derivative times the softcap's; None without either, and without `grad`. The bias and
    ALiBi do not depend on s). With `mask_tile` after it on boundary tiles, the one scoring
    path of the Hopper kernels: the forward and both backward kernels call the pair.
    """
    dlogits = None
    if t.score_mod is not None:
        rows, cols = _mod_positions(t.score_mod, s.shape, q_start, k_start, transposed)
    if t.additive_mod:
        # Logits in units of q.k: the mod's term over the scale, one FMA per score (none of its
        # derivative: it is 1).
        s = s + mod.score.tile(rows, cols, shape=s.shape)
    elif t.score_mod is not None:
        out = mod.score.tile(s * t.scale, rows, cols, shape=s.shape)
        s, dlogits = out if grad else (out, None)
    if t.softcap is not None:
        # tanh from exp2 (the approximate tanh instruction is off by ~1e-3 relative, which
        # the softcap would multiply into the logits).
        tanh = xla_semantics.tanh_from_exp2(s * ((1.0 if t.score_mod is not None else t.scale) / t.softcap))
        s = tanh * t.softcap
        if grad:
            dlogits = 1.0 - tanh * tanh if dlogits is None else dlogits * (1.0 - tanh * tanh)
    # Unscaled logits are in units of q.k, so additive terms are divided by the scale.
    unit = 1.0 if t.scaled_logits else 1.0 / t.scale
    if bias is not None:
        s = s + masks.bias_logits(bias) * unit
    if slope is not None:
        # Positions as float32 vectors in the tile's row and column layouts (exact below
        # 2**24), so that each entry costs a subtract, an abs and a multiply-add.
        q_dim, k_dim = (1, 0) if transposed else (0, 1)
        rows = _position_vector(s.shape, q_dim, q_start + t.spec.offset).astype(jnp.float32)
        cols = _position_vector(s.shape, k_dim, k_start).astype(jnp.float32)
        distance = jnp.abs(lax.broadcast_in_dim(rows, s.shape, [q_dim]) - lax.broadcast_in_dim(cols, s.shape, [k_dim]))
        s = s - (slope if unit == 1.0 else slope * unit) * distance
    return s, dlogits


def logit_grad(ds, dlogits, t: Tiling):
    """dS (d loss / d logits) carried to d loss / d (scale * q.k): times `logits`' derivative.
    With a score_mod, entries where dS is 0 (masked or weightless) stay 0 whatever the
    derivative there (it may be inf at a -inf score)."""
    if dlogits is None:
        return ds
    if t.score_mod is not None:
        return jnp.where(ds == 0.0, 0.0, ds * dlogits)
    return ds * dlogits


def _position_vector(shape, dim: int, start):
    """int32 positions start + [0, shape[dim]) along `dim` of a wgmma-layout tile, in the
    layout that broadcasts back along the other dim."""
    return plgpu.broadcasted_iota(jnp.int32, (shape[dim],), 0, layout=plgpu.Layout.WGMMA.reduce(1 - dim)) + start


def _mod_positions(mod: flex.Mod, shape, q_start, k_start, transposed: bool):
    """The query and key positions of a tile as `mod` takes them: `flex.Along` vectors, so
    that what a mod computes from one side alone is computed once per row or column (a
    position converted to float, a chunk index); 0 for a position it does not use (Mosaic
    GPU's layout inference fails on a vector nothing uses)."""
    q_dim, k_dim = (1, 0) if transposed else (0, 1)
    uses_q, uses_k = mod.uses_positions[:2]
    return (flex.Along(_position_vector(shape, q_dim, q_start), q_dim) if uses_q else 0,
            flex.Along(_position_vector(shape, k_dim, k_start), k_dim) if uses_k else 0)


def mask_tile(s, spec: MaskSpec, q_start, k_start, *, transposed: bool = False, kv_length=None, q_seg=None,
              kv_seg=None, mask_mod: flex.Mod | None = None, mod: flex.KernelMods | None = None):
    """-inf where a score tile in the wgmma register layout does not attend.

    s: float32 [block_q, block_kv] for queries [q_start, ...) and keys [k_start, ...), or
    [block_kv, block_q] with `transposed`. The mask itself is `spec.allowed` (with the batch
    row's `kv_length`, if given), with segment ids (`segment_vector`s of the tile's
    queries and keys) equal ids, and with `mask_mod` its value (batch row, head and arrays
    in `mod`; a `sides.split` mask_mod takes q_seg and kv_seg as its row and column values,
    and no ids are compared)."""
    q_dim, k_dim = (1, 0) if transposed else (0, 1)
    # The bounds once per row (`MaskSpec.key_bounds`, registers of the row vector), then
    # one or two comparisons per score against the key positions, broadcast from a
    # column vector: no [rows, cols] position tiles.
    # (The row vector only where a bound uses it: Mosaic GPU's layout inference fails on a
    # vector nothing uses.)
    rows = _position_vector(s.shape, q_dim, q_start) if spec.left is not None or spec.right is not None else None
    first, last = spec.key_bounds(rows, kv_length)
    full = lambda vector, dim: lax.broadcast_in_dim(vector, s.shape, [dim])
    cols = full(_position_vector(s.shape, k_dim, k_start), k_dim)
    allowed = cols <= (full(last, q_dim) if jnp.ndim(last) else last)
    if first is not None:
        allowed = allowed & (cols >= full(first, q_dim))
    if mask_mod is not None:
        values = ()
        if mask_mod.sides:
            uses_row, uses_col = mask_mod.uses_positions[2:]
            values = (flex.Along(q_seg, q_dim) if uses_row else 0, flex.Along(kv_seg, k_dim) if uses_col else 0)
        allowed = allowed & mod.mask.tile(*_mod_positions(mask_mod, s.shape, q_start, k_start, transposed), *values,
                                          shape=s.shape)
    if q_seg is not None and not (mask_mod is not None and mask_mod.sides):
        allowed = allowed & (lax.broadcast_in_dim(q_seg, s.shape, [q_dim]) == lax.broadcast_in_dim(kv_seg, s.shape, [k_dim]))
    return jnp.where(allowed, s, -jnp.inf)


def with_bias_scratch(kernel, t: Tiling, rows: int, cols: int, stages: int, dtype, *scratch, **kwargs):
    """`pl.run_scoped(lambda *scoped: kernel(bias, scoped), *scratch, **kwargs)`, where with a
    bias `bias` is (a ring of `stages` bias tiles of [rows, cols] (both consumers' rows),
    its ready barriers) and without one (None, None): `scoped` holds the kernel's other
    scratch, in its order, with a bias or without."""
    if not t.bias:
        return pl.run_scoped(lambda *scoped: kernel((None, None), scoped), *scratch, **kwargs)
    ring = plgpu.SMEM((stages, rows, cols), dtype, transforms=smem_tiles())
    return pl.run_scoped(lambda ring, *scoped: kernel((ring, scoped[-1]), scoped[:-1]), ring, *scratch,
                         plgpu.Barrier(num_barriers=stages), **kwargs)


def bias_tile(smem, ready, slot, wg, rows: int):
    """Consumer `wg`'s rows [wg * rows, (wg + 1) * rows) of the bias tile in ring `slot`, waited
    for, in the wgmma register layout (float32)."""
    plgpu.barrier_wait(ready.at[slot])
    tile = plgpu.load(smem.at[slot, pl.ds(wg * rows, rows)], layout=plgpu.Layout.WGMMA)
    return tile.astype(jnp.float32)


def bias_tile_transposed(smem, ready, slot, wg, cols: int):
    """Consumer `wg`'s columns [wg * cols, (wg + 1) * cols) of the bias tile in ring `slot`,
    waited for, transposed: float32 [cols, rows] in the wgmma register layout."""
    plgpu.barrier_wait(ready.at[slot])
    tile = plgpu.load(smem.at[slot, :, pl.ds(wg * cols, cols)].transpose((1, 0)), layout=plgpu.Layout.WGMMA)
    return tile.astype(jnp.float32)


def keep_mask(t: Tiling, stream, shape, q_start, k_start, *, transposed: bool = False):
    """Dropout's keep mask of a [block_q, block_kv] tile in the wgmma register layout (or
    [block_kv, block_q] with `transposed`): `flashjax.dropout.tile_keep` of the query and
    key positions, the same bits as the Triton kernels' and the reference's, for the dropout
    `stream` (`OptionalInputs.dropout_stream`). The row keys are hashed once per query row,
    in the layout of the tile's query dim, the key positions folded once per column, then
    both broadcast. Keys k and k + 64 of a 128-key block share one draw (`dropout.PAIR_BLOCK`);
    in the wgmma layout one thread holds both, so a tile of whole blocks along its columns
    (`k_start` a multiple of 128) hashes once per pair and joins the halves' masks (a
    concatenation of registers)."""
    q_dim, k_dim = (1, 0) if transposed else (0, 1)
    threshold = dropout.keep_threshold(t.dropout_rate)
    row_keys = dropout.row_keys(stream, _position_vector(shape, q_dim, q_start))
    if transposed or shape[k_dim] % dropout.PAIR_BLOCK:
        keys = _position_vector(shape, k_dim, k_start)
        along = lambda x: lax.broadcast_in_dim(x, shape, [k_dim])
        return dropout.keep_bits(lax.broadcast_in_dim(row_keys, shape, [q_dim]), along(dropout.column_words(keys)),
                                 along(dropout.column_shifts(keys)), threshold)
    half = (shape[0], dropout.PAIR_BLOCK // 2)
    row_keys = lax.broadcast_in_dim(row_keys, half, [0])
    parts = []
    for block in range(shape[1] // dropout.PAIR_BLOCK):
        first_keys = _position_vector(half, 1, k_start + block * dropout.PAIR_BLOCK)
        parts += dropout.keep_pair(row_keys, lax.broadcast_in_dim(dropout.column_words(first_keys), half, [1]), threshold)
    return jnp.concatenate(parts, axis=1)


def drop(x, keep):
    """The kept entries of x (`keep_mask`), dropped ones 0; x itself when `keep` is None.
    Unscaled: the kernels apply `Tiling.keep_scale` to what the products of the kept weights
    sum (the forward's 1 / l, dV at its store: `scale_kept_sum`) once, not to every weight."""
    return x if keep is None else jnp.where(keep, x, 0.0)


def scale_kept_sum(x, t: Tiling):
    """x, a sum over kept weights (`drop`), times `Tiling.keep_scale`; x itself without dropout."""
    return x * t.keep_scale if t.dropout_rate > 0.0 else x


def dp_minus_delta(dp, delta, t: Tiling, keep):
    """dP - delta with dP through dropout (kept entries times `Tiling.keep_scale`, dropped
    ones 0), in one fused multiply-add per kept entry; delta broadcast to dP's shape."""
    if keep is None:
        return dp - delta
    return jnp.where(keep, dp * t.keep_scale - delta, -delta)


def segment_scratch(t: Tiling, own_rows: int, streamed: int, stages: int) -> tuple:
    """With segments, one more scoped allocation for a kernel that keeps COMPUTE_WGS tiles of
    `own_rows` rows and streams tiles of `streamed` rows of the other operand through a ring
    of `stages`: (own ids, ring of ids, own ids' barriers, ring's barriers). Without
    segments, nothing."""
    if not t.segments:
        return ()
    return ((
        plgpu.SMEM((COMPUTE_WGS, own_rows), jnp.int32),
        plgpu.SMEM((stages, streamed), jnp.int32),
        plgpu.Barrier(num_barriers=COMPUTE_WGS),
        plgpu.Barrier(num_barriers=stages),
    ),)


def segment_vector(smem, dim: int):
    """Segment ids [n] from shared memory in the layout of dim `dim` of a wgmma score tile."""
    return plgpu.load(smem, layout=plgpu.Layout.WGMMA.reduce(1 - dim))


def own_segment_ids(src, smem, barrier, dim: int):
    """A consumer's own tile's segment ids: copied from `src` (gmem) once, waited for, and
    loaded in the layout of dim `dim` of its score tiles."""
    plgpu.copy_gmem_to_smem(src, smem, barrier)
    plgpu.barrier_wait(barrier)
    return segment_vector(smem, dim)


def ring_segment_ids(smem, ready, slot, dim: int, masked: bool):
    """The segment ids of the streamed tile in ring `slot`, for a masked tile (None for an
    unmasked one). Every tile waits on the slot's ready barrier: a thread counts barrier
    phases by its own waits."""
    plgpu.barrier_wait(ready.at[slot])
    return segment_vector(smem.at[slot], dim) if masked else None


def copy_rows_to_gmem(smem, gmem):
    """TMA copy of a [rows, D] shared-memory tile (`smem_tiles` layout) into gmem [rows, Dv],
    Dv <= D: its first Dv columns. The (8, 64) tiling makes a column slice non-contiguous,
    so a narrower gmem takes one copy per 8-row tile (each a contiguous run of whole
    64-column slabs)."""
    rows, cols = gmem.shape
    if cols == smem.shape[1]:
        plgpu.copy_smem_to_gmem(smem, gmem)
        return
    for r in range(0, rows, 8):
        plgpu.copy_smem_to_gmem(smem.at[pl.ds(r, 8), pl.ds(0, cols)], gmem.at[pl.ds(r, 8)], commit_group=False)
    plgpu.commit_smem_to_gmem_group()


def product(a, b, shape):
    """a @ b (shared-memory operands) into a fresh float32 accumulator, waited for."""

    def body(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        return acc_ref[...]

    return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))


def zeros(shape, layout=None):
    """A float32 register tile of zeros in the wgmma layout (or `layout`)."""
    return plgpu.layout_cast(jnp.full(shape, 0.0, jnp.float32), layout or plgpu.Layout.WGMMA)

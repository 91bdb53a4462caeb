"""The Hopper forward's barrier protocol, simulated on the CPU for the tile ranges the kernel computes.

One CTA of the forward (kernels/mosaic/fwd.py) is a producer that streams the key tiles
[ring_lo, ring_hi) through a ring of `stages` slots and two consumers that each walk their
own range of it, releasing the ring tiles outside their range (`common.release_kv`). The
Mosaic GPU barriers are mbarriers: a phase completes after its arrivals, and a thread's
wait checks only the parity of the phase it counts from its own earlier waits. A thread that
skips a wait, or that releases a slot another thread still reads, races or hangs on the GPU.

This test replays the kernel's barrier operations, in the kernel's order, as threads under a
random scheduler, with the ranges the kernel derives (`MaskSpec.kv_range`, the lengths' and
segments' `masks.dynamic_ranges`, `_at_least_one_tile`, `common.hull`) and the kernel's choice
of which releases wait (`common.upper_skips_wait`). It asserts that every run finishes (no
deadlock) and that every tile a consumer reads is the one in its slot while it reads it.
The same simulation without those waits finds the races: the test checks that too. The
persistent forward's CTAs walk several items through one ring (`common.Items.table`); the
walks are replayed the same way.
"""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from flashjax import flex, masks
from flashjax.kernels.mosaic import common
from flashjax.kernels.mosaic.common import Tiling
from flashjax.kernels.mosaic.fwd import _at_least_one_tile


class Barrier:
    """An mbarrier: `arrivals` per phase; `completed` phases so far."""

    def __init__(self, arrivals: int):
        self.arrivals, self.pending, self.completed = arrivals, 0, 0

    def arrive(self):
        self.pending += 1
        if self.pending == self.arrivals:
            self.pending, self.completed = 0, self.completed + 1


class Race(AssertionError):
    pass


def _simulate(ranges, ring, stages: int, pingpong: bool, skips_wait: bool, lower_waits: bool, seed: int,
              kernel: str = "fwd", walk=None):
    """Runs one CTA's protocol (`kernel` "fwd", or "dq": the dQ kernel's consumer steps);
    raises Race or returns False on a deadlock, True when it finishes. walk: the persistent
    forward's items, [(consumer ranges, ring)] in the order the CTA takes them, the ring
    running on across them (instead of the one item `ranges`, `ring`)."""
    rng = np.random.default_rng(seed)
    items = [(ranges, ring)] if walk is None else walk
    # The tile each ring position holds is (item, key tile); origin: where item n's tiles
    # start in the ring (`fwd.forward`'s `ring[0] - streamed`).
    origins, streamed = [], 0
    for _, (ring_lo, ring_hi) in items:
        origins.append(ring_lo - streamed)
        streamed += ring_hi - ring_lo
    k_ready = [Barrier(1) for _ in range(stages)]
    v_ready = [Barrier(1) for _ in range(stages)]
    k_free = [Barrier(2) for _ in range(stages)]
    v_free = [Barrier(2) for _ in range(stages)]
    schedule = Barrier(2)
    k_slot = [None] * stages  # the tile each slot holds
    v_slot = [None] * stages

    def wait(barrier, waits: dict):
        """A thread's wait: passes once the barrier's phase parity differs from the parity of
        this thread's count of waits on it (what try_wait.parity checks)."""
        k = waits.get(id(barrier), 0)
        while barrier.completed % 2 == k % 2:
            yield
        waits[id(barrier)] = k + 1

    def producer():
        waits = {}
        for n, (_, (ring_lo, ring_hi)) in enumerate(items):
            for j in range(ring_lo, ring_hi):
                s = (j - origins[n]) % stages
                if j - origins[n] >= stages:
                    yield from wait(k_free[s], waits)
                k_slot[s] = (n, j)
                k_ready[s].arrive()
                if j - origins[n] >= stages:
                    yield from wait(v_free[s], waits)
                v_slot[s] = (n, j)
                v_ready[s].arrive()

    def consumer(wg: int):
        waits = {}
        for n, (item_ranges, (ring_lo, ring_hi)) in enumerate(items):
            yield from consume(wg, n, item_ranges[wg], ring_lo, ring_hi, waits)

    def consume(wg: int, n: int, own, ring_lo: int, ring_hi: int, waits: dict):
        lo, hi = own
        slot = lambda j: (j - origins[n]) % stages

        def turn():
            if pingpong:
                schedule.arrive()
                yield from wait(schedule, waits)

        def check(slots, j):
            if slots[slot(j)] != (n, j):
                raise Race(f"consumer {wg} reads tile {(n, j)} from a slot holding {slots[slot(j)]}")

        def release(j, waits_first: bool):
            if waits_first:
                yield from wait(k_ready[slot(j)], waits)
                yield from wait(v_ready[slot(j)], waits)
            k_free[slot(j)].arrive()
            v_free[slot(j)].arrive()
            yield from turn()
            yield from turn()

        if wg == 1:
            yield from turn()
        for j in range(ring_lo, lo):
            yield from release(j, lower_waits)
        if kernel == "dq":  # bwd.dq's step: K for S and dQ, V for dP
            for j in range(lo, hi):
                yield from wait(k_ready[slot(j)], waits)
                check(k_slot, j)
                yield
                yield from wait(v_ready[slot(j)], waits)
                check(v_slot, j)
                yield
                check(v_slot, j)
                v_free[slot(j)].arrive()
                check(k_slot, j)
                yield
                check(k_slot, j)
                k_free[slot(j)].arrive()
        elif pingpong:  # synchronous_loop
            if hi > lo:
                yield from wait(k_ready[slot(lo)], waits)
            for j in range(lo, hi):
                check(k_slot, j)
                yield from turn()  # inside S = Q K^T
                yield
                check(k_slot, j)
                k_free[slot(j)].arrive()
                schedule.arrive()  # end_softmax
                yield from wait(v_ready[slot(j)], waits)
                yield from wait(schedule, waits)
                check(v_slot, j)
                if j + 1 < hi:  # P V issued, the next K waited for, then V released
                    yield from wait(k_ready[slot(j + 1)], waits)
                yield
                check(v_slot, j)
                v_free[slot(j)].arrive()
        else:  # overlapped_loop (hi > lo: _at_least_one_tile)
            yield from wait(k_ready[slot(lo)], waits)
            check(k_slot, lo)
            yield
            k_free[slot(lo)].arrive()
            for j in range(lo + 1, hi):
                yield from wait(k_ready[slot(j)], waits)
                yield from wait(v_ready[slot(j - 1)], waits)
                check(k_slot, j)
                check(v_slot, j - 1)
                yield
                check(k_slot, j)
                check(v_slot, j - 1)
                k_free[slot(j)].arrive()
                v_free[slot(j - 1)].arrive()
            yield from wait(v_ready[slot(hi - 1)], waits)
            check(v_slot, hi - 1)
            yield
            check(v_slot, hi - 1)
            v_free[slot(hi - 1)].arrive()
        for j in range(hi, ring_hi):
            yield from release(j, skips_wait)
        if wg == 0:
            yield from turn()

    threads = [producer(), consumer(0), consumer(1)]
    stuck = 0
    while threads:
        thread = threads[rng.integers(len(threads))]
        try:
            next(thread)
            stuck += 1
        except StopIteration:
            threads.remove(thread)
            stuck = 0
        if stuck > 20_000:  # every thread spinning on a wait: a deadlock
            return False
    return True


def _ctas(t: Tiling, q_len: int, k_len: int, overlap: bool, ranges=None):
    """(consumer ranges, ring) of every CTA of a batch row, as fwd.forward derives them."""
    n_kv = k_len // t.block_kv
    out = []
    for pair in range(q_len // (2 * t.block_q)):
        def kv_tiles(q_block):
            tiles = t.spec.kv_range(q_block, t.block_q, t.block_kv, n_kv)
            if ranges is not None:
                tiles = masks.intersect(tiles, ranges[q_block])
            return _at_least_one_tile(tiles, n_kv) if overlap else tiles

        a, b = kv_tiles(2 * pair), kv_tiles(2 * pair + 1)
        ring = tuple(int(x) for x in common.hull(a, b))
        out.append((((int(a.lo), int(a.hi)), (int(b.lo), int(b.hi))), ring))
    return out


CASES = [
    # (seq_q, seq_k, causal, window, q_length, kv_length, documents)
    pytest.param(1000, 1000, True, None, None, None, None, id="causal"),
    pytest.param(1000, 1000, False, (129, None), None, None, None, id="left-window"),
    pytest.param(1000, 1000, True, (129, None), None, None, None, id="causal-window"),
    pytest.param(1536, 1536, False, (64, 300), None, None, None, id="window-both-sides"),
    pytest.param(1024, 1024, True, None, 513, 700, None, id="causal-lengths"),
    pytest.param(1024, 1024, False, None, 100, 1024, None, id="q-length"),
    pytest.param(1024, 1024, True, None, None, None, [0, 300, 301, 700], id="causal-documents"),
    # a mask_mod's block mask: a band |q - k| <= 40, ranges that start past 0 with no full tile
    pytest.param(300, 517, False, None, None, None, "band", id="block-mask-band"),
    # a prefix LM's: full tiles beside partial ones
    pytest.param(1000, 1000, False, None, None, None, "prefix", id="block-mask-prefix"),
]
BLOCK_MASK_MODS = {
    "band": lambda b, h, i, j: (i - j <= 40) & (j - i <= 40),
    "prefix": lambda b, h, i, j: (j <= i) | (j < 300),
}


def _tiling_and_ranges(seq_q, seq_k, causal, window, q_length, kv_length, documents, block_q=64, block_kv=64,
                       stages=2):
    left, right = window if window else (None, None)
    spec = masks.MaskSpec(seq_q, seq_k, causal, left, right)
    q_len = -(-seq_q // (2 * block_q)) * 2 * block_q
    k_len = -(-seq_k // block_kv) * block_kv
    has_ranges = q_length is not None or kv_length is not None or documents is not None
    mask_mod = BLOCK_MASK_MODS.get(documents) if isinstance(documents, str) else None
    documents = None if mask_mod is not None else documents
    t = Tiling(block_q, block_kv, stages, spec, 1.0, ranges=has_ranges, segments=documents is not None)
    ranges = None
    if has_ranges:
        blocks = None
        if mask_mod is not None:
            block_mask = flex.block_mask(mask_mod, 1, 1, seq_q, seq_k, block_q=64, block_k=64)
            blocks = flex.tile_flags(block_mask, block_q, block_kv, q_len // block_q, k_len // block_kv)
        seg = None
        if documents is not None:
            seg = jnp.asarray((np.arange(q_len)[:, None] >= np.asarray(documents)[None, :]).sum(-1)[None], jnp.int32)
        table = masks.dynamic_ranges(
            batch=1, seq_q=seq_q, seq_k=seq_k, block_q=block_q, block_k=block_kv, padded_q=q_len, padded_k=k_len,
            q_lengths=None if q_length is None else jnp.array([q_length], jnp.int32),
            kv_lengths=None if kv_length is None else jnp.array([kv_length], jnp.int32),
            q_segment_ids=seg, kv_segment_ids=None if seg is None else seg[:, :k_len], blocks=blocks,
        )
        ranges = np.asarray(table[0])
    return t, q_len, k_len, ranges


@pytest.mark.parametrize("kernel", ["fwd-pingpong", "fwd-overlap", "dq"])
@pytest.mark.parametrize("seq_q,seq_k,causal,window,q_length,kv_length,documents", CASES)
def test_protocol_finishes_without_races(seq_q, seq_k, causal, window, q_length, kv_length, documents, kernel):
    t, q_len, k_len, ranges = _tiling_and_ranges(seq_q, seq_k, causal, window, q_length, kv_length, documents)
    overlap = kernel == "fwd-overlap"
    upper_waits = common.upper_skips_wait(t, lockstep=kernel == "fwd-pingpong")
    for (consumer_ranges, ring), seed in itertools.product(_ctas(t, q_len, k_len, overlap, ranges), range(3)):
        finished = _simulate(consumer_ranges, ring, t.stages, pingpong=kernel == "fwd-pingpong", skips_wait=upper_waits,
                             lower_waits=True, seed=seed, kernel="dq" if kernel == "dq" else "fwd")
        assert finished, f"deadlock: consumer ranges {consumer_ranges}, ring {ring}"


def _pairs_at(t: Tiling, pairs: int, k_len: int, ranges=None) -> list:
    """The pair at each position of the schedule (`common.pair_index`): with ranges and no
    causal mask, in the order of `common.pair_order` (one batch row)."""
    order = None
    if ranges is not None and common.takes_pair_order(t):
        order = np.asarray(common.pair_order(jnp.asarray(ranges)[None], t.spec, t.block_q, t.block_kv, k_len // t.block_kv))
    return [int(common.pair_index(pairs, longest_first=t.spec.causal, order=order, index=p)) for p in range(pairs)]


def _walks(t: Tiling, q_len: int, k_len: int, overlap: bool, heads: int, ctas: int, ranges=None):
    """The persistent forward's walks: each CTA's [(consumer ranges, ring)] in the order
    `common.Items.table` gives it its items (one batch row; the ranges do not depend on the
    head), the pairs at their positions (`common.pair_index`)."""
    per_pair = _ctas(t, q_len, k_len, overlap, ranges)
    pairs = len(per_pair)
    pair_at = _pairs_at(t, pairs, k_len, ranges)
    items = common.Items(heads, pairs, 1, ctas)
    table = items.table([per_pair[pair][1][1] - per_pair[pair][1][0] for pair in pair_at])
    return [[per_pair[pair_at[(i // items.batch) % pairs]] for i in table[c, 1:1 + table[c, 0]]] for c in range(ctas)]


WALK_CASES = CASES + [
    pytest.param(700, 200, True, None, None, None, None, id="rows-without-keys"),
    pytest.param(300, 517, False, None, None, None, None, id="q<k"),
]


@pytest.mark.parametrize("kernel", ["fwd-pingpong", "fwd-overlap"])
@pytest.mark.parametrize("seq_q,seq_k,causal,window,q_length,kv_length,documents", WALK_CASES)
def test_persistent_walks_finish_without_races(seq_q, seq_k, causal, window, q_length, kv_length, documents, kernel):
    """The persistent forward: each CTA walks several items through one ring (the tiles of
    item n after those of the items before it), every release waiting on its tile; with
    ranges known at trace time too (lengths, documents, a block mask: items of different
    rings, some empty)."""
    t, q_len, k_len, ranges = _tiling_and_ranges(seq_q, seq_k, causal, window, q_length, kv_length, documents)
    overlap = kernel == "fwd-overlap"
    for walk, seed in itertools.product(_walks(t, q_len, k_len, overlap, heads=3, ctas=4, ranges=ranges), range(2)):
        finished = _simulate(None, None, t.stages, pingpong=not overlap, skips_wait=True, lower_waits=True, seed=seed,
                             walk=walk)
        assert finished, f"deadlock: {walk}"


@pytest.mark.parametrize("overlap", [False, True], ids=["pingpong", "overlap"])
@pytest.mark.parametrize("seq_q,seq_k,causal,window,q_length,kv_length,documents", WALK_CASES)
def test_item_tiles_are_the_rings(seq_q, seq_k, causal, window, q_length, kv_length, documents, overlap):
    """The persistent table's cost of each item (`fwd.item_tiles`, computed at trace time from
    ranges that are constants) is the ring its CTA streams, as the kernel derives it."""
    from flashjax.kernels.mosaic import fwd as mosaic_fwd

    t, q_len, k_len, ranges = _tiling_and_ranges(seq_q, seq_k, causal, window, q_length, kv_length, documents)
    per_pair = _ctas(t, q_len, k_len, overlap, ranges)
    pairs = len(per_pair)
    order = None
    if ranges is not None and common.takes_pair_order(t):
        order = common.pair_order(jnp.asarray(ranges)[None], t.spec, t.block_q, t.block_kv, k_len // t.block_kv)
    opt = common.OptionalInputs(ranges=None if ranges is None else jnp.asarray(ranges)[None], pair_order=order)
    got = mosaic_fwd.item_tiles(t, opt, 1, pairs, k_len // t.block_kv, overlap)
    want = [per_pair[pair][1][1] - per_pair[pair][1][0] for pair in _pairs_at(t, pairs, k_len, ranges)]
    np.testing.assert_array_equal(got[:, 0], want)


def test_persistent_walks_need_the_upper_waits():
    """Across items a consumer must wait on the ring tiles after its range before releasing
    them (a thread counts a barrier's phases by its own waits): the per-item grid's causal
    ping-pong skips those waits, and in a walk that races or deadlocks."""
    t, q_len, k_len, _ = _tiling_and_ranges(1000, 1000, True, None, None, None, None)
    assert not common.upper_skips_wait(t, lockstep=True)
    found = 0
    for walk, seed in itertools.product(_walks(t, q_len, k_len, False, heads=3, ctas=4), range(5)):
        try:
            found += not _simulate(None, None, t.stages, pingpong=True, skips_wait=False, lower_waits=True, seed=seed,
                                   walk=walk)
        except Race:
            found += 1
    assert found > 0


def test_the_simulation_finds_releases_that_do_not_wait():
    """Without the waits the kernel has, the simulation races or deadlocks: the check can fail."""
    t, q_len, k_len, ranges = _tiling_and_ranges(1024, 1024, False, None, 100, 1024, None)
    assert common.upper_skips_wait(t, lockstep=False)
    found = 0
    ctas = [c for c in _ctas(t, q_len, k_len, True, ranges) if c[0][0] != c[0][1]]
    for (consumer_ranges, ring), seed in itertools.product(ctas, range(10)):
        try:
            found += not _simulate(consumer_ranges, ring, t.stages, pingpong=False, skips_wait=False,
                                   lower_waits=True, seed=seed)
        except Race:
            found += 1
    t, q_len, k_len, _ = _tiling_and_ranges(1000, 1000, True, (129, None), None, None, None)
    for (consumer_ranges, ring), seed in itertools.product(_ctas(t, q_len, k_len, False), range(10)):
        if consumer_ranges[0][0] != consumer_ranges[1][0]:  # the second consumer skips the first tile
            try:
                found += not _simulate(consumer_ranges, ring, t.stages, pingpong=True, skips_wait=True,
                                       lower_waits=False, seed=seed)
            except Race:
                found += 1
    assert found > 0


@pytest.mark.parametrize("mask_mod", [
    pytest.param(flex.trace(lambda b, h, i, j: j <= i, flex.MASK_MOD)[0], id="causal-mod"),
    pytest.param(flex.trace(lambda b, h, i, j: j >= i, flex.MASK_MOD)[0], id="anti-causal-mod"),
    pytest.param(flex.trace(lambda b, h, i, j: (i // 300) == (j // 300), flex.MASK_MOD)[0], id="chunked-300"),
])
def test_pair_order_takes_the_longest_pairs_first(mask_mod):
    """The order the forward and dQ kernels take pairs of query tiles in, with ranges and no causal
    mask: a permutation of the pairs, by non-increasing count of the key tiles they visit."""
    seq, block_q, block_kv = 1000, 64, 128
    q_len, k_len = 1024, 1024
    blocks = flex.classify(mask_mod, (), 1, 1, seq, seq, 64, 64)
    bm = flex.BlockMask(blocks, None, seq, seq, 64, 64)
    meets, full = flex.tile_flags(bm, block_q, block_kv, q_len // block_q, k_len // block_kv)
    ranges = masks.dynamic_ranges(batch=2, seq_q=seq, seq_k=seq, block_q=block_q, block_k=block_kv, padded_q=q_len,
                                  padded_k=k_len, blocks=(meets, full))
    spec = masks.MaskSpec(seq_q=seq, seq_k=seq, causal=False)
    order = np.asarray(common.pair_order(ranges, spec, block_q, block_kv, k_len // block_kv))
    assert sorted(order) == list(range(q_len // (2 * block_q)))
    r = np.asarray(ranges)
    work = (r[:, :, masks.HI] - r[:, :, masks.LO]).clip(0).sum(0).reshape(-1, 2).sum(1)
    assert np.all(np.diff(work[order]) <= 0), work[order]

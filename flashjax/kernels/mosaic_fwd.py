"""The Hopper forward kernel (Pallas Mosaic GPU): wgmma, TMA and warp specialisation.

One CTA per (head, pair of query tiles, batch row) runs three warpgroups, in the
FlashAttention-3 arrangement:

* two consumer warpgroups, each owning a `block_q`-row query tile in registers
  (m, l, acc in float32) and walking the key tiles with `wgmma`: S = Q K^T into
  registers, the online softmax, then acc += P V with P fed from registers;
* one producer warpgroup that only issues TMA copies of K and V tiles into a ring
  of `stages` shared-memory slots, waiting on the consumers' "consumed" barriers
  before it overwrites a slot. It gives its registers to the consumers
  (`set_max_registers`).

Two ways keep the tensor cores busy while a consumer runs its softmax (the MUFU/FMA
units), chosen by `FwdTiling.overlap` and `.pingpong` (MosaicConfig.fwd_schedule):
a schedule barrier that ping-pongs the consumers, so that one's softmax runs under
the other's products (`synchronous_loop`), and a software-pipelined key loop in
which each consumer's softmax of tile j runs under its own P V product of tile j-1
(`overlapped_loop`).

The arrays arrive padded to whole tiles (see `mosaic.py`); the true lengths are
static. Causal is aligned bottom-right (query i sees keys j <= i + Tk - Tq): key
tiles entirely above the diagonal are never loaded, the tiles entirely below it
run without a mask, and only the diagonal tiles and the last, partial key tile
pay for the iota/where. Rows that see no key keep m = -inf and l = 0 and finish
as o = 0, lse = -inf.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from flashjax.kernels.common import LOG2E

# Consumer warpgroups per CTA (each owns one block_q query tile).
COMPUTE_WGS = 2
# Registers per thread after `set_max_registers`: the producer, which only issues TMA,
# gives its share to the two consumers (2 * 232 + 40 warpgroup-threads' worth fits
# the 64K-register file).
CONSUMER_REGISTERS, PRODUCER_REGISTERS = 232, 40


@dataclasses.dataclass(frozen=True)
class FwdTiling:
    """Static shape of one kernel call (all lengths padded; seq_q, seq_k are the true ones).

    The backward kernels take it too; `overlap` and `pingpong` (MosaicConfig.fwd_schedule)
    concern the forward only."""

    block_q: int
    block_kv: int
    stages: int
    seq_q: int
    seq_k: int
    causal: bool
    scale: float
    tile_major: bool = False
    overlap: bool = False
    pingpong: bool = True


def grid_spec(tiles: int, heads: int, batch: int, tile_name: str, tile_major: bool):
    """(grid, grid_names): tile-major puts a head's tiles on consecutive CTAs (L2 reuse of K/V)."""
    if tile_major:
        return (tiles, heads, batch), (tile_name, "heads", "batch")
    return (heads, tiles, batch), ("heads", tile_name, "batch")


def _smem_tiles():
    # 128-byte swizzle on (8, 64) tiles: the layout wgmma reads without bank conflicts
    # and TMA writes directly (64 two-byte elements = one 128-byte row).
    return (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def causal_kv_range(q_start, rows: int, *, block_kv: int, n_kv: int, t: FwdTiling):
    """(end, full_end) for the query rows [q_start, q_start + rows): the key tiles
    [0, end) hold a key some row sees, and [0, full_end) need no mask (every key in
    them is real and visible to every row). Python ints when static (not causal)."""
    full_tail = t.seq_k // block_kv  # tiles before it hold only real keys
    if not t.causal:
        return n_kv, min(full_tail, n_kv)
    offset = t.seq_k - t.seq_q  # bottom-right alignment: row i sees keys j <= i + offset
    last_key = q_start + rows - 1 + offset
    end = jnp.clip(lax.div(jnp.maximum(last_key + 1, 0) + block_kv - 1, block_kv), 0, n_kv)
    # A tile is unmasked when its last key is visible to the first row.
    full = lax.div(jnp.maximum(q_start + offset + 1, 0), block_kv)
    return end, jnp.minimum(jnp.minimum(full, end), full_tail)


def _q_pair(q_len: int, block_q: int, causal: bool):
    """This CTA's pair of query tiles. Causal: the last (longest) rows first, so that
    the short CTAs fill the tail of the schedule instead of the long ones."""
    index = lax.axis_index("q_seq")
    return q_len // (COMPUTE_WGS * block_q) - 1 - index if causal else index


def _turn(schedule, enabled: bool):
    """One turn of the ping-pong between the two consumer warpgroups (a no-op when disabled)."""

    def turn():
        if enabled:
            plgpu.barrier_arrive(schedule)
            plgpu.barrier_wait(schedule)

    return turn


def _at_least_one(n):
    return max(n, 1) if isinstance(n, int) else jnp.maximum(n, 1)


def loop(lo, hi, body, carry):
    """fori_loop that emits nothing for a static empty range: the Mosaic GPU lowering of
    a zero-trip loop with constant bounds fails ("Shaped arrays must be represented by
    ir.Values")."""
    if isinstance(lo, int) and isinstance(hi, int):
        if hi <= lo:
            return carry
        return lax.fori_loop(jnp.int32(lo), jnp.int32(hi), body, carry)
    return lax.fori_loop(lo, hi, body, carry)


def forward(q, k, v, t: FwdTiling):
    """q [B, Tqp, H, D], k/v [B, Tkp, Hkv, D] (bf16/fp16, padded) -> o like q, lse2 [B, H, Tqp] (log2 units)."""
    batch, q_len, heads, head_dim = q.shape
    k_len, kv_heads = k.shape[1], k.shape[2]
    dtype = q.dtype
    group = heads // kv_heads
    block_q, block_kv = t.block_q, t.block_kv
    assert q_len % (COMPUTE_WGS * block_q) == 0 and k_len % block_kv == 0, (q.shape, k.shape, t)
    n_kv = k_len // block_kv
    stages = max(1, min(t.stages, n_kv))
    offset = t.seq_k - t.seq_q  # bottom-right causal alignment
    scale_log2 = t.scale * LOG2E  # logits in log2 units: exp2 is one MUFU op

    def kv_range(q_start, rows):
        return causal_kv_range(q_start, rows, block_kv=block_kv, n_kv=n_kv, t=t)

    def kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, scoped):
        b = lax.axis_index("batch")
        h = lax.axis_index("heads")
        wg = lax.axis_index("wg")
        (qo_smem2, k_smem, v_smem, lse_smem2), (k_ready, v_ready, q_ready), (k_free, v_free), schedule = scoped
        cta_q = _q_pair(q_len, block_q, t.causal) * (COMPUTE_WGS * block_q)
        cta_end, _ = kv_range(cta_q, COMPUTE_WGS * block_q)
        if t.overlap:
            # The pipelined loop always runs its first tile (masked, it is harmless for
            # rows that see no key), so the producer always loads it.
            cta_end = _at_least_one(cta_end)

        schedule_turn = _turn(schedule, t.pingpong)

        def scores(q_smem, slot):
            """S = Q K^T for the key tile in `slot`, waited for, with the other consumer's
            turn on the tensor cores in between."""

            def qk(s_ref):
                plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                schedule_turn()
                return s_ref[...]

            return pl.run_scoped(qk, plgpu.ACC((block_q, block_kv), jnp.float32))

        def mask_scores(s, j, q_start):
            rows = plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 0, layout=plgpu.Layout.WGMMA)
            cols = plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 1, layout=plgpu.Layout.WGMMA)
            cols = cols + j * block_kv
            visible = cols < t.seq_k
            if t.causal:
                visible = visible & (cols <= rows + (q_start + offset))
            return jnp.where(visible, s, -jnp.inf)

        def online_softmax(s, m, masked: bool):
            """(m_new, alpha, p) for the scores s of one key tile, m in log2 units so that
            p = exp2(s * scale_log2 - m) is one FMA + MUFU op."""
            m_new = jnp.maximum(m, s.max(axis=1) * scale_log2)
            if masked:
                # A row with no visible key so far keeps m = -inf; subtract 0 instead
                # so that exp2 sees -inf - 0 = -inf (p = 0, alpha = 0), never NaN.
                m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            else:
                m_use = m_new
            alpha = jnp.exp2(m - m_use)
            p = jnp.exp2(s * scale_log2 - lax.broadcast_in_dim(m_use, s.shape, [0]))
            return m_new, alpha, p

        def synchronous_loop(acc, m, l, q_start, end, full_end, q_smem):
            """Key tiles [0, end): each step waits for S = Q K^T, runs the softmax, then
            waits for acc += P V (JAX's FA3 example)."""

            @pl.when(end > 0)
            def _():
                plgpu.barrier_wait(k_ready.at[0])

            def step(j, carry, masked: bool):
                acc, m, l = carry
                slot = lax.rem(j, stages)
                s = scores(q_smem, slot)
                plgpu.barrier_arrive(k_free.at[slot])
                if masked:
                    s = mask_scores(s, j, q_start)
                m_new, alpha, p = online_softmax(s, m, masked)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                l = l * alpha
                p16 = p.astype(dtype)

                def end_softmax():
                    if t.pingpong:
                        plgpu.barrier_arrive(schedule)  # softmax done: the other consumer may issue
                    plgpu.barrier_wait(v_ready.at[slot])
                    if t.pingpong:
                        plgpu.barrier_wait(schedule)  # tensor cores free again

                # The order follows JAX's FA3 example, where it was measured to matter.
                if head_dim <= 128:
                    l = l + p.sum(axis=1)
                    acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
                    end_softmax()
                else:
                    end_softmax()
                    l = l + p.sum(axis=1)

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                    nxt = j + 1

                    @pl.when(nxt < end)
                    def _():
                        plgpu.barrier_wait(k_ready.at[lax.rem(nxt, stages)])

                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l

            carry = (acc, m, l)
            carry = loop(0, full_end, lambda j, c: step(j, c, masked=False), carry)
            return loop(full_end, end, lambda j, c: step(j, c, masked=True), carry)

        def overlapped_loop(acc, m, l, q_start, end, full_end, q_smem):
            """Key tiles [0, end), end >= 1, software-pipelined (FlashAttention-3's
            intra-warpgroup overlap): step j issues S_j = Q K_j^T and acc += P_{j-1} V_{j-1}
            together, then runs tile j's softmax while the P V product is still on the
            tensor cores, and only then waits for it to rescale acc."""
            plgpu.barrier_wait(k_ready.at[0])
            s = scores(q_smem, 0)
            plgpu.barrier_arrive(k_free.at[0])
            first_masked = not (isinstance(full_end, int) and full_end >= 1)
            if first_masked:
                s = mask_scores(s, 0, q_start)
            m, _, p = online_softmax(s, m, first_masked)  # acc is 0: nothing to rescale
            l = p.sum(axis=1)
            p16 = p.astype(dtype)
            schedule_turn()

            def step(j, carry, masked: bool):
                acc, m, l, p16 = carry
                slot, prev = lax.rem(j, stages), lax.rem(j - 1, stages)
                plgpu.barrier_wait(k_ready.at[slot])
                plgpu.barrier_wait(v_ready.at[prev])

                def body(s_ref, acc_ref):
                    acc_ref[...] = acc
                    plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                    plgpu.wgmma(acc_ref, p16, v_smem.at[prev])
                    schedule_turn()
                    # Masked tiles (the diagonal, the tail) wait for P V first: the mask's
                    # index arrays beside P_{j-1} and the in-flight acc would not fit in
                    # the registers. Unmasked tiles, the bulk, overlap.
                    s = plgpu.wgmma_accumulator_load(s_ref, wait_n=0 if masked else 1)
                    plgpu.barrier_arrive(k_free.at[slot])
                    if masked:
                        acc_new = plgpu.wgmma_accumulator_load(acc_ref, wait_n=None)
                        plgpu.barrier_arrive(v_free.at[prev])
                        s = mask_scores(s, j, q_start)
                    m_new, alpha, p = online_softmax(s, m, masked)
                    l_new = l * alpha + p.sum(axis=1)
                    p16_new = p.astype(dtype)
                    if not masked:
                        acc_new = plgpu.wgmma_accumulator_load(acc_ref, wait_n=0)
                        plgpu.barrier_arrive(v_free.at[prev])
                    schedule_turn()
                    return acc_new * lax.broadcast_in_dim(alpha, acc_new.shape, [0]), m_new, l_new, p16_new

                return pl.run_scoped(
                    body, plgpu.ACC((block_q, block_kv), jnp.float32), plgpu.ACC((block_q, head_dim), jnp.float32)
                )

            unmasked_end = _at_least_one(full_end)
            carry = (acc, m, l, p16)
            carry = loop(1, unmasked_end, lambda j, c: step(j, c, masked=False), carry)
            acc, m, l, p16 = loop(unmasked_end, end, lambda j, c: step(j, c, masked=True), carry)

            last = lax.rem(end - 1, stages)
            plgpu.barrier_wait(v_ready.at[last])
            acc = pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, p16, v_smem.at[last]))(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_free.at[last])
            return acc, m, l

        @pl.when(wg < COMPUTE_WGS)
        def _consumer():
            plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
            qo_smem, lse_smem = qo_smem2.at[wg], lse_smem2.at[wg]
            q_start = cta_q + wg * block_q
            end, full_end = kv_range(q_start, block_q)
            if t.overlap:
                end = _at_least_one(end)

            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q_start, block_q), h], qo_smem, q_ready.at[wg])
            plgpu.barrier_wait(q_ready.at[wg])

            m = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            l = plgpu.layout_cast(jnp.full((block_q,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            acc = plgpu.layout_cast(jnp.full((block_q, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)

            # Offset the two consumers by half a step: wg 1 starts one turn late. Both
            # loops take two turns per key tile.
            pl.when(wg == 1)(schedule_turn)
            key_loop = overlapped_loop if t.overlap else synchronous_loop
            acc, m, l = key_loop(acc, m, l, q_start, end, full_end, qo_smem)

            # The producer loads the CTA's key range (the longer of the two tiles' ranges):
            # release the slots this tile does not need and keep the schedule in step.
            def drain(j, _):
                slot = lax.rem(j, stages)
                plgpu.barrier_arrive(k_free.at[slot])
                plgpu.barrier_arrive(v_free.at[slot])
                schedule_turn()
                schedule_turn()

            if t.causal:  # otherwise both tiles visit every key tile
                lax.fori_loop(end, cta_end, drain, None)
            pl.when(wg == 0)(schedule_turn)

            # Rows that saw no key: l = 0 -> o = 0 and lse = m + log2(0) = -inf.
            l_safe = jnp.where(l == 0.0, 1.0, l)
            acc = acc * lax.broadcast_in_dim(1.0 / l_safe, acc.shape, [0])
            qo_smem[...] = acc.astype(dtype)
            lse_smem[...] = m + jnp.log(l) * LOG2E
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(qo_smem, o_ref.at[b, pl.ds(q_start, block_q), h])
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, pl.ds(q_start, block_q)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == COMPUTE_WGS)
        def _producer():
            plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
            kv_h = lax.div(h, group)  # GQA: the query head's kv head; K/V never repeated

            def load(j, slot):
                at = (b, pl.ds(j * block_kv, block_kv), kv_h)
                plgpu.copy_gmem_to_smem(k_ref.at[at], k_smem.at[slot], k_ready.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[at], v_smem.at[slot], v_ready.at[slot])

            for i in range(stages):
                pl.when(i < cta_end)(lambda i=i: load(i, i))

            @pl.loop(stages, jnp.maximum(cta_end, stages))
            def _(j):
                slot = lax.rem(j, stages)
                at = (b, pl.ds(j * block_kv, block_kv), kv_h)
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.copy_gmem_to_smem(k_ref.at[at], k_smem.at[slot], k_ready.at[slot])
                plgpu.barrier_wait(v_free.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[at], v_smem.at[slot], v_ready.at[slot])

    def entry(q_ref, k_ref, v_ref, o_ref, lse_ref):
        tiles = _smem_tiles()
        smem = (
            plgpu.SMEM((COMPUTE_WGS, block_q, head_dim), dtype, transforms=tiles),  # Q in, O out
            plgpu.SMEM((stages, block_kv, head_dim), dtype, transforms=tiles),
            plgpu.SMEM((stages, block_kv, head_dim), dtype, transforms=tiles),
            plgpu.SMEM((COMPUTE_WGS, block_q), jnp.float32),
        )
        ready = (
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=COMPUTE_WGS),
        )
        free = (plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),) * 2
        pl.run_scoped(
            lambda *scoped: kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, scoped),
            smem, ready, free, plgpu.Barrier(num_arrivals=COMPUTE_WGS),
            collective_axes="wg",
        )

    grid, names = grid_spec(q_len // (COMPUTE_WGS * block_q), heads, batch, "q_seq", t.tile_major)
    o, lse2 = plgpu.kernel(
        entry,
        out_type=(q, jax.ShapeDtypeStruct((batch, heads, q_len), jnp.float32)),
        grid=grid,
        grid_names=names,
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        kernel_name="flashjax_mosaic_fwd",  # what profilers show
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(q, k, v)
    return o, lse2

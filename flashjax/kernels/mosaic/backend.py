"""The Hopper backend: pads inputs to whole tiles and runs the Pallas Mosaic GPU kernels.

The kernels want the query length a multiple of two query tiles (one per consumer
warpgroup), the key length a multiple of the key tile and head dims of 64, 128, 192 or
256 (wgmma and the 128-byte swizzle work in 64-column slabs); v's head dim may be smaller
than q's and k's (MLA: 192 / 128). Inputs are
zero-padded here; the kernels' mask spec knows the true lengths and masks the padded
keys, and padded query rows are dropped.

Supported: bfloat16 and float16, causal (bottom-right aligned) or not, a sliding window,
a softcap, ALiBi, q/kv lengths (padding), segment ids (packed documents), attention sinks, an additive bias
and a boolean mask (each [B or 1, H or 1, Tq, Tk]; the mask is folded into the bias as
-inf), dropout (the Triton kernels' keep bits), a score_mod and a mask_mod (with a block
mask narrowing the tile ranges) that read their closed-over arrays at the batch row and
head only, GQA/MQA, any sequence lengths, on an sm90 GPU. `supports` names everything else.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flashjax import backends, flex, masks, sides
from flashjax.kernels import common, extras_grad
from flashjax.kernels.triton import backend as triton_backend
from flashjax.kernels.mosaic import bwd as mosaic_bwd, common as mosaic_common, decode as mosaic_decode, fwd as mosaic_fwd
from flashjax.kernels.mosaic.common import COMPUTE_WGS, OptionalInputs, Tiling
from flashjax.kernels.mosaic.config import HEAD_DIMS, MosaicConfig, device_reasons, padded_head_dim
from flashjax.params import AttentionParams, Call, Extras

# Options besides causal that the kernels implement (through `common.logits`, `mask_tile`
# and the `MaskSpec` ranges).
OPTIONS = ("window", "softcap", "alibi_slopes", "q_lengths", "kv_lengths", "segment_ids", "dropout", "bias", "mask",
           "score_mod", "mask_mod", "block_mask", "sinks")
# The dK/dV kernel keeps a key tile's dK and dV accumulators in registers: a 64-row tile
# of each takes (Dqk + Dv) / 2 float32 registers per thread of a warpgroup. Beside the
# S^T and dP^T tiles, Dqk + Dv = 320 (MLA's 192 + 128) spills a little (280 bytes; 0.90-0.97x
# the plain call's TFLOP/s on an H100). Wider pairs run the kernel split (`mosaic_bwd.dkv`):
# the two consumers share a key tile, one accumulating dV and the other dK.
SPLIT_ABOVE_HEAD_DIM_SUM = 320
# Shared memory a CTA may take on sm90 (227 KB), less a margin for the barriers.
SMEM_BYTES = 227 * 1024 - 1024
H100_SMS = 132


def supports(call: Call) -> list[str]:
    reasons = device_reasons(call.platform, call.compute_capability, call.dtype)
    if call.batch == 0:
        reasons.append("an empty batch (batch 0)")
    v_head_dim = call.v_head_dim or call.head_dim
    too_wide = [f"{name} {dim} > {HEAD_DIMS[-1]}" for name, dim in (("head_dim", call.head_dim), ("v head_dim", v_head_dim))
                if dim > HEAD_DIMS[-1]]
    reasons += too_wide
    if not too_wide and padded_head_dim(v_head_dim) > padded_head_dim(call.head_dim):
        reasons.append(f"v head_dim {v_head_dim} > q/k head_dim {call.head_dim} (the kernels write O through Q's "
                       "shared memory)")
    reasons += [f"{option} (not in the Hopper kernels yet)" for option in call.options() if option not in OPTIONS]
    return reasons + _pair_array_reasons(call) + _mod_reasons(call)


@functools.cache
def _lowered_primitives() -> frozenset:
    """The primitives Pallas' Mosaic GPU lowering has a rule for (on warpgroup arrays); read
    once, when the first call with a mod asks."""
    from jax._src.pallas.mosaic_gpu import lowering

    rules = lowering.mosaic_lowering_rules[(lowering.mgpu.LoweringSemantics.Lane, lowering.gpu_core.PrimitiveSemantics.Warpgroup)]
    return frozenset(primitive.name for primitive in rules)


# Primitives with a Mosaic GPU lowering rule that still fail on a tile in the wgmma layout
# (JAX 0.11.2): no layout inference rule for math.erf / math.atan2, no floating-point % on
# a FragmentedArray. None: every dtype.
_UNLOWERED_ON_TILES = {"erf": None, "atan2": None, "rem": ("bfloat16", "float16", "float32")}


def _unlowered(mod: flex.Mod, derivative: bool) -> list[str]:
    """The primitives of `mod` (of its derivative program, with `derivative`) Mosaic GPU does
    not lower on a score tile."""
    missing = set(mod.primitives(derivative) - _lowered_primitives())
    for name, dtype in mod.typed_primitives(derivative):
        if name in _UNLOWERED_ON_TILES:
            dtypes = _UNLOWERED_ON_TILES[name]
            if dtypes is None or dtype in dtypes:
                missing.add(name)
    return sorted(missing) + mod.unlowered_forms(derivative, "mosaic")


def _kernel_mods(call: Call) -> list[tuple[str, flex.Mod | str]]:
    """(name, the mod the kernels evaluate on a wgmma score tile, or why they cannot) for each
    of the call's mods: a closed-over array read at a position-dependent index (a gather per
    row, column or score, which Mosaic GPU has no instruction for; reads at the batch row and
    head are one scalar load per tile) must be moved out of the kernel by `sides.split`."""
    mods = []
    for name, mod in flex.call_mods(call):
        if why := flex.unreadable_reason(name, mod):
            mod = why
        elif mod.position_reads:
            split = sides.split(mod)
            why = split if isinstance(split, str) else None
            if why is None and "segment_ids" in call.arrays:
                why = "segment_ids take the kernels' one vector per row and column"
            if why is not None:
                mod = (f"{name} reads the closed-over {' and '.join(mod.position_reads)} at an index that "
                       f"depends on q_idx, kv_idx or the score, and {why} (the Triton kernels gather)")
            else:
                mod = split
        mods.append((name, mod))
    return mods


def _mod_reasons(call: Call) -> list[str]:
    """Why the kernels cannot evaluate the call's score_mod / mask_mod on a score tile
    (`_kernel_mods`), or use a primitive Mosaic GPU does not lower."""
    reasons = []
    for name, mod in _kernel_mods(call):
        if isinstance(mod, str):
            reasons.append(mod)
        elif missing := _unlowered(mod, derivative=False):
            reasons.append(f"{name} uses {', '.join(missing)}, which Mosaic GPU does not lower")
    return reasons


def supports_backward(call: Call) -> list[str]:
    """Why the backward kernels cannot take `call` where the forward ones can: a score_mod
    whose derivative they cannot trace or lower."""
    reasons = flex.kernel_backward_reasons(call)
    for name, mod in _kernel_mods(call) if not reasons else ():
        if not isinstance(mod, str) and (missing := _unlowered(mod, derivative=True)):
            reasons.append(f"{name}'s derivative uses {', '.join(missing)}, which Mosaic GPU does not lower")
    return reasons


def _pair_array_reasons(call: Call) -> list[str]:
    """Why the kernels cannot take the call's bias and mask: they read one array of [Tq, Tk]
    tiles in the inputs' dtype (the mask folded into the bias)."""
    if not call.pair_arrays:
        return []
    names = " and ".join(name for name, _, _ in call.pair_arrays)
    reasons = []
    if max(call.head_dim, call.v_head_dim or 0) > 128:
        reasons.append(f"{names} at head_dim {call.head_dim} > 128 (read as bias tiles, a mask folded into them, "
                       "which beside K/V exceed shared memory)")
    broadcast = [name for name, shape, _ in call.pair_arrays if shape[2:] != (call.seq_q, call.seq_k)]
    if broadcast:
        reasons.append(f"{' and '.join(broadcast)} broadcast along q_len or kv_len (the kernels read [Tq, Tk] "
                       "tiles; for padding pass q_lengths / kv_lengths)")
    for name, _, dtype in call.pair_arrays:
        if name == "bias" and dtype != jnp.dtype(call.dtype).name:
            reasons.append(f"a {dtype} bias with {jnp.dtype(call.dtype).name} inputs (the kernels read the bias in "
                           "the inputs' dtype: cast it to use them)")
    if len(call.pair_arrays) == 2:
        (_, bias_shape, _), (_, mask_shape, _) = call.pair_arrays
        combined = tuple(max(a, b) for a, b in zip(bias_shape, mask_shape))
        if combined not in (bias_shape, mask_shape):
            reasons.append(f"bias {bias_shape} and mask {mask_shape} broadcast to {combined}, larger than either "
                           "(the kernels take them as one array)")
    return reasons


def default_config(call: Call) -> MosaicConfig:
    return MosaicConfig.default(call.head_dim, v_head_dim=call.v_head_dim)


def _has_ranges(extras: Extras) -> bool:
    """Lengths, segment ids, a block mask or a mask shared by the heads: the kernels take
    per-tile ranges."""
    return (any(a is not None for a in (extras.q_lengths, extras.kv_lengths, extras.q_segment_ids, extras.block_mask))
            or _mask_skips_tiles(extras))


def _dense(params: AttentionParams, extras: Extras) -> bool:
    """Whether every query row sees every key: no causal mask, window, mask_mod, lengths,
    segment ids, block mask or mask (`MosaicConfig.bwd_block_q_dense`)."""
    return (not params.causal and params.window is None and params.mask_mod is None and not _has_ranges(extras)
            and extras.mask is None)


def _mask_skips_tiles(extras: Extras) -> bool:
    """A boolean mask [B or 1, 1, Tq, Tk] narrows the tile ranges (the ranges are per batch
    row, not per head: a per-head mask is applied pair by pair on every tile)."""
    return extras.mask is not None and extras.mask.shape[1] == 1


def _mask_tile_flags(mask, block_q: int, block_k: int, q_len: int, k_len: int):
    """(meets, full) bool [B or 1, 1, q_len / block_q, k_len / block_k] of a boolean mask
    [B or 1, 1, Tq, Tk]: the tiles with a True pair, and those with no False one (padding
    counts as neither). One read of the mask; nothing of its size is written."""
    rows, cols = mask.shape[2:]
    widths = ((0, 0), (0, 0), (0, q_len - rows), (0, k_len - cols))
    tiles = lambda x: x.reshape(x.shape[:2] + (q_len // block_q, block_q, k_len // block_k, block_k))
    meets = tiles(jnp.pad(mask, widths, constant_values=False)).any(axis=(3, 5))
    full = tiles(jnp.pad(mask, widths, constant_values=True)).all(axis=(3, 5))
    return meets, full


def _block_flags(extras: Extras, block_q: int, block_k: int, q_len: int, k_len: int):
    """(meets, full) bool [B or 1, 1, q_len / block_q, k_len / block_k] of the tiles that the
    mask shared by the heads and the block mask leave non-empty / entirely visible, or None
    without either. The ranges are per batch row, so a block mask that differs per head
    counts a tile as non-empty where any head's is, and full where every head's is."""
    flags = []
    if _mask_skips_tiles(extras):
        flags.append(_mask_tile_flags(extras.mask, block_q, block_k, q_len, k_len))
    if extras.block_mask is not None:
        meets, full = flex.tile_flags(extras.block_mask, block_q, block_k, q_len // block_q, k_len // block_k)
        flags.append((meets.any(axis=1, keepdims=True), full.all(axis=1, keepdims=True)))
    if not flags:
        return None
    meets, full = flags[0]
    for other_meets, other_full in flags[1:]:
        meets, full = meets & other_meets, full & other_full
    return meets, full


def _tiling(params: AttentionParams, extras: Extras, seq_q: int, seq_k: int, block_q: int, block_kv: int,
            stages: int) -> Tiling:
    mask_mod = params.mask_mod
    if mask_mod is not None and mask_mod.position_reads:
        # Its reads per row and per column travel as the segment ids do (`supports` checked).
        mask_mod = sides.split(mask_mod)
    return Tiling(block_q=block_q, block_kv=block_kv, stages=stages, spec=params.mask_spec(seq_q, seq_k),
                  scale=params.scale, softcap=params.softcap, alibi=extras.alibi_slopes is not None,
                  ranges=_has_ranges(extras),
                  segments=extras.q_segment_ids is not None or (mask_mod is not None and bool(mask_mod.sides)),
                  dropout_rate=params.dropout_rate, broadcast_dropout=params.broadcast_dropout,
                  bias=extras.bias is not None or extras.mask is not None,
                  score_mod=params.score_mod, mask_mod=mask_mod, sinks=extras.sinks is not None)


def _kernel_bias(extras: Extras, dtype, q_len: int, k_len: int):
    """The kernels' bias input: the bias with the boolean mask folded in as -inf, in the
    inputs' dtype, zero-padded to [Bb, Hb, q_len, k_len] (padded keys are masked by the
    lengths, padded query rows dropped); None without either. Every kernel reads it as it
    is (the dK/dV kernel transposes its tiles as it loads them into registers)."""
    bias, mask = extras.bias, extras.mask
    if bias is None and mask is None:
        return None
    if mask is None:
        combined = bias.astype(dtype)
    else:
        combined = jnp.where(mask, jnp.zeros((), dtype) if bias is None else bias.astype(dtype), -jnp.inf).astype(dtype)
    widths = ((0, 0), (0, 0), (0, q_len - combined.shape[2]), (0, k_len - combined.shape[3]))
    return jnp.pad(combined, widths)


class TileInputs(NamedTuple):
    """A kernel's inputs derived from the call's lengths, segment ids, mask and block mask
    (`_tile_inputs`); None where the tiling takes none. `ranged_items`: the forward's
    `fwd.item_tiles` where `prepare` found the ranges constant."""

    ranges: Any = None
    q_segment_ids: Any = None
    kv_segment_ids: Any = None
    pair_order: Any = None
    ranged_items: "ItemTiles | None" = None


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class ItemTiles:
    """The persistent forward's cost of each item (`fwd.item_tiles`, int [n_pairs][batch]),
    computed at trace time from constant ranges. A static pytree node: it crosses the
    custom_vjp in the call's structure, where an array would arrive traced."""

    tiles: tuple

    def array(self) -> np.ndarray:
        return np.asarray(self.tiles, np.int64)


def _optional(extras: Extras, t: Tiling, batch: int, seq_q: int, seq_k: int, q_len: int, k_len: int, dtype, *,
              by_key_block: bool = False, kernel: str = "") -> OptionalInputs:
    """The kernels' optional inputs at tiling `t` on inputs padded to q_len / k_len: the ALiBi
    slopes, the `_tile_inputs` (those `prepare` computed for `kernel`, if it did), the bias
    with the mask (`_kernel_bias`), and the arrays score_mod and mask_mod close over."""
    tiles = (extras.tile_inputs or {}).get(kernel)
    if tiles is None:
        tiles = _tile_inputs(extras, t, batch, seq_q, seq_k, q_len, k_len, by_key_block=by_key_block)
    return OptionalInputs(slopes=extras.alibi_slopes, sinks=extras.sinks if t.sinks else None, ranges=tiles.ranges,
                          q_segment_ids=tiles.q_segment_ids, kv_segment_ids=tiles.kv_segment_ids,
                          bias=_kernel_bias(extras, dtype, q_len, k_len),
                          dropout_seed=extras.dropout_seed if t.dropout_rate > 0.0 else None,
                          score_consts=extras.score_consts if t.score_mod is not None else None,
                          mask_consts=extras.mask_consts if t.mask_mod is not None else None,
                          pair_order=tiles.pair_order)


def _tile_inputs(extras: Extras, t: Tiling, batch: int, seq_q: int, seq_k: int, q_len: int, k_len: int, *,
                 by_key_block: bool = False) -> TileInputs:
    """The segment ids (`common.pad_segment_ids`), the lengths and segments folded into
    per-tile ranges (`masks.dynamic_ranges`, the Triton kernels' too), by query tile or, for
    the dK/dV kernel, by key tile (narrowed to the tiles a mask shared by the heads and the
    block mask leave non-empty, `_block_flags`), and the order of the query-tile pairs. A
    `sides.split` mask_mod's row and column values take the segment ids' place
    (`Tiling.segments`)."""
    q_seg = kv_seg = ranges = None
    if extras.q_segment_ids is not None:
        q_seg = common.pad_segment_ids(extras.q_segment_ids, q_len)
        kv_seg = common.pad_segment_ids(extras.kv_segment_ids, k_len)
    if t.ranges:
        ranges = masks.dynamic_ranges(
            batch=batch, seq_q=seq_q, seq_k=seq_k, block_q=t.block_q, block_k=t.block_kv, padded_q=q_len, padded_k=k_len,
            q_lengths=extras.q_lengths, kv_lengths=extras.kv_lengths, q_segment_ids=q_seg, kv_segment_ids=kv_seg,
            by_key_block=by_key_block,
            # Tiles the masks leave empty are never loaded; those they leave full are unmasked.
            blocks=_block_flags(extras, t.block_q, t.block_kv, q_len, k_len),
        )
    if t.mask_mod is not None and t.mask_mod.sides:
        q_seg, kv_seg = sides.values(t.mask_mod, extras.mask_consts, batch, q_len, k_len)
    order = None
    if not by_key_block and mosaic_common.takes_pair_order(t):
        order = mosaic_common.pair_order(ranges, t.spec, t.block_q, t.block_kv, k_len // t.block_kv)
    return TileInputs(ranges, q_seg, kv_seg, order)


def prepare(q, k, v, extras: Extras, params: AttentionParams, config: MosaicConfig) -> Extras:
    """The registry's hook before the custom_vjp: a mask_mod's block mask, built once for the
    forward and the backward at the finest of the kernels' tiles (each kernel re-tiles it
    exactly, `flex.tile_flags`): one evaluation of mask_mod per tile pair; then each
    kernel's `_tile_inputs`. Those are computed at trace time where their inputs are
    constants (a block mask built once outside `jit` and passed as `block_mask`, as
    FlexAttention users build theirs): the compiled call then reads them and computes
    nothing around the kernels. A direct kernel call builds both in `forward` / `backward`."""
    if extras.tile_inputs is not None:
        return extras
    batch, seq_q, seq_k = q.shape[0], q.shape[1], k.shape[1]
    # Built when the call is traced where it is constant and the Hopper kernels take it both
    # ways (they compute their tile inputs from it then too; another backend's would read it
    # in XLA ops, which XLA's compiler folds slowly on a large constant).
    both_ways = all(backend == BACKEND.name for backend in (params.backend, params.backward_backend))
    extras = flex.with_block_mask(extras, params.mask_mod, q.shape, seq_k, min(config.block_q, config.bwd_block_q),
                                  min(config.block_kv, config.bwd_block_kv, config.dq_block_kv), at_trace_time=both_ways)
    tiles = {}
    # Not around the block mask's build: it may run a Pallas kernel, whose body must be traced.
    with jax.ensure_compile_time_eval():
        if params.backend == BACKEND.name and isinstance(params.config, MosaicConfig):
            t, q_len, k_len = _forward_tiling(q, k, v, extras, params, params.config)
            tiles["fwd"] = _ranged_items(_tile_inputs(extras, t, batch, seq_q, seq_k, q_len, k_len), t, batch, q_len,
                                         k_len, _forward_schedule(params.config, params, t) == "overlap")
        if params.backward_backend == BACKEND.name and isinstance(params.backward_config, MosaicConfig):
            bt = _backward_tilings(q, k, v, extras, params, params.backward_config)
            tiles["dkv"] = _tile_inputs(extras, bt.dkv, batch, seq_q, seq_k, bt.q_len, bt.k_len, by_key_block=True)
            tiles["dq"] = _tile_inputs(extras, bt.dq, batch, seq_q, seq_k, bt.q_len, bt.k_len)
    return extras._replace(tile_inputs=tiles)


def _ranged_items(tiles: TileInputs, t: Tiling, batch: int, q_len: int, k_len: int, overlap: bool) -> TileInputs:
    """The forward's tile inputs, with `ranged_items` where its ranges (and pair order) are
    constants of a program being staged (`jit`): a block mask built outside it, segment ids
    given as NumPy arrays. The persistent forward then balances its items by them
    (`forward_ctas`). They become part of the kernels' cache key: a new mask recompiles the
    kernels, as it recompiles the caller's program around them anyway. Outside `jit` (an
    eager `jax.grad` or `jax.vmap`, a new mask each step) they stay operands of one compiled
    call, on the per-item grid."""
    if tiles.ranges is None or any(isinstance(x, jax.core.Tracer) for x in (tiles.ranges, tiles.pair_order)):
        return tiles
    if not _staged():
        return tiles
    opt = OptionalInputs(ranges=tiles.ranges, pair_order=tiles.pair_order)
    n_pairs = q_len // (COMPUTE_WGS * t.block_q)
    items = mosaic_fwd.item_tiles(t, opt, batch, n_pairs, k_len // t.block_kv, overlap)
    return tiles._replace(ranged_items=ItemTiles(tuple(map(tuple, items.tolist()))))


def _staged() -> bool:
    """Whether the caller's trace is being staged into a program (`jit`, `jax.checkpoint`):
    JAX 0.11's internal `unsafe_am_i_under_a_jit`; False where it is missing."""
    from jax._src import core as jax_core

    under_jit = getattr(jax_core, "unsafe_am_i_under_a_jit", None)
    return bool(under_jit and under_jit())


def _drop_padded_rows(o, lse, q_lengths):
    """Query rows at or past a batch row's q length output 0 with lse -inf (the kernels
    compute them as rows like any other)."""
    if q_lengths is None:
        return o, lse
    valid = jnp.arange(o.shape[1], dtype=jnp.int32)[None, :] < q_lengths.astype(jnp.int32)[:, None]
    return jnp.where(valid[:, :, None, None], o, 0.0).astype(o.dtype), jnp.where(valid[:, None, :], lse, -jnp.inf)


def _forward_schedule(config: MosaicConfig, params: AttentionParams, t: Tiling) -> str:
    """The config's schedule; "auto" with a bias, a score_mod or a mask_mod is "pingpong": the
    overlapped loop keeps the next P V product's accumulator in registers beside the score
    tile, with no room left for the bias tile or the mods' position tiles, and it waits for
    P V on every masked tile (a mask_mod's partial tiles; measured on an H100, pingpong is
    5-25% faster there, benchmarks/results/mosaic-notes.md)."""
    if config.fwd_schedule == "auto" and (t.bias or t.score_mod is not None or t.mask_mod is not None):
        return "pingpong"
    return config.forward_schedule(params.causal)


def _key_length(k, page_table) -> int:
    """Keys per batch row: k's, or with a page table (k a pool of pages) its pages' keys."""
    return k.shape[1] if page_table is None else page_table.shape[1] * k.shape[1]


def _forward_tiling(q, k, v, extras: Extras, params: AttentionParams, config: MosaicConfig,
                    page_table=None) -> tuple[Tiling, int, int]:
    """The forward kernel's tiling, and the lengths it pads the queries and keys to; with
    `page_table` (k a pool of pages of a multiple of 64 keys), key tiles that divide a page."""
    seq_q, seq_k = q.shape[1], _key_length(k, page_table)
    # Short key sequences: a smaller key tile wastes less work on padding.
    block_kv = min(config.block_kv, common.round_up(seq_k, 64))
    if page_table is not None:
        block_kv = math.gcd(block_kv, k.shape[1])
    t = _tiling(params, extras, seq_q, seq_k, config.block_q, block_kv, config.stages)
    if t.bias and padded_head_dim(q.shape[3]) == 128 and t.block_kv > 64:
        # The bias ring beside the K/V ring: 128-key tiles of both exceed shared memory at
        # head dim 128; 64-key tiles fit with a stage more.
        t = dataclasses.replace(t, block_kv=64, stages=t.stages + 1)
    return t, common.round_up(seq_q, COMPUTE_WGS * t.block_q), common.round_up(seq_k, t.block_kv)


def persistent_forward_smem_bytes(t: Tiling, dim: int, v_dim: int, itemsize: int) -> int:
    """Shared memory of the persistent forward kernel at tiling `t` (padded head dims): the
    query tiles, the K/V ring, the rows' lse, the bias ring, the segment ids' scratch and the
    output tiles, each rounded up to 1 KB, and 2 KB for the barriers and the alignment of
    the scoped allocations (head dim 64 with a bias: 232,592 bytes in the sm_90 lowering
    against 229,888 in buffers)."""
    rows = COMPUTE_WGS * t.block_q
    buffers = [rows * dim * itemsize, t.stages * t.block_kv * dim * itemsize, t.stages * t.block_kv * v_dim * itemsize,
               rows * 4]
    if t.bias:
        buffers.append(t.stages * rows * t.block_kv * itemsize)
    if t.segments:
        buffers += [rows * 4, t.stages * t.block_kv * 4]
    buffers.append(rows * v_dim * itemsize)  # O's own tiles
    return sum(common.round_up(size, 1024) for size in buffers) + 2048


def forward_ctas(config: MosaicConfig, t: Tiling, shape: tuple[int, int, int], dim: int, v_dim: int,
                 itemsize: int, *, ranged_items: bool = False) -> int | None:
    """The forward's persistent grid (`MosaicConfig.fwd_persistent`): one CTA per SM, at most
    one per item of shape (batch, padded q_len, heads); None for one CTA per item: the config
    asks for it, the output tiles do not fit shared memory beside the rings, or the call has
    ranges (lengths, documents, a block mask) without `ranged_items` (`TileInputs`: known at
    trace time, as a block mask built outside `jit` is): the items' work is then known only
    on the device, and the per-item grid's hardware scheduling balances it."""
    if (not config.fwd_persistent or (t.ranges and not ranged_items)
            or persistent_forward_smem_bytes(t, dim, v_dim, itemsize) > SMEM_BYTES):
        return None
    batch, q_len, heads = shape
    items = batch * heads * (q_len // (COMPUTE_WGS * t.block_q))
    # Without a GPU (the sm_90 lowering tests) an H100 SXM's count.
    return min(items, backends.sm_count() or H100_SMS)


class BackwardTilings(NamedTuple):
    """How the backward runs a call: the dK/dV kernel's tiling (and whether its consumers
    split a key tile's dK and dV, `mosaic_bwd.dkv`), the dQ kernel's, and the padded query
    and key lengths."""

    dkv: Tiling
    dq: Tiling
    q_len: int
    k_len: int
    split: bool


def _dq_tile(dim: int, v_dim: int, block_q: int, block_kv: int, stages: int, t: Tiling,
             itemsize: int) -> tuple[int, int, int | None]:
    """(key tile, K stages, V stages or None for as many as K's) of the dQ kernel's ring, fitted
    to shared memory beside its consumers' own Q, dO, lse and delta: the configured key
    tile, halved (to a multiple of 64 keys, down to 64: wgmma's contraction over the 128-byte swizzle) while not
    one stage of it fits, then as many of the configured stages as fit; where only one of
    K and V fits, a second K tile (S = Q K^T, the step's first product, then need not wait
    for the tile's copy)."""
    own = COMPUTE_WGS * block_q * ((dim + v_dim) * itemsize + 2 * 4 + (4 if t.segments else 0))
    if t.segments:
        # The segment ids' scratch (a second allocation group) costs up to 2 KB more than its
        # bytes in alignment (the sm_90 lowering's count at 224 / 192).
        own += 2048

    def stage(keys):
        bias = COMPUTE_WGS * block_q * keys * itemsize if t.bias else 0
        return keys * (dim + v_dim) * itemsize + bias + (keys * 4 if t.segments else 0)

    while block_kv > 64 and own + stage(block_kv) > SMEM_BYTES:
        block_kv = max(64, block_kv // 2 // 64 * 64)  # a multiple of 64 (192 -> 64, not 96)
    fitting = max(1, min(stages, (SMEM_BYTES - own) // stage(block_kv)))
    # Not with segment ids (their ring follows K's): that pairing has not run on a GPU yet.
    if fitting == 1 < stages and not t.segments and own + stage(block_kv) + block_kv * dim * itemsize <= SMEM_BYTES:
        return block_kv, 2, 1
    return block_kv, fitting, None


def _backward_tilings(q, k, v, extras: Extras, params: AttentionParams, config: MosaicConfig) -> BackwardTilings:
    seq_q, seq_k = q.shape[1], k.shape[1]
    dim, v_dim = padded_head_dim(q.shape[3]), padded_head_dim(v.shape[3])
    block_q, block_kv = config.backward_block_q(_dense(params, extras)), config.bwd_block_kv
    t = dataclasses.replace(_tiling(params, extras, seq_q, seq_k, block_q, block_kv, config.bwd_stages), sinks=False)
    split = dim + v_dim > SPLIT_ABOVE_HEAD_DIM_SUM
    cta_keys = block_kv if split else COMPUTE_WGS * block_kv  # the key tiles of one dK/dV CTA
    dq_block_kv = min(config.dq_block_kv, common.round_up(seq_k, 64))
    if t.bias:
        # The bias ring beside the K/V ring: 128-key tiles of both would exceed shared memory.
        dq_block_kv = min(dq_block_kv, 64)
    dq_block_kv, dq_stages, dq_v_stages = _dq_tile(dim, v_dim, block_q, dq_block_kv, config.bwd_stages, t,
                                                    q.dtype.itemsize)
    # The dQ kernel takes query tiles in pairs.
    q_len = common.round_up(seq_q, COMPUTE_WGS * block_q)
    k_len = common.round_up(seq_k, math.lcm(cta_keys, dq_block_kv))
    t_dq = dataclasses.replace(t, block_kv=dq_block_kv, stages=dq_stages, v_stages=dq_v_stages)
    return BackwardTilings(t, t_dq, q_len, k_len, split)


def forward(q, k, v, extras: Extras, params: AttentionParams, config: MosaicConfig, page_table=None):
    """Returns o [B, Tq, H, Dv] and the natural-log lse [B, H, Tq] (-inf for rows that see no key;
    with sinks, the sink's logit).

    With `page_table` (int32 [B, pages], the decode path's paged caches), k and v are pools of
    pages [num_pages, page_size, Hkv, D] read in place, batch row b's keys the pages
    page_table[b] in order; page_size a multiple of 64, kv lengths only (no other option)."""
    extras = prepare(q, k, v, extras, params, config)
    seq_q, seq_k, v_head_dim = q.shape[1], _key_length(k, page_table), v.shape[3]
    dim, v_dim = padded_head_dim(q.shape[3]), padded_head_dim(v_head_dim)
    pad = common.pad_tokens
    t, q_len, k_len = _forward_tiling(q, k, v, extras, params, config, page_table)
    if page_table is None:
        k, v = pad(k, k_len, dim), pad(v, k_len, v_dim)
    else:
        assert dim == q.shape[3] == k.shape[3] and v_dim == v_head_dim, "the pages are read in place: no padding"
    tiles = (extras.tile_inputs or {}).get("fwd")
    ranged_items = tiles.ranged_items if tiles is not None and t.ranges else None
    ctas = None
    if page_table is None:
        ctas = forward_ctas(config, t, (q.shape[0], q_len, q.shape[2]), dim, v_dim, q.dtype.itemsize,
                            ranged_items=ranged_items is not None)
    o, lse2 = mosaic_fwd.forward(
        pad(q, q_len, dim), k, v, t, _forward_schedule(config, params, t),
        _optional(extras, t, q.shape[0], seq_q, seq_k, q_len, k_len, q.dtype, kernel="fwd"),
        ctas=ctas, page_table=page_table, ranged_items=None if ctas is None or ranged_items is None else ranged_items.array(),
    )
    return _drop_padded_rows(o[:, :seq_q, :, :v_head_dim], lse2[:, :, :seq_q] * common.LN2, extras.q_lengths)


def backward(q, k, v, o, lse, do, dlse, extras: Extras, params: AttentionParams, config: MosaicConfig):
    """Returns (dq, dk, dv, Extras(bias=dbias, sinks=dsinks, score_consts=...)) given the forward's
    o and lse and the cotangents of both (the ALiBi slopes get no gradient). dbias (float32, in
    the bias's broadcast shape) comes from the Triton backend's dbias kernel, the gradients of
    the float arrays score_mod closes over from its XLA computation (`score_consts_grad`):
    separate computations that XLA drops when those gradients are not used. dsinks is a sum
    over the rows of lse and delta (`sinks_grad`); the kernels need no sinks, the lse holds them."""
    extras = prepare(q, k, v, extras, params, config)
    seq_q, seq_k, head_dim, v_head_dim = q.shape[1], k.shape[1], q.shape[3], v.shape[3]
    dim, v_dim = padded_head_dim(head_dim), padded_head_dim(v_head_dim)
    t, t_dq, q_len, k_len, split = _backward_tilings(q, k, v, extras, params, config)
    lse2, delta = common.backward_rows(o, do, lse, dlse, q_len)
    pad = common.pad_tokens
    qp, dop = pad(q, q_len, dim), pad(do.astype(q.dtype), q_len, v_dim)
    kp, vp = pad(k, k_len, dim), pad(v, k_len, v_dim)
    dk, dv = mosaic_bwd.dkv(qp, kp, vp, dop, lse2, delta, t,
                            _optional(extras, t, q.shape[0], seq_q, seq_k, q_len, k_len, q.dtype, by_key_block=True,
                                      kernel="dkv"), split=split)
    dq = mosaic_bwd.dq(qp, kp, vp, dop, lse2, delta, t_dq,
                       _optional(extras, t_dq, q.shape[0], seq_q, seq_k, q_len, k_len, q.dtype, kernel="dq"))
    dq = dq[:, :seq_q, :, :head_dim]
    dbias = score_consts = dsinks = None
    if extras.bias is not None:
        dbias = triton_backend.bias_gradient(q, k, v, o, lse, do, dlse, extras, params)
    if extras.score_consts is not None:
        score_consts = extras_grad.score_consts_grad(q, k, v, do, lse, delta[:, :, :seq_q], extras, params)
    if extras.sinks is not None:
        dsinks = extras_grad.sinks_grad(extras.sinks, lse, delta[:, :, :seq_q])
    return (dq, dk[:, :seq_k, :, :head_dim], dv[:, :seq_k, :, :v_head_dim],
            Extras(bias=dbias, sinks=dsinks, score_consts=score_consts))


BACKEND = backends.Backend(
    name="mosaic",
    description="Pallas Mosaic GPU kernels for Hopper (wgmma, TMA, warp specialisation)",
    config_type=MosaicConfig,
    supports=supports,
    supports_backward=supports_backward,
    default_config=default_config,
    forward=forward,
    backward=backward,
    # Split-KV decoding on the forward kernel (kernels/mosaic/decode.py), for large caches.
    decode=backends.Decoder(supports=mosaic_decode.supports, run=functools.partial(mosaic_decode.decode, forward=forward),
                            declines=mosaic_decode.declines),
    prepare=prepare,
)

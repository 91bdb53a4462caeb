"""The Triton kernels' shared pieces: matrix products, tile reads, scoring, the online-softmax step and tile loops."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from flashjax import dropout, flex, masks
from flashjax.kernels.common import LOG2E
from flashjax.masks import BlockRange, MaskSpec


def dot(a, b, *, trans_b: bool = False, precision=None):
    """2-D matrix product with float32 accumulation (a Triton `tt.dot`); `trans_b` multiplies by b^T."""
    contract_b = 1 if trans_b else 0
    return lax.dot_general(
        a, b, (((1,), (contract_b,)), ((), ())),
        precision=precision, preferred_element_type=jnp.float32,
    )


def dot_precision(dtype) -> lax.Precision | None:
    """float32 inputs ask for full precision: Triton would otherwise round to tf32."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def pair_tile(ref, lead, q_index, k_index):
    """A [bq or 1, bk or 1] tile of a broadcastable (mask or bias) ref.

    `ref` has 2 trailing axes (queries, keys) after 0-2 leading ones (batch, head),
    indexed by the last entries of `lead`. A size-1 axis is broadcast and read
    whole; an index of None reads the whole axis (already tiled by the BlockSpec).
    """
    n_lead = len(ref.shape) - 2
    lead = tuple(lead)[len(lead) - n_lead:] if n_lead else ()
    index = tuple(i if ref.shape[a] > 1 else 0 for a, i in enumerate(lead))
    rows, cols = ref.shape[-2], ref.shape[-1]
    index += (
        slice(None) if rows == 1 or q_index is None else q_index,
        slice(None) if cols == 1 or k_index is None else k_index,
    )
    return ref[index]


@dataclasses.dataclass(frozen=True)
class Scorer:
    """Turns a tile of q.k products into base-2 logits, applying every variant.

    The order is: scale, score_mod, softcap, bias and ALiBi, then the mask (-inf). The
    dataclass is static; per-tile arrays come in as arguments.
    """

    spec: MaskSpec
    scale: float
    softcap: float | None = None
    dropout_rate: float = 0.0
    broadcast_dropout: bool = False
    score_mod: Any = None  # flex.Mod
    mask_mod: Any = None

    @property
    def additive_mod(self) -> bool:
        """Whether the score_mod's term enters the logits as a bias does (`flex.term_as_bias`)."""
        return flex.term_as_bias(self.score_mod, self.softcap)

    def mod_args(self, x, batch, head, *, grad: bool = False) -> flex.KernelMods | None:
        """The user functions at one (batch, head) in a kernel with optional inputs `x`, for
        `logits(..., grad=grad)` and `mask` (`flex.kernel_mods`: what they read at (batch,
        head) alone is evaluated here, before the caller's loop over tiles)."""
        return flex.kernel_mods(self.score_mod, x.score_consts, self.mask_mod, x.mask_consts, batch, head,
                                lowering="triton", grad=grad, term_factor=LOG2E if self.additive_mod else None)

    def logits(self, qk, rows, cols, *, bias=None, slope=None, mod: flex.KernelMods | None = None, grad: bool = False):
        """Returns (s2, chain): base-2 logits, and what `logit_grad` needs: tanh(.) of the softcap
        and, with `grad`, score_mod's derivative in the score (each None when absent)."""
        mod_slope = None
        if self.additive_mod:
            # An additive mod's term enters the base-2 logits as a bias does: one multiply-add
            # per score, and no derivative (it is 1).
            t = None
            s = qk * (self.scale * LOG2E) + mod.score.tile(rows, cols, shape=qk.shape)
        elif self.score_mod is not None:
            if grad:
                score, mod_slope = mod.score.tile(qk * self.scale, rows, cols)
            else:
                score = mod.score.tile(qk * self.scale, rows, cols)
            t = None if self.softcap is None else jnp.tanh(score * (1.0 / self.softcap))
            s = score * LOG2E if t is None else t * (self.softcap * LOG2E)
        elif self.softcap is not None:
            t = jnp.tanh(qk * (self.scale / self.softcap))
            s = t * (self.softcap * LOG2E)
        else:
            t = None
            s = qk * (self.scale * LOG2E)
        if bias is not None:
            s = s + masks.bias_logits(bias.astype(jnp.float32)) * LOG2E
        if slope is not None:
            distance = jnp.abs(rows + self.spec.offset - cols).astype(jnp.float32)
            s = s - (slope * LOG2E) * distance
        return s, (t, mod_slope)

    def mask(self, s, rows, cols, *, kv_length=None, q_seg=None, kv_seg=None, dense=None, mod: flex.KernelMods | None = None):
        """-inf where the pair does not attend (only called on boundary tiles).

        rows and cols broadcast against each other ([bq, 1] x [1, bk], or the
        transposed [1, bq] x [bk, 1]); segment ids follow the same orientation.
        """
        allowed = self.spec.allowed(rows, cols, kv_length)
        if q_seg is not None:
            allowed = allowed & (q_seg.reshape(rows.shape) == kv_seg.reshape(cols.shape))
        if dense is not None:
            allowed = allowed & (dense != 0)
        if self.mask_mod is not None:
            allowed = allowed & mod.mask.tile(rows, cols)
        return jnp.where(allowed, s, -jnp.inf)

    def logit_grad(self, ds, chain):
        """From d/d logits to d/d (scale * q.k): through the softcap, d(c tanh(x / c))/dx = 1 - tanh^2,
        and through score_mod, its derivative in the score."""
        t, mod_slope = chain
        if t is not None:
            ds = ds * (1.0 - t * t)
        if mod_slope is not None:
            # dS is 0 where a pair is masked or weightless; score_mod's derivative there may
            # be anything (inf at a -inf score), so it must not multiply in.
            ds = jnp.where(ds == 0.0, 0.0, ds * mod_slope)
        return ds

    # ---- dropout ----------------------------------------------------------------------
    @property
    def keep_scale(self) -> float:
        """The factor of a kept weight: `flashjax.dropout.keep_scale` (1 / P(keep))."""
        return dropout.keep_scale(self.dropout_rate)

    def dropout_base(self, seed_ref, batch, head, heads: int):
        """The random stream of one (batch, head); one shared stream with broadcast_dropout."""
        if self.dropout_rate == 0.0:
            return None
        stream = 0 if self.broadcast_dropout else batch * heads + head
        return dropout.stream_base(seed_ref[0], seed_ref[1], stream)

    def keep(self, base, rows, cols):
        return dropout.tile_keep(base, rows, cols, dropout.keep_threshold(self.dropout_rate))


class QueryTile(NamedTuple):
    """What a program over one query tile (forward, dQ kernels) reads once, before its key loop."""

    q_block: Any  # the tile's index (programs run the last, heaviest causal tiles first)
    batch: Any
    head: Any
    rows: Any  # int32 [block_q, 1] query positions
    kv_length: Any  # the batch row's key length (with lengths), else None
    q_seg: Any  # int32 [block_q] segment ids, or None
    slope: Any  # this head's ALiBi slope, or None
    drop_base: Any  # this (batch, head)'s dropout stream, or None


def query_tile(scorer: "Scorer", x, *, block_q: int, heads: int) -> QueryTile:
    """The query tile of this program on a grid of (query tile, batch, head); `x` holds the
    kernel's optional input refs (`params.Extras`)."""
    q_block = pl.num_programs(0) - 1 - pl.program_id(0)
    batch, head = pl.program_id(1), pl.program_id(2)
    return QueryTile(
        q_block=q_block,
        batch=batch,
        head=head,
        rows=q_block * block_q + jnp.arange(block_q, dtype=jnp.int32)[:, None],
        kv_length=x.ranges[masks.KV_LENGTH] if x.ranges is not None else None,
        q_seg=x.q_segment_ids[...] if x.q_segment_ids is not None else None,
        slope=x.alibi_slopes[head] if x.alibi_slopes is not None else None,
        drop_base=scorer.dropout_base(x.dropout_seed, batch, head, heads),
    )


def online_softmax_step(acc, m, l, s, v, *, keep=None, v_scale=None, precision=None):
    """One step of FlashAttention's running softmax over a key tile.

    Args:
      acc: unnormalised output [block_q, D] (float32); a tuple of column blocks
        [block_q, D_i] when `v` is one.
      m: running row max [block_q] of the base-2 logits, from `ROW_MAX_START` (finite).
      l: running row sum [block_q] of exp2(s - m).
      s: this tile's base-2 logits [block_q, block_k], -inf where masked (or where an
        infinite input makes them so): a row may have seen no key yet.
      v: this tile's values [block_k, D], or a tuple of their column blocks [block_k, D_i].
      keep: dropout keep mask of the tile; dropped weights still count in l
        (dropout acts on the normalised probabilities).
      v_scale: the values' dequantisation scale (a float8 cache's per page), a scalar or
        per key row [1, block_k]: it multiplies the weights in the P.V product only, so l
        sums the unscaled weights. The weights enter the product's dtype (float16 for a
        float8 cache) as p * v_scale / u, with u the power of two just above the tile's
        largest scale magnitude, and u multiplies the product in float32: a scale far from 1 (1e-8,
        1e5) neither underflows nor overflows float16.

    Returns:
      The updated (acc, m, l).
    """
    # m starts at `ROW_MAX_START`, finite: a row of -inf logits (masked, or from an infinite
    # input) gets p = 0 and alpha = 1 on any tile, with no guard.
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    if keep is not None:
        p = jnp.where(keep, p, 0.0)
    unit = None
    if v_scale is not None:
        unit, inv_unit = power_of_two_above(jnp.max(jnp.abs(v_scale)))
        p = p * (v_scale * inv_unit)

    def product(b):
        out = dot(p.astype(b.dtype), b, precision=precision)
        return out if unit is None else out * unit

    if isinstance(v, tuple):
        acc = tuple(a * alpha[:, None] + product(b) for a, b in zip(acc, v))
    else:
        acc = acc * alpha[:, None] + product(v)
    return acc, m_new, l


def exponent_above(x):
    """The int32 e with x < 2**e <= 2x for a positive normal float32 x (0 gives -126), from
    its bits: exact, and what Triton lowers (it has no frexp)."""
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return lax.shift_right_logical(bits, jnp.int32(23)) - 126


def power_of_two(e):
    """Exactly 2**e (int32 e in [-126, 127]) as float32, built from its bits."""
    return lax.bitcast_convert_type(lax.shift_left(e + 127, jnp.int32(23)), jnp.float32)


def power_of_two_above(x):
    """(u, 1 / u): u the power of two with x < u <= 2x for a positive normal float32 x."""
    e = jnp.clip(exponent_above(x), -126, 126)  # u and 1 / u both normal
    return power_of_two(e), power_of_two(-e)


def visit_tiles(block_range: BlockRange, step, carry, lower_boundary: bool, upper_boundary: bool):
    """Runs `step(i, carry, masked)` over the tiles of a range.

    Tiles [lo, full_lo) and [full_hi, hi) sit on the mask's boundary and are
    computed with the elementwise mask; [full_lo, full_hi) are entirely visible
    and skip it. A side whose boundary can never hold tiles (static knowledge
    from the mask spec: `MaskSpec.kv_boundaries` / `q_boundaries`) is not emitted
    at all, so it costs no code.
    """
    lo, full_lo, full_hi, hi = block_range
    if lower_boundary:
        carry = lax.fori_loop(lo, full_lo, lambda i, c: step(i, c, True), carry)
    carry = lax.fori_loop(full_lo, full_hi, lambda i, c: step(i, c, False), carry)
    if upper_boundary:
        carry = lax.fori_loop(full_hi, hi, lambda i, c: step(i, c, True), carry)
    return carry

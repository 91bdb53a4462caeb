"""Pieces shared by the Pallas kernels: constants, the online-softmax step, tile loops."""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from flashjax.masks import BlockRange

# Kernels work in base 2: exp(x) = exp2(x * log2(e)), and exp2 is a single MUFU
# instruction on NVIDIA GPUs. The logit scale is folded into the same multiply,
# so the kernels' logsumexp is in log2 units (lse2 = lse / ln 2).
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def dot_precision(dtype) -> lax.Precision | None:
    """float32 inputs ask for full precision: Triton would otherwise round to tf32."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def dot(a, b, *, trans_a: bool = False, trans_b: bool = False, precision=None):
    """2-D matrix product with float32 accumulation (a Triton `tt.dot`)."""
    contract_a = 0 if trans_a else 1
    contract_b = 1 if trans_b else 0
    return lax.dot_general(
        a, b, (((contract_a,), (contract_b,)), ((), ())),
        precision=precision, preferred_element_type=jnp.float32,
    )


def online_softmax_step(acc, m, l, s, v, *, masked: bool, precision=None):
    """One step of FlashAttention's running softmax over a key tile.

    Args:
      acc: unnormalised output [block_q, D] (float32).
      m: running row max [block_q] of the base-2 logits.
      l: running row sum [block_q] of exp2(s - m).
      s: this tile's base-2 logits [block_q, block_k], -inf where masked.
      v: this tile's values [block_k, D].
      masked: whether `s` may hold -inf (a boundary tile); then a row may have
        seen no key yet, and m stays -inf.

    Returns:
      The updated (acc, m, l).
    """
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    # A row with no visible key so far keeps m = -inf; shifting by 0 instead keeps
    # exp2(-inf - (-inf)) = NaN out of alpha and p (both become 0).
    m_shift = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
    alpha = jnp.exp2(m - m_shift)
    p = jnp.exp2(s - m_shift[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v, precision=precision)
    return acc, m_new, l


def visit_tiles(block_range: BlockRange, step, carry, *, lower_boundary: bool, upper_boundary: bool):
    """Runs `step(i, carry, masked)` over the tiles of a range.

    Tiles [lo, full_lo) and [full_hi, hi) sit on the mask's boundary and are
    computed with the elementwise mask; [full_lo, full_hi) are entirely visible
    and skip it. A side whose boundary can never hold tiles (static knowledge
    from the mask spec) is not emitted at all, so it costs no code.
    """
    lo, full_lo, full_hi, hi = block_range
    if lower_boundary:
        carry = lax.fori_loop(lo, full_lo, lambda i, c: step(i, c, True), carry)
    carry = lax.fori_loop(full_lo, full_hi, lambda i, c: step(i, c, False), carry)
    if upper_boundary:
        carry = lax.fori_loop(full_hi, hi, lambda i, c: step(i, c, True), carry)
    return carry


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple

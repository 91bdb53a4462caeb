"""How a kernel lowering computes some operations unlike XLA, and how to compute them as
XLA does (JAX 0.11.2's Pallas Triton and Mosaic GPU lowerings).

A score_mod / mask_mod is one program for the reference (XLA) and the kernels
(`flex.Mod.at`). Where a lowering's own rule gives another value on some inputs (a
division by zero that LLVM leaves undefined, a max that ignores NaN, an approximate tanh),
`evaluate` gives the operation's results from other operations whose rules agree with
XLA, so that the kernels never disagree with the reference.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

SHIFTS = (lax.shift_left_p, lax.shift_right_logical_p, lax.shift_right_arithmetic_p)
# The binary operations `evaluate` takes through selects of their operands, where the
# second is a runtime value (a kernel must then give every operand the tile's shape).
SELECTED = (lax.div_p, lax.rem_p, *SHIFTS)
LOG2E = math.log2(math.e)


def tanh_from_exp2(x):
    """tanh as ``1 - 2 / (2**(2 x log2(e)) + 1)``: one exp2 and one division, the Hopper kernels'
    tanh (the built-in softcap's, and a mod's on Mosaic, whose approximate tanh instruction is
    ~1e-3 off relative). Within 2e-7 absolute of tanh with exp2 and division rounded to the
    nearest, ~6e-7 with the GPU's approximate ones; near 0 the absolute error stays but the
    relative one grows (tanh(1e-3) is off by up to ~1e-4 of itself): a logit is off by the
    factor the mod multiplies the tanh by (the cap) times that.
    Odd up to that rounding, +-1 past |x| ~ 9, NaN for NaN."""
    return 1.0 - 2.0 / (jnp.exp2(x * (2.0 * LOG2E)) + 1.0)


def runtime(v) -> bool:
    """Whether a value is only known when the kernel runs (a constant folds in XLA)."""
    return isinstance(v, jax.core.Tracer) or np.ndim(v) > 0


def nan_if_any_nan(out, ins):
    """`out` where no value of `ins` is NaN, NaN where one is (the dtype's own NaN)."""
    for v in ins:
        if runtime(v):
            out = jnp.where(v != v, jnp.asarray(np.nan, out.dtype), out)
        elif np.isnan(v):
            return jnp.full_like(out, np.nan)
    return out


def evaluate(eqn, ins, params, lowering: str) -> list | None:
    """The results of an equation as XLA defines them, where `lowering`'s own rule differs on
    some inputs (JAX 0.11.2), or None where it does not:

    * a float max / min / clamp with a NaN operand: NaN (Triton's maxnumf / minnumf return
      the other operand);
    * an integer division or remainder by zero, and the signed minimum over -1: XLA gives
      -1 (all ones), x, the minimum and 0; both lowerings emit LLVM's sdiv / srem, undefined
      there;
    * a shift by the bit width or more (or a negative amount): 0, or the sign for an
      arithmetic right shift; undefined in LLVM;
    * a number converted to bool: x != 0 (Mosaic keeps the low bit or truncates a float);
    * the sign of a float: NaN for NaN and the zero itself for a zero (Mosaic gives +-1 for
      NaN);
    * tanh on Mosaic, whose kernels compile with approximate math (tanh.approx, ~1e-3
      relative): `tanh_from_exp2`, as the Hopper kernels' built-in softcap, within ~6e-7
      absolute (a form exact relatively near 0 costs a series per score in the kernels'
      issue-bound forward: benchmarks/results/mosaic-notes.md);
    * a float divided by a constant: XLA's algebraic simplifier computes x * (1 / c), the
      reciprocal rounded to the type, where the lowerings divide per element (Mosaic GPU
      an IEEE division, a dozen instructions): the product here too (`score / cap`).
    """
    prim, dtype = eqn.primitive, np.dtype(eqn.invars[0].aval.dtype)
    floating, integer = jnp.issubdtype(dtype, jnp.floating), jnp.issubdtype(dtype, jnp.integer)
    if prim in (lax.max_p, lax.min_p, lax.clamp_p) and floating and lowering == "triton":
        return [nan_if_any_nan(prim.bind(*ins, **params), ins)]
    signed = jnp.issubdtype(dtype, jnp.signedinteger)
    if prim in (lax.div_p, lax.rem_p) and integer and not runtime(ins[1]):
        # A constant divisor: settled here, at no cost where it is neither 0 nor -1.
        x, y = ins[0], int(ins[1])
        if y == 0:
            return [x if prim is lax.rem_p else lax.full_like(x, np.array(-1).astype(dtype))]
        if y == -1 and signed:  # -x wraps the minimum to itself, as XLA's MIN / -1
            return [lax.sub(lax.full_like(x, 0), x) if prim is lax.div_p else lax.full_like(x, 0)]
        return None
    if prim in (lax.div_p, lax.rem_p) and integer:
        x, y = ins
        zero = y == 0
        bad = zero
        if signed:
            bad = bad | ((x == np.iinfo(dtype).min) & (y == -1))  # MIN / 1 = MIN, MIN % 1 = 0: XLA's
        out = prim.bind(x, jnp.where(bad, jnp.ones_like(y), y), **params)
        by_zero = x if prim is lax.rem_p else lax.full_like(out, np.array(-1).astype(dtype))
        return [jnp.where(zero, by_zero, out)]
    if prim in SHIFTS and integer:
        x, y = ins
        bits = dtype.itemsize * 8
        past = (lambda: lax.shift_right_arithmetic(x, lax.full_like(x, bits - 1))) \
            if prim is lax.shift_right_arithmetic_p else (lambda: lax.full_like(x, 0))
        if not runtime(y):  # a constant amount: settled here, at no cost within the width
            return None if 0 <= int(y) < bits else [past()]
        fits = (y < bits) & (y >= 0) if signed else y < bits
        out = prim.bind(x, jnp.where(fits, y, jnp.zeros_like(y)), **params)
        return [jnp.where(fits, out, past())]
    if prim is lax.div_p and floating and runtime(ins[0]) and not runtime(ins[1]):
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            reciprocal = np.asarray(np.asarray(1, dtype) / np.asarray(ins[1], dtype), dtype)
        return [ins[0] * reciprocal]
    if prim is lax.convert_element_type_p and params["new_dtype"] == np.bool_ and dtype != np.bool_:
        return [ins[0] != 0]
    if prim is lax.tanh_p and lowering == "mosaic":
        return [tanh_from_exp2(ins[0])]
    if prim is lax.sign_p and floating:
        x = ins[0]
        return [jnp.where(x > 0, lax.full_like(x, 1), jnp.where(x < 0, lax.full_like(x, -1), x))]
    return None

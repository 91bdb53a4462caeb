"""Block masks by interval evaluation: a traced mask_mod evaluated once per tile pair.

A tile pair is the query positions [q0, q1] against the key positions [k0, k1]. Every
value of the mask_mod's scalar program becomes an interval that holds it at every pair of
the tile (numbers: [lo, hi]; booleans: whether it may be true, whether it may be false),
computed for all tile pairs at once as arrays that broadcast over
[batch, head, query tile, key tile]. The result classifies each tile: EMPTY when the
mask cannot be true anywhere in it, FULL when it cannot be false, else PARTIAL.

Sound, not always tight: a tile called EMPTY or FULL is so at every pair, so the kernels
(which skip EMPTY tiles and leave FULL ones unmasked) compute exactly what the mask says.
Where the intervals lose a relation between values (a product of two terms that depend on
the same index, an index that wraps a period) a tile that is in fact empty or full is
called PARTIAL, and the kernels mask it pair by pair: exact, only slower. On the patterns
masks are made of (comparisons of positions and their offsets, windows, documents as ids
read from an array, prefix lengths, chunks by floor division) the classification is tight.

A read of a closed-over array at an index interval takes the minimum and maximum of the
array over it: exact through a sparse table (O(n log n)) when one index varies over the
tile, the whole array's range when several do. Programs with an operation this module does
not bound return None, and `flex.classify` evaluates every pair instead.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core

from flashjax import flex

__all__ = ["classify"]


class Unsupported(Exception):
    """The program has an operation without an interval rule."""


@dataclasses.dataclass(frozen=True)
class Num:
    """A number in [lo, hi] at every pair of a tile; `point`: it depends on the batch and head
    only, a static fact of the program (its bounds may still differ where a rule widened
    them: `_read` checks); `const`: its value as a NumPy scalar where the program states it
    (a literal), known while tracing."""

    lo: Any
    hi: Any
    point: bool
    const: Any = None
    nan: Any = False  # where a float may be NaN within its bounds (`_may_be_nan`)


@dataclasses.dataclass(frozen=True)
class Bool:
    """A boolean that may be true (`true`) and may be false (`false`) somewhere in a tile."""

    true: Any
    false: Any
    point: bool


@dataclasses.dataclass(frozen=True)
class Array:
    """A closed-over array: only read by `dynamic_slice` at scalar positions."""

    value: Any


def _num(x, point=True, const=None) -> Num:
    x = jnp.asarray(x)
    return Num(x, x, point, const)


def _whole(dtype) -> tuple:
    """The bounds that hold every value of dtype (floats: NaN aside, which `_after_nan`
    tracks)."""
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        return jnp.asarray(info.min, dtype), jnp.asarray(info.max, dtype)
    return jnp.asarray(-jnp.inf, dtype), jnp.asarray(jnp.inf, dtype)


def _is_float(v) -> bool:
    return isinstance(v, Num) and jnp.issubdtype(jnp.result_type(v.lo), jnp.floating)


def _may_be_nan(v: Num):
    """Where a float may be NaN somewhere in the tile: flagged so, or bounded by an infinity
    or NaN (inf - inf and 0 * inf are NaN between finite-looking corners)."""
    return v.nan | ~(jnp.isfinite(v.lo) & jnp.isfinite(v.hi))


def _after_nan(value, hazard):
    """An operation's result where one of its float operands may be NaN (`hazard`): a float
    result may be NaN too (its bounds, min / max / clamp of a NaN, need not say so), an
    integer one (a float converted) any integer, and a comparison either outcome (one with
    NaN is false, ne true, whatever the bounds say)."""
    if isinstance(value, Bool):
        return Bool(value.true | hazard, value.false | hazard, value.point)
    if not isinstance(value, Num):
        return value
    if _is_float(value):
        return dataclasses.replace(value, nan=value.nan | hazard)
    low, high = _whole(jnp.result_type(value.lo))
    return Num(jnp.where(hazard, low, value.lo), jnp.where(hazard, high, value.hi), value.point)


def _without_nan(v: Num) -> Num:
    """A float interval whose bounds came out NaN (0 * inf at a corner) as the whole line, and
    flagged as possibly NaN."""
    if not _is_float(v):
        return v
    unknown = jnp.isnan(v.lo) | jnp.isnan(v.hi)
    lo, hi = _whole(jnp.result_type(v.lo))
    return dataclasses.replace(v, lo=jnp.where(unknown, lo, v.lo), hi=jnp.where(unknown, hi, v.hi), nan=v.nan | unknown)


def _as_num(v) -> Num:
    if isinstance(v, Num):
        return v
    if isinstance(v, Bool):  # bool -> number: 0 / 1
        return Num(jnp.where(v.false, 0, 1), jnp.where(v.true, 1, 0), v.point)
    raise Unsupported("an array used as a number")


def _as_bool(v) -> Bool:
    if isinstance(v, Bool):
        return v
    v = _as_num(v)  # number -> bool: != 0
    return Bool((v.lo != 0) | (v.hi != 0), (v.lo <= 0) & (v.hi >= 0), v.point)


def _is_bool_dtype(aval) -> bool:
    return jnp.dtype(aval.dtype) == jnp.bool_


# ---- the rules -------------------------------------------------------------------------------
def _compare(name, a: Num, b: Num) -> Bool:
    """From the bounds alone; a possibly-NaN float operand is `_after_nan`'s."""
    point = a.point and b.point
    if name == "lt":
        return Bool(a.lo < b.hi, a.hi >= b.lo, point)
    if name == "le":
        return Bool(a.lo <= b.hi, a.hi > b.lo, point)
    if name == "gt":
        return _compare("lt", b, a)
    if name == "ge":
        return _compare("le", b, a)
    meets = (a.lo <= b.hi) & (b.lo <= a.hi)
    same = (a.lo == a.hi) & (b.lo == b.hi) & (a.lo == b.lo)
    if name == "eq":
        return Bool(meets, ~same, point)
    return Bool(~same, meets, point)  # ne


def _corners(f, a: Num, b: Num) -> Num:
    """f over a box, for f monotone in each argument on it: the extremes are at its corners."""
    values = [f(x, y) for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
    lo = hi = values[0]
    for v in values[1:]:
        lo, hi = jnp.minimum(lo, v), jnp.maximum(hi, v)
    return Num(lo, hi, a.point and b.point)


def _no_overflow(result: Num, f, a: Num, b: Num) -> Num:
    """`result` of integer arithmetic f, widened to the whole integer range wherever f at
    the box's corners leaves it in float32 (the wrapped integer bounds would not hold)."""
    if not jnp.issubdtype(jnp.result_type(result.lo), jnp.integer):
        return result
    info = jnp.iinfo(jnp.result_type(result.lo))
    up = lambda x: x.astype(jnp.float32)
    exact = _corners(f, Num(up(a.lo), up(a.hi), a.point), Num(up(b.lo), up(b.hi), b.point))
    # float32 rounding near the limit: a margin of 2^9 (below float32's spacing there is 2^8).
    wraps = (exact.lo < info.min + 512.0) | (exact.hi > info.max - 512.0)
    low, high = _whole(jnp.result_type(result.lo))
    return Num(jnp.where(wraps, low, result.lo), jnp.where(wraps, high, result.hi), result.point)


def _convert(v: Num, dtype) -> Num:
    """v converted to dtype. Conversion is monotone, so the bounds convert, except where an
    integer dtype cannot hold a value of v (a negative int to uint32, int32 to int8): it
    wraps, and the interval widens to the dtype's whole range."""
    if not jnp.issubdtype(dtype, jnp.integer):
        return Num(v.lo.astype(dtype), v.hi.astype(dtype), v.point)
    info = jnp.iinfo(dtype)
    # In float32, with a margin where its spacing exceeds 1 (2^8 near 2^31, as `_no_overflow`).
    margin = lambda limit: 512.0 if abs(int(limit)) >= 2**24 else 0.0
    fits = ((v.lo.astype(jnp.float32) >= float(info.min) + margin(info.min))
            & (v.hi.astype(jnp.float32) <= float(info.max) - margin(info.max)))
    lo = jnp.where(fits, v.lo.astype(dtype), jnp.asarray(info.min, dtype))
    hi = jnp.where(fits, v.hi.astype(dtype), jnp.asarray(info.max, dtype))
    return Num(lo, hi, v.point)


def _divide(a: Num, b: Num, floor: bool) -> Num:
    """a / b (truncated for integers, or floored with `floor`) for a constant nonzero b."""
    c = _known(b)
    if c is None or not np.all(c != 0):
        raise Unsupported("a division by a value not known to be nonzero")
    if jnp.issubdtype(jnp.result_type(a.lo), jnp.integer):
        op = jnp.floor_divide if floor else lax.div
        # min // -1 wraps to min: widened to the whole range, as a sum that wraps.
        return _no_overflow(_corners(op, a, b), jnp.divide, a, b)
    if not floor:
        return _corners(lambda x, y: x / y, a, b)
    # jnp's float floor division floors (x - fmod(x, c)) / c, which can lie one either side
    # of floor(x / c) when x / c rounds across an integer (16 // 0.1 is 159, floor(16 / 0.1)
    # 160), or a few of its ulps off where those exceed 1.
    quotient = _corners(lambda x, y: jnp.floor(x / y), a, b)
    slack = lambda q: 1.0 + jnp.abs(q) * 2.0**-20
    return dataclasses.replace(quotient, lo=quotient.lo - slack(quotient.lo), hi=quotient.hi + slack(quotient.hi),
                               const=None)


def _known(v: Num):
    """v's value as a NumPy array where it is one value known while tracing (a literal of the
    program, or a concrete array: classify runs under jit, where only the literals are
    known), else None."""
    if v.const is not None:
        return np.asarray(v.const)
    try:
        return np.asarray(v.lo) if bool(jnp.all(v.lo == v.hi)) else None
    except jax.errors.ConcretizationTypeError:  # a traced value
        return None


def _modulo(a: Num, b: Num, floor: bool) -> Num:
    """a rem b (sign of a) or, with `floor`, a mod b (sign of b), for a positive constant b."""
    known = _known(b)
    if known is None or not np.all(known > 0):
        raise Unsupported("a remainder by a non-constant or negative divisor")
    c = b.lo
    if jnp.issubdtype(jnp.result_type(a.lo, c), jnp.floating):
        # A float remainder lies in [0, c) (floored) or (-c, c) with a's sign (truncated), up to
        # rounding (-tiny mod c rounds to c): no period bookkeeping, whose floor(x / c) may
        # round otherwise than the remainder.
        nonneg = a.lo >= 0
        lo = jnp.zeros_like(a.lo) if floor else jnp.where(nonneg, 0.0, -c)
        hi = jnp.broadcast_to(c, jnp.shape(a.hi)) if floor else jnp.where(a.hi > 0, c, 0.0)
        return Num(lo.astype(a.lo.dtype), hi.astype(a.lo.dtype), a.point)
    same_period = jnp.floor_divide(a.lo, c) == jnp.floor_divide(a.hi, c)
    if floor:
        lo = jnp.where(same_period, jnp.mod(a.lo, c), 0)
        hi = jnp.where(same_period, jnp.mod(a.hi, c), c - 1)
    else:
        # Truncated remainder: a >= 0 as the floored one; a < 0 in [-(c - 1), 0].
        nonneg = a.lo >= 0
        lo = jnp.where(nonneg, jnp.where(same_period, jnp.mod(a.lo, c), 0), -(c - 1))
        hi = jnp.where(nonneg, jnp.where(same_period, jnp.mod(a.hi, c), c - 1),
                       jnp.where(a.hi >= 0, jnp.minimum(a.hi, c - 1), 0))
    return Num(lo, hi, a.point)


def _select(pred, cases):
    if len(cases) != 2:
        raise Unsupported("select_n with more than two cases")
    pred = _as_bool(pred)
    f, t = cases
    point = pred.point and f.point and t.point
    both, only_true = pred.true & pred.false, pred.true & ~pred.false
    if isinstance(f, Bool) or isinstance(t, Bool):
        f, t = _as_bool(f), _as_bool(t)
        pick = lambda x, y: jnp.where(both, x | y, jnp.where(only_true, y, x))
        return Bool(pick(f.true, t.true), pick(f.false, t.false), point)
    f, t = _as_num(f), _as_num(t)
    lo = jnp.where(both, jnp.minimum(f.lo, t.lo), jnp.where(only_true, t.lo, f.lo))
    hi = jnp.where(both, jnp.maximum(f.hi, t.hi), jnp.where(only_true, t.hi, f.hi))
    return Num(lo, hi, point)


class _RangeTables:
    """Minimum and maximum of a closed-over array over index ranges along one axis (sparse
    tables: level j holds the extremes of the 2^j entries from each position)."""

    def __init__(self):
        self._tables = {}

    def extremes(self, array, axis: int, starts, lo, hi):
        """min and max of array[starts with axis taking lo..hi] (lo <= hi, broadcast arrays)."""
        key = (id(array), axis)
        if key not in self._tables:
            levels_min, levels_max = [array], [array]
            n, width = array.shape[axis], 1
            while 2 * width <= n:
                # Entry i of the next level: the extremes of entries i and i + width of this one
                # (past the end: the last entry, never read by a query).
                pad = [(0, 0)] * array.ndim
                pad[axis] = (0, width)
                ahead = [jnp.pad(lax.slice_in_dim(t[-1], width, n, axis=axis), pad, mode="edge")
                         for t in (levels_min, levels_max)]
                levels_min.append(jnp.minimum(levels_min[-1], ahead[0]))
                levels_max.append(jnp.maximum(levels_max[-1], ahead[1]))
                width *= 2
            self._tables[key] = (jnp.stack(levels_min), jnp.stack(levels_max), array)
        table_min, table_max, _ = self._tables[key]
        length = jnp.maximum(hi - lo + 1, 1).astype(jnp.int32)
        # floor(log2(length)), exactly: the two windows of 2^level from lo and ending at hi
        # cover [lo, hi].
        level = jnp.minimum(31 - lax.clz(length), table_min.shape[0] - 1)
        second = hi - jnp.left_shift(1, level) + 1

        def at(table, position):
            index = list(starts)
            index[axis] = position
            return table[(level, *index)]

        return (jnp.minimum(at(table_min, lo), at(table_min, second)),
                jnp.maximum(at(table_max, lo), at(table_max, second)))


def _read(array: Array, indices: list[Num], tables: _RangeTables) -> Num:
    """array[indices] (a `dynamic_slice` of size 1 everywhere: its start clamped into range)."""
    a = array.value
    clamp = lambda x, n: jnp.clip(x, 0, n - 1)
    los = [clamp(i.lo, n) for i, n in zip(indices, a.shape)]
    his = [clamp(i.hi, n) for i, n in zip(indices, a.shape)]
    varying = [axis for axis, i in enumerate(indices) if not i.point]
    # A point index is one position where its bounds meet; where a rule widened them (an
    # overflow, a conversion that wraps) it may be any: the whole array's range there.
    exact = functools.reduce(jnp.logical_and, [lo == hi for axis, (lo, hi) in enumerate(zip(los, his))
                                               if axis not in varying], jnp.asarray(True))
    whole = lambda lo, hi: Num(jnp.where(exact, lo, jnp.min(a)), jnp.where(exact, hi, jnp.max(a)), not varying)
    if not varying:
        value = a[tuple(los)]
        return whole(value, value)
    if len(varying) == 1:
        return whole(*tables.extremes(a, varying[0], los, los[varying[0]], his[varying[0]]))
    return Num(jnp.min(a), jnp.max(a), False)


def _evaluate(jaxpr, env_values, tables: _RangeTables):
    env = {}

    def read(x):
        if isinstance(x, jex_core.Literal):
            return _as_bool(_num(x.val)) if _is_bool_dtype(x.aval) else _num(x.val, const=np.asarray(x.val))
        return env[x]

    for var, value in zip((*jaxpr.constvars, *jaxpr.invars), env_values):
        env[var] = value
    for eqn in jaxpr.eqns:
        ins = [read(x) for x in eqn.invars]
        name = eqn.primitive.name
        out = _rule(name, eqn, ins, tables)
        outs = out if isinstance(out, tuple) else (out,)
        floats = [v for v in ins if _is_float(v)]
        if floats:
            hazard = functools.reduce(jnp.logical_or, [_may_be_nan(v) for v in floats])
            outs = [_after_nan(v, hazard) for v in outs]
        for var, value in zip(eqn.outvars, outs):
            env[var] = _without_nan(value) if isinstance(value, Num) else value
    return [read(x) for x in jaxpr.outvars]


_IDENTITY = {"squeeze", "reshape", "broadcast_in_dim", "copy"}


def _rule(name, eqn, ins, tables):
    if name in flex.CALLS:
        inner = flex.inner_jaxpr(eqn)
        if inner is None:
            raise Unsupported(f"call {name}")
        return _call(eqn, inner, ins, tables)
    if any(isinstance(v, Array) for v in ins) and name != "dynamic_slice":
        raise Unsupported(f"{name} of a closed-over array")
    if name in _IDENTITY:
        if eqn.outvars[0].aval.shape != ():
            raise Unsupported(f"{name} to a non-scalar")
        return ins[0]
    if name in ("lt", "le", "gt", "ge", "eq", "ne"):
        if all(isinstance(v, Bool) for v in ins) and name in ("eq", "ne"):
            x = _rule("xor", eqn, ins, tables)  # bool equality: as xor
            return x if name == "ne" else Bool(x.false, x.true, x.point)
        return _compare(name, _as_num(ins[0]), _as_num(ins[1]))
    if name in ("and", "or", "xor", "not"):
        if not all(isinstance(v, Bool) for v in ins):
            raise Unsupported(f"bitwise {name} on integers")
        if name == "not":
            (a,) = ins
            return Bool(a.false, a.true, a.point)
        a, b = ins
        point = a.point and b.point
        if name == "and":
            return Bool(a.true & b.true, a.false | b.false, point)
        if name == "or":
            return Bool(a.true | b.true, a.false & b.false, point)
        return Bool((a.true & b.false) | (a.false & b.true), (a.true & b.true) | (a.false & b.false), point)
    if name == "select_n":
        return _select(ins[0], ins[1:])
    if name == "convert_element_type":
        if _is_bool_dtype(eqn.outvars[0].aval):
            return _as_bool(ins[0])
        return _convert(_as_num(ins[0]), eqn.params["new_dtype"])
    if name == "dynamic_slice":
        array, *indices = ins
        if not isinstance(array, Array) or any(s != 1 for s in eqn.params["slice_sizes"]):
            raise Unsupported("dynamic_slice other than of one element of a closed-over array")
        return _read(array, [_as_num(i) for i in indices], tables)
    nums = [_as_num(v) for v in ins]
    if name == "add":
        a, b = nums
        return _no_overflow(Num(a.lo + b.lo, a.hi + b.hi, a.point and b.point), jnp.add, a, b)
    if name == "sub":
        a, b = nums
        return _no_overflow(Num(a.lo - b.hi, a.hi - b.lo, a.point and b.point), jnp.subtract, a, b)
    if name == "mul":
        return _no_overflow(_corners(jnp.multiply, *nums), jnp.multiply, *nums)
    if name == "neg":
        (a,) = nums
        if jnp.issubdtype(jnp.result_type(a.lo), jnp.integer):
            # -min wraps to min: an interval from the minimum negates to the whole range.
            low, high = _whole(jnp.result_type(a.lo))
            at_min = a.lo == low
            return Num(jnp.where(at_min, low, -a.hi), jnp.where(at_min, high, -a.lo), a.point)
        return Num(-a.hi, -a.lo, a.point)
    if name == "abs":
        (a,) = nums
        lo = jnp.where(a.lo >= 0, a.lo, jnp.where(a.hi <= 0, -a.hi, 0))
        # max(|lo|, |hi|) = max(-lo, hi) for lo <= hi, written without abs: on an H100, XLA
        # compiled max(abs(lo), abs(hi)) of int32 tiles to a wrong value (the bound of the
        # nearer end), which made an integer |q - k| <= w band skip tiles it attends. An
        # integer lo at its minimum (a range widened by `_no_overflow`) has no negation.
        hi = jnp.maximum(-a.lo, a.hi)
        if jnp.issubdtype(jnp.result_type(a.lo), jnp.integer):
            # |min| wraps to min itself: an interval from the minimum holds both ends.
            info = jnp.iinfo(jnp.result_type(a.lo))
            at_min = a.lo == info.min
            lo, hi = jnp.where(at_min, info.min, lo), jnp.where(at_min, info.max, hi)
        return Num(lo, hi, a.point)
    if name in ("max", "min"):
        a, b = nums
        f = jnp.maximum if name == "max" else jnp.minimum
        return Num(f(a.lo, b.lo), f(a.hi, b.hi), a.point and b.point)
    if name == "sign":
        (a,) = nums
        return Num(jnp.sign(a.lo), jnp.sign(a.hi), a.point)
    if name in ("floor", "ceil"):
        (a,) = nums
        f = jnp.floor if name == "floor" else jnp.ceil
        return Num(f(a.lo), f(a.hi), a.point)
    if name == "clamp":
        low, x, high = nums
        return Num(jnp.clip(x.lo, low.lo, high.lo), jnp.clip(x.hi, low.hi, high.hi), low.point and x.point and high.point)
    if name == "div":
        return _divide(*nums, floor=False)
    if name == "rem":
        return _modulo(*nums, floor=False)
    raise Unsupported(name)


def _call(eqn, inner, ins, tables):
    """A nested call (`inner`: its (jaxpr, consts)): jnp's floor_divide and remainder by a
    positive constant get their exact monotone rules (the bodies' sign corrections would
    widen the intervals); others are evaluated inline."""
    name = eqn.params.get("name", "")
    if (name in ("floor_divide", "remainder") and len(ins) == 2 and not any(isinstance(v, Array) for v in ins)
            and _is_jnp(name, eqn)):
        a, b = (_as_num(v) for v in ins)
        c = _known(b)
        if c is not None and np.all(c > 0):
            return _divide(a, b, floor=True) if name == "floor_divide" else _modulo(a, b, floor=True)
    jaxpr, consts = inner
    return tuple(_evaluate(jaxpr, [*map(_const, consts), *ins], tables))


def _const(c):
    """A closed-over value: an array read by index, or a scalar number."""
    return Array(jnp.asarray(c)) if jnp.ndim(c) else _num(c)


@functools.lru_cache(maxsize=64)
def _jnp_body(name: str, avals: tuple) -> str:
    """The text of jnp.<name>'s nested jaxpr at these operand (shape, dtype, weak_type)s."""
    args = [jax.ShapeDtypeStruct(shape, dtype, weak_type=weak) for shape, dtype, weak in avals]
    (eqn,) = jax.make_jaxpr(getattr(jnp, name))(*args).jaxpr.eqns
    return str(eqn.params["jaxpr"])


def _is_jnp(name: str, eqn) -> bool:
    """Whether a call named floor_divide / remainder is jnp's own (a user's function of that
    name gets no special rule)."""
    avals = tuple((tuple(v.aval.shape), jnp.dtype(v.aval.dtype), bool(getattr(v.aval, "weak_type", False)))
                  for v in eqn.invars)
    try:
        return _jnp_body(name, avals) == str(eqn.params.get("jaxpr"))
    except Exception:  # noqa: BLE001 - any mismatch in tracing jnp's version: no special rule
        return False


def classify(jaxpr, consts, n_batch: int, n_heads: int, q_len: int, kv_len: int, block_q: int, block_k: int):
    """The int8 [n_batch, n_heads, n_q, n_k] tile classes of a traced mask_mod (`flex.Mod.jaxpr`
    and its closed-over arrays), or None when the program has an operation without an
    interval rule. n_batch / n_heads are 1 for an axis the mask_mod does not read."""
    n_q, n_k = -(-q_len // block_q), -(-kv_len // block_k)
    q_lo = jnp.arange(n_q, dtype=jnp.int32)[None, None, :, None] * block_q
    k_lo = jnp.arange(n_k, dtype=jnp.int32)[None, None, None, :] * block_k
    args = [
        _num(jnp.arange(n_batch, dtype=jnp.int32)[:, None, None, None]),
        _num(jnp.arange(n_heads, dtype=jnp.int32)[None, :, None, None]),
        Num(q_lo, jnp.minimum(q_lo + block_q, q_len) - 1, False),
        Num(k_lo, jnp.minimum(k_lo + block_k, kv_len) - 1, False),
    ]
    try:
        (result,) = _evaluate(jaxpr, [*map(_const, consts), *args], _RangeTables())
    except Unsupported:
        return None
    result = _as_bool(result)
    shape = (n_batch, n_heads, n_q, n_k)
    codes = flex.tile_class(jnp.broadcast_to(result.true, shape), ~jnp.broadcast_to(result.false, shape))
    return codes.astype(jnp.int8)

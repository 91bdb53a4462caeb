"""A mask_mod's per-row and per-column reads of closed-over arrays, moved out of the kernels.

A document mask reads a closed-over array at a position: ``ids[b, q_idx] == ids[b, kv_idx]``.
Inside a kernel that is a gather per row and per column of a score tile. The Triton kernels
gather through pointers. The Hopper kernels cannot gather from registers, but they stream an
int32 vector per row and per column of each tile beside K/V: the path segment ids take.

`split` rewrites such a mask_mod into three programs:

* a row program ``(batch, head, q_idx) -> int32`` and a column program
  ``(batch, head, kv_idx) -> int32``, each computing the one value per position that the mask
  reads from the closed-over arrays (``ids[b, q_idx]``); `values` evaluates them in XLA over
  every position ([B, T] int32, a read of the arrays, nothing of [Tq, Tk]);
* the rest of the mask: a `flex.Mod` of ``(batch, head, q_idx, kv_idx, row, col)`` that reads
  the closed-over arrays at the batch and head only, which the Hopper kernels evaluate on a
  tile from the two streamed vectors.

Values of another dtype travel as int32: booleans and narrower integers converted, 32-bit
floats bit-cast. The attention computed is the same: each program is the user's own
equations, split at the values that depend on one side only.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core

from flashjax import flex

__all__ = ["split", "values"]

# Bit sets of what a value of the program depends on.
_Q, _K, _BATCH, _HEAD = 1, 2, 4, 8


# Bounded: keyed by user programs, which a long session may trace without end.
@functools.lru_cache(maxsize=64)
def split(mod: flex.Mod) -> flex.Mod | str:
    """The mask_mod `mod` with its one-sided position reads moved out (see the module
    docstring), or why that cannot be done (a sentence).

    Returns:
      A `flex.Mod` whose `sides` are the (row, column) programs and whose program takes the
      two values after kv_idx; `mod` itself when it reads no closed-over array at a position.
    """
    if mod.name != flex.MASK_MOD:
        return "only a mask_mod's reads move out of the kernels"
    jaxpr = mod.jaxpr
    consts = set(jaxpr.constvars)
    depends = dict(zip(jaxpr.invars, (_BATCH, _HEAD, _Q, _K)))
    positional = set()  # values computed from a closed-over array read at a position
    for eqn in jaxpr.eqns:
        operands = [x for x in eqn.invars if isinstance(x, jex_core.Var)]
        on = functools.reduce(operator.or_, (depends.get(x, 0) for x in operands if x not in consts), 0)
        reads = any(x in consts for x in operands)
        if reads and on & _Q and on & _K:
            return "it reads a closed-over array at an index that depends on both q_idx and kv_idx"
        if any(x in positional for x in operands) or (reads and on & (_Q | _K)):
            positional.update(eqn.outvars)
        depends.update({x: on for x in eqn.outvars})
    if not positional:
        return mod

    def one_sided(x) -> int:
        """_Q or _K for a position-read value of one side only, else 0."""
        if not isinstance(x, jex_core.Var) or x not in positional:
            return 0
        side = depends[x] & (_Q | _K)
        return side if side in (_Q, _K) else 0

    # The one-sided values the rest of the program takes: operands of equations that mix
    # both sides, and the results.
    found = {_Q: [], _K: []}
    uses = [(eqn.invars, depends[eqn.outvars[0]]) for eqn in jaxpr.eqns if eqn.outvars]
    uses.append((jaxpr.outvars, _Q | _K))
    for operands, on in uses:
        if on & _Q and on & _K:
            for x in operands:
                side = one_sided(x)
                if side and x not in found[side]:
                    found[side].append(x)
    for side, name in ((_Q, "row"), (_K, "column")):
        if len(found[side]) > 1:
            return (f"it reads {len(found[side])} values per {name} from closed-over arrays (the Hopper kernels "
                    f"stream one per {name})")
        if found[side] and depends[found[side][0]] & _HEAD:
            return (f"the value it reads per {name} depends on the head (the Hopper kernels stream one vector per "
                    "batch row)")
        if found[side] and _encoding(found[side][0].aval.dtype) is None:
            return f"it reads {found[side][0].aval.dtype} values per {name} (32 bits at most travel to the kernels)"
    row, col = (found[side][0] if found[side] else None for side in (_Q, _K))
    sides = (_side_program(mod, row), _side_program(mod, col))
    rest = _rest_program(mod, row, col)
    return flex.Mod(name=mod.name, const_avals=mod.const_avals, jaxpr=rest, uses_batch=mod.uses_batch,
                    uses_head=mod.uses_head, program=" | ".join(map(str, (rest, *sides))), sides=sides,
                    callbacks=mod.callbacks, rule_arrays=mod.rule_arrays)


def values(mod: flex.Mod, consts, batch: int, q_len: int, kv_len: int):
    """The row and column values of a `split` mod at every position: int32 [batch, q_len] and
    [batch, kv_len] (positions past the arrays read what the kernels' clamped reads would)."""
    def over_positions(program, length):
        one = lambda b, i: flex._evaluate(program, tuple(consts), (b, jnp.int32(0), i))[0]
        positions = jnp.arange(length, dtype=jnp.int32)
        return jax.vmap(lambda b: jax.vmap(lambda i: one(b, i))(positions))(jnp.arange(batch, dtype=jnp.int32))

    row, col = mod.sides
    return over_positions(row, q_len), over_positions(col, kv_len)


def _encoding(dtype):
    """(to int32, from int32) for values of `dtype`, or None when they do not fit 32 bits."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return (lambda x: x.astype(jnp.int32)), (lambda x: x != 0)
    if jnp.issubdtype(dtype, jnp.integer) and dtype.itemsize < 4 or dtype == np.int32:
        return (lambda x: x.astype(jnp.int32)), (lambda x: x.astype(dtype))
    if dtype == np.uint32:
        return (lambda x: lax.bitcast_convert_type(x, jnp.int32)), (lambda x: lax.bitcast_convert_type(x, dtype))
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize <= 4:
        to = lambda x: lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
        return to, (lambda x: lax.bitcast_convert_type(x, jnp.float32).astype(dtype))
    return None


def _needed(jaxpr, wanted, given=()) -> list:
    """The equations that compute `wanted` (vars), taking the `given` vars as known."""
    live = {x for x in wanted if isinstance(x, jex_core.Var)}
    given = set(given)
    eqns = []
    for eqn in reversed(jaxpr.eqns):
        if any(x in live and x not in given for x in eqn.outvars):
            eqns.append(eqn)
            live.update(x for x in eqn.invars if isinstance(x, jex_core.Var))
    return eqns[::-1]


def _run(eqns, env) -> None:
    read = lambda x: x.val if isinstance(x, jex_core.Literal) else env[x]
    for eqn in eqns:
        env.update(zip(eqn.outvars, flex._bind(eqn, [read(x) for x in eqn.invars])))


def _as_program(fn, mod: flex.Mod, num_args: int):
    """A jaxpr of `fn(*consts, *num_args int32 scalars)` whose constvars are the consts (paired,
    as in the user's program, with the arrays it was traced with)."""
    avals = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in mod.const_avals]
    closed = jax.make_jaxpr(fn)(*avals, *[jax.ShapeDtypeStruct((), jnp.int32)] * num_args)
    assert not closed.consts, closed
    n = len(avals)
    return closed.jaxpr.replace(constvars=closed.jaxpr.invars[:n], invars=closed.jaxpr.invars[n:],
                                consts=mod.jaxpr.consts)


def _side_program(mod: flex.Mod, value):
    """(consts, batch, head, index) -> int32: the one-sided `value` (None: the constant 0)."""
    jaxpr = mod.jaxpr
    n = len(mod.const_avals)
    q_side = value is not None and jaxpr.invars[2] in _inputs_of(jaxpr, value)

    def program(*args):
        if value is None:
            return jnp.int32(0)
        consts, (batch, head, index) = args[:n], args[n:]
        positions = (index, jnp.int32(0)) if q_side else (jnp.int32(0), index)
        env = dict(zip((*jaxpr.constvars, *jaxpr.invars), (*consts, batch, head, *positions)))
        _run(_needed(jaxpr, [value]), env)
        return _encoding(value.aval.dtype)[0](env[value])

    return _as_program(program, mod, 3)


def _inputs_of(jaxpr, value) -> set:
    """The invars and constvars `value` depends on."""
    live = {value}
    for eqn in _needed(jaxpr, [value]):
        live.update(x for x in eqn.invars if isinstance(x, jex_core.Var))
    return live


def _rest_program(mod: flex.Mod, row, col):
    """(consts, batch, head, q_idx, kv_idx, row, col) -> the mask, `row` and `col` (vars of the
    user's program, or None) taken as given."""
    jaxpr = mod.jaxpr
    n = len(mod.const_avals)
    given = [x for x in (row, col) if x is not None]

    def program(*args):
        consts, index, encoded = args[:n], args[n:n + 4], args[n + 4:]
        env = dict(zip((*jaxpr.constvars, *jaxpr.invars), (*consts, *index)))
        for var, code in zip((row, col), encoded):
            if var is not None:
                env[var] = _encoding(var.aval.dtype)[1](code)
        _run(_needed(jaxpr, jaxpr.outvars, given), env)
        return [x.val if isinstance(x, jex_core.Literal) else env[x] for x in jaxpr.outvars]

    return _as_program(program, mod, 6)

"""User score and mask functions (FlexAttention for JAX): tracing, evaluation and block sparsity.

`flash_attention(score_mod=..., mask_mod=...)` takes plain Python functions of scalars,
as PyTorch's FlexAttention does::

  score_mod(score, batch, head, q_idx, kv_idx) -> score   # score = scale * q.k, float32
  mask_mod(batch, head, q_idx, kv_idx) -> bool            # True = attend

`trace` traces a function once at scalar shapes into a `Mod`. Every array it closes over
(a bias table, per-document ids, per-head slopes) is hoisted out of the trace and travels
as an operand (`Extras.score_consts` / `mask_consts`): the kernels read it through a ref,
and the custom VJP returns its gradient. The `Mod` is the static part of a call, and it is
the traced program, not the function object: functions that trace to the same program (a
mod rebuilt every step, closing over new arrays of the same shapes) share the compiled
kernels, whatever values the arrays hold.

The one scalar program is evaluated in two ways:

* in XLA (the reference, the block-mask builder, the gradient of closed-over arrays):
  `elementwise(mod.bind(consts), ...)`, vmapped over index grids;
* in the kernels: `Mod.at(refs, batch, head)` (`kernel_mods`) once per (batch row, head), then its
  `TileProgram.tile(...)` per tile, vmapped over the tile, reading each closed-over
  array one element per score through its ref (`table[h, bucket]` becomes a pointer load:
  Triton has no gather on values).

`BlockMask` records, for one tiling, which tile pairs a mask_mod leaves empty (never
loaded), full (mask_mod not evaluated) or partial; the Triton glue re-tiles it to each
kernel's tiles (`tile_flags`) and folds it into the per-tile ranges of
`masks.dynamic_ranges`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import operator
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core

from flashjax import xla_semantics
from flashjax.vma import vary_alike, varying_axes

__all__ = ["Mod", "BlockMask", "block_mask", "trace", "elementwise", "SCORE_MOD", "MASK_MOD"]

SCORE_MOD, MASK_MOD = "score_mod", "mask_mod"
# Codes of `BlockMask.blocks`.
EMPTY, PARTIAL, FULL = 0, 1, 2
# The block-mask builder evaluates mask_mod on about this many (query, key) pairs per step.
_STEP_PAIRS = 1 << 21
# Whether `classify`, where it evaluates every pair (exact=True, or a mask_mod without
# interval rules), does so with the Triton kernel on a GPU: on an H100 a 32k block mask takes
# it 0.19-0.22 of a causal forward, the XLA builder 0.58-0.64. False: XLA everywhere.
KERNEL_BUILDER = True


# ---- tracing ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class Mod:
    """A user score_mod or mask_mod traced at scalar shapes, its closed-over arrays hoisted out.

    Equal (and hashing alike) when the traced programs are: the same operations on
    closed-over arrays of the same shapes and dtypes (a jit static; the arrays' values are
    operands), the same custom derivative rules (compared through the derivative's program)
    and the same host callbacks. Two different function objects that trace alike share
    compilations.

    Attributes:
      name: "score_mod" or "mask_mod".
      const_avals: ((shape, dtype), ...) of the closed-over arrays, in trace order.
      jaxpr: the scalar program; its constvars are the closed-over arrays, its invars the
        scalar arguments (score, batch, head, q_idx, kv_idx; no score for a mask_mod).
      uses_batch, uses_head: whether the result depends on the batch / head index (a block
        mask is broadcast along the axes it does not use).
      sides: () for a user's function. For a mask_mod split by `sides.split`: its (row,
        column) programs (jaxprs of the closed-over arrays and (batch, head, index), each
        returning the int32 value the mask reads at one query / key position), and `jaxpr`
        takes those two values after kv_idx.
    """

    name: str
    const_avals: tuple
    jaxpr: Any
    uses_batch: bool
    uses_head: bool
    program: str = ""  # the jaxpr's text (with `sides`, theirs too): what equality compares
    sides: tuple = ()
    # The Python functions the program calls, whose text shows no more than a name
    # (pure_callback's): equality compares them too.
    callbacks: tuple = ()
    # The arrays a custom_jvp / custom_vjp rule of a score_mod closes over (`_ArrayKey`s):
    # baked into the derivative, so compared by value.
    rule_arrays: tuple = ()

    def _key(self):
        return (self.name, self.const_avals, self.program, self.callbacks, self.rule_arrays)

    def __eq__(self, other):
        return isinstance(other, Mod) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    @functools.cached_property
    def calls_custom_vjp(self) -> bool:
        """Whether the program calls a ``jax.custom_vjp`` function (inside nested calls and loops
        too): its derivative exists in reverse mode only, and the kernels' backward traces
        d score_mod / d score forward (`_value_and_slope`)."""
        return any(eqn.primitive.name == "custom_vjp_call" for eqn in _nested_eqns(self.jaxpr))

    @functools.cached_property
    def uses_batch_and_head(self) -> tuple[bool, bool]:
        """Whether the result depends on the batch index, on the head index."""
        start = 1 if self.name == SCORE_MOD else 0
        return tuple(_used_inputs(self.jaxpr)[start:start + 2])

    @functools.cached_property
    def uses_positions(self) -> tuple[bool, ...]:
        """Whether the result depends on q_idx, on kv_idx (and with `sides`, on the row value,
        on the column value)."""
        return tuple(_used_inputs(self.jaxpr)[(1 if self.name == SCORE_MOD else 0) + 2:])

    @functools.cached_property
    def key_bound(self) -> int | None:
        """The least c for which the program states that this mask_mod lets through only
        pairs with ``kv_idx <= q_idx + c``; None where it states no such bound.

        Found in the conjuncts of the result (operands of ``&``): comparisons whose two sides
        are q_idx and kv_idx plus or minus integer literals (``kv_idx <= q_idx``,
        ``q_idx - kv_idx >= 0``, ``kv_idx < q_idx + 1``), read as integer arithmetic: exact
        for positions up to `KEY_BOUND_POSITIONS` (2**29), where no value the reading
        follows (at most two positions and constants below 2**24) wraps around int32. A mask
        may imply a bound it does not state this way (through a closed-over array, or a
        disjunction): that one is not found. `flash_attention` adds its built-in causal mask
        to a call whose mask_mod states a bound within it: the result is the same, and the
        kernels then skip the upper triangle structurally and order their tiles as for a
        causal call.
        """
        if self.name != MASK_MOD:
            return None
        q_idx, kv_idx = self.jaxpr.invars[2:4]
        affine = {q_idx: ({"q": 1}, 0), kv_idx: ({"kv": 1}, 0)}  # var: ({position: coefficient}, constant)
        bounds = {}  # bool var: the least c of its conjuncts' kv_idx <= q_idx + c
        for eqn in self.jaxpr.eqns:
            name, ins = eqn.primitive.name, [_affine_operand(x, affine) for x in eqn.invars]
            if name in ("add", "sub") and None not in ins:
                terms, constant = _affine_sum(*ins, sign=1 if name == "add" else -1)
                if sum(map(abs, terms.values())) <= 2 and abs(constant) < 2 ** 24:
                    affine[eqn.outvars[0]] = (terms, constant)
            elif name == "neg" and None not in ins:
                affine[eqn.outvars[0]] = _affine_sum(({}, 0), ins[0], sign=-1)
            elif name in ("le", "lt", "ge", "gt") and None not in ins:
                left, right = ins if name in ("le", "lt") else ins[::-1]
                # left <= right (or <): right - left = q_idx - kv_idx + d >= 0 (or >= 1).
                terms, d = _affine_sum(right, left, sign=-1)
                if terms == {"q": 1, "kv": -1}:
                    bounds[eqn.outvars[0]] = d - (1 if name in ("lt", "gt") else 0)
            elif name == "and" and eqn.outvars[0].aval.dtype == np.bool_:
                found = [bounds[x] for x in eqn.invars if isinstance(x, jex_core.Var) and x in bounds]
                if found:
                    bounds[eqn.outvars[0]] = min(found)
        out = self.jaxpr.outvars[0]
        return bounds.get(out) if isinstance(out, jex_core.Var) else None

    def bind(self, consts) -> Callable:
        """The scalar function with the closed-over arrays `consts` (values) put back: for XLA."""
        return lambda *args: _evaluate(self.jaxpr, tuple(consts), args)[0]

    def tile(self, refs, *args, grad: bool = False, shape: tuple | None = None, lowering: str | None = None):
        """Evaluates the function on a tile inside a kernel (`at`, then `TileProgram.tile`).

        Args:
          refs: the kernel refs of the closed-over arrays (as `kernel_operands` passed them).
          args: (score,) batch, head, q_idx, kv_idx (and with `sides` the row and column
            values); broadcastable arrays, `Along` vectors or scalars.
          grad: also return d score_mod / d score at each element (score_mod only).
          shape: the tile's shape, where `args` may not span it (`Along` vectors, unused
            positions passed as scalars); by default the broadcast of the arrays.
          lowering: the kernel's lowering, "triton" or "mosaic": the operations whose rule
            there differs from XLA's semantics on some inputs are evaluated as XLA does
            (`xla_semantics.evaluate`), so that the kernels agree with the reference.

        Returns:
          The tile of results (float32 scores or bools), with `grad` a pair (scores, slopes);
          slopes is None for an `additive` score_mod (its derivative is 1: nothing to multiply).
        """
        lead = 1 if self.name == SCORE_MOD else 0
        batch, head = args[lead:lead + 2]
        program = self.at(refs, batch, head, lowering=lowering, grad=grad)
        return program.tile(*args[:lead], *args[lead + 2:], shape=shape)

    def at(self, refs, batch, head, *, lowering: str | None = None, grad: bool = False,
           term_factor: float | None = None) -> "TileProgram":
        """The function at one batch row and query head inside a kernel, for its tiles.

        What the program computes from the batch row, the head and the closed-over arrays
        alone (ALiBi's ``slopes[h]``, a load, and its product with a constant) is evaluated
        here, once; the tiles then evaluate only what varies over their positions. A kernel
        calls this before its loop over key tiles: Mosaic GPU's compiler leaves a load from
        global memory inside the loop where the program put it (one per tile).

        Args:
          refs, lowering: as `tile` takes them.
          batch, head: the batch row and query head (scalars).
          grad: the tiles return (value, d score_mod / d score), as `tile` does.
          term_factor: the tiles return the `additive_term` program with this factor: the
            term from the positions alone (score_mod with an `additive_term`).

        Returns:
          A `TileProgram`: ``.tile(*varying, shape=None)`` where varying is (score,) q_idx,
          kv_idx (and with `sides` the row and column values); with `term_factor`, q_idx
          and kv_idx.
        """
        consts = tuple(_ConstRef(ref, shape, dtype) for ref, (shape, dtype) in zip(refs, self.const_avals))
        # A closed-over scalar is loaded here too, not where each tile uses it.
        consts = tuple(c if c.shape else c.load() for c in consts)
        if term_factor is not None:
            (jaxpr, own), lead, returns = self.additive_term, (*consts, np.float32(term_factor)), "value"
        elif grad and not self.additive:
            (jaxpr, own), lead, returns = self._value_and_slope, (*consts, _VARYING), "pair"
        else:
            jaxpr, own, lead = self.jaxpr, consts, (_VARYING,) if self.name == SCORE_MOD else ()
            returns = "value_and_none" if grad else "value"
        template = (*lead, batch, head, *(_VARYING,) * (len(jaxpr.invars) - len(lead) - 2))
        known = {}
        if np.ndim(batch) == 0 and np.ndim(head) == 0:  # (not where they vary over a tile: `tile` takes arrays)
            token = _LOWERING.set(lowering)
            try:
                known = _uniform_values(jaxpr, own, template)
            finally:
                _LOWERING.reset(token)
        return TileProgram(jaxpr, own, template, known, lowering, returns)

    @functools.cached_property
    def _read_sides(self) -> dict:
        """{closed-over array (constvar): the set of sides each of its reads' index depends on},
        a side being a bit set of the query (1) and the key (2) positions; the score counts as
        both."""
        q_side, k_side = 1, 2
        first = [q_side | k_side] if self.name == SCORE_MOD else []
        sides = dict(zip(self.jaxpr.invars, first + [0, 0, q_side, k_side]))
        consts = set(self.jaxpr.constvars)
        read = {}
        for eqn in self.jaxpr.eqns:
            variables = [x for x in eqn.invars if isinstance(x, jex_core.Var)]
            side = functools.reduce(operator.or_, (sides.get(x, 0) for x in variables if x not in consts), 0)
            for x in variables:
                if x in consts:
                    read.setdefault(x, set()).add(side)
            sides.update({x: side for x in eqn.outvars})
        return read

    @functools.cached_property
    def pair_read_bytes(self) -> int:
        """Bytes per (query, key) pair read from the closed-over arrays at an index that depends
        on both the query and the key (or on the score), as a T5 table at the bucket of
        kv_idx - q_idx is: the gather of a whole score tile and its int32 index, which the
        Triton kernels stage through shared memory. 0 when every read depends on one side."""
        return sum(np.dtype(x.aval.dtype).itemsize + 4 for x, sides in self._read_sides.items() if 3 in sides)

    @functools.cached_property
    def position_reads(self) -> tuple[str, ...]:
        """The closed-over arrays (as ``dtype[shape]``) read at an index that depends on q_idx,
        kv_idx or the score: a gather per row, column or score of a tile. Reads at the batch
        and head alone are one scalar load per tile."""
        return tuple(f"{np.dtype(x.aval.dtype).name}{list(x.aval.shape)}" for x, sides in self._read_sides.items()
                     if any(sides))

    def _programs(self, derivative: bool) -> list:
        """[(jaxpr, its closed-over array variables)]: the mod's own program (what the forward
        kernels run) or, with `derivative`, a score_mod's value-and-derivative program (what
        the backward kernels run; none for a mask_mod)."""
        if not derivative:
            return [(self.jaxpr, self.jaxpr.constvars)]
        if self.name == SCORE_MOD:
            jaxpr = self._value_and_slope[0]
            return [(jaxpr, jaxpr.invars[:len(self.const_avals)])]
        return []

    def _computations(self, derivative: bool):
        """The equations a program (`_programs`) computes with, inside nested calls too. Reads
        of a closed-over array (`dynamic_slice`, `gather`: loads through its ref in a kernel)
        are left out."""
        for jaxpr, consts in self._programs(derivative):
            for eqn, refs in _equations_with_refs(jaxpr, consts):
                if not (eqn.primitive.name in ("dynamic_slice", "gather") and refs[0]):
                    yield eqn

    @functools.cached_property
    def unreadable_arrays(self) -> tuple[str, ...]:
        """How the program (or its derivative program) uses a closed-over array other than the
        kernels can (`_ref_read`: one element per score, every axis indexed at once, or a
        scalar), as "dtype[shape] in `primitive`"; the kernels cannot run such a mod."""
        uses = []
        for derivative in (False, True):
            for jaxpr, consts in self._programs(derivative):
                for eqn, refs in _equations_with_refs(jaxpr, consts):
                    if any(refs) and _ref_read(eqn, refs) is None:
                        arrays = ", ".join(f"{np.dtype(x.aval.dtype).name}{list(x.aval.shape)}"
                                           for x, ref in zip(eqn.invars, refs) if ref)
                        uses.append(f"{arrays} in `{eqn.primitive.name}`")
        return tuple(dict.fromkeys(uses))

    def unlowered_forms(self, derivative: bool, lowering: str) -> list[str]:
        """Operations of the forward (or, with `derivative`, the backward) kernels' program in a
        form the lowering ("triton" or "mosaic", JAX 0.11.2) has no rule for, although it has one
        for the primitive: a select_n of more than two cases (`jnp.select`'s, a three-way
        `lax.select_n`), a stack or concatenate (more than two arrays on Triton; any on
        Mosaic), a `lax.cond` / `lax.switch` whose branch depends on the score or a position
        (either lowering), and any cond in Triton's derivative program."""
        found = []
        for jaxpr, consts in self._programs(derivative):
            # The batch row, the head and the closed-over arrays are the same over a tile.
            first = 1 if self.name == SCORE_MOD else 0
            args = jaxpr.invars[len(jaxpr.invars) - len(_scalar_args(self.name)) - (2 if self.sides else 0):]
            uniform = set(consts) | set(args[first:first + 2])
            varying = _dependents(jaxpr, set(jaxpr.invars) - uniform)
            top = {id(eqn) for eqn in jaxpr.eqns}
            for eqn in _nested_eqns(jaxpr):
                name, n = eqn.primitive.name, len(eqn.invars)
                if name == "select_n" and n > 3:
                    found.append(f"a select_n of {n - 1} cases (jnp.select)")
                elif name in ("stack", "concatenate") and (lowering == "mosaic" or n > 2):
                    found.append(f"a {name} of {n} arrays")
                elif name == "cond":
                    index = eqn.invars[0]
                    # A cond inside another call is taken as varying: its operands are not traced here.
                    per_score = not isinstance(index, jex_core.Literal) and (index in varying or id(eqn) not in top)
                    if per_score:
                        found.append("a lax.cond / lax.switch on the score or a position")
                    elif lowering == "triton" and derivative:
                        found.append("a lax.cond / lax.switch in the derivative program")
        return sorted(set(found))

    def primitives(self, derivative: bool = False) -> frozenset:
        """The names of the primitives the forward (or, with `derivative`, the backward) kernels
        evaluate for this mod (`_computations`)."""
        return frozenset(name for name, _ in self.typed_primitives(derivative))

    def typed_primitives(self, derivative: bool = False) -> frozenset:
        """(name, dtype name of the first operand) of each primitive of `primitives`."""
        return self._typed_primitives[derivative]

    @functools.cached_property
    def _typed_primitives(self) -> dict:
        def typed(eqn):
            name = REWRITTEN[eqn.primitive.name][0] if eqn.primitive.name in REWRITTEN else eqn.primitive.name
            return name and (name, np.dtype(eqn.invars[0].aval.dtype).name if eqn.invars else "")

        return {derivative: frozenset(filter(None, map(typed, self._computations(derivative))))
                for derivative in (False, True)}

    @functools.cached_property
    def additive(self) -> bool:
        """Whether d score_mod / d score is 1 at every input: the score plus a function of the
        positions, batch, head and closed-over arrays (ALiBi, a relative-position bias). The
        derivative program's result then depends on no input, and is 1."""
        if self.name != SCORE_MOD:
            return False
        jaxpr, consts = self._value_and_slope
        slope = jaxpr.outvars[1]
        if isinstance(slope, jex_core.Var) and slope in _dependents(jaxpr, jaxpr.invars):
            return False
        # Evaluated now, with concrete zeros, even when first asked inside a kernel's trace, and
        # outside any mesh (under shard_map with a mesh set, arrays made here would be typed on
        # its manual axes). Where JAX still cannot evaluate it eagerly (constants typed on a
        # set mesh's Explicit axes), the mod counts as not additive: the kernels then compute
        # its derivative, the same gradients at a little more work.
        try:
            with jax.ensure_compile_time_eval(), _no_mesh():
                inputs = [jnp.zeros(v.aval.shape, v.aval.dtype) for v in jaxpr.invars]
                return bool(jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(jaxpr, consts))(*inputs)[1] == 1.0)
        except (AssertionError, NotImplementedError, TypeError, ValueError):
            return False

    @functools.cached_property
    def additive_term(self):
        """For an `additive` score_mod written as the score plus or minus a term g that does
        not read the score (ALiBi's ``score - slopes[h] * |q - k|``, a bias table's
        ``score + table[h, bucket]``): a scalar program (consts, factor, batch, head, q_idx,
        kv_idx) -> factor * (score_mod(score) - score), else None.

        The kernels then keep their logits in the units they keep without a mod: q.k plus the
        term times 1 / scale (Hopper), or base-2 logits plus it times log2(e) (Triton), one
        multiply-add per score instead of a multiply of every score before the mod. The factor
        goes into g's last product where one side is the same at every position of a tile (the
        slope: ``slopes[h] * factor`` once per tile) and that product is float32 and is g itself
        (no conversion after it, which would round or overflow the scaled value where the
        mod rounds g); else it multiplies g converted to float32. A mod that converts the score
        to a narrower type (``score.astype(bfloat16)``) rounds it: not a term, None.
        """
        if not self.additive:
            return None
        jaxpr = self.jaxpr
        score, *_, q_idx, kv_idx = jaxpr.invars
        # Values that vary over a tile's positions (or are the score): the others are uniform.
        varying = _dependents(jaxpr, (score, q_idx, kv_idx))
        producer = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
        # Walk back from the result through the score's own addition and sign changes to the
        # product the factor can enter.
        scaled_product, at = None, jaxpr.outvars[0]
        while isinstance(at, jex_core.Var) and at in producer:
            eqn = producer[at]
            name, ins = eqn.primitive.name, eqn.invars
            if name in ("add", "sub") and any(x is score for x in ins):
                at = ins[1] if ins[0] is score else ins[0]
            elif name == "neg":
                at = ins[0]
            else:
                if name == "mul" and eqn.outvars[0].aval.dtype == np.float32:
                    uniform = [isinstance(x, jex_core.Literal) or x not in varying for x in ins]
                    if uniform.count(True) == 1:
                        scaled_product = (eqn, uniform.index(True))
                break
        zero = object()  # the score, which the term does not read

        def term(*consts_and_args):
            consts, (factor, *index) = consts_and_args[:len(jaxpr.constvars)], consts_and_args[len(jaxpr.constvars):]
            env = dict(zip((*jaxpr.constvars, *jaxpr.invars), (*consts, zero, *index)))
            read = lambda x: x.val if isinstance(x, jex_core.Literal) else env[x]
            for eqn in jaxpr.eqns:
                ins = [read(x) for x in eqn.invars]
                name = eqn.primitive.name
                if any(x is zero for x in ins):
                    if name == "add":
                        outs = [ins[1] if ins[0] is zero else ins[0]]
                    elif name == "sub":
                        outs = [zero if ins[1] is zero and ins[0] is zero else ins[0] if ins[1] is zero else -ins[1]]
                    elif name in ("neg", "pvary", "copy", "copy_p") or (
                            name == "convert_element_type" and _exact_float_conversion(eqn.params["new_dtype"])):
                        outs = [zero]
                    else:
                        raise _NotAdditive(name)
                else:
                    if scaled_product is not None and eqn is scaled_product[0]:
                        ins[scaled_product[1]] = ins[scaled_product[1]] * factor
                    outs = _bind(eqn, ins)
                for var, value in zip(eqn.outvars, outs):
                    env[var] = value
            out = read(jaxpr.outvars[0])
            if out is zero:
                return jnp.zeros((), jnp.float32)
            return out.astype(jnp.float32) if scaled_product is not None else jnp.asarray(out, jnp.float32) * factor

        avals = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in self.const_avals]
        try:
            # Traced outside any mesh: under jax.set_mesh the constants the trace makes would
            # be typed on its axes, and a kernel inside shard_map cannot close over them.
            with _no_mesh():
                closed = jax.make_jaxpr(term)(*avals, jax.ShapeDtypeStruct((), jnp.float32), *_scalar_args(SCORE_MOD)[1:])
        except _NotAdditive:
            return None
        return closed.jaxpr, tuple(closed.consts)

    @functools.cached_property
    def _value_and_slope(self):
        """A scalar program (consts, score, batch, head, q_idx, kv_idx) -> (score_mod, d score_mod / d score),
        the derivative traced in with jax.jvp (the kernels' backward uses it in place of 1), its
        arithmetic shortened by `_evaluate_slope` (the value's program is the mod's own)."""
        assert self.name == SCORE_MOD
        n = len(self.const_avals)

        def value_and_slope(*consts_and_args):
            consts, (score, *index) = consts_and_args[:n], consts_and_args[n:]
            value = lambda s: _evaluate(self.jaxpr, consts, (s, *index))[0]
            return jax.jvp(value, (score,), (jnp.ones_like(score),))

        avals = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in self.const_avals]
        closed = jax.make_jaxpr(value_and_slope)(*avals, *_scalar_args(SCORE_MOD))
        if not self.calls_custom_vjp:  # (whose jvp is a placeholder, `kernel_backward_reasons`)
            invars = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
            closed = jax.make_jaxpr(lambda *args: _evaluate_slope(closed.jaxpr, closed.consts, args))(*invars)
        return closed.jaxpr, tuple(closed.consts)


# A tile input of `Mod.at`'s template (the score, a position): what its values depend on
# varies over a tile, and is evaluated per tile.
_VARYING = object()


class TileProgram(NamedTuple):
    """A mod's program at one batch row and head inside a kernel (`Mod.at`)."""

    jaxpr: Any
    consts: tuple  # the program's constvars' values (`_ConstRef`s of the closed-over arrays, or its own)
    template: tuple  # its invars' values, `_VARYING` where a tile gives them
    known: dict  # {var: (value, ())}: what `Mod.at` evaluated once
    lowering: str | None
    returns: str  # "value", "pair" (value, derivative) or "value_and_none" (an additive mod's derivative, 1)

    def tile(self, *varying, shape: tuple | None = None):
        """The program on one tile: `varying` in the template's `_VARYING` slots (see `Mod.at`)."""
        fill = iter(varying)
        args = tuple(next(fill) if a is _VARYING else a for a in self.template)
        token = _LOWERING.set(self.lowering)
        try:
            outs = _evaluate_tile(self.jaxpr, self.consts, args, shape, known=self.known)
        finally:
            _LOWERING.reset(token)
        if self.returns == "pair":
            return tuple(outs)
        return (outs[0], None) if self.returns == "value_and_none" else outs[0]


class KernelMods(NamedTuple):
    """A call's score_mod and mask_mod at one batch row and query head inside a kernel
    (`TileProgram`s, each None without its function): `kernel_mods`."""

    score: Any
    mask: Any


def term_as_bias(score_mod: Mod | None, softcap) -> bool:
    """Whether a kernel adds score_mod's `additive_term` to its logits as a bias (no softcap
    after the mod), rather than evaluating the mod on the scaled score."""
    return score_mod is not None and softcap is None and score_mod.additive_term is not None


def kernel_mods(score_mod: Mod | None, score_refs, mask_mod: Mod | None, mask_refs, batch, head, *, lowering: str,
                grad: bool = False, term_factor: float | None = None) -> KernelMods | None:
    """`Mod.at` of a kernel's score_mod and mask_mod (either may be None; their closed-over
    arrays' refs beside them) at (batch, head), for the kernel's loop over tiles; None
    without either. `grad` and `term_factor` apply to the score_mod."""
    if score_mod is None and mask_mod is None:
        return None
    score = None if score_mod is None else score_mod.at(score_refs, batch, head, lowering=lowering, grad=grad,
                                                        term_factor=term_factor)
    mask = None if mask_mod is None else mask_mod.at(mask_refs, batch, head, lowering=lowering)
    return KernelMods(score, mask)


def _uniform_values(jaxpr, consts, args) -> dict:
    """{var: (value, ())} of a program's equations that read no `_VARYING` input (directly or
    through another equation) and have no effects (a callback runs where the program puts
    it), evaluated (see `_evaluate_tile`)."""
    env = _evaluate_batched(jaxpr, [(c, ()) for c in consts], [(a, ()) for a in args], env_out=True)
    produced = {v for eqn in jaxpr.eqns for v in eqn.outvars}
    return {v: value for v, value in env.items() if v in produced and value[0] is not _VARYING}


class _NotAdditive(Exception):
    """The score enters an operation other than an addition, a subtraction, a sign change or a
    conversion (`Mod.additive_term`)."""


def _no_mesh():
    """A context without a mesh, for eager evaluation at trace time (JAX 0.11's internal
    `use_abstract_mesh`; a no-op where it is missing)."""
    from jax._src import mesh as mesh_lib

    use = getattr(mesh_lib, "use_abstract_mesh", None)
    empty = getattr(mesh_lib, "empty_abstract_mesh", None)
    return use(empty) if use is not None and empty is not None else contextlib.nullcontext()


def _scalar_args(name: str):
    index = [jax.ShapeDtypeStruct((), jnp.int32)] * 4
    return ([jax.ShapeDtypeStruct((), jnp.float32)] if name == SCORE_MOD else []) + index


def trace(fn, name: str) -> tuple[Mod, tuple]:
    """Traces a user score_mod or mask_mod at scalar shapes.

    Returns:
      (the `Mod`, the tuple of arrays it closes over: concrete arrays and tracers of an
      enclosing transformation alike, in the order of `Mod.const_avals`).

    Raises:
      ValueError: `fn` is not callable, or does not return one scalar (a bool for a mask_mod,
        a float for a score_mod).
    """
    what = "score_mod(score, batch, head, q_idx, kv_idx)" if name == SCORE_MOD else "mask_mod(batch, head, q_idx, kv_idx)"
    if not callable(fn):
        raise ValueError(f"{name} must be a function {what}, got {type(fn).__name__}.")

    def checked(*args):
        out = jnp.asarray(fn(*args))
        if out.shape != ():
            called = "scalar int32 indices" + (" and a float32 score" if name == SCORE_MOD else "")
            raise ValueError(
                f"{name} must return one scalar: it is called with {called}, as FlexAttention's vmap does, "
                f"and returned shape {out.shape}."
            )
        if name == MASK_MOD:
            if out.dtype != jnp.bool_:
                raise ValueError(f"mask_mod must return a bool (True = attend), got {out.dtype}.")
            return out
        if not jnp.issubdtype(out.dtype, jnp.floating):
            raise ValueError(f"score_mod must return a float score, got {out.dtype}.")
        return out.astype(jnp.float32)

    closed = jax.make_jaxpr(checked)(*_scalar_args(name))
    if any(isinstance(param, jex_core.ClosedJaxpr) and param.consts and eqn.primitive.name in INLINED_CALLS
           for eqn in _nested_eqns(closed.jaxpr) for param in eqn.params.values()):
        # Arrays closed over inside a nested jit are baked into its program, out of sight of
        # the Mod's equality (and of the kernels' operands): the calls inlined, they are the
        # program's own closed-over arrays.
        closed = jax.make_jaxpr(lambda *args: _evaluate(closed.jaxpr, closed.consts, args))(*_scalar_args(name))
    closed = closed.replace(jaxpr=_without_pvary(closed.jaxpr))
    for c in closed.consts:
        if jax.dtypes.issubdtype(c.dtype, jax.dtypes.prng_key):
            raise ValueError(f"{name} closes over a typed PRNG key ({c.dtype}): close over jax.random.key_data(key) "
                             "and rebuild the key inside with jax.random.wrap_key_data.")
    jaxpr, consts = _hoist_constants(closed.jaxpr, tuple(jnp.asarray(c) for c in closed.consts))
    # The Mod is a jit static: its program pairs the constvars with shapes, not with the
    # arrays (which may be tracers of the enclosing trace, and are passed as operands).
    jaxpr = jaxpr.replace(consts=tuple(jax.ShapeDtypeStruct(c.shape, c.dtype) for c in consts))
    used = _used_inputs(jaxpr)
    first_index = 1 if name == SCORE_MOD else 0
    mod = Mod(
        name=name, const_avals=tuple((tuple(c.shape), np.dtype(c.dtype)) for c in consts),
        jaxpr=jaxpr, uses_batch=used[first_index], uses_head=used[first_index + 1],
        program=str(jaxpr), callbacks=_callbacks(jaxpr),
    )
    if name == SCORE_MOD and any(eqn.primitive.name in CUSTOM_RULES for eqn in _nested_eqns(jaxpr)):
        # A custom_jvp / custom_vjp rule prints as a name: two mods that differ only in their
        # rules would compare equal (and share compiled backwards). Their derivative's program
        # holds the rules' operations, and the arrays the rules close over are compared by value.
        derivative, rule_arrays = _derivative_program(mod)
        mod = dataclasses.replace(mod, program=f"{mod.program}\nderivative:\n{derivative}",
                                  rule_arrays=tuple(map(_ArrayKey, rule_arrays)))
    return mod, consts


def _callbacks(jaxpr) -> tuple:
    """The Python callables held by the program's equations (pure_callback's function, ...),
    which its text prints without telling them apart; custom rules are compared through
    `_derivative_program` instead (their wrappers are rebuilt at every trace)."""
    return tuple(param for eqn in _nested_eqns(jaxpr) if eqn.primitive.name not in CUSTOM_RULES
                 for param in eqn.params.values() if callable(param))


def _derivative_program(mod: Mod) -> tuple[str, tuple]:
    """(the text of the program of a score_mod's reverse derivative in the score and the
    closed-over arrays (a custom rule's operations included), the arrays that program closes
    over: those of the custom rules)."""
    def cotangents(consts, score, *indices):
        value = lambda score, consts: mod.bind(consts)(score, *indices)
        return jax.vjp(value, score, consts)[1](jnp.ones((), jnp.float32))

    consts = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in mod.const_avals]
    closed = jax.make_jaxpr(cotangents)(consts, *_scalar_args(SCORE_MOD))
    return str(closed.jaxpr), tuple(closed.consts)


class _ArrayKey:
    """An array compared by value (shape, dtype and contents); a tracer (no value yet) by identity."""

    def __init__(self, array):
        self.array = array
        self._value = None
        if not isinstance(array, jax.core.Tracer):
            value = np.asarray(array)
            self._value = (value.shape, value.dtype.str, value.tobytes())

    def __eq__(self, other):
        if not isinstance(other, _ArrayKey):
            return NotImplemented
        if self._value is None or other._value is None:
            return self.array is other.array
        return self._value == other._value

    def __hash__(self):
        return hash(self._value) if self._value is not None else id(self.array)


def _without_pvary(jaxpr):
    """The jaxpr without its pvary equations, each output replaced by its operand: a mod traced
    inside jax.shard_map (check_vma=True) casts values, a closed-over array included, to
    vary over mesh axes; the kernels read such an array through its ref, and `_bind` casts
    each equation's operands alike where they vary (`vma.vary_alike`)."""
    alias = {}
    eqns = []
    for eqn in jaxpr.eqns:
        invars = [alias.get(x, x) if isinstance(x, jex_core.Var) else x for x in eqn.invars]
        if eqn.primitive.name == "pvary":
            alias.update(zip(eqn.outvars, invars))
        else:
            eqns.append(eqn.replace(invars=invars))
    if not alias:
        return jaxpr
    outvars = [alias.get(x, x) if isinstance(x, jex_core.Var) else x for x in jaxpr.outvars]
    return jaxpr.replace(eqns=eqns, outvars=outvars)


def _hoist_constants(jaxpr, consts: tuple):
    """(jaxpr, consts) with the arrays the mod builds from literals alone (a `jnp.arange`,
    a `jnp.linspace`) evaluated here, once, and passed in as closed-over arrays (a kernel
    reads arrays only through its inputs). Scalars computed from literals stay in place
    (constants the kernels' compilers fold); what reads a closed-over array stays in the
    mod, read per score as the arrays' own reads are (the ring passes its position map so).
    A device's index on a mesh axis (`jax.lax.axis_index` inside the user's shard_map) is
    evaluated here too, where the axis is bound, and passed in as a closed-over scalar."""
    built, pure = set(), set()  # built: arrays from literals; pure: such scalars
    from_literals = lambda x: isinstance(x, jex_core.Literal) or x in pure
    fixed, rest = [], []  # fixed: the equations of built and pure values, in order
    for eqn in jaxpr.eqns:
        mesh_dependent = eqn.primitive.name in MESH_DEPENDENT  # its effect: naming the axis
        if (eqn.effects and not mesh_dependent) or not all(from_literals(x) or x in built for x in eqn.invars):
            rest.append(eqn)
            continue
        fixed.append(eqn)
        if mesh_dependent:
            built.update(eqn.outvars)
        elif all(map(from_literals, eqn.invars)) and all(v.aval.shape == () for v in eqn.outvars):
            pure.update(eqn.outvars)
            rest.append(eqn)
        else:
            built.update(eqn.outvars)
    if not built:  # the common case: nothing evaluated on the call's path
        return jaxpr, consts
    env = {}
    read = lambda x: x.val if isinstance(x, jex_core.Literal) else env[x]
    for eqn in fixed:
        if eqn.primitive.name in MESH_DEPENDENT:  # this device's value, a value of the caller's trace
            env[eqn.outvars[0]] = eqn.primitive.bind(*map(read, eqn.invars), **eqn.params)
        else:
            env.update(zip(eqn.outvars, _bind(eqn, [read(x) for x in eqn.invars])))
    needed = []
    for x in [x for eqn in rest for x in eqn.invars] + list(jaxpr.outvars):
        if isinstance(x, jex_core.Var) and x in built and x not in needed:
            needed.append(x)
    hoisted = tuple(jnp.asarray(env[x]) for x in needed)
    # A jaxpr's constvars are the inputs with values attached (without, they are invars).
    out = jaxpr.replace(constvars=(*jaxpr.constvars, *needed), eqns=rest, consts=(*jaxpr.consts, *hoisted))
    return out, (*consts, *hoisted)


def _nested_eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs its equations hold (calls, loop bodies, branches)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for inner in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(inner, jex_core.ClosedJaxpr):
                    yield from _nested_eqns(inner.jaxpr)
                elif isinstance(inner, jex_core.Jaxpr):
                    yield from _nested_eqns(inner)


def kernel_backward_reasons(call) -> list[str]:
    """Why a kernel backend's backward cannot differentiate `call`'s mods (empty when it can):
    both kernel families trace d score_mod / d score forward into their kernels."""
    if call.score_mod is not None and call.score_mod.calls_custom_vjp:
        return ["score_mod calls a jax.custom_vjp function, whose derivative the kernels cannot trace "
                "forward (jvp) into the backward"]
    if call.score_mod is not None and call.score_mod.rule_arrays:
        return ["score_mod's custom derivative rule closes over arrays, which the kernels take only as "
                "inputs (close over them in the score_mod itself)"]
    return []


def call_mods(call) -> list[tuple[str, Mod]]:
    """(name, `Mod`) of the call's score_mod and mask_mod, those given."""
    return [(name, mod) for name, mod in ((SCORE_MOD, call.score_mod), (MASK_MOD, call.mask_mod)) if mod is not None]


def unreadable_reason(name: str, mod: Mod) -> str | None:
    """Why the kernels cannot evaluate `mod` (named `name` for the message): it uses a
    closed-over array other than by reading one element (`Mod.unreadable_arrays`)."""
    if not mod.unreadable_arrays:
        return None
    return f"{name} uses the closed-over {'; '.join(mod.unreadable_arrays)}. {UNREADABLE_HINT}"


def _dependents(jaxpr, seeds) -> set:
    """The variables of a jaxpr's top level that depend on `seeds` (a forward walk), seeds included."""
    found = set(seeds)
    for eqn in jaxpr.eqns:
        if any(isinstance(x, jex_core.Var) and x in found for x in eqn.invars):
            found.update(eqn.outvars)
    return found


def _exact_float_conversion(dtype) -> bool:
    """Whether converting a float32 score to `dtype` keeps its value (float32 itself, or wider)."""
    dtype = np.dtype(dtype)
    return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize >= 4


# Positions up to which `Mod.key_bound`'s reading of a mask is exact.
KEY_BOUND_POSITIONS = 2 ** 29


def _affine_sum(left, right, sign: int):
    """left + sign * right of two ({position: coefficient}, constant) pairs, without zero terms."""
    (left_terms, a), (right_terms, b) = left, right
    terms = {p: left_terms.get(p, 0) + sign * right_terms.get(p, 0) for p in {*left_terms, *right_terms}}
    return {p: c for p, c in terms.items() if c}, a + sign * b


def _affine_operand(x, affine: dict):
    """An operand of `Mod.key_bound`'s equations as ({position: coefficient}, constant): a
    variable it has, or an integer literal (below 2**24 in magnitude, so that the positions
    plus the constants stay far from int32's wrap-around); None otherwise."""
    if isinstance(x, jex_core.Literal):
        value = np.asarray(x.val)
        if value.ndim == 0 and np.issubdtype(value.dtype, np.integer) and abs(int(value)) < 2 ** 24:
            return {}, int(value)
        return None
    return affine.get(x)


def _used_inputs(jaxpr) -> list[bool]:
    """Which invars of a jaxpr its outputs (or its effects) depend on."""
    live = _dependencies(jaxpr, jaxpr.outvars, effects=True)
    return [v in live for v in jaxpr.invars]


def kernel_operands(consts) -> tuple:
    """The closed-over arrays as kernel inputs: booleans as int8 (Triton loads no i1), scalars as [1]."""
    out = []
    for c in consts:
        c = c.astype(jnp.int8) if c.dtype == jnp.bool_ else c
        out.append(c.reshape(1) if c.ndim == 0 else c)
    return tuple(out)


# ---- evaluation --------------------------------------------------------------------------------
def elementwise(fn, *args):
    """`fn` (a function of scalars) at every element of the broadcast of `args`.

    Arguments of shape () stay scalars (unbatched); the others are broadcast to the common
    shape and vmapped over, one vmap per axis (no reshapes: what a Triton kernel can lower).
    """
    shape = jnp.broadcast_shapes(*(jnp.shape(a) for a in args))
    args = [a if jnp.ndim(a) == 0 else jnp.broadcast_to(a, shape) for a in args]
    in_axes = tuple(None if jnp.ndim(a) == 0 else 0 for a in args)
    for _ in shape:
        fn = jax.vmap(fn, in_axes=in_axes)
    return fn(*args)


class _ConstRef(NamedTuple):
    """A closed-over array inside a kernel: its ref, and its shape and dtype as the user gave it."""

    ref: Any
    shape: tuple
    dtype: Any

    def load(self, index=()):
        value = self.ref[tuple(index)] if self.shape else self.ref[0]
        return value != 0 if self.dtype == np.bool_ else value


def _evaluate(jaxpr, consts, args) -> list:
    """Evaluates a jaxpr (constvars bound to `consts`, invars to `args`), eagerly or under a trace.

    A `_ConstRef` among the values (inside a kernel) is read, never loaded whole: the reads
    (`dynamic_slice` and point `gather`s of one element) become loads at the clamped index;
    a scalar one is loaded where it is used; nested calls are evaluated inline.
    """
    env = {}

    def read(x):
        return x.val if isinstance(x, jex_core.Literal) else env[x]

    for var, value in zip((*jaxpr.constvars, *jaxpr.invars), (*consts, *args)):
        env[var] = value
    for eqn in jaxpr.eqns:
        ins = [read(x) for x in eqn.invars]
        if any(isinstance(x, _ConstRef) for x in ins):
            outs = _with_refs(eqn, ins)
        elif eqn.primitive.name in INLINED_CALLS or (eqn.primitive.name in CUSTOM_RULES and _retyped(eqn, ins)):
            # A custom rule's programs take values that vary over the mesh axes they were
            # traced for (inside jax.shard_map): given others, its body runs inline,
            # differentiated as its operations are (the same derivative, but at a kink the
            # rule chose: relu at 0).
            outs = _evaluate(*inner_jaxpr(eqn), ins)
        else:
            outs = _bind(eqn, ins)
        for var, value in zip(eqn.outvars, outs):
            env[var] = value
    return [read(x) for x in jaxpr.outvars]


def _retyped(eqn, ins) -> bool:
    """Whether an equation's operands vary over other mesh axes than its own were traced with."""
    traced = lambda var: getattr(getattr(var.aval, "mat", None), "varying", frozenset())
    return any(varying_axes(value) != traced(var) for var, value in zip(eqn.invars, ins))


class Along(NamedTuple):
    """A `Mod.tile` argument that varies along one axis of the tile only: `values` [n], the
    tile's n positions along `axis`. Mosaic GPU holds a row's or a column's values in a
    register layout of their own, with no size-1 axis to broadcast along."""

    values: Any
    axis: int


def _evaluate_slope(jaxpr, consts, args) -> list:
    """Evaluates a (value, slope) program (`Mod._value_and_slope`) as `_evaluate` does, with
    the slope's arithmetic in fewer operations per score, as a kernel's backward runs it.

    * Products by constants, which the chain rule leaves one per step (``cap * (1/cap * g)``
      for ``cap * tanh(score / cap)``), are multiplied together first: one product, none
      where the constants' product is 1. Only where the value does not use the product (the
      value keeps every rounding of the mod's own program: the forward's logits), and only
      where each constant and their product are normal float32 numbers or an exact 0 (no
      overflow or underflow that the steps would not have had).
    * ``one_minus_square`` (tanh's derivative) of a float32 as ``1 - x * x``: one fused
      multiply-add on the GPU (rounded once, as exact as the built-in softcap's), where its
      rule computes ``(1 + x) * (1 - x)``, three operations. Not in 16-bit types, where the
      product would be rounded before the subtraction.
    """
    env = {}
    scaled = {}  # var: (c, x), a float32 value c * x not computed yet (c a float32 constant)
    value_vars = _dependencies(jaxpr, jaxpr.outvars[:1])

    def read(v):
        if isinstance(v, jex_core.Literal):
            return v.val
        if v in scaled:
            c, x = scaled.pop(v)
            env[v] = x if c == 1 else x * c
        return env[v]

    def constant(v):
        """The float32 scalar constant `v` is, or None."""
        if isinstance(v, jex_core.Literal):
            value = v.val
        elif v in scaled or xla_semantics.runtime(env[v]):
            return None
        else:
            value = env[v]
        return np.float32(value) if np.asarray(value).dtype == np.float32 else None

    def normal(c):
        return np.isfinite(c) and (c == 0 or abs(c) >= np.finfo(np.float32).tiny)

    for var, value in zip((*jaxpr.constvars, *jaxpr.invars), (*consts, *args)):
        env[var] = value
    for eqn in jaxpr.eqns:
        out = eqn.outvars[0] if len(eqn.outvars) == 1 else None  # (a debug callback has none)
        float32 = out is not None and out.aval.dtype == jnp.float32 and out.aval.shape == ()
        if eqn.primitive in (lax.mul_p, lax.neg_p) and float32 and out not in value_vars:
            if eqn.primitive is lax.neg_p:
                others, c = list(eqn.invars), np.float32(-1)
            else:
                factors = [constant(v) for v in eqn.invars]
                others = [v for v, f in zip(eqn.invars, factors) if f is None]
                c = next((f for f in factors if f is not None), None)
            if len(others) == 1 and isinstance(others[0], jex_core.Var) and others[0] not in value_vars:
                (other,) = others
                inner, x = scaled.get(other, (np.float32(1), None))
                with np.errstate(over="ignore", under="ignore", invalid="ignore"):
                    product = np.float32(inner * c)
                if normal(product) and normal(c) and (product != 0 or c == 0 or inner == 0):
                    scaled[out] = (product, read(other) if x is None else x)
                    continue
        ins = [read(v) for v in eqn.invars]
        if eqn.primitive is lax.one_minus_square_p and float32 and xla_semantics.runtime(ins[0]):
            outs = [1 - ins[0] * ins[0]]
        elif eqn.primitive.name in INLINED_CALLS:
            outs = _evaluate(*inner_jaxpr(eqn), ins)
        else:
            outs = _bind(eqn, ins)
        for var, value in zip(eqn.outvars, outs):
            env[var] = value
    return [read(v) for v in jaxpr.outvars]


def _dependencies(jaxpr, outvars, effects: bool = False) -> set:
    """The variables of a jaxpr that `outvars` (and with `effects` the equations with effects)
    depend on: a backward walk over the equations."""
    live = {v for v in outvars if isinstance(v, jex_core.Var)}
    for eqn in reversed(jaxpr.eqns):
        if any(v in live for v in eqn.outvars) or (effects and eqn.effects):
            live.update(v for v in eqn.invars if isinstance(v, jex_core.Var))
    return live


def _evaluate_tile(jaxpr, consts, args, shape: tuple | None = None, known: dict | None = None) -> list:
    """Evaluates a scalar jaxpr on a tile: `args` are scalars, arrays that broadcast against
    each other (a tile's rows [bq, 1], columns [1, bk], scores [bq, bk]) or `Along` vectors;
    the results have the tile's full shape (`shape`, or the broadcast of the arrays).

    Each equation runs, vmapped, on the tile axes its operands vary along and at the
    broadcast shape of its own operands only, so that a value of the rows alone (a row's
    document id read from a closed-over array, a position converted to float) is computed
    once per row, not once per score: a [bq, bk] gather would stage its indices and values
    through shared memory. Nested calls (jit, custom_jvp) are evaluated equation by
    equation: Mosaic GPU has no lowering rule for custom_jvp calls (jnp functions built on
    them), and each select then gets `_bind`'s typed cases. `known`: values of the program's
    variables computed before (`_uniform_values`), whose equations are not evaluated again.
    """
    arrays = [a for a in args if not isinstance(a, (_ConstRef, Along)) and jnp.ndim(a) > 0]
    rank = len(shape) if shape is not None else max(
        [jnp.ndim(a) for a in arrays] + [a.axis + 1 for a in args if isinstance(a, Along)], default=0)
    # A value is (array, axes): its leading dims span the tile axes `axes` (increasing; an
    # array argument spans all `rank`, some of size 1), the rest are the element's own.
    inputs = []
    for a in args:
        if isinstance(a, Along):
            inputs.append((a.values, (a.axis,)))
        elif isinstance(a, _ConstRef) or jnp.ndim(a) == 0:
            inputs.append((a, ()))
        else:
            if jnp.ndim(a) < rank:
                padded = (1,) * (rank - jnp.ndim(a)) + tuple(jnp.shape(a))
                a = lax.broadcast_in_dim(a, padded, tuple(range(rank - jnp.ndim(a), rank)))
            inputs.append((a, tuple(range(rank))))
    everything = tuple(range(rank))
    tile = tuple(shape) if shape is not None else _span(inputs, everything)
    outs = _evaluate_batched(jaxpr, [(c, ()) for c in consts], inputs, known)
    return [(jnp.broadcast_to(v, tile + jnp.shape(v)) if not axes else _expand(v, axes, everything, tile))
            if rank else v for v, axes in outs]


def _span(values, axes: tuple) -> tuple:
    """The broadcast extent of (value, axes) pairs along the tile axes `axes`."""
    size = dict.fromkeys(axes, 1)
    for v, own in values:
        for i, axis in enumerate(own):
            size[axis] = max(size[axis], jnp.shape(v)[i])
    return tuple(size[a] for a in axes)


def _expand(v, axes: tuple, to_axes: tuple, extent: tuple):
    """A value spanning tile `axes` broadcast to span `to_axes` (a superset) at `extent`."""
    shape = extent + tuple(jnp.shape(v)[len(axes):])
    if tuple(jnp.shape(v)) == shape:
        return v
    if axes == to_axes:
        return jnp.broadcast_to(v, shape)
    dims = [to_axes.index(a) for a in axes] + list(range(len(to_axes), len(shape)))
    return lax.broadcast_in_dim(v, shape, dims)


def _evaluate_batched(jaxpr, consts, args, known: dict | None = None, *, env_out: bool = False):
    """`_evaluate` on (value, axes) pairs (see `_evaluate_tile`): the outputs, or with `env_out`
    every variable's value. An equation with a `_VARYING` operand gives `_VARYING` results
    (`_uniform_values`), as does, with `env_out`, one with effects (evaluated where the
    program puts it); one whose results are all in `known` is not evaluated."""
    env = dict(known or {})

    def read(x):
        return (x.val, ()) if isinstance(x, jex_core.Literal) else env[x]

    for var, value in zip((*jaxpr.constvars, *jaxpr.invars), (*consts, *args)):
        env[var] = value
    for eqn in jaxpr.eqns:
        if known and eqn.outvars and all(v in known for v in eqn.outvars):
            continue
        ins = [read(x) for x in eqn.invars]
        has_ref = any(isinstance(v, _ConstRef) for v, _ in ins)
        inner = inner_jaxpr(eqn)
        if any(v is _VARYING for v, _ in ins) or (env_out and eqn.effects):
            outs = [(_VARYING, ())] * len(eqn.outvars)
        elif inner is not None:  # inline, keeping the batching
            jaxpr_, consts_ = inner
            outs = _evaluate_batched(jaxpr_, [(c, ()) for c in consts_], ins)
        elif not any(axes for _, axes in ins):
            run = _with_refs if has_ref else _bind
            outs = [(o, ()) for o in run(eqn, [v for v, _ in ins])]
        else:
            axes = tuple(sorted(set().union(*(axes for _, axes in ins))))
            outs = [(o, axes) for o in _vmapped_equation(eqn, ins, axes, has_ref)]
        for var, value in zip(eqn.outvars, outs):
            env[var] = value
    return env if env_out else [read(x) for x in jaxpr.outvars]


def _vmapped_equation(eqn, ins, axes: tuple, has_ref: bool) -> list:
    """One equation on the broadcast of its batched operands over the tile `axes` they vary
    along, vmapped over them."""
    extent = _span([(v, own) for v, own in ins if own], axes)
    if eqn.primitive is lax.select_n_p or _selected(eqn, [v for v, _ in ins]):
        # Every operand of a select spans the equation's axes: Mosaic GPU cannot broadcast a
        # scalar predicate (or case) over a tile implicitly (`where(flags[h], s, 0.5 * s)`);
        # nor those of the operations `xla_semantics` evaluates through selects (`i // sizes[h]`).
        ins = [(v.load() if isinstance(v, _ConstRef) and not v.shape else v, own) for v, own in ins]
        batched = [True] * len(ins)
    else:
        batched = [bool(own) for _, own in ins]
    batched_values = [_expand(v, own, axes, extent) for (v, own), b in zip(ins, batched) if b]
    run = _with_refs if has_ref else _bind

    def one(*values):
        values = iter(values)
        return tuple(run(eqn, [next(values) if b else v for (v, _), b in zip(ins, batched)]))

    for _ in axes:
        one = jax.vmap(one)
    return list(one(*batched_values))


# Primitives the kernels evaluate as other operations: neither lowering has a rule for them,
# and a plain mod's programs hold them. Each maps to (the primitive that runs instead, for
# `Mod.typed_primitives`, None for none; the function `_bind` applies).
REWRITTEN = {
    "add_any": ("add", lax.add),  # the sum of two cotangents in a derivative program (s * tanh(s))
    "copy": (None, lambda x: x),  # jnp.copy, and inside some jnp functions (gelu)
    "pvary": (None, lambda x: x),  # a mod traced inside jax.shard_map (see `_bind`)
}


# The kernel lowering a `TileProgram` evaluates for while it runs ("triton", "mosaic"), None
# elsewhere (XLA: the reference's own semantics).
_LOWERING = contextvars.ContextVar("flashjax_flex_lowering", default=None)


def _selected(eqn, ins) -> bool:
    """Whether `xla_semantics.evaluate` takes an equation through selects of its operands (an
    integer division, remainder or shift by a runtime amount, in a kernel)."""
    return (_LOWERING.get() is not None and eqn.primitive in xla_semantics.SELECTED
            and jnp.issubdtype(eqn.invars[0].aval.dtype, jnp.integer)
            and (isinstance(ins[1], _ConstRef) or xla_semantics.runtime(ins[1])))


def _bind(eqn, ins) -> list:
    """Applies an equation's primitive to values (as `jax.core.eval_jaxpr` does)."""
    if eqn.primitive.name == "pvary":
        # A mod traced inside jax.shard_map (check_vma=True) casts values to vary over the
        # mesh axes of the arrays it closes over; the values here may vary over other axes (the
        # derivative program's traced arrays vary over none) or none (in a kernel), so each
        # equation's operands are cast alike below instead (`vary_alike`), and a pvary is
        # the value itself, constant or not.
        return list(ins)
    params = eqn.primitive.get_bind_params(eqn.params)
    # JAX versions differ: some return (subfuns, params), others the params alone.
    subfuns, params = params if isinstance(params, tuple) else ((), params)
    if eqn.primitive is lax.select_n_p:
        # Pallas' Triton lowering (JAX 0.11.2) gives a weakly typed constant case the
        # predicate's type (a `where(c, 7, x)` becomes a select of i1 and i32, which Triton
        # rejects on the GPU): the cases enter with their own dtype, strongly typed.
        # (A constant case stays a constant, so that a select of constants still folds.)
        typed = lambda v, dtype: lax.convert_element_type(v, dtype) if xla_semantics.runtime(v) else np.asarray(v, dtype)
        ins = [ins[0], *(typed(v, var.aval.dtype) for v, var in zip(ins[1:], eqn.invars[1:]))]
    if not subfuns and all(not isinstance(v, jax.core.Tracer) and np.ndim(v) == 0 for v in ins):
        # A scalar of constants folds here, to a NumPy scalar (a literal in a kernel): Pallas'
        # Triton lowering has rules that take no constant operand (a negated constant in a
        # derivative program).
        with jax.ensure_compile_time_eval():
            outs = eqn.primitive.bind(*ins, **params)
        outs = outs if eqn.primitive.multiple_results else [outs]
        return [np.asarray(o)[()] for o in outs]
    ins = vary_alike(ins)
    lowering = _LOWERING.get()
    if lowering is not None and (outs := xla_semantics.evaluate(eqn, ins, params, lowering)) is not None:
        return outs
    if eqn.primitive.name in REWRITTEN:
        return [REWRITTEN[eqn.primitive.name][1](*ins)]
    if eqn.primitive is lax.not_p and eqn.invars[0].aval.dtype == np.bool_:
        # Mosaic GPU (JAX 0.11.2) cannot lower the not of a boolean tile ("Register bitwidth
        # ... must be divisible by 8, got 2"); an xor with True is the same value.
        return [jnp.logical_xor(ins[0], True)]
    outs = eqn.primitive.bind(*subfuns, *ins, **params)
    return outs if eqn.primitive.multiple_results else [outs]


def _equations_with_refs(jaxpr, consts):
    """(equation, which of its operands are closed-over arrays) for each equation of `jaxpr`
    (`consts`: its variables bound to closed-over arrays) and, in place of a nested call
    (`inner_jaxpr`), of the call's body, as the kernels evaluate them."""
    consts = set(consts)
    for eqn in jaxpr.eqns:
        refs = [isinstance(x, jex_core.Var) and x in consts for x in eqn.invars]
        inner = inner_jaxpr(eqn)
        if inner is not None:
            yield from _equations_with_refs(inner[0], [x for x, ref in zip(inner[0].invars, refs) if ref])
        else:
            yield eqn, refs


def _ref_read(eqn, refs) -> str | None:
    """How the kernels evaluate an equation whose operands flagged in `refs` are closed-over
    arrays (kernel refs, never loaded whole): "element", a `dynamic_slice` of one element;
    "gather", a `gather` of single elements (every axis indexed); "call", a nested call,
    evaluated inline; "scalars", every such operand a scalar, loaded where used. None: they
    cannot (a slice, a whole-array operation)."""
    name = eqn.primitive.name
    if name == "dynamic_slice" and refs[0] and not any(refs[1:]) and all(n == 1 for n in eqn.params["slice_sizes"]):
        return "element"
    if name == "gather" and refs[0] and not refs[1] and _is_point_gather(eqn):
        return "gather"
    if inner_jaxpr(eqn) is not None:
        return "call"
    if all(x.aval.shape == () for x, ref in zip(eqn.invars, refs) if ref):
        return "scalars"
    return None


def _with_refs(eqn, ins) -> list:
    """One equation that takes a closed-over array, inside a kernel (`_ref_read`)."""
    read = _ref_read(eqn, [isinstance(x, _ConstRef) for x in ins])
    if read == "element":
        # dynamic_slice clamps its start into the array: for one element, to [0, dim - 1].
        array = ins[0]
        index = [lax.clamp(jnp.int32(0), _index32(i), jnp.int32(d - 1)) for i, d in zip(ins[1:], array.shape)]
        return [array.load(index).reshape((1,) * len(array.shape))]
    if read == "gather":
        return [_point_gather(eqn, ins[0], ins[1])]
    if read == "call":
        jaxpr, consts = inner_jaxpr(eqn)
        return _evaluate(jaxpr, consts, ins)
    if read == "scalars":
        return _bind(eqn, [x.load() if isinstance(x, _ConstRef) else x for x in ins])
    arrays = ", ".join(f"{jnp.dtype(x.dtype).name}{list(x.shape)}" for x in ins if isinstance(x, _ConstRef))
    raise ValueError(f"a score_mod/mask_mod uses the closed-over array {arrays} in `{eqn.primitive.name}`. "
                     f"{UNREADABLE_HINT}")


# Why the kernels refuse a mod that uses a closed-over array whole, and what to do instead.
UNREADABLE_HINT = ("Inside the kernels a closed-over array can only be read one element per score, every axis "
                   "indexed at once (e.g. table[h, bucket], not table[h][bucket] or table * 2); compute derived "
                   "arrays before the call and close over them.")


def _index32(index):
    """An index as int32 (under x64 too), clamped into int32's range first: a cast would wrap
    a uint32 or 64-bit index past it (2**32 - 1 to -1), and the clamp into the array that
    follows would then read the first element where XLA reads the last."""
    dtype = jnp.dtype(getattr(index, "dtype", np.int32))
    info = np.iinfo(np.int32)
    if jnp.issubdtype(dtype, jnp.unsignedinteger) and dtype.itemsize >= 4:
        index = jnp.minimum(index, np.asarray(info.max, dtype))
    elif dtype.itemsize > 4:
        index = jnp.clip(index, np.asarray(info.min, dtype), np.asarray(info.max, dtype))
    return jnp.asarray(index, jnp.int32)


def _is_point_gather(eqn) -> bool:
    """Whether a gather reads single elements: every axis indexed, slices of size 1."""
    dnums = eqn.params["dimension_numbers"]
    return not (dnums.offset_dims or dnums.operand_batching_dims
                or any(size != 1 for size in eqn.params["slice_sizes"])
                or sorted(dnums.start_index_map) != list(range(len(eqn.invars[0].aval.shape))))


def _point_gather(eqn, array: _ConstRef, indices):
    """A gather of single elements (`_is_point_gather`) as a clamped load."""
    dnums = eqn.params["dimension_numbers"]
    # The index columns by lax.split, not slicing: Triton lowers a split of the last axis
    # (and jnp builds a 2-D index as a join of two columns), not lax.slice.
    n = len(dnums.start_index_map)
    parts = [indices] if n == 1 else lax.split(indices, [1] * n, axis=indices.ndim - 1)
    columns = [_index32(lax.squeeze(part, (part.ndim - 1,))) for part in parts]
    raw = [columns[dnums.start_index_map.index(d)] for d in range(len(array.shape))]
    value = array.load([lax.clamp(0, i, d - 1) for i, d in zip(raw, array.shape)])
    if eqn.params["mode"] == lax.GatherScatterMode.FILL_OR_DROP:
        inside = functools.reduce(jnp.logical_and, [(i >= 0) & (i < d) for i, d in zip(raw, array.shape)])
        fill = eqn.params.get("fill_value")
        if fill is None:
            dtype = jnp.dtype(value.dtype)
            fill = (np.nan if jnp.issubdtype(dtype, jnp.inexact) else
                    True if dtype == jnp.bool_ else np.iinfo(dtype).min if jnp.issubdtype(dtype, jnp.signedinteger)
                    else np.iinfo(dtype).max)
        value = jnp.where(inside, value, jnp.asarray(fill, value.dtype))
    return value


# Call-like primitives: their body runs once, on the equation's operands. A loop's body (scan,
# while) runs many times: loops are evaluated as primitives, never inlined.
CALLS = frozenset({"pjit", "jit", "closed_call", "core_call", "remat", "remat2", "checkpoint", "custom_jvp_call",
                   "custom_vjp_call"})
# The calls `_evaluate` inlines rather than binds: a jit recorded where the mod was traced
# carries that trace's mesh context (an Explicit mesh set with jax.set_mesh), which a
# shard_map body evaluating the mod cannot take. Custom-derivative calls keep their rules.
CUSTOM_RULES = frozenset({"custom_jvp_call", "custom_vjp_call"})
INLINED_CALLS = CALLS - CUSTOM_RULES
# Operations whose value is the device's place on a mesh axis: a kernel has no mesh axis, so
# `_hoist_constants` evaluates them where the mod is traced.
MESH_DEPENDENT = frozenset({"axis_index"})


def inner_jaxpr(eqn):
    """(jaxpr, consts) of a call-like equation (`CALLS`: jit, custom_jvp/vjp call, remat) taking
    the equation's operands; None for any other equation."""
    if eqn.primitive.name not in CALLS:
        return None
    for param in eqn.params.values():
        if isinstance(param, jex_core.ClosedJaxpr) and len(param.jaxpr.invars) == len(eqn.invars):
            return param.jaxpr, tuple(param.consts)
        if isinstance(param, jex_core.Jaxpr) and len(param.invars) == len(eqn.invars) and not param.constvars:
            return param, ()
    return None


# ---- block sparsity ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BlockMask:
    """Which tile pairs of a [q_len, kv_len] score matrix a mask_mod leaves empty, full or partial.

    A pytree (its `blocks` are the only leaf), so it can be built once and passed to many
    calls, under jit or not. Build it with `flashjax.block_mask`. Its mask_mod is static
    (with the arrays it closes over): a mask rebuilt outside jit for every step, from new
    document ids, is a new static argument and recompiles the step; build such a mask
    inside the jitted function from its traced ids instead.

    Attributes:
      blocks: int8 [Bm, Hm, ceil(q_len / block_q), ceil(kv_len / block_k)]: 0 empty (no pair
        attends), 1 partial, 2 full (every pair attends). Bm is 1 when mask_mod ignores the
        batch index, Hm when it ignores the head.
      mask_mod: the function it was built from.
      q_len, kv_len: the sequence lengths it covers.
      block_q, block_k: its tiles (powers of two).
    """

    blocks: Any
    mask_mod: Callable
    q_len: int
    kv_len: int
    block_q: int
    block_k: int


jax.tree_util.register_dataclass(
    BlockMask, data_fields=["blocks"], meta_fields=["mask_mod", "q_len", "kv_len", "block_q", "block_k"]
)


def block_mask(mask_mod, batch: int, heads: int, q_len: int, kv_len: int, *, block_q: int = 128,
               block_k: int = 128, exact: bool = False) -> BlockMask:
    """Classifies every tile pair of a mask_mod without materialising [q_len, kv_len].

    Each tile pair is recorded as empty (never loaded by the kernels), full (mask_mod is not
    evaluated there) or partial. By default mask_mod is evaluated once per tile pair, on
    intervals (`flashjax.intervals`): every value of the program bounded over the tile's
    positions. That is sound (a tile called empty or full is so at every pair, so attention
    is exact either way) and tight on the patterns masks are built from (position
    comparisons and offsets, windows, document ids read from an array, prefix lengths,
    chunks); where bounds lose a relation a truly empty or full tile is called partial and
    masked pair by pair, which costs time, not exactness. ``exact=True``, or a program with an
    operation that has no interval rule, evaluates mask_mod at every pair instead (tile row
    by tile row, or a Triton kernel on a GPU). Axes mask_mod does not read (batch, head) are
    not evaluated and broadcast.

    The result can be reused by every call with the same mask_mod and lengths (across layers,
    under jit). One built inside a jit from traced arrays belongs to that trace: build it
    outside jit, or inside the jit that uses it (used after its jit has returned, it raises). The Triton kernels re-tile it to their own tiles, exactly: a kernel tile
    covering several blocks is empty (full) when all of them are, one inside a block inherits
    its class. The default 128 x 128 matches the Triton tiles at head dims 64 and 128; a
    finer block mask skips more of an irregular mask but costs more to build.

    Args:
      mask_mod: ``mask_mod(batch, head, q_idx, kv_idx) -> bool`` on int32 scalars (True = attend).
      batch, heads: the call's batch size and number of query heads.
      q_len, kv_len: the call's sequence lengths.
      block_q, block_k: tile sizes, powers of two >= 16.
      exact: evaluate mask_mod at every (query, key) pair: the tightest classification.

    Returns:
      A `BlockMask`.
    """
    for arg, value in (("batch", batch), ("heads", heads), ("q_len", q_len), ("kv_len", kv_len)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"block_mask: {arg} must be an int >= 1, got {value!r}.")
    for arg, value in (("block_q", block_q), ("block_k", block_k)):
        if not isinstance(value, (int, np.integer)) or value < 16 or value & (value - 1):
            raise ValueError(f"block_mask: {arg} must be a power of two >= 16, got {value!r}.")
    mod, consts = trace(mask_mod, MASK_MOD)
    blocks = _classify_compiled(mod, consts, int(batch), int(heads), int(q_len), int(kv_len), int(block_q), int(block_k),
                                bool(exact))
    return BlockMask(blocks, mask_mod, int(q_len), int(kv_len), int(block_q), int(block_k))


def with_block_mask(extras, mask_mod: Mod | None, q_shape, kv_len: int, block_q: int, block_k: int, *,
                    at_trace_time: bool = False):
    """`extras` (a `params.Extras`) with the block mask of the call's mask_mod at tiles of
    block_q x block_k (the finest of a backend's kernels: each re-tiles it exactly with
    `tile_flags`); unchanged without a mask_mod or with a block mask already.

    at_trace_time: for a backend that computes its tile inputs from the block mask when the
    call is traced (the Hopper kernels' `prepare`): a constant block mask is built then too
    (`classify`). Elsewhere it stays in the program: XLA ops that read a large constant
    block mask would be folded by XLA's compiler, slowly (seconds at 16k tokens).
    """
    if mask_mod is None or extras.block_mask is not None:
        return extras
    batch, seq_q, heads = q_shape[:3]
    blocks = classify(mask_mod, extras.mask_consts, batch, heads, seq_q, kv_len, block_q, block_k,
                      at_trace_time=at_trace_time)
    return extras._replace(block_mask=BlockMask(blocks, None, seq_q, kv_len, block_q, block_k))


def tile_class(meets, full):
    """The `BlockMask.blocks` code (int32) of tiles that meet the mask somewhere / everywhere.

    Arithmetic on 0/1 rather than nested selects: the Pallas Triton lowering mistypes a
    select between scalars (its result comes out boolean) in the block-mask kernel."""
    meets, full = jnp.asarray(meets).astype(jnp.int32), jnp.asarray(full).astype(jnp.int32)
    return EMPTY + meets * ((PARTIAL - EMPTY) + (FULL - PARTIAL) * full)


# The most tiles (n_batch * n_heads * n_q * n_k, int8 each) of a block mask `classify` builds
# when the call is traced: 1 MiB, a 64k x 64k mask at 64 x 64 tiles.
TRACE_TIME_TILES = 2**20


def classify(mod: Mod, consts, batch: int, heads: int, q_len: int, kv_len: int, block_q: int, block_k: int,
             exact: bool = False, at_trace_time: bool = False):
    """The int8 [Bm, Hm, n_q, n_k] classes of `BlockMask.blocks`, for a traced mask_mod and its
    closed-over arrays: on intervals, once per tile pair (`intervals.classify`), unless
    `exact` or the program has no interval rule; then at every pair, by XLA tile row by tile
    row or (`KERNEL_BUILDER`, on a GPU) by a Triton kernel (`kernels/triton/block_mask.py`).

    at_trace_time: where the block mask is a constant (none of the mask_mod's arrays traced:
    `mods.causal()`, a window, documents closed over as concrete ids; concrete lengths, not
    jax.export's symbolic ones) and has at most `TRACE_TIME_TILES` tiles, its interval
    classification is evaluated now, when the call is traced, so that a backend's tile
    ranges and order computed from it are constants too (the Hopper forward then runs its
    persistent grid) and the compiled call computes nothing for them.
    """
    n_batch = batch if mod.uses_batch else 1
    n_heads = heads if mod.uses_head else 1
    if not exact:
        from flashjax import intervals  # it reads this module's evaluation helpers

        sizes = (n_batch, n_heads, q_len, kv_len)
        constant = (at_trace_time and not any(isinstance(c, jax.core.Tracer) for c in consts)
                    and all(isinstance(n, (int, np.integer)) for n in sizes)
                    and n_batch * n_heads * -(-q_len // block_q) * -(-kv_len // block_k) <= TRACE_TIME_TILES)
        with jax.ensure_compile_time_eval() if constant else contextlib.nullcontext():
            codes = intervals.classify(mod.jaxpr, consts, n_batch, n_heads, q_len, kv_len, block_q, block_k)
        if codes is not None:
            return codes
    if KERNEL_BUILDER and jax.default_backend() == "gpu" and not mod.unreadable_arrays:
        from flashjax.kernels.triton import block_mask as triton_block_mask  # the kernels import this module

        return triton_block_mask.classify(mod, consts, n_batch, n_heads, q_len, kv_len, block_q, block_k)
    return _classify_by_rows(mod, consts, n_batch, n_heads, q_len, kv_len, block_q, block_k)


def _classify_by_rows(mod: Mod, consts, n_batch: int, n_heads: int, q_len: int, kv_len: int, block_q: int,
                      block_k: int):
    """`classify` in XLA: a map over chunks of each query tile row's key tiles."""
    n_q, n_k = -(-q_len // block_q), -(-kv_len // block_k)
    # Each step classifies `chunk` key tiles of one query tile row.
    chunk = max(1, min(n_k, _STEP_PAIRS // (block_q * block_k)))
    n_chunks = -(-n_k // chunk)

    def classify(item):
        b, rest = jnp.divmod(item, n_heads * n_q * n_chunks)
        h, rest = jnp.divmod(rest, n_q * n_chunks)
        qi, c = jnp.divmod(rest, n_chunks)
        rows = qi * block_q + jnp.arange(block_q, dtype=jnp.int32)[:, None]
        cols = c * (chunk * block_k) + jnp.arange(chunk * block_k, dtype=jnp.int32)[None, :]
        valid = (rows < q_len) & (cols < kv_len)
        # Each value at the shape of what it depends on (a row's document id once per row).
        attend = _evaluate_tile(mod.jaxpr, tuple(consts), (b, h, rows, cols))[0]
        nonempty = jnp.any((attend & valid).reshape(block_q, chunk, block_k), axis=(0, 2))
        full = jnp.all((attend | ~valid).reshape(block_q, chunk, block_k), axis=(0, 2))
        return tile_class(nonempty, full).astype(jnp.int8)

    items = jnp.arange(n_batch * n_heads * n_q * n_chunks, dtype=jnp.int32)
    codes = lax.map(classify, items, batch_size=max(1, min(len(items), _STEP_PAIRS // (block_q * chunk * block_k))))
    return codes.reshape(n_batch, n_heads, n_q, n_chunks * chunk)[..., :n_k]


# `block_mask` called outside jit (once per step, say) compiles its builder once per traced
# mask program and shapes: a new closure over new arrays of the same shapes (a mask_mod
# built per batch) is the same `Mod`, a cache hit. Under an outer jit it is inlined.
_classify_compiled = jax.jit(classify, static_argnums=(0, 2, 3, 4, 5, 6, 7, 8))


def tile_flags(mask: BlockMask, block_q: int, block_k: int, n_q: int, n_k: int):
    """The block mask at another tiling: (meets, full) bool [Bm, Hm, n_q, n_k].

    Exact for any tile sizes: a tile meets the mask if a block it overlaps does, and is
    full if all the blocks it overlaps are (blocks past the mask's lengths count as
    full: they hold only padding, which the kernels mask). A tile inside a block inherits
    its class; tiles wholly past the mask's lengths (padding) meet nothing.
    """
    meets, full = mask.blocks != EMPTY, mask.blocks == FULL
    for axis, have, want, n in ((2, mask.block_q, block_q, n_q), (3, mask.block_k, block_k, n_k)):
        meets, full = _retile(meets, full, axis, have, want, n)
    return meets, full


def _retile(meets, full, axis: int, have: int, want: int, n: int):
    """`tile_flags` along one axis: n tiles of `want` positions from blocks of `have`.

    Tiles that are whole multiples of the blocks reduce groups of blocks (a reshape);
    tiles that divide the blocks repeat them; other sizes take, for each of the at most
    `overlap` blocks a tile can overlap, that block (static indices). On an H100 a prefix
    count (cumsum, then a difference of two gathers) gave wrong flags inside the attention
    program though not alone, so the common cases stay reshapes and repeats."""
    size = meets.shape[axis]
    if want % have == 0:
        factor = want // have
        widths = [(0, 0)] * meets.ndim
        widths[axis] = (0, -size % factor)
        # Blocks past the end are neutral: they meet nothing and do not spoil "full".
        meets = jnp.pad(meets, widths, constant_values=False)
        full = jnp.pad(full, widths, constant_values=True)
        split = meets.shape[:axis] + (meets.shape[axis] // factor, factor) + meets.shape[axis + 1:]
        meets, full = jnp.any(meets.reshape(split), axis=axis + 1), jnp.all(full.reshape(split), axis=axis + 1)
    elif have % want == 0:
        meets, full = jnp.repeat(meets, have // want, axis=axis), jnp.repeat(full, have // want, axis=axis)
    else:
        starts = np.arange(n) * want
        first = np.minimum(starts // have, size)  # the blocks [first, last) overlap tile i
        last = np.minimum((starts + want - 1) // have + 1, size)
        shape = [1] * meets.ndim
        shape[axis] = n
        met, all_full = jnp.zeros((), bool), jnp.ones((), bool)
        for k in range(int(np.max(last - first, initial=0))):
            index, overlaps = np.minimum(first + k, size - 1), jnp.asarray(first + k < last).reshape(shape)
            met = met | (jnp.take(meets, index, axis=axis) & overlaps)
            all_full = all_full & (jnp.take(full, index, axis=axis) | ~overlaps)
        inside = jnp.asarray(first < last).reshape(shape)  # tiles wholly past the blocks meet nothing
        return met & inside, all_full & inside
    # Tiles past the blocks (padding) meet nothing and are not full.
    grown = meets.shape[axis]
    if grown >= n:
        return lax.slice_in_dim(meets, 0, n, axis=axis), lax.slice_in_dim(full, 0, n, axis=axis)
    widths = [(0, 0)] * meets.ndim
    widths[axis] = (0, n - grown)
    return jnp.pad(meets, widths), jnp.pad(full, widths)


def check_block_mask(mask, mask_mod, batch: int, heads: int, seq_q: int, seq_k: int):
    """A `BlockMask` that fits the call (its lengths, broadcastable batch/head axes, the same mask_mod)."""
    if not isinstance(mask, BlockMask):
        raise ValueError(f"block_mask must be a flashjax.BlockMask (from flashjax.block_mask), got {type(mask).__name__}.")
    if (mask.q_len, mask.kv_len) != (seq_q, seq_k):
        raise ValueError(
            f"block_mask was built for q_len={mask.q_len}, kv_len={mask.kv_len}; this call has {seq_q}, {seq_k}."
        )
    bm, hm = mask.blocks.shape[:2]
    if bm not in (1, batch) or hm not in (1, heads):
        raise ValueError(f"block_mask has batch/heads ({bm}, {hm}); this call has ({batch}, {heads}).")
    try:
        own, own_consts = trace(mask.mask_mod, MASK_MOD)
        # An array of an ended trace raises where it is used (a no-op on it raises now).
        for const in own_consts:
            if isinstance(const, jax.core.Tracer):
                lax.stop_gradient(const)
    except jax.errors.UnexpectedTracerError as e:
        raise ValueError(
            "block_mask's mask_mod reads values of a transformation's trace that has ended (a BlockMask built "
            "inside a jax.jit or jax.vmap and returned from it): build it outside, or inside the same jit or "
            "vmap as the flash_attention call that uses it."
        ) from e
    for axis, built, wanted, used in zip(("batch", "heads"), (bm, hm), (batch, heads), own.uses_batch_and_head):
        if built == 1 and wanted > 1 and used:
            # Row 0's empty and full tiles would stand for every row of an axis the mask varies along.
            raise ValueError(f"block_mask was built with {axis}=1, but its mask_mod reads the {axis} index; "
                             f"build it with {axis}={wanted}.")
    if mask_mod is not None and mask_mod is not mask.mask_mod:
        given, given_consts = trace(mask_mod, MASK_MOD)
        # The same program on the same arrays (a rebuilt mod) is the same mask.
        if given != own or any(_ArrayKey(a) != _ArrayKey(b) for a, b in zip(given_consts, own_consts)):
            raise ValueError(
                "block_mask was built from another mask_mod than the one given: pass mask_mod=None "
                "(the block mask's own is used) or the same function."
            )
    return mask


def float_consts(consts) -> tuple | None:
    """The floating closed-over arrays (the differentiable ones), in order."""
    if consts is None:
        return None
    return tuple(c for c in consts if jnp.issubdtype(c.dtype, jnp.floating))


def merge_float_consts(consts, floats, others="keep"):
    """`consts` with its floating entries replaced by `floats`; the others kept (or set to `others`)."""
    if consts is None:
        return None
    floats = iter(floats)
    return tuple(next(floats) if jnp.issubdtype(c.dtype, jnp.floating) else (c if others == "keep" else others)
                 for c in consts)

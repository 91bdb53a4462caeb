"""Data and head parallelism: `flash_attention` run shard by shard, with no gather.

Attention is independent across batch rows and heads, so a batch- or head-sharded
call needs no communication at all: every device runs the kernels on its own
shard. `sharded_flash_attention` states that to JAX with `jax.shard_map`; the
kernels, their `custom_vjp` and the backward run per shard, and the only
collective left is the sum of a broadcast bias's gradient over the shards that
share it.

Why not let plain `flash_attention` under `jit` follow its inputs' sharding? The
kernel is a `pallas_call` (a Triton custom call on the GPU) that XLA's SPMD
partitioner cannot see into: it gathers the operands and runs the whole problem
on every device. `jax.experimental.custom_partitioning` can teach it a rule, but
in JAX 0.11.2 that means a Shardy rule plus a partition callback for the forward
*and* for the backward (the rule applies to a primitive, not through
`custom_vjp`), Python callbacks at compile time (no AOT export or persistent cache
of the partitioned program), and an API still marked experimental. `shard_map` is
stable, composes with `grad`, `vmap` and `jit`, and its cost is visible: a
reshard of inputs laid out differently, which XLA inserts before the call.

Sequence sharding is a different algorithm (keys live on other devices): use
`flashjax.ring.ring_attention`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from flashjax import checks, flex, vma
from flashjax.api import flash_attention

__all__ = ["sharded_flash_attention"]

# Keyword arguments of `flash_attention` that are arrays, by how they are sharded.
_BATCH_ARRAYS = ("q_lengths", "kv_lengths")
_HEAD_ARRAYS = ("alibi_slopes", "sinks")
_PAIR_ARRAYS = ("bias", "mask")  # broadcastable to [batch, heads, q_len, kv_len]


def sharded_flash_attention(q, k, v, *, mesh: Mesh, batch_axis=None, head_axis=None, **kwargs):
    """`flashjax.flash_attention` on batch- and/or head-sharded arrays, each device on its shard.

    Forward and backward run the kernels per shard with no all-gather of q, k or v.
    Call it on global arrays, inside or outside ``jit`` (on a mesh of Explicit axes,
    ``jax.make_mesh``'s default, differentiate under ``jit`` or ``jax.set_mesh``: JAX
    refuses an eager ``grad`` there). Arrays sharded otherwise along the batch or the heads
    are resharded by XLA to the layout below; arrays sharded along the sequence or the head
    dim raise (see Raises).

    Example::

      mesh = jax.make_mesh((2, 2), ("data", "model"))
      out = sharded_flash_attention(q, k, v, mesh=mesh, batch_axis="data",
                                    head_axis="model", causal=True)

    Args:
      q: queries [batch, q_len, heads, head_dim].
      k, v: keys [batch, kv_len, kv_heads, head_dim] and values [batch, kv_len, kv_heads,
        v_head_dim] (v's head dim may differ, as in `flashjax.flash_attention`).
      mesh: the device mesh.
      batch_axis: mesh axis name (or tuple of names) that splits the batch, or None.
      head_axis: mesh axis name (or tuple of names) that splits the heads, or None.
        With GQA/MQA both ``heads`` and ``kv_heads`` are split by it, so every
        device keeps whole query groups with their K/V head.
      **kwargs: any other argument of `flashjax.flash_attention`. Per-batch arrays
        (``segment_ids``, ``q_lengths``, ``kv_lengths``) follow ``batch_axis``;
        ``bias``/``mask`` follow the batch and head axes along the dims they are
        not broadcast over; ``alibi_slopes`` and ``sinks`` follow ``head_axis``, and so
        does a ``block_mask`` along its batch and head axes where it has them. A
        ``score_mod``/``mask_mod`` sees the global batch and head indices (each shard's
        offset added), and the arrays it closes over whole. Dropout draws an
        independent mask per shard (the key is folded with the shard index), so
        its bits differ from an unsharded call unless ``broadcast_dropout=True``.

    Returns:
      The output [batch, q_len, heads, v_head_dim] sharded as
      ``P(batch_axis, None, head_axis, None)`` (and with ``return_lse=True`` the lse
      [batch, heads, q_len] sharded as ``P(batch_axis, head_axis, None)``).

    Raises:
      ValueError: when neither axis is given, an axis is not on the mesh, a size
        does not divide, or q/k/v arrive sharded along the sequence or head_dim
        (use `flashjax.ring.ring_attention` for the sequence).
    """
    _check(q, k, v, mesh, batch_axis, head_axis)
    return _sharded(q, k, v, mesh, batch_axis, head_axis, kwargs)


def explicit_layout(q, k, v):
    """(mesh, batch_axis, head_axis) when q, k or v is typed on a mesh with Explicit axes (what
    JAX's ``jax.make_mesh`` builds by default), else None: q's batch and head axes, each None
    where q is not split along it."""
    mesh = _explicit_mesh(q, k, v)
    if mesh is None:
        return None
    spec = _explicit_spec(q, mesh)
    return mesh, spec[0], spec[2]


def _explicit_mesh(*arrays):
    """The first mesh of Explicit axes one of `arrays` is typed on, else None."""
    meshes = (getattr(_sharding(x), "mesh", None) for x in arrays)
    return next((m for m in meshes if m is not None and m.explicit_axes), None)


def _explicit_spec(x, mesh) -> tuple:
    """x's PartitionSpec over the mesh's Explicit axes, as a 4-tuple: what its type says under
    jit (a concrete array's own sharding may also name Auto axes of a mixed mesh, along which
    the per-shard path does not split)."""
    return tuple(checks.only_mesh_axes(_input_spec(x) or (), set(mesh.explicit_axes))) + (None,) * 4


def run_on_explicit_layout(q, k, v, layout, kwargs):
    """`flash_attention` on arrays typed on an Explicit mesh (`explicit_layout`): per shard of
    q's batch and head axes (shard_map, as `sharded_flash_attention`), after gathering any
    sequence or head_dim split (what XLA does for a Pallas call on an Auto mesh); with
    neither axis split, every device runs the whole call."""
    mesh, batch_axis, head_axis, _ = _per_shard(layout, q.shape[0], k.shape[2])
    spec = P(batch_axis, None, head_axis, None)
    q, k, v = (_place(mesh, x, spec) for x in (q, k, v))
    return _sharded(q, k, v, mesh, batch_axis, head_axis, kwargs)


def shard_call(call, layout):
    """The `Call` each device makes for `call` on arrays of an Explicit `layout`
    (`run_on_explicit_layout`): its share of the batch and of the heads (the heads whole
    where the kv heads do not divide)."""
    return _device_call(call, layout)[0]


def _device_call(call, layout):
    """(the `Call` or `DecodeCall` one device makes on an Explicit `layout`, the layout it runs
    on: `_per_shard`'s)."""
    mesh, batch_axis, head_axis, sizes = _per_shard(layout, call.batch, call.kv_heads)
    call = dataclasses.replace(call, batch=call.batch // sizes["batch_axis"], heads=call.heads // sizes["head_axis"],
                               kv_heads=call.kv_heads // sizes["head_axis"])
    return call, (mesh, batch_axis, head_axis)


def _per_shard(layout, batch: int, kv_heads: int):
    """(mesh, batch_axis, head_axis, their sizes) of the per-shard call on an Explicit `layout`:
    an axis whose size does not divide the batch, or the kv heads (MQA), dropped (that dim
    gathered)."""
    mesh, batch_axis, head_axis = layout
    sizes = checks.check_mesh_axes(mesh, batch_axis=batch_axis, head_axis=head_axis)
    if batch % sizes["batch_axis"]:
        batch_axis = None
    if kv_heads % sizes["head_axis"]:
        head_axis = None
    return mesh, batch_axis, head_axis, checks.check_mesh_axes(mesh, batch_axis=batch_axis, head_axis=head_axis)


def decode_layout(q, k_cache, paged: bool):
    """(mesh, batch_axis, head_axis) of a `decode_attention` call whose arrays are typed on a
    mesh of Explicit axes, else None. The layout follows the cache, the largest operand: its
    kv-head axis and, for a contiguous cache, its batch axis (a paged pool has none); q's
    axis for a dim where the cache has none, unless the cache splits along that mesh axis."""
    mesh = _explicit_mesh(q, k_cache)
    if mesh is None:
        return None
    q_spec, k_spec = (_explicit_spec(x, mesh) for x in (q, k_cache))
    batch_axis = None if paged else k_spec[0]
    head_axis = k_spec[2]
    taken = lambda axis: set(checks.mesh_axis_names(axis)) & set(checks.mesh_axis_names(batch_axis) +
                                                                  checks.mesh_axis_names(head_axis))
    # q's axes where the cache has none, unless the cache splits along them otherwise.
    if batch_axis is None and not taken(q_spec[0]):
        batch_axis = q_spec[0]
    if head_axis is None and not taken(q_spec[2]):
        head_axis = q_spec[2]
    return mesh, batch_axis, head_axis


def shard_decode_call(call, layout):
    """(the `DecodeCall` each device makes, the layout it runs on) for a decode `call` on an
    Explicit `layout` (`decode_layout`): an axis whose size does not divide the batch, or
    the kv heads (MQA), is dropped, and that dim is gathered."""
    return _device_call(call, layout)


def decode_per_shard(fn, q, cache, layout):
    """``fn(q, cache) -> (out, lse)``, a decode step, run per shard of `layout`'s batch and
    head axes (`shard_decode_call`), with no communication: each device reads its sequences'
    cache and its kv heads. A paged pool is split along the kv heads only (any sequence may
    own any page); the arrays laid out otherwise are resharded first.

    q [B, q_len, H, D]; cache a `KVCache`. Returns out [B, q_len, H, Dv] sharded as
    ``P(batch_axis, None, head_axis, None)`` and lse [B, H, q_len] as ``P(batch_axis, head_axis, None)``.
    """
    mesh, batch_axis, head_axis = layout
    paged = cache.page_table is not None
    heads_spec = P(None if paged else batch_axis, None, head_axis, None)
    specs = dict(k=heads_spec, v=heads_spec, lengths=P(batch_axis), page_table=P(batch_axis, None))
    names = [name for name in cache._fields if getattr(cache, name) is not None]
    arrays = [getattr(cache, name) for name in names]
    for name in ("k_scale", "v_scale"):  # [Hkv] or [num_pages, Hkv]
        if getattr(cache, name) is not None:
            specs[name] = P(*(None,) * (getattr(cache, name).ndim - 1), head_axis)
    in_specs = (P(batch_axis, None, head_axis, None), *(specs[name] for name in names))

    def local(q, *arrays):
        return fn(q, type(cache)(**dict.fromkeys(cache._fields) | dict(zip(names, arrays))))

    out_specs = (P(batch_axis, None, head_axis, None), P(batch_axis, head_axis, None))
    args = [_place(mesh, x, spec) for x, spec in zip((q, *arrays), in_specs)]
    # Checked (check_vma) only where the operands vary over the manual axes of a user's
    # shard_map with check_vma=True (one manual over some axes of an Explicit mesh): unchecked,
    # the outputs would be typed invariant over those axes, and the cotangent of an operand
    # replicated over them (sinks) would not be summed over their devices. Elsewhere
    # unchecked, so that the kernels' interpret mode runs too (the compiled kernels would
    # pass the check, `vma.py`).
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=bool(vma.varying_axes(args)))(*args)


def _sharded(q, k, v, mesh, batch_axis, head_axis, kwargs):
    functions = {name: kwargs.pop(name) for name in (flex.SCORE_MOD, flex.MASK_MOD) if kwargs.get(name) is not None}
    block_mask = kwargs.get("block_mask")
    if block_mask is not None:
        # It carries its own mask_mod: that one (with offsets) is the one the shards use.
        flex.check_block_mask(block_mask, functions.pop(flex.MASK_MOD, None), q.shape[0], q.shape[2], q.shape[1],
                              k.shape[1])
        functions[flex.MASK_MOD] = block_mask.mask_mod
        kwargs["block_mask"] = dataclasses.replace(block_mask, mask_mod=None)
    # The mods are traced here: the shards evaluate their programs on the closed-over arrays,
    # passed whole (P()) as operands, and the compiled call is cached on the programs, never
    # on the functions (which may read state that changes between calls).
    mods, consts = [], []
    for name, fn in functions.items():
        mod, mod_consts = flex.trace(fn, name)
        mods.append((name, mod, len(mod_consts)))
        consts += mod_consts
    spec = P(batch_axis, None, head_axis, None)
    names, arrays, specs = [], [], []
    static = {}
    for name, value in kwargs.items():
        array_spec = _kwarg_spec(name, value, q.shape[0], q.shape[2], batch_axis, head_axis)
        if array_spec is None:
            static[name] = value
        else:
            value, array_spec = array_spec
            names.append(name)
            arrays.append(value)
            specs.append(array_spec)
    in_specs = (spec, spec, spec, *specs, *(P() for _ in consts))
    args = [_place(mesh, x, s) for x, s in zip((q, k, v, *arrays, *consts), in_specs)]
    outer_axes = vma.varying_axes(q, k, v, arrays, consts)
    key = (mesh, batch_axis, head_axis, tuple(names), in_specs, tuple(static.items()), tuple(mods), bool(outer_axes))
    try:
        run = _shard_mapped(*key)
    except TypeError:  # an unhashable option: built for this call alone
        run = _shard_mapped.__wrapped__(*key)
    if outer_axes:
        run = _forward_only(run, outer_axes, (batch_axis, head_axis))
    return run(*args)


def _forward_only(run, outer_axes, inner_axes):
    """`run` (`_shard_mapped` checking the values' mesh axes) with a clear error for its
    gradient: JAX 0.11 cannot lower the transpose of a checked shard_map nested in a user's
    shard_map that is manual over other axes of the mesh (its residuals' shardings list
    the outer axes first, which Shardy rejects)."""

    @jax.custom_vjp
    def call(*args):
        return run(*args)

    def fwd(*args):
        return run(*args), None

    def bwd(_, cotangent):
        inner = sorted(set(checks.mesh_axis_names(inner_axes[0]) + checks.mesh_axis_names(inner_axes[1])))
        raise NotImplementedError(
            f"the gradient of flash_attention on arrays split over the Explicit mesh axes {inner} inside a "
            f"jax.shard_map with check_vma=True that is manual over {sorted(outer_axes)}: JAX cannot lower the "
            "backward of the per-shard call nested there. Make the shard_map manual over every mesh axis "
            "(axis_names), or pass check_vma=False to it (docs/distributed.md)."
        )

    call.defvjp(fwd, bwd)
    return call


@functools.lru_cache(maxsize=32)
def _shard_mapped(mesh, batch_axis, head_axis, names: tuple, in_specs: tuple, static: tuple, mods: tuple,
                  check_vma: bool):
    """`flash_attention` per shard of q's batch and head axes, under jit: jit traces the body
    even when the call is eager, where an eager shard_map would run the backends' host-side
    code op by op on its per-device values (which JAX 0.11 cannot always place on a manual
    mesh). Cached on the options and the mods' programs ((name, `flex.Mod`, count of its
    closed-over arrays), which follow the array options among the operands), so that eager
    calls in a loop compile once."""
    static = dict(static)
    return_lse = bool(static.get("return_lse", False))
    fold_dropout = static.get("dropout_rate", 0.0) > 0.0 and not static.get("broadcast_dropout", False)

    def local(q, k, v, *operands):
        options = dict(static, **dict(zip(names, operands)))
        consts = operands[len(names):]
        if mods:
            # The mods index the whole batch and all heads: this shard's first ones.
            batch_offset = checks.mesh_axes_index(mesh, batch_axis) * q.shape[0]
            head_offset = checks.mesh_axes_index(mesh, head_axis) * q.shape[2]
            for name, mod, count in mods:
                fn = _with_offsets(mod.bind(consts[:count]), name == flex.SCORE_MOD, batch_offset, head_offset)
                consts = consts[count:]
                if name == flex.MASK_MOD and options.get("block_mask") is not None:
                    # The block mask's blocks arrive split; its mask_mod is the traced one.
                    options["block_mask"] = dataclasses.replace(options["block_mask"], mask_mod=fn)
                else:
                    options[name] = fn
        if fold_dropout:
            # The kernels' dropout hash sees local batch/head indices: without this
            # every shard would draw the same mask.
            options["dropout_rng"] = jax.random.fold_in(options["dropout_rng"], checks.mesh_axes_index(mesh, batch_axis, head_axis))
        return flash_attention(q, k, v, **options)

    spec, lse_spec = P(batch_axis, None, head_axis, None), P(batch_axis, head_axis, None)
    out_specs = (spec, lse_spec) if return_lse else spec
    # Checked as `decode_per_shard` says (then forward only, `_forward_only`). Inputs with a
    # replicated spec (a bias broadcast over the batch) get their cotangents summed over the
    # devices by shard_map's transpose, which is what their broadcast means.
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma))


def _with_offsets(mod, is_score_mod: bool, batch_offset, head_offset):
    """A score_mod or mask_mod of one shard: it passes the global batch and head indices on."""
    if is_score_mod:
        return lambda score, b, h, q_idx, kv_idx: mod(score, b + batch_offset, h + head_offset, q_idx, kv_idx)
    return lambda b, h, q_idx, kv_idx: mod(b + batch_offset, h + head_offset, q_idx, kv_idx)


def _sharding(x):
    """The NamedSharding x is known to have (concrete arrays: their own; tracers: their type's), else None."""
    sharding = getattr(x, "sharding", None) if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) else None
    if sharding is None:
        try:
            sharding = jax.typeof(x).sharding
        except (AttributeError, TypeError):
            return None
    return sharding if isinstance(sharding, NamedSharding) else None


def _input_spec(x):
    """The PartitionSpec x is known to have (concrete arrays, explicit-sharding tracers), else None."""
    return getattr(_sharding(x), "spec", None)


def _check(q, k, v, mesh, batch_axis, head_axis):
    checks.check_qkv(q, k, v)
    if batch_axis is None and head_axis is None:
        raise ValueError(
            "sharded_flash_attention needs batch_axis and/or head_axis; to shard the sequence use "
            "flashjax.ring.ring_attention."
        )
    sizes = checks.check_mesh_axes(mesh, batch_axis=batch_axis, head_axis=head_axis)
    checks.check_divisible(q, k, sizes)
    for name, x in (("q", q), ("k", k), ("v", v)):
        spec = _input_spec(x)
        if spec is None:
            continue
        spec = tuple(spec) + (None,) * (4 - len(spec))
        if spec[1] is not None:
            raise ValueError(
                f"{name} is sharded along the sequence (spec {P(*spec)}): sharded_flash_attention splits only "
                "batch and heads; use flashjax.ring.ring_attention for sequence (context) parallelism, or "
                "reshard the sequence axis to None."
            )
        if spec[3] is not None:
            raise ValueError(
                f"{name} is sharded along head_dim (spec {P(*spec)}): every head needs its whole head_dim; "
                "shard the heads (head_axis) instead."
            )


def _kwarg_spec(name, value, batch, heads, batch_axis, head_axis):
    """(array, spec) for an array argument of flash_attention, None for a static one."""
    if value is None:
        return None
    if name == "segment_ids":
        if isinstance(value, (tuple, list)):
            return tuple(value), (P(batch_axis, None), P(batch_axis, None))
        return value, P(batch_axis, None)
    if name in _BATCH_ARRAYS:
        return value, P(batch_axis)
    if name in _HEAD_ARRAYS:
        return value, P(head_axis)
    if name == "block_mask":  # a pytree whose leaf, blocks [Bm, Hm, q tiles, k tiles], is split
        dim_b, dim_h = value.blocks.shape[:2]
        return value, P(batch_axis if dim_b == batch and dim_b > 1 else None,
                        head_axis if dim_h == heads and dim_h > 1 else None, None, None)
    if name == "dropout_rng":
        return value, P()
    if name in _PAIR_ARRAYS and hasattr(value, "ndim") and value.ndim <= 4:
        full = value.reshape((1,) * (4 - value.ndim) + tuple(value.shape))
        dim_b, dim_h = full.shape[0], full.shape[1]
        return full, P(batch_axis if dim_b == batch and dim_b > 1 else None,
                       head_axis if dim_h == heads and dim_h > 1 else None, None, None)
    return None


def _place(mesh: Mesh, x, spec):
    """Lays x (an array or a pair of arrays) out as spec on the mesh."""
    if isinstance(x, tuple):
        return tuple(_place(mesh, a, s) for a, s in zip(x, spec))
    return checks.place_on_mesh(mesh, x, spec)

"""The mesh axes values vary over inside `jax.shard_map` with check_vma=True (JAX's
"varying manual axes"), for the kernels: Pallas cannot infer a kernel's output types there
(`out_types` states them), and a custom VJP's cotangents must have its inputs' types
(`vary_alike` makes the inputs of one call alike). Outside shard_map, or with
check_vma=False, every value varies over no axis and these change nothing."""

from __future__ import annotations

import jax


def varying_axes(*trees) -> frozenset:
    """The mesh axes any array in `trees` varies over inside `jax.shard_map` (empty outside
    one, or with check_vma=False)."""
    axes = frozenset()
    for leaf in jax.tree.leaves(trees):
        mat = getattr(jax.typeof(leaf), "mat", None)
        axes |= mat.varying if mat is not None else frozenset()
    return axes


def vary_alike(tree, *like):
    """Every array of `tree` cast to vary over the union of the axes they (and the arrays of
    `like`) vary over: the kernels' outputs (one type for all, `out_types`) and so their
    cotangents then match each input's type, and the cast's transpose sums the gradient of
    an input replicated over an axis (k, v or a bias shared by the shards of q) over that
    axis."""
    axes = varying_axes(tree, like)
    if not axes:
        return tree

    def cast(x):
        missing = tuple(sorted(axes - varying_axes(x)))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def out_types(shapes, *inputs):
    """`shapes` (a pytree of ShapeDtypeStructs or arrays) as the ShapeDtypeStructs of a Pallas
    kernel's outputs that vary over the mesh axes of its `inputs`: inside `jax.shard_map`
    with check_vma=True, Pallas cannot infer them and asks for them."""
    mat = jax.sharding.ManualAxisType(varying=varying_axes(inputs))
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, manual_axis_type=mat), shapes)

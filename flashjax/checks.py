"""Argument checks shared by `flash_attention`, `ring_attention`, `sharded_flash_attention` and
`decode_attention`.

Each raises ValueError with a message that names the argument and says what to change.
They run before anything is traced.
"""

from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P

__all__ = [
    "check_qkv", "check_scale", "check_window", "check_static_number", "check_dropout",
    "check_segment_ids", "check_lengths", "check_slopes", "check_sinks", "check_pair_array", "mesh_axis_names", "check_mesh_axes",
    "check_cache", "check_cache_scale", "check_cache_contents", "check_num_splits",
]


def _shape_str(q, k, v) -> str:
    return f"q{tuple(q.shape)}, k{tuple(k.shape)}, v{tuple(v.shape)}"


# Positions are int32 in every backend.
MAX_POSITION = 2**31 - 1


def check_qkv(q, k, v, *, v_head_dim: bool = False):
    """q [B, Tq, H, D], k and v [B, Tk, Hkv, D], one floating (or complex) dtype, Hkv divides H.

    With `v_head_dim`, v may have its own head dim ([B, Tk, Hkv, Dv]: MLA)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ValueError(f"{name} must be an array, got {type(x).__name__}.")
        if x.ndim != 4:
            raise ValueError(
                f"{name} must have rank 4 [batch, seq, heads, head_dim], got shape {tuple(x.shape)} "
                f"({_shape_str(q, k, v)}). Use jax.vmap for extra batch dimensions."
            )
    if v_head_dim and k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"k and v must have the same shape except the head_dim ([batch, kv_len, kv_heads]), got {_shape_str(q, k, v)}."
        )
    if not v_head_dim and k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {_shape_str(q, k, v)}.")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {_shape_str(q, k, v)}.")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must have the same head_dim, got {_shape_str(q, k, v)}.")
    if min(q.shape[1], k.shape[1]) < 1:
        raise ValueError(f"sequence lengths must be >= 1, got {_shape_str(q, k, v)}.")
    heads, kv_heads = q.shape[2], k.shape[2]
    if kv_heads < 1 or heads < 1 or heads % kv_heads:
        raise ValueError(
            f"the number of query heads ({heads}) must be a multiple of the key/value heads ({kv_heads}); "
            f"got {_shape_str(q, k, v)}."
        )
    if min(q.shape[3], v.shape[3]) < 1:
        raise ValueError(f"head_dim must be >= 1, got {_shape_str(q, k, v)}.")
    dtypes = {jnp.dtype(x.dtype) for x in (q, k, v)}
    if len(dtypes) != 1:
        raise ValueError(f"q, k and v must share one dtype, got q:{q.dtype}, k:{k.dtype}, v:{v.dtype}.")
    (dtype,) = dtypes
    if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.complexfloating)):
        raise ValueError(f"unsupported dtype {dtype} for q, k, v; use a floating dtype (bfloat16, float16, float32).")
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 1:
        raise ValueError(
            f"unsupported dtype {dtype} for q, k, v: 8-bit floats are not attention inputs here; cast them to "
            "bfloat16 (decode_attention reads float8 key/value caches with their scales)."
        )


def check_static_number(name: str, value, *, what: str = "a number"):
    """`value` as a Python float; a JAX or NumPy array (even a scalar) or a bool is refused:
    these options shape the compiled kernels, so they must be known when tracing."""
    if isinstance(value, (bool, jnp.bool_)) or not isinstance(value, numbers.Real) or isinstance(value, jax.Array):
        kind = type(value).__name__
        raise ValueError(
            f"{name} must be {what} given as a static Python number (it is compiled into the kernels), "
            f"got {value!r} of type {kind}." + (" Use float(...) on a concrete value." if hasattr(value, "shape") else "")
        )
    return float(value)


def check_bool(name: str, value) -> bool:
    """A static flag (a Python or NumPy bool; a traced one cannot choose the program)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be a bool (a static Python bool), got {value!r}.")
    return bool(value)


def check_scale(scale, head_dim: int) -> float:
    """The logit scale: 1 / sqrt(head_dim) by default, else a finite Python number > 0."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    scale = check_static_number("scale", scale, what="a positive number")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be finite and > 0, got {scale}.")
    return scale


def check_softcap(softcap) -> float | None:
    if softcap is None:
        return None
    softcap = check_static_number("softcap", softcap, what="a finite number > 0 or None")
    if not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a finite number > 0 or None (None: no cap), got {softcap}.")
    return softcap


def check_window(window, span: int | None = None):
    """(left, right) with ints >= 0 or None per side; None when both sides are unbounded.

    A side of `span` or more (the call's query and key positions all lie within `span`
    of each other) reaches every key: it is returned as None, the same mask, so that a
    huge side (2**31 - 1 for "unbounded") never enters the int32 position arithmetic."""
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(f"window must be a pair (left, right) of ints >= 0 or None, got {window!r}.")
    checked = []
    for side, value in zip(("left", "right"), window):
        if value is None:
            checked.append(None)
        elif isinstance(value, numbers.Integral) and not isinstance(value, (bool, jnp.bool_)) and value >= 0:
            if value > MAX_POSITION:
                raise ValueError(f"window {side} must be at most {MAX_POSITION} (positions are int32); "
                                 f"use None for an unbounded side, got {value!r}.")
            checked.append(None if span is not None and value >= span else int(value))
        else:
            raise ValueError(f"window {side} must be an int >= 0 or None (a static Python int), got {value!r}.")
    return tuple(checked) if checked != [None, None] else None


def check_dropout(dropout_rate, dropout_rng) -> float:
    """The rate as a Python float in [0, 1); with a rate > 0, `dropout_rng` must be a PRNG key."""
    rate = check_static_number("dropout_rate", dropout_rate, what="a number in [0, 1)")
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {rate}.")
    if rate > 0.0:
        if dropout_rng is None:
            raise ValueError("dropout_rate > 0 needs a dropout_rng (a jax.random key).")
        dtype = getattr(dropout_rng, "dtype", None)
        shape = tuple(getattr(dropout_rng, "shape", (None,)))
        typed = dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key) and shape == ()
        raw_shape = _raw_key_shape()
        raw = (dtype is not None and not jnp.issubdtype(dtype, jax.dtypes.prng_key) and dtype == jnp.uint32
               and shape == raw_shape)
        if not (typed or raw):
            raise ValueError(
                "dropout_rng must be one jax.random key (jax.random.key(...) or a uint32"
                f"{list(raw_shape)} jax.random.PRNGKey(...) of the default implementation), got {dropout_rng!r}."
            )
    return rate


def _raw_key_shape() -> tuple[int, ...]:
    """The shape of a raw key of JAX's default PRNG implementation (uint32[2] for threefry,
    uint32[4] for rbg), which `jax.random.PRNGKey` returns and jax.random functions take."""
    return _raw_key_shape_of(jax.config.jax_default_prng_impl)


@functools.cache
def _raw_key_shape_of(impl: str) -> tuple[int, ...]:
    """`_raw_key_shape`, computed once per implementation (`impl`, the cache key)."""
    return tuple(jax.eval_shape(lambda: jax.random.PRNGKey(0)).shape)


def check_pair_array(name: str, x, shape: tuple[int, ...], *, floating: bool):
    """A bias or mask: broadcastable to [B, H, Tq, Tk]; returned 4-D with size-1 broadcast axes."""
    if x is None:
        return None
    if not hasattr(x, "shape"):
        raise ValueError(f"{name} must be an array broadcastable to {shape}, got {type(x).__name__}.")
    if x.ndim > 4:
        raise ValueError(f"{name} must have at most 4 dims [batch, heads, q_len, kv_len], got shape {tuple(x.shape)}.")
    full = (1,) * (4 - x.ndim) + tuple(x.shape)
    if any(d not in (1, s) for d, s in zip(full, shape)):
        raise ValueError(f"{name} of shape {tuple(x.shape)} is not broadcastable to [batch, heads, q_len, kv_len] = {shape}.")
    if floating and not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name} must be a floating array, got dtype {x.dtype}.")
    if not floating and x.dtype != jnp.bool_:
        raise ValueError(f"{name} must be a boolean array (True = attend), got dtype {x.dtype}.")
    return x.reshape(full)


def check_segment_ids(segment_ids, batch: int, seq_q: int, seq_k: int):
    """(q_ids int32 [B, Tq], kv_ids int32 [B, Tk]) from one array or a pair; (None, None) without ids.

    Ids of a dtype int32 cannot hold (int64 under x64, uint32) whose values are traced or lie
    outside int32 become their ranks (`_ranks`): the same documents, where a cast would wrap
    two ids into one."""
    if segment_ids is None:
        return None, None
    if isinstance(segment_ids, (tuple, list)):
        if len(segment_ids) != 2:
            raise ValueError("segment_ids must be an array [batch, seq] or a pair (q_segment_ids, kv_segment_ids).")
        q_ids, kv_ids = segment_ids
    else:
        if seq_q != seq_k:
            raise ValueError(
                f"segment_ids as one array needs q_len == kv_len (got {seq_q} and {seq_k}); "
                "pass a pair (q_segment_ids [batch, q_len], kv_segment_ids [batch, kv_len])."
            )
        q_ids = kv_ids = segment_ids
    fits = True
    for name, ids, length in (("q segment_ids", q_ids, seq_q), ("kv segment_ids", kv_ids, seq_k)):
        if not hasattr(ids, "shape") or tuple(ids.shape) != (batch, length):
            raise ValueError(f"{name} must have shape {(batch, length)}, got {getattr(ids, 'shape', type(ids).__name__)}.")
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(f"{name} must be integers, got dtype {ids.dtype}.")
        if not np.can_cast(ids.dtype, np.int32):
            concrete = not isinstance(ids, jax.core.Tracer)
            # In NumPy: a concrete array closed over by a jitted function would give traced
            # min / max under jit.
            values = np.asarray(ids) if concrete else None
            fits &= concrete and (not ids.size or (int(values.min()) >= -(2**31) and int(values.max()) <= MAX_POSITION))
    if not fits:
        return _ranks(q_ids, kv_ids)
    return q_ids.astype(jnp.int32), kv_ids.astype(jnp.int32)


def _ranks(q_ids, kv_ids):
    """Each batch row's q and kv ids replaced by their rank among the row's distinct ids (int32):
    equal ids stay equal, distinct ones distinct, and their order is kept (as the kernels' tile
    ranges of sorted documents need). Concrete ids are ranked in NumPy (without x64, JAX would
    take 64-bit ones as int32, wrapping them); traced ones are 64-bit only under x64."""
    concrete = not isinstance(q_ids, jax.core.Tracer) and not isinstance(kv_ids, jax.core.Tracer)
    if not concrete and not jax.config.jax_enable_x64:
        # A NumPy array int32 cannot hold beside a traced (hence int32) one.
        raise ValueError("segment_ids: one of the pair is a NumPy array with ids outside int32 and the other traced "
                         "(int32 without x64); pass both as NumPy arrays, or ids that fit int32.")
    xp = np if concrete else jnp
    both = xp.concatenate([np.asarray(q_ids), np.asarray(kv_ids)] if concrete else [q_ids, kv_ids], axis=1)
    order = xp.argsort(both, axis=1)
    ordered = xp.take_along_axis(both, order, axis=1)
    new = xp.concatenate([xp.zeros_like(ordered[:, :1], bool), ordered[:, 1:] != ordered[:, :-1]], axis=1)
    ranks = xp.cumsum(new, axis=1, dtype=np.int32)
    # Back to the ids' places: the inverse permutation of `order`.
    ranks = xp.take_along_axis(ranks, xp.argsort(order, axis=1), axis=1)
    return jnp.asarray(ranks[:, : q_ids.shape[1]]), jnp.asarray(ranks[:, q_ids.shape[1]:])


def _check_vector(name: str, x, size: int, axis: str, kind, what: str):
    """x of shape (size,) [axis] whose dtype is a `kind` (jnp.integer, jnp.floating), described as `what`."""
    if not hasattr(x, "shape"):
        raise ValueError(f"{name} must be an array of shape ({size},) [{axis}], got a {type(x).__name__} "
                         f"(pass jnp.asarray({name})).")
    if tuple(x.shape) != (size,):
        raise ValueError(f"{name} must have shape ({size},) [{axis}], got {x.shape}.")
    if not jnp.issubdtype(x.dtype, kind):
        raise ValueError(f"{name} must be {what}, got dtype {x.dtype}.")


def check_lengths(name: str, lengths, batch: int):
    """int32 [batch] (or None), clamped to [-1, MAX_POSITION] before the cast (which would wrap
    64-bit or unsigned ones): a length past the sequence means the whole sequence, and any
    negative one no position, either way; the kernels' tile arithmetic (a ceiling division
    by the tile) then cannot overflow. A concrete -1 is still refused where lengths must lie
    in the cache (`decode_attention`)."""
    if lengths is None:
        return None
    _check_vector(name, lengths, batch, "batch", jnp.integer, "integers")
    info = jnp.iinfo(lengths.dtype)
    low, high = max(info.min, -1), min(info.max, MAX_POSITION)
    if isinstance(lengths, np.ndarray):  # in NumPy: JAX would cast 64-bit ones to int32 first
        return jnp.asarray(np.clip(lengths, low, high).astype(np.int32))
    return jnp.clip(lengths, jnp.asarray(low, lengths.dtype), jnp.asarray(high, lengths.dtype)).astype(jnp.int32)


def check_sinks(sinks, heads: int):
    """float [heads] (or None); differentiable."""
    if sinks is None:
        return None
    _check_vector("sinks", sinks, heads, "heads", jnp.floating, "a floating array (a logit per head)")
    return sinks


def check_config_ints(config, *names: str, optional: tuple = ()) -> None:
    """The integer fields `names` of a frozen config dataclass, as Python ints: NumPy integers
    are converted; anything else (bools, floats, strings; None unless the field is in
    `optional`) raises a TypeError naming the field, before any kernel sees it."""
    owner = type(config).__name__
    for name in names:
        value = getattr(config, name)
        if value is None and name in optional:
            continue
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{owner}.{name} must be an int, got {value!r}.")
        object.__setattr__(config, name, int(value))


def check_slopes(slopes, heads: int, dtype=jnp.float32):
    """[heads] (or None) in float32, or in float64 for float64 inputs (`dtype`, which the
    reference computes in); not differentiated."""
    if slopes is None:
        return None
    if not hasattr(slopes, "shape") or tuple(slopes.shape) != (heads,):
        raise ValueError(f"alibi_slopes must have shape ({heads},) [heads], got {getattr(slopes, 'shape', type(slopes).__name__)}.")
    if not jnp.issubdtype(slopes.dtype, jnp.floating):
        raise ValueError(f"alibi_slopes must be a floating array (a slope per head), got dtype {slopes.dtype}.")
    wide = jnp.dtype(dtype) == jnp.float64
    return jax.lax.stop_gradient(slopes.astype(jnp.float64 if wide else jnp.float32))


# ---- KV caches (decode_attention) -----------------------------------------------------------
FLOAT8_CACHE = jnp.dtype(jnp.float8_e4m3fn)


def check_cache(q, k_cache, v_cache, page_table, v_head_dim=None) -> tuple[int, int | None, int]:
    """q [B, q_len, H, D] against a contiguous cache [B, max_len, Hkv, D] (``page_table`` None)
    or a paged one [num_pages, page_size, Hkv, D] with ``page_table`` int [B, pages_per_seq].
    v_cache has k_cache's shape but its own head dim Dv; or it is None and ``v_head_dim``
    (in [1, D]) says how many leading features of k_cache are the values (a latent cache).
    The cache has q's dtype, or float8_e4m3fn. Returns (capacity: keys per sequence,
    page_size or None, the values' head dim)."""
    caches = (("q", q), ("k_cache", k_cache)) + ((("v_cache", v_cache),) if v_cache is not None else ())
    for name, x in caches:
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ValueError(f"{name} must be an array, got {type(x).__name__}.")
        if x.ndim != 4:
            layout = "[batch, q_len, heads, head_dim]" if name == "q" else (
                "[batch, max_len, kv_heads, head_dim]" if page_table is None else "[num_pages, page_size, kv_heads, head_dim]")
            raise ValueError(f"{name} must have rank 4 {layout}, got shape {tuple(x.shape)}. Use jax.vmap for extra batch dimensions.")
    shapes = ", ".join(f"{name}{tuple(x.shape)}" for name, x in caches)
    if v_cache is None:
        if v_head_dim is None:
            raise ValueError("v_cache is None: pass v_head_dim, the leading features of k_cache that are the values "
                             "(a latent cache, e.g. MLA's 512 of 576).")
        if not isinstance(v_head_dim, (int, np.integer)) or isinstance(v_head_dim, bool) or not 1 <= v_head_dim <= k_cache.shape[3]:
            raise ValueError(f"v_head_dim must be an int in [1, k_cache's head_dim = {k_cache.shape[3]}], got {v_head_dim!r}.")
        v_head_dim = int(v_head_dim)
    else:
        if k_cache.shape[:3] != v_cache.shape[:3]:
            raise ValueError(f"k_cache and v_cache must have the same shape but for the head dim, got {shapes}.")
        if k_cache.dtype != v_cache.dtype:
            raise ValueError(f"k_cache and v_cache must share one dtype, got {k_cache.dtype} and {v_cache.dtype}.")
        if v_head_dim is not None and v_head_dim != v_cache.shape[3]:
            raise ValueError(f"v_head_dim {v_head_dim!r} is for a latent cache (v_cache None); v_cache has head dim "
                             f"{v_cache.shape[3]}.")
        v_head_dim = v_cache.shape[3]
    batch, q_len, heads, head_dim = q.shape
    if min(q.shape) < 1 or min(k_cache.shape) < 1 or (v_cache is not None and min(v_cache.shape) < 1):
        raise ValueError(f"every dimension of q and of the caches must be >= 1, got {shapes}.")
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"q and k_cache must have the same head_dim, got {shapes}.")
    kv_heads = k_cache.shape[2]
    if heads % kv_heads:
        raise ValueError(f"the number of query heads ({heads}) must be a multiple of the caches' kv_heads ({kv_heads}); got {shapes}.")
    if not jnp.issubdtype(q.dtype, jnp.floating) or jnp.dtype(q.dtype) == FLOAT8_CACHE:
        raise ValueError(f"unsupported dtype {q.dtype} for q; use a floating dtype (bfloat16, float16, float32).")
    if jnp.dtype(k_cache.dtype) not in (jnp.dtype(q.dtype), FLOAT8_CACHE):
        raise ValueError(
            f"k_cache and v_cache must have q's dtype ({q.dtype}) or float8_e4m3fn (with k_scale and v_scale), "
            f"got {k_cache.dtype}."
        )
    if page_table is None:
        if k_cache.shape[0] != batch:
            raise ValueError(
                f"a contiguous cache [batch, max_len, kv_heads, head_dim] must have q's batch size {batch}, got {shapes}; "
                "for a paged cache [num_pages, page_size, kv_heads, head_dim] pass page_table."
            )
        return k_cache.shape[1], None, v_head_dim
    if not hasattr(page_table, "shape") or page_table.ndim != 2 or page_table.shape[0] != batch or page_table.shape[1] < 1:
        raise ValueError(
            f"page_table must have shape (batch={batch}, pages_per_seq >= 1), got "
            f"{getattr(page_table, 'shape', type(page_table).__name__)} (with {shapes})."
        )
    if not jnp.issubdtype(page_table.dtype, jnp.integer):
        raise ValueError(f"page_table must be integers (page indices into k_cache's first axis), got dtype {page_table.dtype}.")
    page_size = k_cache.shape[1]
    return page_table.shape[1] * page_size, page_size, v_head_dim


def check_cache_scale(name: str, scale, cache_dtype, kv_heads: int, num_pages: int | None):
    """A float8 cache's dequantisation scale: float [kv_heads], or [num_pages, kv_heads] for a
    paged cache; None for other caches. Returned as float32."""
    if jnp.dtype(cache_dtype) != FLOAT8_CACHE:
        if scale is not None:
            raise ValueError(f"{name} is for a float8_e4m3fn cache; this cache is {jnp.dtype(cache_dtype).name}: pass {name}=None.")
        return None
    if scale is None:
        raise ValueError(f"a float8_e4m3fn cache needs {name} (float32 [kv_heads], or [num_pages, kv_heads] for a paged cache; "
                         "jnp.ones(kv_heads) for an unscaled one).")
    shapes = [(kv_heads,)] + ([(num_pages, kv_heads)] if num_pages is not None else [])
    if not hasattr(scale, "shape") or tuple(scale.shape) not in shapes:
        raise ValueError(
            f"{name} must have shape {' or '.join(map(str, shapes))} ([kv_heads]"
            f"{', or [num_pages, kv_heads] per page' if num_pages is not None else '; per-page scales need a paged cache'}), "
            f"got {getattr(scale, 'shape', type(scale).__name__)}."
        )
    if not jnp.issubdtype(scale.dtype, jnp.floating):
        raise ValueError(f"{name} must be floating, got dtype {scale.dtype}.")
    return scale.astype(jnp.float32)


def _concrete(x):
    """x as a numpy array, or None when it is traced (under jit or vmap: not checkable)."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def check_cache_contents(kv_lengths, page_table, capacity: int, page_size: int | None, num_pages: int | None):
    """Concrete lengths lie in [0, capacity] and the page-table entries a sequence uses (its
    first cdiv(length, page_size)) in [0, num_pages). Traced values are not checked."""
    lengths = _concrete(kv_lengths)
    if lengths is None:
        return
    bad = np.flatnonzero((lengths < 0) | (lengths > capacity))
    if bad.size:
        where = "max_len" if page_table is None else "pages_per_seq * page_size"
        raise ValueError(
            f"kv_lengths must lie in [0, {capacity}] (the cache's {where}); sequence {int(bad[0])} has {int(lengths[bad[0]])}."
        )
    table = None if page_table is None else _concrete(page_table)
    if table is None:
        return
    used = np.arange(table.shape[1])[None, :] < -(-lengths[:, None] // page_size)
    out = used & ((table < 0) | (table >= num_pages))
    if out.any():
        b, p = (int(i[0]) for i in np.nonzero(out))
        raise ValueError(
            f"page_table[{b}, {p}] = {int(table[b, p])} is not a page of the cache (0 <= page < {num_pages}); "
            f"sequence {b} uses its first {-(-int(lengths[b]) // page_size)} entries."
        )


def check_num_splits(num_splits) -> int | None:
    if num_splits is None:
        return None
    if isinstance(num_splits, (bool, jnp.bool_)) or not isinstance(num_splits, numbers.Integral) or num_splits < 1:
        raise ValueError(f"num_splits must be None (chosen per call) or a static Python int >= 1, got {num_splits!r}.")
    return int(num_splits)


# ---- mesh axes ------------------------------------------------------------------------------
def mesh_axis_names(axis) -> tuple[str, ...]:
    """A mesh axis argument (None, a name, or a tuple of names) as a tuple of names."""
    if axis is None:
        return ()
    return tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)


def mesh_axes_index(mesh, *axes):
    """Inside shard_map: this device's linear index over the mesh axes named by `axes` (each
    None, a name or a tuple of names), 0 without any."""
    index = 0
    for axis in axes:
        for name in mesh_axis_names(axis):
            index = index * mesh.shape[name] + jax.lax.axis_index(name)
    return index


def place_on_mesh(mesh, x, spec):
    """x laid out as `spec` (a PartitionSpec) on `mesh`: along Explicit axes by `jax.reshard`
    (such meshes type arrays by their layout, and shard_map wants its inputs typed exactly
    as its in_specs), along Auto ones by a sharding constraint (a mesh may mix both kinds)."""
    explicit = set(mesh.explicit_axes)
    if not explicit:
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
    x = jax.reshard(x, NamedSharding(mesh, only_mesh_axes(spec, explicit)))
    auto = only_mesh_axes(spec, set(mesh.axis_names) - explicit)
    if any(entry is not None for entry in auto):
        x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, auto))
    return x


def only_mesh_axes(spec, names) -> P:
    """`spec` with the mesh axes outside `names` removed (an entry left empty becomes None)."""
    kept = []
    for entry in spec:
        entry = tuple(name for name in mesh_axis_names(entry) if name in names)
        kept.append(None if not entry else entry[0] if len(entry) == 1 else entry)
    return P(*kept)


def check_mesh_axes(mesh, **axes) -> dict[str, int]:
    """Checks keyword mesh-axis arguments (e.g. ``batch_axis="data"``): every name is an
    axis of the mesh and no name is used twice. Returns each argument's total size."""
    if not isinstance(mesh, (Mesh, AbstractMesh)):
        raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
    used = []
    sizes = {}
    for arg, axis in axes.items():
        names = mesh_axis_names(axis)
        for name in names:
            if name not in mesh.shape:
                raise ValueError(f"{arg} {name!r} is not an axis of the mesh (axes: {tuple(mesh.shape)}).")
        used += names
        sizes[arg] = math.prod(mesh.shape[name] for name in names)
    if len(set(used)) != len(used):
        raise ValueError(f"{', '.join(axes)} must name distinct mesh axes, got {used}.")
    return sizes


def check_divisible(q, k, sizes: dict[str, int], batch_arg: str = "batch_axis", head_arg: str = "head_axis"):
    """The batch splits over `batch_arg`'s size; heads and kv_heads over `head_arg`'s."""
    batch, heads, kv_heads = q.shape[0], q.shape[2], k.shape[2]
    n_batch, n_head = sizes.get(batch_arg, 1), sizes.get(head_arg, 1)
    if batch % n_batch:
        raise ValueError(f"batch {batch} is not divisible by the size {n_batch} of {batch_arg}.")
    if heads % n_head or kv_heads % n_head:
        raise ValueError(
            f"heads ({heads}) and kv_heads ({kv_heads}) must both be divisible by the size {n_head} of {head_arg}: "
            "each device keeps whole query groups with their K/V head. Shard fewer ways or replicate the K/V heads."
        )

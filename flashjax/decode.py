"""`decode_attention`: a few new queries per sequence against a KV cache (decoding, chunked
prefill, speculative verification); forward only. Argument checks, then the registry
(`backends.choose_decode`), then the chosen backend's `Decoder`."""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np

from flashjax import backends, checks
from flashjax.kernels.common import fold_sinks
from flashjax.params import DecodeCall, DecodeParams, KVCache
from flashjax.vma import varying_axes

__all__ = ["decode_attention", "explain_decode"]


def decode_attention(
    q,
    k_cache,
    v_cache,
    kv_lengths,
    *,
    page_table=None,
    causal: bool = True,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    backend: str = "auto",
    k_scale=None,
    v_scale=None,
    num_splits: int | None = None,
    config=None,
    v_head_dim: int | None = None,
    sinks=None,
):
    """Attention of a few new queries per sequence over a KV cache, read in place.

    Sequence ``b`` holds ``L = kv_lengths[b]`` tokens in the cache, the new queries' own
    keys included (write them into the cache first). Its query ``i`` sits at key position
    ``i' = L - q_len + i``: the masks are aligned to the bottom right of each sequence's
    *own* length. Per sequence and query head ``h`` (kv head ``g = h // (heads // kv_heads)``)::

      logits = scale * q[h] @ k[g, :L]^T                 # k dequantised: k_cache * k_scale
      logits = softcap * tanh(logits / softcap)          # if softcap
      logits = -inf where j > i' (causal), or outside [i' - left, i' + right] (window)
      out = softmax(logits) @ v[g, :L]

    This is `flash_attention(q, k[:, :L], v[:, :L], causal=..., window=...)` per sequence.
    A query that sees no key (``L = 0``, or ``i' < 0`` under ``causal``: a sequence shorter
    than the chunk) outputs 0 with lse ``-inf``. Forward only: it is for inference, and
    ``jax.grad`` through it with respect to q or the caches raises (the sinks, merged
    outside the kernel, do get a gradient); train with `flashjax.flash_attention`. Works under
    ``jit`` and ``vmap``.

    Arrays typed on a mesh of Explicit axes (``jax.make_mesh``'s default) run per shard, with
    no collective, along the cache's batch and kv-head axes (q's where the cache has none and
    does not use that mesh axis; a paged pool is split along its kv heads only, since any
    sequence may own any page): each device reads its own sequences and heads of the cache.
    Arrays laid out otherwise are resharded to that layout first. On a mesh of Auto axes XLA
    gathers the inputs.

    The Triton kernel (``backend="triton"``, what ``auto`` takes where it can) splits each
    sequence's keys over several programs (flash-decoding), reads every K/V byte once per
    kv head for all the query heads of its group, follows the page table in the kernel,
    skips the tiles past each length or outside the window, and dequantises float8 tiles
    in registers (with bfloat16 or float16 queries its products then run in float16, q
    scaled by a power of two per row); the splits are merged exactly through their
    logsumexps.

    Example::

      # 8 sequences, one new token each, 32 query heads over 8 kv heads, a paged bf16 cache
      out = flashjax.decode_attention(q, k_pages, v_pages, lengths, page_table=table)
      # q [8, 1, 32, 128]; k_pages, v_pages [num_pages, 64, 8, 128]; table int32 [8, pages_per_seq]

    Args:
      q: new queries [batch, q_len, heads, head_dim]; q_len is small (1 for decoding, up
        to a few hundred for chunked prefill or speculative verification).
      k_cache: keys, contiguous [batch, max_len, kv_heads, head_dim], or paged
        [num_pages, page_size, kv_heads, head_dim] with ``page_table``. Same dtype as q,
        or float8_e4m3fn with ``k_scale`` and ``v_scale``. ``kv_heads`` divides ``heads``.
      v_cache: values, the shape and dtype of ``k_cache`` but for the head dim, which may
        differ (``v_head_dim``; MLA's 128 values for 192-dim keys). ``None`` for a latent
        cache (absorbed MLA, FlashMLA's layout): the values are then the first
        ``v_head_dim`` features of ``k_cache`` itself (e.g. 512 of 576), read once.
      kv_lengths: int [batch]: tokens held by each sequence, in [0, capacity] (``max_len``,
        or ``pages_per_seq * page_size``). Keys at or past it get no weight, whatever
        their slots hold (stale tokens, a NaN). Except with ``backend="mosaic"``, which
        reads the key tile that holds the length whole: there the slots past the length
        in that tile, and the pages it reaches through the table's entries past the
        sequence's last page, must hold finite values (a NaN would reach the output as 0 * NaN).
      page_table: int [batch, pages_per_seq]: page ``p`` of sequence ``b`` (its keys
        ``p * page_size ...``) is ``k_cache[page_table[b, p]]``. Entries past a sequence's
        last page may hold anything (e.g. -1): a tile that reaches them reads some page of
        the pool, whose keys get no weight.
      causal: query ``i`` attends keys ``j <= i'`` (default True: the new tokens see the
        cache and each other causally).
      window: ``(left, right)``: query ``i`` attends keys ``i' - left <= j <= i' + right``;
        ``None`` for an unbounded side. With ``causal`` the right side is 0.
      softcap: if set (a static number > 0), ``softcap * tanh(logits / softcap)``.
      scale: logit scale (static); defaults to ``1 / sqrt(head_dim)``.
      return_lse: also return the row logsumexp ``[batch, heads, q_len]`` (natural log,
        float32; ``-inf`` for queries without keys).
      backend: ``"auto"`` (default), ``"triton"`` (the split-KV kernel; interpret mode
        without a GPU), ``"mosaic"`` (on an H100: the Hopper forward kernel on a bf16/fp16
        cache split in place, contiguous or in pages of a multiple of 64 keys; ``auto``
        passes it by, the Triton kernel being as fast or faster) or ``"xla"`` (the
        reference: gathers the pages, dequantises, masks by the lengths and materialises
        the scores). ``auto`` takes the first backend of the
        platform's order (`flashjax.backends`) whose decode path supports the call and
        does not decline it. A named backend that cannot run the call raises
        ``NotImplementedError`` with its reasons.
      k_scale, v_scale: float32 dequantisation scales of a float8 cache (the cache holds
        value / scale): per kv head ``[kv_heads]``, or per page ``[num_pages, kv_heads]``
        for a paged cache. Required with a float8 cache, refused with another.
      num_splits: parts each sequence's keys are split into (a static int), ``None`` to
        choose from the batch, kv heads, cache length and the GPU's SM count
        (`flashjax.kernels.triton.decode.num_splits`); at most the cache's key tiles (a
        larger count is cut to it). The xla backend ignores it.
      config: the decode kernel's tiling, `flashjax.DecodeConfig` (``block_k``,
        ``num_warps``, ``num_stages``), which selects the Triton backend; ``None`` for its
        default.
      v_head_dim: with ``v_cache=None``, the values' head dim, in [1, head_dim] (a float8
        latent cache then takes ``k_scale`` only). Otherwise ``None`` (v_cache's own).
      sinks: float ``[heads]``, a logit per query head that joins every row's softmax
        denominator and contributes no value (gpt-oss's attention sinks), as in
        `flash_attention`; folded in exactly after the splits are merged. A query without
        keys then has lse = its sink's logit (and output 0).

    Returns:
      The output ``[batch, q_len, heads, v_head_dim]`` (v_head_dim = v_cache's head dim,
      or the argument) in q's dtype, and with ``return_lse=True`` a pair ``(output, lse)``.

    Raises:
      ValueError: for inconsistent shapes or dtypes, a page table that does not fit,
        scales that do not fit the cache, bad options, and (for concrete arrays) lengths
        outside [0, capacity] or used page-table entries outside [0, num_pages); the
        message names the argument. (Checking a concrete array reads it to the host, a
        device sync per call: call it under ``jit`` in a decoding loop.) Traced lengths and page tables (under ``jit`` or
        ``vmap``) cannot be checked: lengths are then clamped to [0, capacity] and page
        indices to [0, num_pages), so no read leaves the cache, but a bad value gives a
        wrong result rather than an error.
      NotImplementedError: when the named backend cannot run the call; under
        ``jax.grad`` with respect to q or the caches (the kernel has no gradient). Under
        ``jax.jvp`` JAX itself raises (a TypeError: no forward-mode derivative of a
        custom_vjp function). Under ``jax.lax.stop_gradient`` of its output the step runs.
    """
    cache, call, params = _prepare(
        q, k_cache, v_cache, kv_lengths, page_table=page_table, causal=causal, window=window, softcap=softcap,
        scale=scale, k_scale=k_scale, v_scale=v_scale, num_splits=num_splits, v_head_dim=v_head_dim,
    )
    sinks = checks.check_sinks(sinks, q.shape[2])
    return_lse = checks.check_bool("return_lse", return_lse)
    call, layout = _per_device(q, cache, call)
    choice = backends.choose_decode(call, backend, config)
    with jax.named_scope("decode_attention"):
        out, lse = _decode(q, cache, sinks, DecodeParams(**params, backend=choice.backend, config=config), layout)
    return (out, lse) if return_lse else out


def explain_decode(q, k_cache, v_cache, kv_lengths, *, backend: str = "auto", config=None, **options) -> backends.Choice:
    """Which backend `decode_attention` runs this call on, and why the ones before it do not.

    Takes the arguments of `decode_attention` (arrays or ``jax.ShapeDtypeStruct``s) and runs
    no kernel (with concrete arrays, it checks the lengths' range as decode_attention does):
    ``print(flashjax.explain_decode(q, k_cache, None, lengths, v_head_dim=512))`` shows the
    backend chosen and each backend ``auto`` tried before it with its reasons.

    Args:
      q, k_cache, v_cache, kv_lengths: as `decode_attention`'s (q [batch, q_len, heads,
        head_dim]; caches [batch, max_len, kv_heads, head_dim] or pools [num_pages,
        page_size, kv_heads, head_dim]; kv_lengths int [batch]); arrays or
        ``jax.ShapeDtypeStruct``s.
      backend, config: as `decode_attention`'s.
      **options: any other keyword argument of `decode_attention` (``page_table``,
        ``k_scale``, ``v_head_dim``, ...).

    Returns:
      A `flashjax.backends.Choice` (its ``backend`` field names the one chosen).
    """
    # decode_attention's own signature: its defaults, and a TypeError for an unknown keyword.
    bound = inspect.signature(decode_attention).bind(q, k_cache, v_cache, kv_lengths, **options)
    bound.apply_defaults()
    taken = {name: bound.arguments[name] for name in inspect.signature(_prepare).parameters}
    # NumPy scalars (np.float32(0.5) as the scale) are static options, as decode_attention takes them.
    arrays = {name: value for name, value in taken.items() if hasattr(value, "shape") and not isinstance(value, np.generic)}
    static = {name: value for name, value in taken.items() if name not in arrays}
    concrete = all(isinstance(x, (np.ndarray, jax.Array)) and not isinstance(x, jax.core.Tracer)
                   for x in arrays.values())
    if concrete:  # every check decode_attention makes, the lengths' range included (a few [batch] ops)
        described = [_prepare(**taken)[1]]
    else:  # under eval_shape: checks and describes, computes nothing
        described = []
        jax.eval_shape(lambda arrays: described.append(_prepare(**arrays, **static)[1]), arrays)
    checks.check_sinks(bound.arguments["sinks"], q.shape[2])
    call, _ = _per_device(q, KVCache(k_cache, v_cache, None, bound.arguments["page_table"]), described[0])
    return backends.choose_decode(call, backend, config)


def _per_device(q, cache: KVCache, call: DecodeCall):
    """(the call one device makes, the Explicit layout it runs on or None): on arrays typed on
    a mesh of Explicit axes the step runs per shard (`sharding.decode_per_shard`)."""
    from flashjax import sharding  # imports the API, which imports this module

    layout = sharding.decode_layout(q, cache.k, paged=cache.page_table is not None)
    return (call, None) if layout is None else sharding.shard_decode_call(call, layout)


def _prepare(q, k_cache, v_cache, kv_lengths, *, page_table, causal, window, softcap, scale, k_scale, v_scale,
             num_splits, v_head_dim):
    """Checks the arguments; returns (KVCache, DecodeCall, DecodeParams fields without the backend)."""
    capacity, page_size, v_head_dim = checks.check_cache(q, k_cache, v_cache, page_table, v_head_dim)
    latent = v_cache is None
    if latent and v_scale is not None:
        raise ValueError("v_scale is for a separate v_cache: a latent cache's values are k_cache's features and "
                         "share k_scale.")
    batch, q_len, heads, head_dim = q.shape
    num_pages, kv_heads = (k_cache.shape[0] if page_size is not None else None), k_cache.shape[2]
    if kv_lengths is None:
        raise ValueError("kv_lengths is required: int [batch], the tokens each sequence holds in the cache.")
    lengths = checks.check_lengths("kv_lengths", kv_lengths, batch)
    k_scale = checks.check_cache_scale("k_scale", k_scale, k_cache.dtype, kv_heads, num_pages)
    if latent:
        v_scale = k_scale
    v_scale = checks.check_cache_scale("v_scale", v_scale, k_cache.dtype, kv_heads, num_pages)
    if k_scale is not None and k_scale.shape != v_scale.shape:
        raise ValueError(f"k_scale and v_scale must both be per kv head or both per page, got {k_scale.shape} and {v_scale.shape}.")
    checks.check_cache_contents(kv_lengths, page_table, capacity, page_size, num_pages)  # the values passed, unclamped
    checks.check_bool("causal", causal)
    window = checks.check_window(window, span=capacity + q_len)
    softcap = checks.check_softcap(softcap)
    scale = checks.check_scale(scale, head_dim)
    num_splits = checks.check_num_splits(num_splits)
    cache = KVCache(k_cache, v_cache, lengths, page_table, k_scale, v_scale)
    platform, capability = backends.describe_device()
    call = DecodeCall(
        batch=batch, q_len=q_len, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=jnp.dtype(q.dtype),
        cache_dtype=jnp.dtype(k_cache.dtype), capacity=capacity, page_size=page_size,
        scales=None if k_scale is None else ("head" if k_scale.ndim == 1 else "page"), causal=bool(causal),
        window=window, softcap=softcap, platform=platform, compute_capability=capability,
        v_head_dim=v_head_dim, latent=latent, varying_axes=tuple(sorted(varying_axes(q, cache))),
    )
    params = dict(
        scale=scale, causal=bool(causal), window=window, softcap=softcap, num_splits=num_splits,
        sm_count=backends.sm_count(), interpret=platform != "gpu", v_head_dim=v_head_dim if latent else None,
    )
    return cache, call, params


@functools.partial(jax.jit, static_argnums=(3, 4))
def _decode(q, cache: KVCache, sinks, params: DecodeParams, layout):
    step = functools.partial(_step, params=params)
    if layout is None:
        out, lse = step(q, cache)
    else:
        from flashjax import sharding

        out, lse = sharding.decode_per_shard(step, q, cache, layout)
        mesh, _, head_axis = layout
        if sinks is not None:  # laid out as the heads of the lse they join
            sinks = checks.place_on_mesh(mesh, sinks, jax.sharding.PartitionSpec(head_axis))
    if sinks is not None:
        out, lse = fold_sinks(out, lse, sinks)
    # The backends return float32 outputs: rounded to q's dtype once, after the sinks.
    return out.astype(q.dtype), lse


def _step(q, cache: KVCache, params: DecodeParams):
    # Traced values escape the API's checks: keep every read inside the cache.
    lengths = jnp.clip(cache.lengths, 0, cache.capacity)
    if cache.page_table is not None:
        # Clipped before the cast: an int64 entry past int32 (under x64) must not wrap into range.
        cache = cache._replace(page_table=jnp.clip(cache.page_table, 0, cache.k.shape[0] - 1).astype(jnp.int32))
    return _forward_only(q, cache._replace(lengths=lengths), params)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _forward_only(q, cache: KVCache, params: DecodeParams):
    return backends.get(params.backend).decode.run(q, cache, params)


def _forward_only_fwd(q, cache: KVCache, params: DecodeParams):
    return _forward_only(q, cache, params), None


def _forward_only_bwd(params: DecodeParams, residuals, cotangents):
    raise NotImplementedError(
        "flashjax.decode_attention is forward only (inference): it has no gradient. "
        "Train with flashjax.flash_attention, which is differentiable (it takes kv_lengths for padded caches)."
    )


_forward_only.defvjp(_forward_only_fwd, _forward_only_bwd)

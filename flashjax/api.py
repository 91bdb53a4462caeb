"""`flash_attention` and `explain`: argument checks, normalisation, then the backend registry."""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np

from flashjax import autodiff, backends, checks, dropout, flex
from flashjax.params import AttentionParams, Call, Extras
from flashjax.vma import varying_axes

__all__ = ["flash_attention", "explain"]


def flash_attention(
    q,
    k,
    v,
    *,
    causal: bool = False,
    scale: float | None = None,
    bias=None,
    mask=None,
    segment_ids=None,
    q_lengths=None,
    kv_lengths=None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    alibi_slopes=None,
    score_mod=None,
    mask_mod=None,
    block_mask=None,
    sinks=None,
    dropout_rate: float = 0.0,
    dropout_rng=None,
    broadcast_dropout: bool = False,
    float32_residual: bool = False,
    return_lse: bool = False,
    backend: str = "auto",
    config=None,
):
    """Exact attention, computed tile by tile without materialising the scores.

    Computes, per batch row and query head ``h``::

      logits = scale * q[h] @ k[g]^T                      # g = h // (heads // kv_heads)
      logits = score_mod(logits, b, h, i, j)              # if score_mod (float32, per element)
      logits = softcap * tanh(logits / softcap)           # if softcap
      logits = logits + bias - alibi_slope[h] * |i' - j|  # if bias / alibi_slopes
      logits = -inf where the pair is masked               # causal, window, segments, lengths, mask, mask_mod
      out = softmax([logits, sink[h]])[:-1] @ v[g]         # the sink only with sinks; dropout on the weights

    with FlashAttention kernels on a GPU. Query ``i`` sits at key position
    ``i' = i + kv_len - q_len`` (bottom-right alignment); ``i'`` uses the array lengths,
    not ``q_lengths``/``kv_lengths``; ``score_mod`` and ``mask_mod`` see the plain
    positions ``i`` and ``j`` in the call's arrays. Differentiable in ``q``, ``k``, ``v``,
    ``bias``, ``sinks`` and the float arrays ``score_mod`` closes over (and through the
    logsumexp with ``return_lse=True``); works under ``jit``, ``grad``, ``vmap`` and
    ``jax.checkpoint``. The kernels' gradient is a first-order reverse-mode rule (a custom
    VJP): forward mode (``jax.jvp``, ``jax.jacfwd``) and second derivatives need
    ``backend="xla"``.

    A row whose keys are all masked (by any option, including a bias of ``-inf`` or of
    float32's or bfloat16's ``finfo.min``, Flax's masking idiom: bias values at or below
    -1.7014e38 mask their key; float16's -65504 does not)
    outputs 0, with lse ``-inf`` (the sink's logit with ``sinks``) and zero gradients,
    never NaN. (``jax.nn`` and Flax return the mean of the values for such rows.)

    Arrays typed on a mesh of Explicit axes (``jax.make_mesh``'s default) run per shard
    along q's batch and head axes, as `flashjax.sharded_flash_attention` runs them (a
    sequence or head_dim split is gathered first); on a mesh of Auto axes XLA gathers the
    inputs, and `sharded_flash_attention` states the layout instead.

    Example::

      q = jax.random.normal(key, (2, 1024, 8, 64), jnp.bfloat16)
      out = flashjax.flash_attention(q, q, q, causal=True)   # [2, 1024, 8, 64]

    Args:
      q: queries [batch, q_len, heads, head_dim].
      k: keys [batch, kv_len, kv_heads, head_dim]; ``kv_heads`` divides ``heads``
        and query head ``h`` uses kv head ``h // (heads // kv_heads)`` (grouped-query
        and multi-query attention, without copying K/V).
      v: values [batch, kv_len, kv_heads, v_head_dim]: the shape of ``k`` except that the
        head dim may differ (MLA: 192 for q and k, 128 for v); the output has v's head dim.
        Every backend takes it; the Hopper kernels only where v's head dim is at most q's
        (they write the output through the queries' shared memory).
      causal: query ``i`` attends keys ``j <= i'``. With ``q_len != kv_len`` the mask
        is aligned to the bottom right, as in FlashAttention-2: the last query sees
        every key, so a decode step against a KV cache sees the whole cache.
      scale: logit scale (a static Python number); defaults to ``1 / sqrt(head_dim)``.
      bias: additive float bias broadcastable to ``[batch, heads, q_len, kv_len]``,
        read tile by tile (never expanded); added after the softcap. ``-inf`` and
        values at or below -1.7014e38 (float32's or bfloat16's ``finfo.min``, not
        float16's) mask their key. Its gradient is
        reduced over the axes it broadcasts along.
      mask: boolean, broadcastable to ``[batch, heads, q_len, kv_len]``; True = attend
        (the convention of ``jax.nn.dot_product_attention`` and Flax). Broadcasting aligns
        the trailing axes: a 3-D ``[batch, q_len, kv_len]`` mask is read as ``[heads,
        q_len, kv_len]`` (an error unless batch == heads, a wrong mask if they are equal);
        pass ``mask[:, None]``.
      segment_ids: int ``[batch, seq]`` (self-attention) or a pair
        ``([batch, q_len], [batch, kv_len])``: a query attends only keys of its own
        segment (packed sequences). Tiles that share no segment are skipped.
      q_lengths, kv_lengths: int ``[batch]``, right padding: keys at or past
        ``kv_lengths`` get no weight; query rows at or past ``q_lengths`` output 0,
        with lse ``-inf`` and 0 gradient. Tiles past a length are not loaded. A length past
        the sequence counts as the whole sequence and a negative one as none (unchecked:
        lengths are usually traced). Values past ``kv_lengths`` must be finite: a NaN
        there reaches the rows that read its tile (0 * NaN), as with any mask.
      window: ``(left, right)`` sliding window: query ``i`` attends keys ``j`` with
        ``i' - left <= j <= i' + right``; ``None`` for an unbounded side; combine with
        ``causal=True`` for ``right = 0``. Tiles outside the band are skipped.
      softcap: if set (a finite static number > 0), ``softcap * tanh(logits / softcap)``
        (Gemma-2 style), applied to ``scale * q @ k^T`` before bias and ALiBi.
      alibi_slopes: float ``[heads]``: ALiBi, adds ``-slope * |i' - j|`` to the logits,
        computed in the kernel (no bias array). Not differentiated.
      score_mod: ``score_mod(score, batch, head, q_idx, kv_idx) -> score``, written with
        ``jnp`` on scalars (int32 indices; ``score = scale * q.k`` in float32), as
        PyTorch's FlexAttention: applied to every score before the softcap, bias and
        ALiBi, inside the kernels, and differentiated there (its derivative in the score
        is traced in). Arrays it closes over (a bias table, per-head slopes) are inputs of
        the kernels, read one element per score (``table[h, bucket]``); the gradient of
        the float ones is returned (on the Triton backend: an XLA pass over query chunks
        that recomputes the scores, about two matrix products per score). The static part
        of the call is the traced program: a function rebuilt per call that traces alike
        (the same operations on closed-over arrays of the same shapes) reuses the compiled
        kernels. See docs/flex.md.
      mask_mod: ``mask_mod(batch, head, q_idx, kv_idx) -> bool`` (True = attend), combined
        with the other masks. Tiles it leaves empty are skipped: see ``block_mask``.
      block_mask: a `flashjax.BlockMask` from `flashjax.block_mask` (the tile pairs that
        ``mask_mod`` leaves empty, full or partial), to reuse across calls and layers;
        without one the call builds it (``mask_mod`` evaluated once per tile pair, on
        intervals of positions). It carries its ``mask_mod``, so ``mask_mod`` may be omitted.
      sinks: float ``[heads]``: attention sinks (gpt-oss), a learned logit per head that
        joins the softmax denominator of every row and contributes no value;
        differentiable. Rows past ``q_lengths`` are padding and get no sink. Finite, or
        -inf for a head without one; +inf (a sink taking every row's whole weight) gives
        NaN rows on the kernels.
      dropout_rate, dropout_rng: dropout on the attention probabilities, drawn in the
        kernel from a counter-based hash of (seed, batch, head, row, column), so the
        backward regenerates the same mask and nothing N x N is stored (16 random bits
        per weight: the rate is drawn as a multiple of 2**-16, and kept weights are
        scaled by 1 / P(keep) of the rate as drawn, so dropout is unbiased). The rate is a static
        Python number; the rng a ``jax.random`` key.
      broadcast_dropout: one dropout mask shared by every batch row and head
        (Flax's ``broadcast_dropout=True``).
      float32_residual: keep the output in float32 for the backward (4 bytes per output
        element until the backward runs). The backward's ``delta = rowsum(dO * O)`` then
        does not see O rounded to bf16/fp16, which in very peaked rows (huge logits)
        cancels against ``P * dP`` and can cost dq and dk most of their accuracy; with it
        they are as accurate as the float32 reference's. Triton and xla backends.
      return_lse: also return the row logsumexp ``[batch, heads, q_len]`` (natural
        log; float32, or the inputs' dtype when wider; ``-inf`` for rows without keys).
      backend: ``"auto"`` (default), or a registered backend: ``"mosaic"`` (Hopper
        kernels: wgmma, TMA, warp specialisation; sm90 GPUs), ``"triton"`` (Pallas
        Triton kernels; any CUDA GPU, interpret mode without one) or ``"xla"`` (the
        pure-JAX reference, differentiated by JAX). ``auto`` takes the first of
        mosaic, triton, xla (triton, xla without a GPU) that supports the call;
        `flashjax.explain` says which and why. A named backend that cannot run the
        call raises ``NotImplementedError`` with its reasons. When the forward's
        backend has no backward for the call, the backward runs on the next
        backend that has one.
      config: the config of one backend (`flashjax.TritonConfig` or
        `flashjax.MosaicConfig`); it selects that backend under ``auto``. ``None``
        picks the backend's tuned default.

    Returns:
      The attention output ``[batch, q_len, heads, v_head_dim]`` in ``q``'s dtype,
      and with ``return_lse=True`` a pair ``(output, lse)``.

    Raises:
      ValueError: for inconsistent shapes, unsupported dtypes, or bad option values
        (the message names the argument).
      NotImplementedError: when a backend named by ``backend`` (or implied by
        ``config``) cannot run the call.
    """
    from flashjax import sharding  # imports this module

    return_lse = checks.check_bool("return_lse", return_lse)
    layout = sharding.explicit_layout(q, k, v)
    if layout is not None:
        # Arrays typed on an Explicit mesh: the kernels run per shard (a Pallas call cannot
        # take explicitly sharded operands).
        options = dict(
            causal=causal, scale=scale, bias=bias, mask=mask, segment_ids=segment_ids, q_lengths=q_lengths,
            kv_lengths=kv_lengths, window=window, softcap=softcap, alibi_slopes=alibi_slopes, score_mod=score_mod,
            mask_mod=mask_mod, block_mask=block_mask, sinks=sinks, dropout_rate=dropout_rate,
            dropout_rng=dropout_rng, broadcast_dropout=broadcast_dropout, float32_residual=float32_residual,
        )
        # The arguments checked whole (the shards check theirs again, in their own shapes).
        _described(q, k, v, options)
        return sharding.run_on_explicit_layout(q, k, v, layout, options | dict(return_lse=return_lse, backend=backend,
                                                                                config=config))
    call, extras, params = _prepare(
        q, k, v, causal=causal, scale=scale, bias=bias, mask=mask, segment_ids=segment_ids, q_lengths=q_lengths,
        kv_lengths=kv_lengths, window=window, softcap=softcap, alibi_slopes=alibi_slopes, score_mod=score_mod,
        mask_mod=mask_mod, block_mask=block_mask, sinks=sinks, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
        broadcast_dropout=broadcast_dropout, float32_residual=float32_residual,
    )
    choice = backends.choose(call, backend, config)
    params = AttentionParams(
        **params, backend=choice.backend, config=choice.config, backward_backend=choice.backward_backend,
        backward_config=choice.backward_config,
    )
    with jax.named_scope("flash_attention"):
        if isinstance(q, jax.core.Tracer):
            # Inside the caller's trace, before `_attention`'s: what the kernels derive from
            # inputs that are constants there (a block mask built outside jit) is computed
            # once, at trace time, instead of in every call of the compiled program.
            extras = autodiff.prepare(q, k, v, extras, params)
        out, lse = _attention(q, k, v, extras, params)
    return (out, lse) if return_lse else out


def explain(q, k, v, *, backend: str = "auto", config=None, **options) -> backends.Choice:
    """Which backends `flash_attention` runs this call on, and why the faster ones do not.

    Takes the arguments of `flash_attention` (arrays or ``jax.ShapeDtypeStruct``s) and
    runs nothing. ``print(flashjax.explain(q, k, v, causal=True))`` shows, for the
    forward and the backward, the backend chosen and each backend ``auto`` tried before
    it with the options that excluded it.

    On arrays typed on a mesh of Explicit axes it describes the call each device makes
    (its share of the batch and heads), as `flash_attention` runs it.

    Args:
      q, k, v: as `flash_attention`'s ([batch, q_len, heads, head_dim], [batch, kv_len,
        kv_heads, head_dim], [batch, kv_len, kv_heads, v_head_dim]); arrays or
        ``jax.ShapeDtypeStruct``s.
      backend, config: as `flash_attention`'s.
      **options: any other keyword argument of `flash_attention`, arrays or shape structs.

    Returns:
      A `flashjax.backends.Choice` (its ``backend`` and ``backward_backend`` fields name them).

    Raises:
      ValueError: as `flash_attention` does for bad arguments.
      NotImplementedError: a named backend (or the one ``config`` implies) cannot run the
        call; the message lists its reasons, as `flash_attention`'s would.
    """
    unknown = sorted(set(options) - set(inspect.signature(flash_attention).parameters))
    if unknown:
        raise TypeError(f"explain() got an unexpected keyword argument {unknown[0]!r} (it takes flash_attention's).")
    options.pop("return_lse", None)
    from flashjax import sharding  # imports this module

    call, layout = _described(q, k, v, options), sharding.explicit_layout(q, k, v)
    if layout is not None:  # the kernels run per shard: the call one device makes
        call = sharding.shard_call(call, layout)
    return backends.choose(call, backend, config)


def _described(q, k, v, options: dict) -> Call:
    """The `Call` of `flash_attention`'s arguments (`options`: its keywords that `_prepare`
    takes), checked as `_prepare` checks them, on the whole arrays, without computing anything
    (under `jax.eval_shape`: arrays, tracers and shape structs alike)."""
    # Scalars (a jnp.float32 scale) stay as given: traced, `_prepare` would refuse them.
    arrays = {name: value for name, value in options.items() if name not in SCALAR_OPTIONS and _is_array_like(value)}
    static = {name: value for name, value in options.items() if name not in arrays}
    described = []

    def describe(q, k, v, arrays):
        described.append(_prepare(q, k, v, **arrays, **static)[0])

    jax.eval_shape(describe, q, k, v, arrays)
    return described[0]


# flash_attention's options that are numbers or flags, never arrays streamed into the kernels.
SCALAR_OPTIONS = frozenset({"causal", "scale", "window", "softcap", "dropout_rate", "broadcast_dropout",
                            "float32_residual"})


def _is_array_like(value) -> bool:
    if isinstance(value, np.generic):  # a NumPy scalar option (np.float32(0.5)) is static
        return False
    if isinstance(value, flex.BlockMask):
        return True
    if isinstance(value, (tuple, list)):
        return bool(value) and all(_is_array_like(v) for v in value)
    return hasattr(value, "shape") and hasattr(value, "dtype")


@functools.partial(jax.jit, static_argnums=4)
def _attention(q, k, v, extras, params):
    return autodiff.attention(q, k, v, extras, params)


def _prepare(q, k, v, *, causal=False, scale=None, bias=None, mask=None, segment_ids=None, q_lengths=None,
             kv_lengths=None, window=None, softcap=None, alibi_slopes=None, score_mod=None, mask_mod=None,
             block_mask=None, sinks=None, dropout_rate=0.0, dropout_rng=None, broadcast_dropout=False,
             float32_residual=False):
    """Checks the arguments; returns (Call, Extras, AttentionParams fields without the backends)."""
    checks.check_qkv(q, k, v, v_head_dim=True)
    batch, seq_q, heads, head_dim = q.shape
    seq_k = k.shape[1]
    for name, flag in (("causal", causal), ("broadcast_dropout", broadcast_dropout), ("float32_residual", float32_residual)):
        checks.check_bool(name, flag)
    scale = checks.check_scale(scale, head_dim)
    window = checks.check_window(window, span=seq_q + seq_k)
    softcap = checks.check_softcap(softcap)
    dropout_rate = checks.check_dropout(dropout_rate, dropout_rng)
    shape = (batch, heads, seq_q, seq_k)
    q_segments, kv_segments = checks.check_segment_ids(segment_ids, batch, seq_q, seq_k)
    if score_mod is not None and jnp.issubdtype(q.dtype, jnp.complexfloating):
        raise ValueError(f"score_mod takes real scores; got {q.dtype} inputs.")
    score, score_consts = flex.trace(score_mod, flex.SCORE_MOD) if score_mod is not None else (None, None)
    if block_mask is not None:
        block_mask = flex.check_block_mask(block_mask, mask_mod, batch, heads, seq_q, seq_k)
        mask_mod = block_mask.mask_mod
        # The traced mask_mod below stands for it: a function in the block mask (a static of
        # its pytree) would key the compiled call on the function, rebuilt or not.
        block_mask = dataclasses.replace(block_mask, mask_mod=None)
    masked, mask_consts = flex.trace(mask_mod, flex.MASK_MOD) if mask_mod is not None else (None, None)
    if (masked is not None and masked.key_bound is not None and isinstance(seq_q, int) and isinstance(seq_k, int)
            and masked.key_bound <= seq_k - seq_q and max(seq_q, seq_k) <= flex.KEY_BOUND_POSITIONS):
        # The mask_mod lets through only pairs the built-in causal mask (bottom-right aligned)
        # lets through: adding that mask changes no pair, and the kernels then skip the upper
        # triangle structurally and take their query tiles longest first, as for a causal call
        # (a causal document mask's forward measured 1.07-1.08x the built-in without it). Not
        # with symbolic lengths (jax.export), whose comparison is inconclusive.
        causal = True
    extras = Extras(
        bias=checks.check_pair_array("bias", bias, shape, floating=True),
        mask=checks.check_pair_array("mask", mask, shape, floating=False),
        q_segment_ids=q_segments,
        kv_segment_ids=kv_segments,
        q_lengths=checks.check_lengths("q_lengths", q_lengths, batch),
        kv_lengths=checks.check_lengths("kv_lengths", kv_lengths, batch),
        alibi_slopes=checks.check_slopes(alibi_slopes, heads, q.dtype),
        dropout_seed=dropout.seed_words(dropout_rng) if dropout_rate > 0.0 else None,
        sinks=checks.check_sinks(sinks, heads),
        score_consts=score_consts,
        mask_consts=mask_consts,
        block_mask=block_mask,
    )
    given = {
        "bias": extras.bias, "mask": extras.mask, "segment_ids": extras.q_segment_ids,
        "q_lengths": extras.q_lengths, "kv_lengths": extras.kv_lengths, "alibi_slopes": extras.alibi_slopes,
        "sinks": extras.sinks,
    }
    mods = {"score_mod": score, "mask_mod": masked, "block_mask": block_mask}
    platform, capability = backends.describe_device()
    call = Call(
        batch=batch, seq_q=seq_q, seq_k=seq_k, heads=heads, kv_heads=k.shape[2], head_dim=head_dim,
        dtype=jnp.dtype(q.dtype), causal=bool(causal), window=window, softcap=softcap, dropout_rate=dropout_rate,
        float32_residual=bool(float32_residual), arrays=frozenset(name for name, value in given.items() if value is not None),
        mods=frozenset(name for name, value in mods.items() if value is not None),
        v_head_dim=v.shape[3] if v.shape[3] != head_dim else None,
        platform=platform, compute_capability=capability,
        pair_arrays=tuple((name, tuple(given[name].shape), jnp.dtype(given[name].dtype).name)
                          for name in ("bias", "mask") if given[name] is not None),
        score_mod=score, mask_mod=masked, varying_axes=tuple(sorted(varying_axes(q, k, v, extras))),
    )
    params = dict(
        scale=scale, causal=bool(causal), window=window, softcap=softcap, dropout_rate=dropout_rate,
        broadcast_dropout=bool(broadcast_dropout), float32_residual=bool(float32_residual), score_mod=score,
        mask_mod=masked, interpret=platform != "gpu",
    )
    return call, extras, params

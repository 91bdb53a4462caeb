"""Context-parallel ring attention: the sequence split over devices, K/V passed round a ring.

Each of the N devices on the mesh axis ``axis_name`` keeps its shard of the queries
and, in N steps, sees every shard of the keys and values: at each step it attends
its queries to the K/V block it holds (flash attention, with the logsumexp) while
that block travels on to the next device with `jax.lax.ppermute`. The partial
outputs are merged through their logsumexps (the FlashAttention-2 online softmax, one
level up; exact up to the rounding of the lse: at logits of magnitude L the weights
carry a relative error of about L * 2**-24, 6e-5 at L = 1e3 in float32, which a single
call does not have)::

    lse = logsumexp_s lse_s,    o = sum_s exp(lse_s - lse) * o_s

The backward is a `jax.custom_vjp` of its own: the saved global (o, lse) let every
device recompute the exact probabilities of each block, ``P = exp(S - lse)``, so the
kernels' backward, given the global lse and ``delta = rowsum(dO * O) - dlse``, returns
each block's exact share of dQ, dK and dV. dQ stays on its device; the dK/dV
accumulators travel round the ring with their K/V block and come home at the end.

Causal attention and load balance. With the sequence split in N contiguous shards,
device r needs only the K/V of devices <= r: the last device does N times the work
of the first. With ``load_balance=True`` the sequence axis is expected in **zig-zag
order** (see `zigzag_order`): the sequence is cut in 2N chunks and device r holds
chunks r and 2N-1-r, so that every device does the same work at every step:

* step 0, its own block: plain causal attention on the local 2 chunks (in local
  order, chunk r precedes chunk 2N-1-r, so the local causal mask is the global one);
* a block from device j < r: all local queries attend the block's first chunk
  (chunk j), nothing of its second (chunk 2N-1-j follows both query chunks);
* a block from device j > r: the local second chunk (2N-1-r) attends the whole
  block, the first chunk (r) sees none of it.

Either way 2 chunk x chunk products per step, half of a full block. Masked work is
skipped (`jax.lax.cond` on the device index), never computed and thrown away.

Segment ids (packed documents) ride along: the kv ids of a block travel round the
ring with its K/V (int32 [B, T / N], tiny next to K/V), each step passes the local
query ids and the held block's kv ids to the block kernels, and the zig-zag branches
slice the ids exactly as they slice q and K/V. A block in which a query row meets
no key of its segment gives that row lse = -inf, i.e. weight 0 in the merge.

score_mod and mask_mod see global positions: each block call gets the map from its
local query and key indices to the global ones (two chunks on a side in the zig-zag
layout, one per sliced side, the held block's device for the keys) as an operand, and a
wrapper of the user's function applies it; the gradients of the float arrays a score_mod
closes over are summed over the steps and the devices.

Communication: the ppermute of the next K/V block is issued before the current
block's attention and nothing of that step reads its result, and in the backward the
accumulator sent after step s is only added to after step s+1's kernels, so XLA is
free to run each transfer under a kernel. The ring is unrolled in Python (N is static
and small), so each step's kernel and collectives are plain HLO ops the scheduler can
reorder, with no while loop between them. Whether it does is XLA's choice: with the
Triton blocks it runs one of a step's two transfers under the kernel; with the Hopper
(Mosaic GPU) blocks JAX 0.11.2's XLA puts the transfers before the kernel that could hide
them, synchronous (benchmarks/results/ring-notes.md has the traces).
"""

from __future__ import annotations

import dataclasses
import functools

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from flashjax import autodiff, backends, checks, flex
from flashjax.kernels.common import fold_sinks, merge
from flashjax.params import AttentionParams, Call, Extras

__all__ = ["ring_attention", "zigzag_order", "zigzag_restore"]


# ---- the zig-zag layout ---------------------------------------------------------------
def _zigzag_chunks(n: int) -> np.ndarray:
    """Chunk order of the zig-zag layout: [0, 2n-1, 1, 2n-2, ..., n-1, n]."""
    return np.stack([np.arange(n), 2 * n - 1 - np.arange(n)], axis=1).reshape(-1)


def _permute_chunks(x, n: int, axis: int, order: np.ndarray):
    axis = axis % x.ndim
    length = x.shape[axis]
    if length % (2 * n):
        raise ValueError(
            f"the zig-zag layout cuts the sequence in 2 * {n} = {2 * n} equal chunks; "
            f"length {length} (axis {axis}) is not a multiple of {2 * n}."
        )
    chunks = x.reshape(*x.shape[:axis], 2 * n, length // (2 * n), *x.shape[axis + 1:])
    index = (slice(None),) * axis + (jnp.asarray(order),)
    # With an explicitly sharded sequence axis (jax.make_mesh's default), the chunk
    # gather crosses devices: keep the input's layout rather than leave it ambiguous.
    return chunks.at[index].get(out_sharding=jax.typeof(chunks).sharding).reshape(x.shape)


def zigzag_order(x, n: int, axis: int = 1):
    """Reorders a sequence axis from natural order into the zig-zag layout of `ring_attention`.

    The sequence is cut in ``2n`` equal chunks and rearranged as chunks
    ``[0, 2n-1, 1, 2n-2, ..., n-1, n]``; sharded in ``n`` equal parts over the
    ring's mesh axis, device ``r`` then holds chunks ``r`` and ``2n-1-r``.

    Apply it once to the model's inputs (token ids, positions for RoPE, labels), not
    per layer: every position-wise layer is indifferent to the order, and attention
    only needs to know the layout (``load_balance=True``).

    Example::

      tokens = zigzag_order(tokens, n, axis=1)            # [batch, seq]
      positions = zigzag_order(jnp.arange(seq), n, axis=0)

    Args:
      x: an array with a sequence axis whose length is a multiple of ``2n``.
      n: the number of devices on the ring's mesh axis.
      axis: the sequence axis (1 for [batch, seq, ...]).

    Returns:
      ``x`` with the sequence axis permuted (same shape and dtype).
    """
    return _permute_chunks(x, n, axis, _zigzag_chunks(n))


def zigzag_restore(x, n: int, axis: int = 1):
    """The inverse of `zigzag_order`: from the zig-zag layout back to natural order.

    Args:
      x: an array whose ``axis`` is in zig-zag order for ``n`` devices, e.g. ring attention's
        output [batch, seq, heads, head_dim] (``seq`` a multiple of ``2 * n``).
      n: the number of devices on the ring's mesh axis.
      axis: the sequence axis.

    Returns:
      ``x`` with the sequence axis in natural order.
    """
    return _permute_chunks(x, n, axis, np.argsort(_zigzag_chunks(n)))


# ---- the public function --------------------------------------------------------------
def ring_attention(
    q,
    k,
    v,
    *,
    mesh: Mesh,
    axis_name: str,
    causal: bool = False,
    segment_ids=None,
    scale: float | None = None,
    load_balance: bool = True,
    return_lse: bool = False,
    batch_axis=None,
    head_axis=None,
    backend: str = "auto",
    config=None,
    sinks=None,
    softcap: float | None = None,
    score_mod=None,
    mask_mod=None,
):
    """Exact attention with the sequence sharded over a mesh axis (context parallelism).

    Call it with global arrays (inside or outside ``jit``; on a mesh of Explicit axes,
    ``jax.make_mesh``'s default, differentiate under ``jit`` or ``jax.set_mesh``: JAX
    refuses an eager ``grad`` there); their sequence axis is split in equal shards over
    ``axis_name`` (inputs laid out differently are resharded to that by XLA). No device
    ever holds more than its query shard and two K/V blocks. Differentiable in q, k, v
    (and through the lse).

    Example::

      mesh = jax.make_mesh((4,), ("sp",))
      n = mesh.shape["sp"]
      q, k, v = (zigzag_order(x, n) for x in (q, k, v))   # once, on the model inputs
      ids = zigzag_order(segment_ids, n)                 # [batch, seq], packed documents
      out = ring_attention(q, k, v, mesh=mesh, axis_name="sp", causal=True, segment_ids=ids)
      out = zigzag_restore(out, n)                       # natural order again

    Args:
      q: queries [batch, seq, heads, head_dim].
      k, v: keys and values [batch, kv_seq, kv_heads, head_dim]; ``kv_heads``
        divides ``heads`` (GQA). ``kv_seq == seq`` when ``causal``.
      mesh: the device mesh.
      axis_name: the mesh axis the sequence is sharded over (the ring).
      causal: causal self-attention over the global positions.
      segment_ids: packed sequences (document masking): int ``[batch, seq]`` (when
        ``kv_seq == seq``) or a pair ``(q_segment_ids [batch, seq],
        kv_segment_ids [batch, kv_seq])``; a query attends only keys with the same
        id (on top of ``causal``). In the same sequence layout as q, k, v, so in
        zig-zag order with ``causal`` and ``load_balance`` (reorder them with
        `zigzag_order`, like the tokens); sharded like the sequence. A query row
        that sees no key outputs 0 with lse = -inf and gets zero gradients.
      scale: logit scale; defaults to ``1 / sqrt(head_dim)``.
      load_balance: with ``causal=True``, the sequence axis of q, k, v (and of the
        output) is in the zig-zag layout of `zigzag_order` (every device does equal
        work); with ``False`` it is in natural order (device r holds the r-th
        contiguous shard and the last device does N times the work of the first).
        Without ``causal`` the layout does not matter and this is ignored.
      return_lse: also return the logsumexp [batch, heads, seq] (float32, float64 for
        float64 inputs; natural log), in the same sequence layout as the output.
      batch_axis, head_axis: optional further mesh axes (names or tuples of names)
        for the batch and head dimensions (data/head parallelism on top of the
        ring); kv_heads must be divisible by the head axis size too.
      backend: the backend of the per-block calls, chosen as in
        `flashjax.flash_attention` (``"auto"``: the Hopper kernels on an H100/H200,
        segment ids and softcap included; the Triton kernels on other GPUs and for
        score_mod/mask_mod; ``"xla"``: pure-JAX blocks, materialising each block's
        scores, for checking).
      config: the chosen backend's config for the per-block calls; ``None`` = tuned default.
      sinks: float ``[heads]``, a logit per query head that joins every row's softmax
        denominator and contributes no value (gpt-oss's attention sinks), as in
        `flashjax.flash_attention`; folded in exactly after the ring's merge (a row without
        keys then outputs 0 with lse = its sink's logit). Differentiable (dsinks).
      softcap: if set (a static number > 0), logits = ``softcap * tanh(logits / softcap)``
        (Gemma 2), in every block call: it depends on no position, so each block applies it
        exactly.
      score_mod, mask_mod: as in `flashjax.flash_attention` (``score_mod(score, b, h, q_idx,
        kv_idx)``, ``mask_mod(b, h, q_idx, kv_idx)``), called with global batch, head and
        sequence indices: positions in the natural order of the sequence (with ``causal``
        and ``load_balance`` the zig-zag layout is undone for them; without ``causal`` the
        shards are taken in natural order). Differentiable in the float arrays a score_mod
        closes over. The blocks then run on the Triton kernels under ``auto``, and each
        block call builds its mask_mod's block mask (no ``block_mask`` argument).

    Returns:
      The output [batch, seq, heads, head_dim] in q's dtype (and the lse [batch, heads,
      seq] with ``return_lse=True``). On a mesh of Explicit axes the output is typed
      (laid out) as q is; elsewhere it is laid out as the ring computes it: batch,
      sequence and heads split over ``batch_axis``, ``axis_name`` and ``head_axis``.

    Raises:
      ValueError: for inconsistent shapes (of segment_ids too), unknown mesh axes,
        sizes that do not divide, or bad options; the message says what to change.
      NotImplementedError: when the named backend cannot run the block calls.
    """
    checks.check_qkv(q, k, v)
    if jnp.issubdtype(q.dtype, jnp.complexfloating):
        raise ValueError(f"ring_attention takes real floating inputs (its merge weighs partials by real "
                         f"logsumexps); got {q.dtype}: use flashjax.flash_attention(..., backend='xla').")
    q_ids, kv_ids = checks.check_segment_ids(segment_ids, q.shape[0], q.shape[1], k.shape[1])
    segments = None if q_ids is None else (q_ids, kv_ids)
    return_lse = checks.check_bool("return_lse", return_lse)
    mods = _trace_mods(score_mod, mask_mod, q.dtype)
    ring = _check(q, k, v, mesh, axis_name, causal, scale, load_balance, batch_axis, head_axis, backend, config,
                  segments is not None, checks.check_softcap(softcap), mods)
    sinks = checks.check_sinks(sinks, q.shape[2])
    o, lse = _ring_jit(ring, q, k, v, segments, mods.score_consts, mods.mask_consts)
    if sinks is not None:
        # Sinks laid out along the heads as the lse is (on an Explicit mesh a sinks array split
        # over another axis would not combine with it).
        o, lse = fold_sinks(o, lse, _place(ring, sinks, P(ring.head_axis)))
    o = _typed_like(ring, o, q)  # on an Explicit mesh, q's type (a residual x + o keeps x's)
    return (o, lse) if return_lse else o


# ---- static description of one call ---------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Ring:
    """Everything static about a ring call (hashable: a jit static and custom_vjp nondiff arg)."""

    mesh: Mesh
    axis_name: str
    size: int  # devices on the ring
    causal: bool
    zigzag: bool  # causal with the zig-zag layout
    batch_axis: object
    head_axis: object
    block: AttentionParams  # the per-block calls' parameters and backends (causal set per call)
    # Where the block's position map sits among each mod's closed-over arrays (None: no mod).
    score_slot: int | None = None
    mask_slot: int | None = None

    @property
    def has_mods(self) -> bool:
        return self.score_slot is not None or self.mask_slot is not None

    @property
    def qkv_spec(self):
        return P(self.batch_axis, self.axis_name, self.head_axis, None)

    @property
    def lse_spec(self):
        return P(self.batch_axis, self.head_axis, self.axis_name)

    @property
    def ids_spec(self):
        return P(self.batch_axis, self.axis_name)

    def params(self, causal: bool) -> AttentionParams:
        return dataclasses.replace(self.block, causal=causal)


def _check(q, k, v, mesh, axis_name, causal, scale, load_balance, batch_axis, head_axis, backend, config,
           has_segments: bool, softcap: float | None, mods: "_Mods") -> _Ring:
    batch, seq_q, heads, head_dim = q.shape
    seq_k = k.shape[1]
    if not isinstance(axis_name, str):
        raise ValueError(f"axis_name must be the name of a mesh axis, got {axis_name!r}.")
    sizes = checks.check_mesh_axes(mesh, axis_name=axis_name, batch_axis=batch_axis, head_axis=head_axis)
    checks.check_divisible(q, k, sizes)
    n = sizes["axis_name"]
    causal = checks.check_bool("causal", causal)
    if causal and seq_q != seq_k:
        raise ValueError(f"causal ring attention is self-attention: q and k need the same length, got {seq_q} and {seq_k}.")
    zigzag = checks.check_bool("load_balance", load_balance) and causal
    parts = 2 * n if zigzag else n
    for name, length in (("q", seq_q), ("k", seq_k)):
        if length % parts:
            layout = f"the zig-zag layout (2 chunks per device, {n} devices)" if zigzag else f"{n} equal shards"
            raise ValueError(f"{name}'s sequence length {length} must be a multiple of {parts} for {layout}.")
    if not isinstance(mesh, Mesh):
        raise ValueError(f"ring_attention needs a jax.sharding.Mesh of devices (it places the ring's blocks on "
                         f"them), got {type(mesh).__name__}.")
    device = mesh.devices.flat[0]
    has_mods = mods.score is not None or mods.mask is not None
    if has_mods and backend == "auto" and device.platform == "gpu":
        backend = "triton"  # the ring's blocks with mods are verified on the Triton kernels
    # The block calls: a device's queries against a block of keys (a zig-zag step halves one side).
    call = Call(
        batch=batch // sizes["batch_axis"], seq_q=seq_q // n, seq_k=seq_k // n, heads=heads // sizes["head_axis"],
        kv_heads=k.shape[2] // sizes["head_axis"], head_dim=head_dim, dtype=jnp.dtype(q.dtype), causal=causal,
        softcap=softcap, arrays=frozenset({"segment_ids"} if has_segments else ()), platform=device.platform,
        mods=frozenset(name for name, mod in (("score_mod", mods.score), ("mask_mod", mods.mask)) if mod is not None),
        score_mod=mods.score, mask_mod=mods.mask,
        compute_capability=str(getattr(device, "compute_capability", "")) if device.platform == "gpu" else "",
    )
    choice = backends.choose(call, backend, config)
    block = AttentionParams(
        scale=checks.check_scale(scale, head_dim), softcap=softcap, score_mod=mods.score, mask_mod=mods.mask,
        backend=choice.backend, config=choice.config,
        backward_backend=choice.backward_backend, backward_config=choice.backward_config,
        interpret=device.platform != "gpu",
    )
    return _Ring(mesh=mesh, axis_name=axis_name, size=n, causal=causal, zigzag=zigzag, batch_axis=batch_axis,
                 head_axis=head_axis, block=block, score_slot=mods.score_slot, mask_slot=mods.mask_slot)


# ---- score_mod / mask_mod: global positions per block -------------------------------------
# A block's position map: (q_first, q_second, q_split, k_first, k_second, k_split, batch
# offset, head offset); local index i of a side is global `first + i` below `split`, else
# `second + i - split` (a zig-zag side holds two chunks).
_POSITION_FIELDS = 8


class _Mods(NamedTuple):
    """The traced mods (None without), where the position map sits among their closed-over
    arrays, and the user's closed-over arrays (the map left out)."""

    score: object = None
    score_slot: int | None = None
    score_consts: tuple = ()
    mask: object = None
    mask_slot: int | None = None
    mask_consts: tuple = ()


def _trace_mods(score_mod, mask_mod, dtype) -> _Mods:
    """Traces the user's mods wrapped to see global indices through a position-map operand
    (a placeholder array here; each block call passes its own)."""
    if score_mod is None and mask_mod is None:
        return _Mods()
    if score_mod is not None and jnp.issubdtype(dtype, jnp.complexfloating):
        raise ValueError(f"score_mod takes real scores; got {dtype} inputs.")
    placeholder = jnp.zeros((_POSITION_FIELDS,), jnp.int32)

    def globals_of(b, h, q_idx, kv_idx):
        # One element per read (the kernels read a closed-over array only so).
        at = lambda field: jax.lax.dynamic_index_in_dim(placeholder, field, keepdims=False)
        side = lambda i, first, second, split: jnp.where(i < split, first + i, second + (i - split))
        return (b + at(6), h + at(7), side(q_idx, at(0), at(1), at(2)), side(kv_idx, at(3), at(4), at(5)))

    fields = {}
    for name, fn, kind in (("score", score_mod, flex.SCORE_MOD), ("mask", mask_mod, flex.MASK_MOD)):
        if fn is None:
            continue
        if not callable(fn):
            raise ValueError(f"{kind} must be a function, got {type(fn).__name__}.")
        wrapped = ((lambda s, *idx, fn=fn: fn(s, *globals_of(*idx))) if kind == flex.SCORE_MOD
                   else (lambda *idx, fn=fn: fn(*globals_of(*idx))))
        mod, consts = flex.trace(wrapped, kind)
        slot = next((i for i, c in enumerate(consts) if c is placeholder), None)
        assert slot is not None, "the position map must be among the traced mod's closed-over arrays"
        fields |= {name: mod, f"{name}_slot": slot, f"{name}_consts": consts[:slot] + consts[slot + 1:]}
    return _Mods(**fields)


def _positions(ring: _Ring, step: int, shard: tuple[int, int], parts: tuple[str, str], batch: int, heads: int):
    """The position map of a block call at `step` (traced: it depends on the device).

    shard: the local query shard's and the held block's lengths; parts: which of them the
    call takes, "all" or (zig-zag) its "first" or "second" chunk; batch, heads: the local
    batch and query-head counts (their global offsets come from the mesh)."""
    n = ring.size
    r = jax.lax.axis_index(ring.axis_name)

    def side(device, rows, part):
        if not ring.zigzag:  # natural order: shard `device` of the sequence
            return device * rows, device * rows + rows, rows
        chunk = rows // 2
        first, second = device * chunk, (2 * n - 1 - device) * chunk
        if part == "all":
            return first, second, chunk
        start = first if part == "first" else second
        return start, start + chunk, chunk

    q_map = side(r, shard[0], parts[0])
    k_map = side((r - step) % n, shard[1], parts[1])  # the block held at `step` is device r - step's
    offsets = (checks.mesh_axes_index(ring.mesh, ring.batch_axis) * batch,
               checks.mesh_axes_index(ring.mesh, ring.head_axis) * heads)
    return jnp.stack([jnp.asarray(x, jnp.int32) for x in (*q_map, *k_map, *offsets)])


def _extras(ring: _Ring, seg, mods, position) -> Extras:
    """The block's optional arrays: its segment ids (q_ids [B, Tq], kv_ids [B, Tk]) if any,
    and its mods' closed-over arrays with the block's position map in its slot."""
    extras = Extras() if seg is None else Extras(q_segment_ids=seg[0], kv_segment_ids=seg[1])
    if mods is None:
        return extras
    score_consts, mask_consts = mods
    with_map = lambda consts, slot: None if slot is None else (*consts[:slot], position, *consts[slot:])
    return extras._replace(score_consts=with_map(score_consts, ring.score_slot),
                           mask_consts=with_map(mask_consts, ring.mask_slot))


def _block_forward(ring: _Ring, q, k, v, causal: bool, seg, mods=None, position=None):
    """(o [B, Tq, H, D], lse [B, H, Tq]), both `_accumulated`, of q attending one K/V block.

    ``seg``: None or (q_ids [B, Tq], kv_ids [B, Tk]) of exactly these queries and keys;
    ``mods``: None or the user's (score_consts, mask_consts), with the block's ``position``
    map (`_positions`).
    """
    params = ring.params(causal)
    forward = functools.partial(backends.get(params.backend).forward, params=params, config=params.config)
    o, lse = autodiff.first_order_only(forward, params.backend)(q, k, v, _extras(ring, seg, mods, position))
    return o.astype(_accumulated(q)), lse.astype(_accumulated(q))


def _block_backward(ring: _Ring, q, k, v, o, lse, do, dlse, causal: bool, seg, mods=None, position=None):
    """This block's share of (dq, dk, dv), `_accumulated`, given the *global* o and lse, and of the
    gradients of the score_mod's float closed-over arrays (`_const_grads`)."""
    params = ring.params(causal)
    backward = functools.partial(backends.get(params.backward_backend).backward, params=params,
                                 config=params.backward_config)
    extras = _extras(ring, seg, mods, position)
    dq, dk, dv, dextras = autodiff.first_order_only(backward, params.backward_backend)(q, k, v, o, lse, do, dlse, extras)
    dconsts = None
    if mods is not None:
        grads = dextras.score_consts
        if grads is not None and ring.score_slot is not None:
            grads = grads[:ring.score_slot] + grads[ring.score_slot + 1:]  # the position map's (an int)
        dconsts = _const_grads(mods[0], grads)
    acc = _accumulated(q)
    return dq.astype(acc), dk.astype(acc), dv.astype(acc), dconsts


def _accumulated(x):
    """The dtype the ring accumulates x's partials in: float32, or x's own where it is wider
    (float64)."""
    return jnp.promote_types(x.dtype, jnp.float32)


def _const_grads(consts, grads=None):
    """Gradients of a score_mod's float closed-over arrays (float32 or wider, zeros where
    `grads` has none), None for the others: the same structure from every branch of a step."""
    grads = grads or (None,) * len(consts)
    return tuple(
        None if not jnp.issubdtype(c.dtype, jnp.floating) else
        (jnp.zeros(c.shape, _accumulated(c)) if g is None else g.astype(_accumulated(c)))
        for c, g in zip(consts, grads)
    )


# ---- one ring step: which part of the block this device's queries see ----------------
def _visible_earlier(ring: _Ring, step: int):
    """True when the block held at `step` (> 0) comes from a device before this one.

    At step s device r holds the block of device (r - s) mod N, which precedes r
    exactly when s <= r.
    """
    return step <= jax.lax.axis_index(ring.axis_name)


def _first_keys(seg, c: int):
    """The ids of the `earlier` branch: all local queries, the block's first chunk of keys."""
    return None if seg is None else (seg[0], seg[1][:, :c])


def _last_queries(seg, c: int):
    """The ids of the `later` branch: the local second chunk of queries, all the block's keys."""
    return None if seg is None else (seg[0][:, c:], seg[1])


def _step_forward(ring: _Ring, step: int, q, k, v, seg, mods=None):
    """(o, lse) of the local queries against the K/V block held at `step`; masked work skipped.

    ``seg``: None or (the local q_ids [B, Tq], the held block's kv_ids [B, Tk]); ``mods``:
    None or the user's (score_consts, mask_consts).
    """
    at = _position_of(ring, step, q, k, mods)
    if not ring.causal:
        return _block_forward(ring, q, k, v, False, seg, mods, at("all", "all"))
    if step == 0:
        return _block_forward(ring, q, k, v, True, seg, mods, at("all", "all"))
    if not ring.zigzag:
        # A whole earlier block is visible; a later one is invisible: no kernel call at all.
        empty = lambda: (jnp.zeros(q.shape, _accumulated(q)), jnp.full(_lse_shape(q), -jnp.inf, _accumulated(q)))
        full = lambda: _block_forward(ring, q, k, v, False, seg, mods, at("all", "all"))
        return jax.lax.cond(_visible_earlier(ring, step), full, empty)
    c = q.shape[1] // 2

    def earlier():  # every local query sees the block's first chunk, none sees its second
        return _block_forward(ring, q, k[:, :c], v[:, :c], False, _first_keys(seg, c), mods, at("all", "first"))

    def later():  # only the local second chunk sees the block, all of it
        o2, lse2 = _block_forward(ring, q[:, c:], k, v, False, _last_queries(seg, c), mods, at("second", "all"))
        o1 = jnp.zeros_like(o2)
        lse1 = jnp.full_like(lse2, -jnp.inf)
        return jnp.concatenate([o1, o2], axis=1), jnp.concatenate([lse1, lse2], axis=2)

    return jax.lax.cond(_visible_earlier(ring, step), earlier, later)


def _step_backward(ring: _Ring, step: int, q, k, v, seg, o, lse, do, dlse, mods=None):
    """(dq, dk, dv, dconsts) shares of the block held at `step`, mirroring `_step_forward`
    (same ids and position maps); dconsts: `_const_grads` (None without mods)."""
    at = _position_of(ring, step, q, k, mods)
    if not ring.causal:
        return _block_backward(ring, q, k, v, o, lse, do, dlse, False, seg, mods, at("all", "all"))
    if step == 0:
        return _block_backward(ring, q, k, v, o, lse, do, dlse, True, seg, mods, at("all", "all"))
    zeros = lambda x: jnp.zeros(x.shape, _accumulated(q))
    no_consts = None if mods is None else _const_grads(mods[0])
    if not ring.zigzag:
        full = lambda: _block_backward(ring, q, k, v, o, lse, do, dlse, False, seg, mods, at("all", "all"))
        return jax.lax.cond(_visible_earlier(ring, step), full, lambda: (zeros(q), zeros(k), zeros(v), no_consts))
    c = q.shape[1] // 2

    def earlier():
        dq, dk1, dv1, dconsts = _block_backward(ring, q, k[:, :c], v[:, :c], o, lse, do, dlse, False,
                                                _first_keys(seg, c), mods, at("all", "first"))
        return dq, jnp.concatenate([dk1, zeros(dk1)], axis=1), jnp.concatenate([dv1, zeros(dv1)], axis=1), dconsts

    def later():
        dq2, dk, dv, dconsts = _block_backward(
            ring, q[:, c:], k, v, o[:, c:], lse[:, :, c:], do[:, c:], dlse[:, :, c:], False, _last_queries(seg, c),
            mods, at("second", "all"),
        )
        return jnp.concatenate([zeros(dq2), dq2], axis=1), dk, dv, dconsts

    return jax.lax.cond(_visible_earlier(ring, step), earlier, later)


def _position_of(ring: _Ring, step: int, q, k, mods):
    """at(q_part, k_part) -> the block's position map (None without mods)."""
    if mods is None:
        return lambda q_part, k_part: None
    return lambda q_part, k_part: _positions(ring, step, (q.shape[1], k.shape[1]), (q_part, k_part), q.shape[0],
                                             q.shape[2])


def _lse_shape(q):
    return (q.shape[0], q.shape[2], q.shape[1])


def _shift(ring: _Ring, x):
    """Sends x to the next device on the ring (device r receives from r - 1)."""
    n = ring.size
    return jax.lax.ppermute(x, ring.axis_name, [(i, (i + 1) % n) for i in range(n)])


# ---- the ring, per device ---------------------------------------------------------------
def _split(segments):
    """(q_ids, kv_ids) of the local shard, or (None, None) without segment ids."""
    return (None, None) if segments is None else segments


def _pair(q_ids, kv_ids):
    """A step's ids as the blocks take them: None without segment ids."""
    return None if q_ids is None else (q_ids, kv_ids)


def _local_forward(ring: _Ring, q, k, v, segments, score_consts=(), mask_consts=()):
    q_ids, kv_ids = _split(segments)
    mods = (score_consts, mask_consts) if ring.has_mods else None
    held = (k, v, kv_ids)  # a block's kv ids travel with its K/V (None: nothing to send)
    o = lse = None
    for step in range(ring.size):
        # Issued before this step's attention, which does not read it: the transfer
        # of the next block may run under the kernel (XLA's choice, module docstring).
        incoming = _shift(ring, held) if step < ring.size - 1 else None
        k_s, v_s, kv_ids_s = held
        o_s, lse_s = _step_forward(ring, step, q, k_s, v_s, _pair(q_ids, kv_ids_s), mods)
        o, lse = (o_s, lse_s) if o is None else merge(o, lse, o_s, lse_s)
        held = incoming
    return o.astype(q.dtype), lse


def _local_backward(ring: _Ring, q, k, v, segments, o, lse, do, dlse, score_consts=(), mask_consts=()):
    q_ids, kv_ids = _split(segments)
    mods = (score_consts, mask_consts) if ring.has_mods else None
    held = (k, v, kv_ids)
    dq = jnp.zeros(q.shape, _accumulated(q))
    dconsts = None if mods is None else _const_grads(score_consts)
    arriving = None  # the dK/dV accumulator of the block now held, sent by the previous device
    for step in range(ring.size):
        incoming = _shift(ring, held) if step < ring.size - 1 else None
        k_s, v_s, kv_ids_s = held
        dq_s, dk_s, dv_s, dconsts_s = _step_backward(ring, step, q, k_s, v_s, _pair(q_ids, kv_ids_s), o, lse, do,
                                                     dlse, mods)
        dq = dq + dq_s
        if mods is not None:
            dconsts = tuple(None if a is None else a + b for a, b in zip(dconsts, dconsts_s))
        # The accumulator is added to only after this step's kernels, so its transfer
        # (sent at the end of the previous step) may run under them.
        acc = (dk_s, dv_s) if arriving is None else (arriving[0] + dk_s, arriving[1] + dv_s)
        # After N sends the accumulator of block r is back on device r.
        arriving = _shift(ring, acc)
        held = incoming
    dk, dv = arriving
    grads = (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype))
    if mods is None:
        return grads
    # Every device's blocks add to the closed-over arrays' gradients: summed over the mesh
    # axes that split the work.
    axes = (ring.axis_name, *checks.mesh_axis_names(ring.batch_axis), *checks.mesh_axis_names(ring.head_axis))
    total = tuple(None if g is None else jax.lax.psum(g, axes).astype(c.dtype) for g, c in zip(dconsts, score_consts))
    return (*grads, total)


# ---- global arrays: shard_map, custom_vjp, jit --------------------------------------------
def _sharded(ring: _Ring, fn, in_specs, out_specs):
    # check_vma=False: every output is explicitly per-device, and the kernels' interpret
    # mode (which does not carry the values' mesh axes, `vma.py`) runs there too.
    return jax.shard_map(
        functools.partial(fn, ring), mesh=ring.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
    )


def _place(ring: _Ring, x, spec):
    """Lays x out as `spec` on the mesh (a no-op when it already is)."""
    return checks.place_on_mesh(ring.mesh, x, spec)


def _segments_spec(ring: _Ring, segments):
    """The shard_map spec of the ids: sharded like the sequence (None, matching None, without ids)."""
    return None if segments is None else (ring.ids_spec, ring.ids_spec)


def _place_segments(ring: _Ring, segments):
    return None if segments is None else tuple(_place(ring, ids, ring.ids_spec) for ids in segments)


def _consts_specs(consts):
    """Closed-over arrays are whole on every device (the mods index them globally)."""
    return tuple(P() for _ in consts)


def _forward_global(ring: _Ring, q, k, v, segments, score_consts, mask_consts):
    spec = ring.qkv_spec
    q, k, v = (_place(ring, x, spec) for x in (q, k, v))
    in_specs = (spec, spec, spec, _segments_spec(ring, segments), _consts_specs(score_consts), _consts_specs(mask_consts))
    fn = _sharded(ring, _local_forward, in_specs, (spec, ring.lse_spec))
    return fn(q, k, v, _place_segments(ring, segments), *_place_consts(ring, score_consts, mask_consts))


def _place_consts(ring: _Ring, score_consts, mask_consts):
    return tuple(tuple(_place(ring, c, P()) for c in consts) for consts in (score_consts, mask_consts))


# segments: None or (q_ids int32 [B, Tq], kv_ids int32 [B, Tk]); integers, so no cotangent.
# score_consts / mask_consts: the arrays the mods close over (the float ones of score_consts
# differentiable).
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(ring: _Ring, q, k, v, segments, score_consts, mask_consts):
    return _forward_global(ring, q, k, v, segments, score_consts, mask_consts)


def _ring_fwd(ring: _Ring, q, k, v, segments, score_consts, mask_consts):
    o, lse = _forward_global(ring, q, k, v, segments, score_consts, mask_consts)
    return (o, lse), (q, k, v, segments, score_consts, mask_consts, o, lse)


def _ring_bwd(ring: _Ring, residuals, cotangents):
    q, k, v, segments, score_consts, mask_consts, o, lse = residuals
    primals = (q, k, v)
    do, dlse = cotangents
    spec, lse_spec = ring.qkv_spec, ring.lse_spec
    in_specs = (spec, spec, spec, _segments_spec(ring, segments), spec, lse_spec, spec, lse_spec,
                _consts_specs(score_consts), _consts_specs(mask_consts))
    out_specs = (spec, spec, spec)
    if ring.has_mods:
        out_specs += (tuple(P() if jnp.issubdtype(c.dtype, jnp.floating) else None for c in score_consts),)
    q, k, v, o, do = (_place(ring, x, spec) for x in (q, k, v, o, do.astype(o.dtype)))
    lse, dlse = (_place(ring, x, lse_spec) for x in (lse, dlse))
    fn = _sharded(ring, _local_backward, in_specs, out_specs)
    grads = fn(q, k, v, _place_segments(ring, segments), o, lse, do, dlse,
               *_place_consts(ring, score_consts, mask_consts))
    dscore = grads[3] if ring.has_mods else tuple(None for _ in score_consts)
    dscore = tuple(None if g is None else _typed_like(ring, g, c) for g, c in zip(dscore, score_consts))
    dqkv = tuple(_typed_like(ring, g, x) for g, x in zip(grads[:3], primals))
    return (*dqkv, None, dscore, tuple(None for _ in mask_consts))


def _typed_like(ring: _Ring, cotangent, primal):
    """On an Explicit mesh, `cotangent` laid out as `primal` is typed (JAX wants a cotangent
    of the primal's type: a replicated q's gradient arrives split along the ring); elsewhere
    unchanged."""
    if not ring.mesh.explicit_axes:
        return cotangent
    sharding = jax.typeof(primal).sharding
    if sharding.mesh.empty:  # an array typed on no mesh: replicated on the ring's
        sharding = NamedSharding(ring.mesh, P())
    return jax.reshard(cotangent, sharding)


_ring.defvjp(_ring_fwd, _ring_bwd)


@functools.partial(jax.jit, static_argnums=0)
def _ring_jit(ring: _Ring, q, k, v, segments, score_consts, mask_consts):
    return _ring(ring, q, k, v, segments, score_consts, mask_consts)

"""Ring attention (`flashjax.ring`) against the single-device float32 reference.

The multi-device bodies (`check_*`) run on 4 CPU devices in a subprocess (see
tests/multidevice.py for why); the Pallas kernels run in interpret mode there.
Layout checks and argument errors run in the pytest process on a 1-device mesh.
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import Inputs, Result, check_close, check_lse, check_under_remat_and_vmap, reference_result
from multidevice import DEVICES, gpus_or_skip, run_on_devices, two_rows_or_skip
from flashjax import reference
from flashjax.ring import ring_attention, zigzag_order, zigzag_restore


def _inputs(seed, batch, seq_q, seq_k, heads, kv_heads, head_dim, dtype) -> Inputs:
    rng = np.random.default_rng(seed)
    draw = lambda *shape, dt=dtype: jnp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dt)
    return Inputs(
        q=draw(batch, seq_q, heads, head_dim), k=draw(batch, seq_k, kv_heads, head_dim),
        v=draw(batch, seq_k, kv_heads, head_dim), do=draw(batch, seq_q, heads, head_dim),
        dlse=draw(batch, heads, seq_q, dt=jnp.float32),
    )


def _packed_ids(lengths_per_row, total: int):
    """Sorted segment ids int32 [batch, total] from each row's document lengths (the last runs to the end)."""
    rows = [np.repeat(np.arange(len(lengths)), lengths)[:total] for lengths in lengths_per_row]
    rows = [np.pad(r, (0, total - len(r)), mode="edge") for r in rows]
    return jnp.asarray(np.stack(rows), jnp.int32)


def _mods(table, doc_ids, window: int):
    """A score_mod with a learned relative-position bias per head (closing over a float
    table, differentiable) and a mask_mod of documents (closing over int ids) with a
    window: both read global positions, so a ring that passed local ones would differ."""
    length = table.shape[1] // 2
    score_mod = lambda score, b, h, q_idx, kv_idx: score + table[h % table.shape[0], q_idx - kv_idx + length]
    mask_mod = lambda b, h, q_idx, kv_idx: (doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (q_idx - kv_idx < window)
    return score_mod, mask_mod


@functools.partial(jax.jit, static_argnames=("causal", "softcap", "window"))
def _reference_with_arrays(x: Inputs, segment_ids, sinks, table, doc_ids, *, causal: bool, softcap=None, window=None):
    """(Result, dsinks or None, dtable or None): the reference with segment ids, sinks and
    mods (arrays, so not through conftest.reference_result), differentiated in the sinks
    and the score_mod's table too."""
    up = lambda a: a.astype(jnp.float32)

    def fn(q, k, v, s, t):
        mods = {} if t is None else dict(zip(("score_mod", "mask_mod"), _mods(t, doc_ids, window)))
        return reference.attention(q, k, v, causal=causal, segment_ids=segment_ids, sinks=s, softcap=softcap,
                                   return_lse=True, **mods)

    (o, lse), pullback = jax.vjp(fn, up(x.q), up(x.k), up(x.v), sinks, table)
    dq, dk, dv, dsinks, dtable = pullback((up(x.do), x.dlse))
    return Result(o, lse, dq, dk, dv), dsinks, dtable


def check_ring(*, seed, causal, load_balance=True, batch=1, seq_q=128, seq_k=None, heads=2, kv_heads=2,
               head_dim=32, dtype="float32", backend="triton", mesh_shape=(DEVICES,), batch_axis=None,
               segments=None, kv_segments=None, sinks=False, softcap=None, mods=False):
    """Ring output, lse and gradients (through o and lse) equal the reference's.

    With ``causal`` and ``load_balance``, inputs, cotangents, segment ids and the
    reference's results are put in zig-zag order (the layout the ring expects)
    before comparing. ``segments``: document lengths per batch row (natural order)
    for packed segment ids; with ``kv_segments`` too, the ids are a pair (q ids
    from ``segments``, kv ids from ``kv_segments``). ``sinks``: a sink logit per head (the
    first head's -inf: no sink), and dsinks checked too; ``softcap`` caps the logits;
    ``mods``: `_mods` (documents of 40 tokens, a 48-token window), the table's gradient checked.
    """
    dtype = jnp.dtype(dtype)
    seq_k = seq_q if seq_k is None else seq_k
    names = ("dp", "sp")[-len(mesh_shape):]
    mesh = jax.make_mesh(mesh_shape, names)
    n = mesh.shape["sp"]
    x = _inputs(seed, batch, seq_q, seq_k, heads, kv_heads, head_dim, dtype)
    ids = sink_logits = want_dsinks = table = doc_ids = want_dtable = None
    if segments is not None:
        ids = _packed_ids(segments, seq_q)
        if kv_segments is not None:
            ids = (ids, _packed_ids(kv_segments, seq_k))
    if sinks:
        sink_logits = jnp.asarray(np.random.default_rng(seed + 1).normal(0.0, 2.0, heads), jnp.float32)
        sink_logits = sink_logits.at[0].set(-jnp.inf)
    if mods:
        rng = np.random.default_rng(seed + 2)
        table = jnp.asarray(rng.normal(0.0, 1.0, (heads, 2 * seq_k)), jnp.float32)
        doc_ids = jnp.asarray(np.broadcast_to(np.arange(max(seq_q, seq_k)) // 40, (batch, max(seq_q, seq_k))), jnp.int32)
    if ids is not None or sinks or mods:
        want, want_dsinks, want_dtable = _reference_with_arrays(x, ids, sink_logits, table, doc_ids, causal=causal,
                                                                softcap=softcap, window=48 if mods else None)
    else:
        want = reference_result(x.q, x.k, x.v, x.do, x.dlse, causal=causal, softcap=softcap)
    if causal and load_balance:
        x = Inputs(*(zigzag_order(a, n, axis=2 if a.ndim == 3 else 1) for a in x))
        want = Result(*(zigzag_order(a, n, axis=2 if a.ndim == 3 else 1) for a in want))
        ids = jax.tree.map(lambda a: zigzag_order(a, n, axis=1), ids)

    def ring(q, k, v, sinks, table, ids):
        score_mod, mask_mod = _mods(table, doc_ids, 48) if table is not None else (None, None)
        return ring_attention(
            q, k, v, mesh=mesh, axis_name="sp", causal=causal, load_balance=load_balance,
            return_lse=True, backend=backend, batch_axis=batch_axis, segment_ids=ids, sinks=sinks, softcap=softcap,
            score_mod=score_mod, mask_mod=mask_mod,
        )

    (o, lse), pullback = jax.vjp(functools.partial(jax.jit(ring), ids=ids), x.q, x.k, x.v, sink_logits, table)
    dq, dk, dv, dsinks, dtable = pullback((x.do, x.dlse))
    if sinks:
        check_close(dsinks, want_dsinks, dtype, "dsinks")
    if mods:
        check_close(dtable, want_dtable, dtype, "dtable")
    assert o.dtype == dtype and dq.dtype == dtype and dk.dtype == dtype
    check_close(o, want.o, dtype, "o")
    check_lse(lse, want.lse, dtype)
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv)):
        check_close(got, getattr(want, name), dtype, name)


@pytest.mark.parametrize(
    "case",
    [
        # Kernels (interpret mode): the unmasked and the zig-zag steps.
        dict(causal=False, heads=4, kv_heads=2, head_dim=32),
        dict(causal=True, load_balance=True, heads=4, kv_heads=2, head_dim=64, dtype="bfloat16"),
        # Pure-JAX blocks (fast): the contiguous causal layout, cross-attention lengths
        # with MQA, and a batch axis beside the ring on a 2 x 2 mesh.
        dict(causal=True, load_balance=False, backend="xla"),
        dict(causal=False, seq_q=64, seq_k=128, heads=4, kv_heads=1, backend="xla"),
        dict(causal=True, load_balance=True, batch=2, mesh_shape=(2, 2), batch_axis="dp", backend="xla"),
        # Segment ids (packed documents), 32-position shards: boundaries at 20, 70 and
        # 110 fall inside shards and documents span several shards.
        dict(causal=False, heads=4, kv_heads=2, segments=[[20, 50, 40]], backend="xla"),
        # Kernels, zig-zag branches: q and kv ids differ, so the q rows 80..89 of
        # document 2 see no key (kv document 2 starts at 90): lse = -inf, zero gradients.
        dict(causal=True, load_balance=True, heads=4, kv_heads=2, segments=[[40, 40, 48]], kv_segments=[[40, 50, 38]]),
        # Contiguous causal layout, other ids per batch row (one boundary on a shard edge).
        dict(causal=True, load_balance=False, batch=2, mesh_shape=(2, 2), batch_axis="dp", backend="xla",
             segments=[[20, 50, 40], [64, 64]]),
        # Sinks folded after the ring's merge: with the kernels' zig-zag steps and rows
        # without keys (their lse becomes the sink's; the first head has none, -inf), and
        # on the contiguous layout.
        dict(causal=True, load_balance=True, heads=4, kv_heads=2, segments=[[40, 40, 48]], kv_segments=[[40, 50, 38]],
             sinks=True),
        dict(causal=True, load_balance=False, heads=4, kv_heads=1, backend="xla", sinks=True),
        # A softcap (position-free, so exact per block): kernels, zig-zag; and xla, full.
        dict(causal=True, load_balance=True, heads=4, kv_heads=2, softcap=2.0, sinks=True),
        dict(causal=False, seq_q=64, seq_k=128, backend="xla", softcap=1.5),
        # score_mod / mask_mod at global positions, the score_mod's closed-over table
        # differentiated: zig-zag kernels (both branches' position maps), the contiguous
        # causal layout, and cross-attention with a batch axis beside the ring.
        dict(causal=True, load_balance=True, heads=4, kv_heads=2, mods=True),
        dict(causal=True, load_balance=False, backend="xla", mods=True, sinks=True),
        dict(causal=False, seq_q=64, seq_k=128, batch=2, mesh_shape=(2, 2), batch_axis="dp", backend="xla", mods=True),
    ],
    ids=["full-gqa", "causal-zigzag-gqa-bf16", "xla-causal-contiguous", "xla-cross-mqa", "xla-dp-sp",
         "xla-full-gqa-segments", "causal-zigzag-gqa-segments-empty-rows", "xla-dp-sp-contiguous-segments",
         "causal-zigzag-sinks-empty-rows", "xla-causal-contiguous-mqa-sinks", "causal-zigzag-softcap-sinks",
         "xla-cross-softcap", "causal-zigzag-mods", "xla-causal-contiguous-mods-sinks", "xla-dp-sp-cross-mods"],
)
def test_ring_matches_reference(case, request):
    seed = zlib.crc32(request.node.nodeid.encode())
    run_on_devices(__file__, "check_ring", seed=seed, **case)


def check_ring_lowers_to_triton_for_sm90(*, options: str):
    """The ring's compiled (non-interpret) Triton blocks lower for CUDA as on an H100, each
    Triton module verified (`cuda_lowering.as_on_h100`): the kernels, their scoring and the
    mods' position maps as the GPU's Triton receives them. Forward and backward, zig-zag."""
    import dataclasses

    from cuda_lowering import as_on_h100
    from flashjax import ring as ring_module

    def compiled_blocks(check):  # the ring picks interpret mode from the mesh's CPU devices
        def checked(*args, **kwargs):
            ring = check(*args, **kwargs)
            return dataclasses.replace(ring, block=dataclasses.replace(ring.block, interpret=False))

        return checked

    seq, heads = 512, 4
    extra = {}
    if options == "mods":
        table = jnp.zeros((heads, 2 * seq), jnp.float32)
        doc_ids = jnp.asarray(np.broadcast_to(np.arange(seq) // 40, (1, seq)), jnp.int32)
        extra = dict(zip(("score_mod", "mask_mod"), _mods(table, doc_ids, 48)))
    elif options == "segments-softcap":
        extra = dict(segment_ids=_packed_ids([[100, 300, 112]], seq), softcap=2.0)
    mesh = jax.make_mesh((2,), ("sp",))
    q = jax.ShapeDtypeStruct((1, seq, heads, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, seq, 2, 64), jnp.bfloat16)

    def loss(q, k, v):
        o = ring_attention(q, k, v, mesh=mesh, axis_name="sp", causal=True, backend="triton", **extra)
        return jnp.sum(o.astype(jnp.float32))

    check = ring_module._check
    ring_module._check = compiled_blocks(check)
    try:
        with as_on_h100():
            text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
    finally:
        ring_module._check = check
    assert text.count("__gpu$xla.gpu.triton") >= 3, "the ring's forward and backward blocks on the Triton kernels"


@pytest.mark.parametrize("options", ["plain", "segments-softcap", "mods"])
def test_ring_lowers_to_triton_for_sm90(options):
    run_on_devices(__file__, "check_ring_lowers_to_triton_for_sm90", options=options)


def check_ring_transforms(*, seed):
    """The ring under jax.checkpoint (gradients of a rematerialised ring) and under vmap (an
    extra leading axis over the batch) equals the reference (pure-JAX blocks: the transforms
    act on the ring's custom_vjp and shard_map, not on the kernels)."""
    mesh = jax.make_mesh((DEVICES,), ("sp",))
    x = _inputs(seed, 2, 64, 64, 4, 2, 16, jnp.float32)
    ring = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, axis_name="sp", causal=True, load_balance=False,
                                          backend="xla")
    oracle = lambda q, k, v: reference.attention(q, k, v, causal=True)
    check_under_remat_and_vmap(ring, oracle, x.q, x.k, x.v, x.do)


def test_ring_under_remat_and_vmap(request):
    run_on_devices(__file__, "check_ring_transforms", seed=zlib.crc32(request.node.nodeid.encode()))


def check_ring_on_explicit_meshes(*, seed):
    """On a mesh of Explicit axes (jax.make_mesh's default), with inputs typed replicated:
    the gradients are typed like the inputs (so a gather before the ring, `x[:, perm]` or
    `zigzag_order`, differentiates), and under jax.set_mesh a mask_mod and a score_mod
    with a learned table differentiate (q and the table) on the reference blocks and the
    Triton blocks, against the reference."""
    mesh = jax.make_mesh((DEVICES,), ("sp",))
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((1, 32, 2, 16), dtype=np.float32))
    table = jnp.asarray(rng.standard_normal((2, 8), dtype=np.float32))
    perm = np.arange(32)[::-1].copy()
    ring = lambda q, **kw: ring_attention(q, q, q, mesh=mesh, axis_name="sp", **kw)
    (dq,) = jax.vjp(lambda q: ring(q, backend="xla", causal=False), q)[1](jnp.ones_like(q))
    assert jax.typeof(dq).sharding.spec == jax.typeof(q).sharding.spec, (jax.typeof(dq), jax.typeof(q))
    for layout in (lambda q: q[:, perm], lambda q: zigzag_order(q, DEVICES)):
        want = jax.grad(lambda q: jnp.sum(reference.attention(layout(q), layout(q), layout(q)) ** 2))(q)
        got = jax.jit(jax.grad(lambda q: jnp.sum(ring(layout(q), backend="xla") ** 2)))(q)
        check_close(got, want, jnp.float32, "dq through a gather")
    mask_mod = lambda b, h, i, j: j >= i - 20

    def loss(attention, **kw):  # the table an argument, for its gradient
        def run(q, t):
            score_mod = lambda s, b, h, i, j: s + t[h, jnp.clip(i - j, 0, 7)]
            return jnp.sum(attention(q, q, q, causal=True, mask_mod=mask_mod, score_mod=score_mod, **kw) ** 2)
        return run

    want = jax.grad(loss(reference.attention), argnums=(0, 1))(q, table)
    with jax.set_mesh(mesh):
        for backend in ("xla", "triton"):
            got = jax.jit(jax.grad(loss(ring_attention, mesh=mesh, axis_name="sp", backend=backend, load_balance=False),
                                   argnums=(0, 1)))(q, table)
            for name, g, w in zip(("dq", "dtable"), got, want):
                check_close(g, w, jnp.float32, f"{name} {backend}")
    # Sinks split over the ring's axis (any layout of the caller's) are laid out along the heads.
    sinks_host = rng.standard_normal(DEVICES).astype(np.float32)
    sinks = jax.device_put(sinks_host, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("sp")))
    q4 = jnp.asarray(rng.standard_normal((1, 32, DEVICES, 16), dtype=np.float32))
    want = jax.grad(lambda q, s: jnp.sum(reference.attention(q, q, q, causal=True, sinks=s) ** 2),
                    argnums=(0, 1))(q4, jnp.asarray(sinks_host))
    got = jax.jit(jax.grad(lambda q, s: jnp.sum(ring(q, causal=True, sinks=s, backend="xla", load_balance=False) ** 2),
                           argnums=(0, 1)))(q4, sinks)
    for name, g, w in zip(("dq", "dsinks"), got, want):
        check_close(g, w, jnp.float32, f"{name} with sharded sinks")


def test_ring_on_explicit_meshes(request):
    run_on_devices(__file__, "check_ring_on_explicit_meshes", seed=zlib.crc32(request.node.nodeid.encode()))


def check_ring_precision_types_and_second_order(*, seed):
    """float64 inputs stay float64 through the merge (every layout, including the causal
    natural-order one whose skipped blocks are constants); a Hessian-vector product through
    the reference blocks is finite with a query row that sees no key (the merge's logaddexp
    never meets two -inf); on an Explicit mesh the output is typed as q; complex is refused."""
    jax.config.update("jax_enable_x64", True)
    mesh = jax.make_mesh((DEVICES,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 32, 2, 16))) for _ in range(3))
    assert q.dtype == jnp.float64
    for causal, load_balance in ((False, True), (True, True), (True, False)):
        layout = (lambda x: zigzag_order(x, DEVICES)) if causal and load_balance else (lambda x: x)
        got = ring_attention(layout(q), layout(k), layout(v), mesh=mesh, axis_name="sp", causal=causal,
                             load_balance=load_balance, backend="xla")
        want = layout(reference.attention(q, k, v, causal=causal))
        assert got.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-12, atol=1e-12)
    # Query 5's document has no key: its row sees nothing.
    q_ids = jnp.asarray(np.r_[np.zeros(5), [7], np.ones(26)][None], jnp.int32)
    kv_ids = jnp.asarray(np.r_[np.zeros(8), np.ones(24)][None], jnp.int32)
    tangent = jnp.asarray(rng.standard_normal(q.shape))

    def hvp(attention, **kw):
        loss = lambda q, k, v: jnp.sum(jnp.sin(attention(q, k, v, segment_ids=(q_ids, kv_ids), **kw)))
        return jax.jvp(lambda q: jax.grad(loss, argnums=(0, 1, 2))(q, k, v), (q,), (tangent,))[1]

    got = hvp(ring_attention, mesh=mesh, axis_name="sp", backend="xla")
    want = hvp(reference.attention)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert np.isfinite(np.asarray(g)).all(), name
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-9, atol=1e-9, err_msg=name)
    explicit = jax.make_mesh((DEVICES,), ("sp",))
    for spec in (jax.sharding.PartitionSpec(), jax.sharding.PartitionSpec(None, "sp")):
        x = jax.device_put(q.astype(jnp.float32), jax.sharding.NamedSharding(explicit, spec))
        out = ring_attention(x, x, x, mesh=explicit, axis_name="sp", backend="xla")
        assert jax.typeof(out).sharding.spec == jax.typeof(x).sharding.spec, (jax.typeof(out), jax.typeof(x))
    with pytest.raises(ValueError, match="real floating inputs"):
        ring_attention(q.astype(jnp.complex64), k.astype(jnp.complex64), v.astype(jnp.complex64), mesh=mesh,
                       axis_name="sp", backend="xla")


def test_ring_precision_types_and_second_order(request):
    run_on_devices(__file__, "check_ring_precision_types_and_second_order",
                   seed=zlib.crc32(request.node.nodeid.encode()))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_zigzag_layout(n):
    seq = 4 * n
    x = jnp.arange(2 * seq).reshape(2, seq)
    z = zigzag_order(x, n)
    chunk = seq // (2 * n)
    shards = np.asarray(z[0]).reshape(n, 2, chunk)
    for r in range(n):  # device r holds chunks r and 2n-1-r
        np.testing.assert_array_equal(shards[r, 0], np.arange(r * chunk, (r + 1) * chunk))
        np.testing.assert_array_equal(shards[r, 1], np.arange((2 * n - 1 - r) * chunk, (2 * n - r) * chunk))
    np.testing.assert_array_equal(zigzag_restore(z, n), x)


def test_single_device_ring(make_inputs, reference_vjp, assert_result_close):
    """A ring of one device is plain attention (checks the wrapper and custom_vjp, not the ring)."""
    mesh = jax.make_mesh((1,), ("sp",))
    x = make_inputs(1, 64, 64, 2, 2, 32)
    fn = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, axis_name="sp", causal=True, return_lse=True, backend="xla")
    (o, lse), pullback = jax.vjp(fn, x.q, x.k, x.v)
    got = Result(o, lse, *pullback((x.do, x.dlse)))
    assert_result_close(got, reference_vjp(x.q, x.k, x.v, x.do, x.dlse, causal=True), jnp.float32)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(axis_name="seq"), "not an axis of the mesh"),
        (dict(seq=63), "multiple of 2"),
        (dict(causal=False, seq_k=32), None),
        (dict(seq_k=32), "same length"),
        (dict(backend="cuda"), "backend must be 'auto' or one of"),
        (dict(config={"block_q": 64}), "config must be one of"),
        (dict(head_axis="sp"), "distinct"),
        (dict(segment_ids=np.zeros((1, 32), np.int32)), r"q segment_ids must have shape \(1, 64\)"),
        (dict(segment_ids=(np.zeros((1, 64), np.int32), np.zeros((2, 64), np.int32))), "kv segment_ids must have"),
        (dict(segment_ids=np.zeros((1, 64), np.float32)), "segment_ids must be integers"),
        (dict(causal=False, seq_k=32, segment_ids=np.zeros((1, 64), np.int32)), "segment_ids as one array"),
        (dict(sinks=np.zeros(3, np.float32)), "sinks"),
        (dict(sinks=np.zeros(2, np.int32)), "sinks"),
        (dict(softcap=-1.0), "softcap must be a finite number > 0"),
        (dict(score_mod=3), "score_mod must be a function"),
        (dict(mask_mod=lambda b, h, q_idx, kv_idx: q_idx), "mask_mod must return a bool"),
        (dict(load_balance="False"), "load_balance must be a bool"),
        (dict(return_lse="no"), "return_lse must be a bool"),
        (dict(mesh=jax.sharding.AbstractMesh((1,), ("sp",))), "needs a jax.sharding.Mesh of devices"),
    ],
)
def test_ring_errors(kwargs, message):
    mesh = jax.make_mesh((1,), ("sp",))
    seq = kwargs.pop("seq", 64)
    seq_k = kwargs.pop("seq_k", seq)
    q = jnp.zeros((1, seq, 2, 16))
    k = jnp.zeros((1, seq_k, 2, 16))
    options = dict(mesh=mesh, axis_name="sp", causal=True) | kwargs
    if message is None:
        assert ring_attention(q, k, k, **options).shape == q.shape
        return
    with pytest.raises(ValueError, match=message):
        ring_attention(q, k, k, **options)


def test_ring_named_backend_that_cannot_run_the_blocks():
    """The ring chooses its block backend like flash_attention: a named one that cannot
    run the call raises with its reasons (here: no Hopper GPU, or segment ids)."""
    mesh = jax.make_mesh((1,), ("sp",))
    q = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="mosaic"):
        ring_attention(q, q, q, mesh=mesh, axis_name="sp", backend="mosaic",
                       segment_ids=jnp.zeros((1, 64), jnp.int32))


# Each device's blocks on the kernels `auto` picks (the Hopper kernels on H100/H200; the
# Triton kernels with mods), bf16 at sizes whose zig-zag chunks fill the Hopper tiles:
# 1024 tokens over 4 GPUs are chunks of 128 rows. The cases mirror the CPU ones above.
GPU_RING_CASES = [
    pytest.param(dict(causal=False), id="full-gqa"),
    pytest.param(dict(causal=True), id="causal-zigzag-gqa"),
    pytest.param(dict(causal=True, load_balance=False), id="causal-contiguous-gqa"),
    pytest.param(dict(causal=False, seq_q=512, seq_k=1024, kv_heads=1), id="cross-mqa"),
    pytest.param(dict(causal=True, segments=[[300, 300, 424]], kv_segments=[[300, 340, 384]]),
                 id="causal-zigzag-segments-empty-rows"),
    pytest.param(dict(causal=True, segments=[[300, 300, 424]], kv_segments=[[300, 340, 384]], sinks=True),
                 id="causal-zigzag-segments-sinks"),
    pytest.param(dict(causal=True, softcap=2.0, sinks=True), id="causal-zigzag-softcap-sinks"),
    pytest.param(dict(causal=True, mods=True), id="causal-zigzag-mods"),
    pytest.param(dict(causal=True, batch=2, data_parallel=True), id="causal-zigzag-dp-sp"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_RING_CASES)
def test_ring_on_gpus(case, request):
    """The ring over every visible GPU (2 or more), against the float32 reference."""
    gpus = gpus_or_skip("a ring")
    case = dict(case)
    mesh_shape = (gpus,)
    if case.pop("data_parallel", False):
        mesh_shape = two_rows_or_skip(gpus)
        case["batch_axis"] = "dp"
    defaults = dict(seq_q=1024, heads=4, kv_heads=2, head_dim=128, dtype="bfloat16", backend="auto")
    check_ring(seed=zlib.crc32(request.node.nodeid.encode()), mesh_shape=mesh_shape, **(defaults | case))


def test_ring_second_derivatives_raise_a_clear_error():
    """Grad of grad and a Hessian-vector product of ring attention on the kernels raise the
    error that names backend="xla" (the ring's own custom VJP calls the kernels), and its
    gradient is unchanged."""
    mesh = jax.make_mesh((1,), ("sp",))
    q = jax.random.normal(jax.random.key(0), (1, 32, 2, 16))
    loss = lambda q, backend: jnp.sum(jnp.sin(ring_attention(q, q, q, mesh=mesh, axis_name="sp", backend=backend)))
    with pytest.raises(NotImplementedError, match="second derivatives.*backend='xla'"):
        jax.jvp(lambda q: jax.grad(loss)(q, "triton"), (q,), (q,))
    with pytest.raises(NotImplementedError, match="second derivatives.*backend='xla'"):
        jax.grad(lambda q: jnp.sum(jax.grad(loss)(q, "triton") ** 2))(q)
    np.testing.assert_allclose(jax.grad(loss)(q, "triton"), jax.grad(loss)(q, "xla"), rtol=1e-5, atol=1e-5)

"""Batch/head-sharded attention (`flashjax.sharding`) against the single-device reference.

The multi-device bodies (`check_*`) run on 4 CPU devices in a subprocess (see
tests/multidevice.py for why); the Pallas kernels run in interpret mode there.
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from conftest import check_close, check_lse, check_under_remat_and_vmap
from flashjax import reference
from flashjax.ring import ring_attention
from flashjax.sharding import sharded_flash_attention
from multidevice import DEVICES, gpus_or_skip, run_on_devices, two_rows_or_skip


def check_sharded(*, seed, mesh_shape, batch_axis, head_axis, batch=4, seq=64, heads=4, kv_heads=4, head_dim=32,
                  causal=False, dtype="float32", extras=False, backend="triton"):
    """Output, lse and gradients equal the reference's; the compiled program gathers nothing.

    With ``extras``: a bias broadcast over the batch (its gradient sums over the batch
    shards), segment ids and key lengths, all sharded along with q, k, v. ``backend``: the
    per-shard calls' (the Triton kernels, in interpret mode on CPU devices).
    """
    dtype = jnp.dtype(dtype)
    mesh = jax.make_mesh(mesh_shape, ("data", "model")[: len(mesh_shape)])
    rng = np.random.default_rng(seed)
    draw = lambda *shape, dt=dtype: jnp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dt)
    q, do = draw(batch, seq, heads, head_dim), draw(batch, seq, heads, head_dim)
    k, v = draw(batch, seq, kv_heads, head_dim), draw(batch, seq, kv_heads, head_dim)
    dlse = draw(batch, heads, seq, dt=jnp.float32)
    arrays = {}
    if extras:
        arrays = dict(
            bias=draw(1, heads, seq, seq, dt=jnp.float32),
            segment_ids=jnp.asarray(np.sort(rng.integers(0, 3, (batch, seq)), axis=1), jnp.int32),
            kv_lengths=jnp.asarray(rng.integers(seq // 2, seq + 1, (batch,)), jnp.int32),
        )
    diff = ("bias",) if extras else ()

    def sharded(q, k, v, *diff_arrays):
        kwargs = dict(arrays, **dict(zip(diff, diff_arrays)))
        return sharded_flash_attention(
            q, k, v, mesh=mesh, batch_axis=batch_axis, head_axis=head_axis, causal=causal,
            return_lse=True, backend=backend, **kwargs,
        )

    def oracle(q, k, v, *diff_arrays):
        kwargs = dict(arrays, **dict(zip(diff, diff_arrays)))
        up = lambda x: x.astype(jnp.float32)
        return reference.attention(up(q), up(k), up(v), causal=causal, return_lse=True, **kwargs)

    def vjp(fn, *primals):
        (o, lse), pullback = jax.vjp(fn, *primals)
        return (o, lse, *pullback((do.astype(o.dtype), dlse)))

    spec = jax.sharding.PartitionSpec(batch_axis, None, head_axis, None)
    place = lambda x: jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
    primals = (place(q), place(k), place(v), *(arrays[name] for name in diff))
    # Compiled once, both to run and to read the program (a second .lower() would recompile).
    step = jax.jit(lambda *p: vjp(sharded, *p)).lower(*primals).compile()
    got = step(*primals)
    want = jax.jit(lambda *p: vjp(oracle, *p))(q, k, v, *(arrays[name] for name in diff))
    names = ("o", "lse", "dq", "dk", "dv", *(f"d{name}" for name in diff))
    for name, g, w in zip(names, got, want):
        if name == "lse":
            check_lse(g, w, dtype)
        else:
            check_close(g, w, dtype, name)
    # The output stays sharded as the inputs: no device holds the whole result.
    assert got[0].sharding.spec == spec, got[0].sharding
    assert "all-gather" not in step.as_text(), "the sharded program gathers q, k or v"


def check_sharded_mods(*, seed, block_mask: bool):
    """score_mod (a learned table per head, a factor per batch row), a document mask_mod (ids per
    batch row) and sinks on a batch x head mesh: the mods see global batch and head indices, so
    output, lse and the gradients of q, k, v, the table and the sinks equal the reference's;
    with ``block_mask`` the block mask built for the whole batch is split along with it."""
    mesh = jax.make_mesh((2, 2), ("data", "model"))
    batch, seq, heads, head_dim = 4, 48, 4, 32
    rng = np.random.default_rng(seed)
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape, dtype=np.float32))
    q, k, v, do = (draw(batch, seq, heads, head_dim) for _ in range(4))
    dlse = draw(batch, heads, seq)
    table, sinks = draw(heads, 9), draw(heads)
    row_factor = jnp.asarray(rng.uniform(0.5, 2.0, batch), jnp.float32)
    ids = jnp.asarray(np.sort(rng.integers(0, 3, (batch, seq)), axis=1), jnp.int32)

    def score_mod_of(table):
        def score_mod(score, b, h, q_idx, kv_idx):
            return score * row_factor[b] + table[h, jnp.clip(kv_idx - q_idx + 4, 0, 8)]
        return score_mod

    def mask_mod(b, h, q_idx, kv_idx):
        return (ids[b, q_idx] == ids[b, kv_idx]) & (kv_idx <= q_idx + h)

    options = dict(mask_mod=mask_mod)
    if block_mask:
        options = dict(block_mask=flashjax.block_mask(mask_mod, batch, heads, seq, seq, block_q=16, block_k=16))

    def sharded(q, k, v, table, sinks):
        return sharded_flash_attention(q, k, v, mesh=mesh, batch_axis="data", head_axis="model",
                                       score_mod=score_mod_of(table), sinks=sinks, return_lse=True,
                                       backend="triton", **options)

    def oracle(q, k, v, table, sinks):
        return reference.attention(q, k, v, score_mod=score_mod_of(table), mask_mod=mask_mod, sinks=sinks,
                                   return_lse=True)

    def vjp(fn, *primals):
        (o, lse), pullback = jax.vjp(fn, *primals)
        return (o, lse, *pullback((do, dlse)))

    got = jax.jit(lambda *p: vjp(sharded, *p))(q, k, v, table, sinks)
    want = jax.jit(lambda *p: vjp(oracle, *p))(q, k, v, table, sinks)
    for name, g, w in zip(("o", "lse", "dq", "dk", "dv", "dtable", "dsinks"), got, want):
        if name == "lse":
            check_lse(g, w, jnp.float32)
        else:
            check_close(g, w, jnp.float32, name)


def check_sharded_transforms(*, seed):
    """Batch-sharded attention under jax.checkpoint (gradients) and vmap (an extra leading axis)
    equals the reference (pure-JAX shards: the transforms act on the shard_map wrapper)."""
    mesh = jax.make_mesh((DEVICES,), ("data",))
    rng = np.random.default_rng(seed)
    q, k, v, w = (jnp.asarray(rng.standard_normal((DEVICES, 32, 2, 16), dtype=np.float32)) for _ in range(4))
    sharded = lambda q, k, v: sharded_flash_attention(q, k, v, mesh=mesh, batch_axis="data", causal=True,
                                                      backend="xla")
    oracle = lambda q, k, v: reference.attention(q, k, v, causal=True)
    check_under_remat_and_vmap(sharded, oracle, q, k, v, w)


def check_explicit_layouts(*, seed, set_mesh, mesh_shape=(2, 2), dtype="float32", backend="triton", seq_q=32,
                           seq_k=40, head_dim=16):
    """Plain `flash_attention` on arrays placed on a mesh of Explicit axes (JAX's default
    `jax.make_mesh`), split along the batch, the heads, both, neither or the sequence: output
    and gradients equal the reference's (with a score_mod, sinks and key lengths), under jit
    and eagerly, with or without `jax.set_mesh`; the output keeps q's batch and head split.
    The reference runs in float32 on the same (rounded) inputs."""
    import contextlib

    P, NamedSharding = jax.sharding.PartitionSpec, jax.sharding.NamedSharding
    mesh = jax.make_mesh(tuple(mesh_shape), ("data", "model"))
    assert mesh.explicit_axes == ("data", "model")
    dtype = jnp.dtype(dtype)
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((4, seq_q, 4, head_dim), dtype=np.float32), dtype)
    k, v = (jnp.asarray(rng.standard_normal((4, seq_k, 2, head_dim), dtype=np.float32), dtype) for _ in range(2))
    up = lambda *xs: [x.astype(jnp.float32) for x in xs]
    slopes = jnp.asarray([0.5, 0.25, 0.1, 0.2])
    options = dict(causal=True, score_mod=lambda s, b, h, i, j: s - slopes[h] * jnp.abs(i - j).astype(jnp.float32),
                   sinks=jnp.ones(4), kv_lengths=jnp.array([seq_k, seq_k * 3 // 4, seq_k // 2, seq_k // 4]))
    loss = lambda attention: lambda q, k, v: jnp.sum(attention(q, k, v, **options).astype(jnp.float32) * q)
    want = reference.attention(*up(q, k, v), **options)
    want_grads = jax.grad(loss(reference.attention), argnums=(0, 1, 2))(*up(q, k, v))
    with jax.set_mesh(mesh) if set_mesh else contextlib.nullcontext():
        for spec, kept in ((P("data"), P("data")), (P(None, None, "model"), P(None, None, "model")),
                           (P("data", None, "model"), P("data", None, "model")), (P(), P()),
                           (P(None, "data"), P())):
            qs, ks, vs = (jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v))
            out = jax.jit(lambda q, k, v: flashjax.flash_attention(q, k, v, backend=backend, **options))(qs, ks, vs)
            check_close(out, want, dtype, f"o {spec}")
            assert tuple(jax.typeof(out).sharding.spec)[:3] == tuple(kept) + (None,) * (3 - len(kept)), (spec, out)
            check_close(flashjax.flash_attention(qs, ks, vs, backend=backend, **options), want, dtype, "eager o")
            grads = jax.jit(jax.grad(loss(flashjax.flash_attention), argnums=(0, 1, 2)))(qs, ks, vs)
            for name, g, w in zip(("dq", "dk", "dv"), grads, want_grads):
                check_close(g, w, dtype, f"{name} {spec}")
        # MQA with the query heads split: one kv head cannot be, so the heads are gathered.
        qs = jax.device_put(q, NamedSharding(mesh, P("data", None, "model")))
        k1, v1 = (jax.device_put(x[:, :, :1], NamedSharding(mesh, P("data"))) for x in (k, v))
        out = jax.jit(lambda q, k, v: flashjax.flash_attention(q, k, v, backend=backend, causal=True))(qs, k1, v1)
        check_close(out, reference.attention(*up(q, k[:, :, :1], v[:, :, :1]), causal=True), dtype, "o mqa")


def check_mods_on_shards():
    """The shards evaluate the mods' traced programs on their closed-over arrays as operands:
    a mod reading state that changes between calls (a bound method reading an attribute)
    sees the new values, and a mask_mod closing over document ids split over an Explicit
    mesh (like the tokens) equals the built-in segment_ids. `explain` on such arrays
    describes one device's call."""
    P, NamedSharding = jax.sharding.PartitionSpec, jax.sharding.NamedSharding
    q = jax.random.normal(jax.random.key(0), (4, 16, 2, 16))

    class Model:
        bias = jnp.zeros((2,))

        def score_mod(self, s, b, h, i, j):
            return s + self.bias[h] * (i - j).astype(jnp.float32)

    model = Model()
    auto = jax.make_mesh((DEVICES,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    for bias in (jnp.zeros((2,)), jnp.full((2,), 0.5)):
        model.bias = bias
        got = sharded_flash_attention(q, q, q, mesh=auto, batch_axis="data", score_mod=model.score_mod)
        check_close(got, reference.attention(q, q, q, score_mod=model.score_mod), jnp.float32, "o after the update")
    mesh = jax.make_mesh((DEVICES,), ("data",))
    docs = jnp.asarray(np.repeat(np.arange(4), 4)[None].repeat(4, 0) % 3)
    qs, docs_split = (jax.device_put(x, NamedSharding(mesh, P("data"))) for x in (q, docs))
    got = flashjax.flash_attention(qs, qs, qs, mask_mod=lambda b, h, i, j: docs_split[b, i] == docs_split[b, j])
    check_close(got, reference.attention(q, q, q, segment_ids=docs), jnp.float32, "o with split document ids")
    # explain describes the call one device makes: past the interpret-mode limit whole
    # (the reference), within it per batch shard (the Triton kernels, as they run).
    big = jax.device_put(jnp.zeros((8, 600, 2, 16)), NamedSharding(mesh, P("data")))
    assert flashjax.explain(big, big, big).backend == "triton"
    assert flashjax.explain(np.zeros(big.shape), np.zeros(big.shape), np.zeros(big.shape)).backend == "xla"


def test_mods_on_shards():
    run_on_devices(__file__, "check_mods_on_shards")


def check_inside_user_shard_map(*, seed, mesh_shape=(2, 2), head_dim=16, dtype="float32", backends=("auto",)):
    """flash_attention and decode_attention called inside the user's own jax.shard_map with
    its default check_vma=True (the kernels' outputs typed with the inputs' mesh axes), on a
    (data, sp) mesh, against the reference:

    * q, k, v split along the batch and the heads;
    * q's rows split along sp, k, v, a bias [1, H, 1, Tk] and a score_mod's table (through
      relu, a custom_jvp rule) replicated over sp: their gradients are the sums over the sp
      shards;
    * decode steps on a cache split along the batch.

    Without a GPU the Triton kernels' interpret mode cannot run there: auto takes the
    reference, and backend="triton" says why.
    """
    P = jax.sharding.PartitionSpec
    mesh = jax.make_mesh(mesh_shape, ("data", "sp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rng = np.random.default_rng(seed)
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape, dtype=np.float32))
    heads, dtype = 2 * mesh_shape[1], jnp.dtype(dtype)
    q, k, v = (draw(4, seq, heads, head_dim).astype(dtype) for seq in (24 * mesh_shape[1], 40, 40))
    bias, table = draw(1, heads, 1, 40), draw(heads)
    mask_mod = lambda b, h, i, j: j % 3 != 1  # of the key alone: q's rows may be split
    loss = lambda o: jnp.sum(jnp.sin(o))

    def attend(q, k, v, bias, table, backend=None):
        mod = lambda s, b, h, i, j: s + jax.nn.relu(table[h]) * (j % 5)  # relu: a custom_jvp rule
        if backend is None:
            up = lambda x: x.astype(jnp.float32)
            return reference.attention(up(q), up(k), up(v), bias=bias, mask_mod=mask_mod, score_mod=mod)
        return flashjax.flash_attention(q, k, v, bias=bias, mask_mod=mask_mod, score_mod=mod, backend=backend)

    args = (q, k, v, bias, table)
    want, want_grads = attend(*args), jax.grad(lambda *a: loss(attend(*a)), argnums=range(5))(*args)
    layouts = {
        "batch and heads": (P("data", None, "sp"), P("data", None, "sp"), P(None, "sp"), P("sp")),
        "rows of q": (P("data", "sp"), P("data"), P(), P()),
    }
    for backend in backends:
        for name, (q_spec, kv_spec, bias_spec, table_spec) in layouts.items():
            f = jax.shard_map(functools.partial(attend, backend=backend), mesh=mesh,  # check_vma=True
                              in_specs=(q_spec, kv_spec, kv_spec, bias_spec, table_spec), out_specs=q_spec)
            check_close(jax.jit(f)(*args), want, dtype, f"o, {name}, {backend}")
            grads = jax.jit(jax.grad(lambda *a: loss(f(*a)), argnums=range(5)))(*args)
            for arg, got, expected in zip(("q", "k", "v", "bias", "table"), grads, want_grads):
                check_close(got, expected, dtype, f"d{arg}, {name}, {backend}")
        lengths = jnp.asarray([40, 7, 0, 33], jnp.int32)
        step = jax.shard_map(lambda q, k, v, n: flashjax.decode_attention(q, k, v, n, backend=backend), mesh=mesh,
                             in_specs=(P("data"),) * 4, out_specs=P("data"))
        keys = jnp.arange(40)[None, None, None, :]
        visible = keys <= lengths[:, None, None, None] - 2 + jnp.arange(2)[None, None, :, None]
        want_step = reference.attention(*(x.astype(jnp.float32) for x in (q[:, :2], k, v)),
                                        mask=visible & (keys < lengths[:, None, None, None]))
        check_close(jax.jit(step)(q[:, :2], k, v, lengths), want_step, dtype, f"decode, {backend}")
    if jax.default_backend() != "gpu":
        f = jax.shard_map(functools.partial(attend, backend="triton"), mesh=mesh, in_specs=P("data"), out_specs=P("data"))
        with pytest.raises(NotImplementedError, match="check_vma=False"):
            f(q, k, v, None, table)


def test_inside_user_shard_map(request):
    run_on_devices(__file__, "check_inside_user_shard_map", seed=zlib.crc32(request.node.nodeid.encode()))


@pytest.mark.gpu
def test_inside_user_shard_map_on_gpus(request):
    """As on the CPU devices, with the compiled kernels: the Triton ones and those auto
    takes (the Hopper ones on sm90), bf16, over every visible GPU (an even count)."""
    gpus = gpus_or_skip("the shards")
    if gpus % 2:
        pytest.skip(f"a (2, gpus / 2) mesh needs an even count of GPUs; {gpus} visible")
    check_inside_user_shard_map(seed=zlib.crc32(request.node.nodeid.encode()), mesh_shape=(2, gpus // 2),
                                head_dim=64, dtype="bfloat16", backends=("triton", "auto"))


def check_explicit_arguments_checked_whole():
    """flash_attention on Explicit-mesh arrays checks its arguments on the whole arrays, before
    the per-shard call: the messages name the user's shapes and options."""
    P = jax.sharding.PartitionSpec
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    q = jax.device_put(jnp.ones((4, 16, 4, 16), jnp.float32), jax.sharding.NamedSharding(mesh, P("data", None, "model")))
    cases = [
        (dict(dropout_rate=0.5), "needs a dropout_rng"),
        (dict(dropout_rng=3, dropout_rate=0.5), "dropout_rng must be one jax.random key"),
        (dict(kv_lengths=jnp.ones((3,), jnp.int32)), r"kv_lengths must have shape \(4,\)"),
        (dict(segment_ids=jnp.ones((4, 15), jnp.int32)), r"must have shape \(4, 16\)"),
        (dict(bias=jnp.ones((3, 16, 16))), "not broadcastable"),
        (dict(scale=jnp.float32(0.5)), "static Python number"),
    ]
    with jax.set_mesh(mesh):
        for options, message in cases:
            with pytest.raises(ValueError, match=message):
                flashjax.flash_attention(q, q, q, **options)


def test_explicit_arguments_checked_whole():
    run_on_devices(__file__, "check_explicit_arguments_checked_whole")


def check_partly_manual_shard_map(*, seed, mesh_shape=(2, 2)):
    """Inside a user's shard_map manual over one axis ("data") of an Explicit (data, model)
    mesh, the arrays still split along "model" by their type, against the reference:

    * decode_attention with replicated sinks: out, and the sinks' gradient summed over the
      "data" shards (check_vma=True and False);
    * flash_attention: the forward under both, its gradient under check_vma=False, and under
      check_vma=True a NotImplementedError naming check_vma=False (never a wrong gradient);
    * a score_mod reading `jax.lax.axis_index` (the shard's global batch row) on an Auto
      mesh: out and the gradients of q and of the table it reads.
    """
    P = jax.sharding.PartitionSpec
    mesh = jax.make_mesh(mesh_shape, ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    rng = np.random.default_rng(seed)
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape, dtype=np.float32))
    q, k, v, sinks = draw(4, 16, 4, 16), draw(4, 24, 4, 16), draw(4, 24, 4, 16), draw(4)
    put = lambda x, spec: jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
    split = (*(put(x, P("data", None, "model")) for x in (q, k, v)), put(sinks, P("model")))
    loss = lambda o: jnp.sum(jnp.sin(o))
    lengths = jnp.asarray([24, 5, 0, 17], jnp.int32)
    keys = jnp.arange(24)[None, None, None, :]
    visible = keys < lengths[:, None, None, None]

    def partly_manual(fn, check_vma, extra=()):
        return jax.shard_map(fn, mesh=mesh, in_specs=(P("data"),) * 3 + (P(),) + extra, out_specs=P("data"),
                             axis_names={"data"}, check_vma=check_vma)

    want_step = lambda s: reference.attention(q[:, -1:], k, v, mask=visible, sinks=s)
    want = lambda s: reference.attention(q, k, v, sinks=s)
    step_args = (split[0][:, -1:], *split[1:], put(lengths, P("data")))
    for check_vma in (True, False):
        step = partly_manual(lambda q, k, v, s, n: flashjax.decode_attention(q, k, v, n, sinks=s), check_vma,
                             (P("data"),))
        attend = partly_manual(lambda q, k, v, s: flashjax.flash_attention(q, k, v, sinks=s), check_vma)
        with jax.set_mesh(mesh):
            out_step = jax.jit(step)(*step_args)
            dsinks_step = jax.jit(jax.grad(lambda *a: loss(step(*a)), argnums=3))(*step_args)
            out = jax.jit(attend)(*split)
        check_close(out_step, want_step(sinks), jnp.float32, f"decode, check_vma={check_vma}")
        check_close(dsinks_step, jax.grad(lambda s: loss(want_step(s)))(sinks), jnp.float32,
                    f"decode dsinks, check_vma={check_vma}")
        check_close(out, want(sinks), jnp.float32, f"o, check_vma={check_vma}")
        grad = jax.jit(jax.grad(lambda *a: loss(attend(*a)), argnums=(0, 1, 2, 3)))
        if check_vma:
            with jax.set_mesh(mesh), pytest.raises(NotImplementedError, match="check_vma=False"):
                grad(*split)
        else:
            with jax.set_mesh(mesh):
                got = grad(*split)
            expected = jax.grad(lambda q, k, v, s: loss(reference.attention(q, k, v, sinks=s)), argnums=range(4))(q, k, v, sinks)
            for name, g, w in zip(("q", "k", "v", "sinks"), got, expected):
                check_close(g, w, jnp.float32, f"d{name}, check_vma=False")

    auto = jax.make_mesh((np.prod(mesh_shape),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    table = draw(4) * 3
    mod = lambda t, offset: lambda s, b, h, i, j: s + t[b + offset()] * (j - i) / 8
    global_rows = lambda q, t: flashjax.flash_attention(q, q, q, score_mod=mod(t, lambda: jax.lax.axis_index("data") * q.shape[0]))
    f = jax.shard_map(global_rows, mesh=auto, in_specs=(P("data"), P()), out_specs=P("data"))
    oracle = lambda q, t: reference.attention(q, q, q, score_mod=mod(t, lambda: 0))
    check_close(jax.jit(f)(q, table), oracle(q, table), jnp.float32, "axis_index in a score_mod")
    got = jax.jit(jax.grad(lambda q, t: loss(f(q, t)), argnums=(0, 1)))(q, table)
    for name, g, w in zip(("q", "table"), got, jax.grad(lambda q, t: loss(oracle(q, t)), argnums=(0, 1))(q, table)):
        check_close(g, w, jnp.float32, f"d{name}, axis_index in a score_mod")


def test_partly_manual_shard_map(request):
    run_on_devices(__file__, "check_partly_manual_shard_map", seed=zlib.crc32(request.node.nodeid.encode()))


@pytest.mark.gpu
def test_partly_manual_shard_map_on_gpus(request):
    """As on the CPU devices, with the compiled kernels auto takes, over every visible GPU (an
    even count) as (2, gpus / 2). (A manual "data" axis of size 1, a (1, 2) mesh, fails in
    XLA's SPMD partitioner (JAX 0.11.2: "Cross-partition allreduce must be in (partial)
    manual partitioning mode") under the decode step's gradient, with check_vma False too.)"""
    gpus = gpus_or_skip("the shards")
    if gpus % 2:
        pytest.skip(f"a (2, gpus / 2) mesh needs an even count of GPUs; {gpus} visible")
    check_partly_manual_shard_map(seed=zlib.crc32(request.node.nodeid.encode()), mesh_shape=(2, gpus // 2))


def check_mixed_meshes(*, seed):
    """On a mesh of one Explicit and one Auto axis: the ring along either (with the batch
    along the other), sharded_flash_attention along the Auto one, and eager flash_attention
    and decode_attention on arrays split along both, against the reference (the per-shard
    path splits along the Explicit axis; the Auto one is XLA's)."""
    E, A = jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto
    P, NamedSharding = jax.sharding.PartitionSpec, jax.sharding.NamedSharding
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((4, 16, 4, 16), dtype=np.float32))
    want = reference.attention(q, q, q, causal=True)
    for types in ((E, A), (A, E)):
        mesh = jax.make_mesh((2, 2), ("data", "sp"), axis_types=types)
        ring = jax.jit(lambda q: ring_attention(q, q, q, mesh=mesh, axis_name="sp", batch_axis="data", causal=True,
                                                load_balance=False, backend="xla"))
        check_close(ring(q), want, jnp.float32, f"ring, axis types {types}")
        split = jax.jit(lambda q: sharded_flash_attention(q, q, q, mesh=mesh, batch_axis="sp", causal=True))
        check_close(split(q), want, jnp.float32, f"sharded, axis types {types}")
    qs = jax.device_put(q, NamedSharding(mesh, P("sp", None, "data")))  # the batch on the Explicit axis
    check_close(flashjax.flash_attention(qs, qs, qs, causal=True), want, jnp.float32, "eager flash_attention")
    lengths = jnp.full((4,), 16, jnp.int32)
    got = flashjax.decode_attention(qs[:, -1:], qs, qs, lengths)
    check_close(got, want[:, -1:], jnp.float32, "eager decode_attention")


def test_mixed_meshes(request):
    run_on_devices(__file__, "check_mixed_meshes", seed=zlib.crc32(request.node.nodeid.encode()))


def check_errors():
    """Sequence or head_dim sharding, GQA head counts that do not divide: ValueErrors that say what to do."""
    mesh = jax.make_mesh((DEVICES,), ("x",))
    P = jax.sharding.PartitionSpec
    q = jnp.zeros((4, 16, 4, 16))
    for spec, message in ((P(None, "x"), "ring_attention"), (P(None, None, None, "x"), "head_dim")):
        sharded = jax.device_put(q, jax.sharding.NamedSharding(mesh, spec))
        with pytest.raises(ValueError, match=message):
            sharded_flash_attention(sharded, sharded, sharded, mesh=mesh, batch_axis="x")
    kv = jnp.zeros((4, 16, 2, 16))
    with pytest.raises(ValueError, match="kv_heads"):
        sharded_flash_attention(q, kv, kv, mesh=mesh, head_axis="x")
    with pytest.raises(ValueError, match="batch_axis and/or head_axis"):
        sharded_flash_attention(q, q, q, mesh=mesh)
    with pytest.raises(ValueError, match="not an axis"):
        sharded_flash_attention(q, q, q, mesh=mesh, batch_axis="data")


@pytest.mark.parametrize(
    "case",
    [
        dict(mesh_shape=(DEVICES,), batch_axis="data", head_axis=None, causal=True),
        dict(mesh_shape=(DEVICES,), batch_axis=None, head_axis="data", heads=8, kv_heads=4, head_dim=64),
        dict(mesh_shape=(2, 2), batch_axis="data", head_axis="model", heads=4, kv_heads=2, extras=True),
        dict(mesh_shape=(2, 2), batch_axis=("data", "model"), head_axis=None, dtype="bfloat16", causal=True),
    ],
    ids=["batch-causal", "heads-gqa", "batch-heads-extras", "batch-two-axes-bf16"],
)
def test_sharded_matches_reference(case, request):
    run_on_devices(__file__, "check_sharded", seed=zlib.crc32(request.node.nodeid.encode()), **case)


@pytest.mark.parametrize("block_mask", [False, True], ids=["mask-mod", "block-mask"])
def test_sharded_mods_see_global_indices(block_mask, request):
    run_on_devices(__file__, "check_sharded_mods", seed=zlib.crc32(request.node.nodeid.encode()), block_mask=block_mask)


def test_sharded_under_remat_and_vmap(request):
    run_on_devices(__file__, "check_sharded_transforms", seed=zlib.crc32(request.node.nodeid.encode()))


@pytest.mark.parametrize("set_mesh", [False, True], ids=["arrays", "set-mesh"])
def test_explicit_layouts(set_mesh, request):
    run_on_devices(__file__, "check_explicit_layouts", seed=zlib.crc32(request.node.nodeid.encode()), set_mesh=set_mesh)


def test_sharded_errors():
    run_on_devices(__file__, "check_errors")


# The same checks over every visible GPU, the shards on the kernels `auto` picks (the Hopper
# kernels on H100/H200), bf16 at a size the Hopper tiles fill.
GPU_SHARDED_CASES = [
    pytest.param(dict(axes="batch", causal=True), id="batch-causal"),
    pytest.param(dict(axes="heads"), id="heads-gqa"),
    pytest.param(dict(axes="batch-heads", extras=True), id="batch-heads-extras"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_SHARDED_CASES)
def test_sharded_on_gpus(case, request):
    """Batch- and head-sharded attention over every visible GPU (2 or more), against the reference."""
    gpus = gpus_or_skip("the shards")
    case = dict(case)
    axes = case.pop("axes")
    if axes == "batch":
        layout = dict(mesh_shape=(gpus,), batch_axis="data", head_axis=None, batch=2 * gpus, heads=4, kv_heads=2)
    elif axes == "heads":
        layout = dict(mesh_shape=(gpus,), batch_axis=None, head_axis="data", batch=2, heads=4 * gpus, kv_heads=2 * gpus)
    else:
        layout = dict(mesh_shape=two_rows_or_skip(gpus), batch_axis="data", head_axis="model", batch=4,
                      heads=2 * gpus, kv_heads=gpus)
    check_sharded(seed=zlib.crc32(request.node.nodeid.encode()), seq=1024, head_dim=128, dtype="bfloat16",
                  backend="auto", **layout, **case)


@pytest.mark.gpu
@pytest.mark.parametrize("split", ["batch", "heads"])
def test_explicit_layouts_on_gpus(split, request):
    """Arrays on a mesh of Explicit axes over every visible GPU (2 or more; the mesh's other
    axis of size 1 where fewer than 4), on the kernels `auto` picks (the Hopper kernels on
    H100/H200), bf16, against the reference."""
    gpus = gpus_or_skip("the arrays")
    if gpus >= 4 and gpus % 2 == 0:
        mesh_shape = (2, gpus // 2)
    else:
        mesh_shape = (gpus, 1) if split == "batch" else (1, gpus)
    check_explicit_layouts(seed=zlib.crc32(request.node.nodeid.encode()), set_mesh=False, mesh_shape=mesh_shape,
                           dtype="bfloat16", backend="auto", seq_q=512, seq_k=640, head_dim=64)

"""score_mod, mask_mod, block masks, attention sinks and MLA head dims, against the reference.

Every kernel case runs the Triton kernels (interpret mode on the CPU) forward and
backward, with random cotangents for o and lse, and compares o, lse and the gradients of
q, k, v and of every differentiable array (a score_mod's closed-over table, the sinks,
the bias) with `flashjax.reference.attention` given the same functions. The mods are
those of `flashjax.mods`, the ones docs/flex.md shows. Small tiles (three different
tilings for the three kernels) make a sequence of 70 span several tiles, so that block
masks skip tiles, fill others and leave boundary tiles to the elementwise mask.
"""

from __future__ import annotations

import re
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core
import numpy as np
import pytest
from conftest import check_close, check_lse

from test_variants import SMALL_TILES, Shape, _params, packed_ids

import flashjax
from flashjax import api, autodiff, backends, flex, mods, reference, xla_semantics


def draw(rng, shape: Shape, dtype, q_scale=1.0):
    def normal(*dims, mult=1.0, dt=dtype):
        return jnp.asarray((mult * rng.standard_normal(dims)).astype(np.float32)).astype(dt)

    s = shape
    dv = s.v_head_dim or s.head_dim
    return dict(
        q=normal(s.batch, s.seq_q, s.heads, s.head_dim, mult=q_scale),
        k=normal(s.batch, s.seq_k, s.kv_heads, s.head_dim),
        v=normal(s.batch, s.seq_k, s.kv_heads, dv),
        do=normal(s.batch, s.seq_q, s.heads, dv),
        dlse=normal(s.batch, s.heads, s.seq_q, dt=jnp.float32),
    )


class Result(NamedTuple):
    o: jax.Array
    lse: jax.Array
    grads: dict  # dq, dk, dv and one entry per differentiable array


def vjp(attention, x, arrays: dict, options: Callable, dlse):
    """o, lse and the pullback of (do, dlse) of ``attention(q, k, v, return_lse=True, **options(arrays))``.

    `options` builds the keyword arguments from the differentiable `arrays` (so that the
    mods close over traced arrays, as in a training step).
    """

    def fn(q, k, v, arrays):
        return attention(q, k, v, return_lse=True, **options(arrays))

    (o, lse), pullback = jax.vjp(fn, x["q"], x["k"], x["v"], arrays)
    dq, dk, dv, darrays = pullback((x["do"].astype(o.dtype), dlse))
    return Result(o, lse, dict(dq=dq, dk=dk, dv=dv, **darrays))


def run_both(x, options, arrays=None, *, config=SMALL_TILES, backend="triton", reference_on_cpu=False,
             **kernel_kwargs) -> tuple[Result, Result]:
    """(kernel, reference) results; the reference in float32 on upcast inputs. The lse
    cotangent is zeroed on rows whose reference lse is -inf (the lse is constant there).

    reference_on_cpu: run the reference with XLA on the CPU. XLA on the GPU drops a round
    trip through a narrower float (`astype(bfloat16).astype(float32)`, its excess-precision
    rule), which the kernels and the CPU keep; mods that round need the CPU's reference.
    """
    arrays = arrays or {}
    up = lambda t: jax.tree.map(lambda a: a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a, t)

    def reference_options(arrays):  # the reference takes a block mask's mask_mod
        kwargs = options(arrays)
        if "block_mask" in kwargs:
            kwargs["mask_mod"] = kwargs.pop("block_mask").mask_mod
        return kwargs

    @jax.jit
    def reference_run(x, arrays):
        _, lse = reference.attention(x["q"], x["k"], x["v"], return_lse=True, **reference_options(arrays))
        dlse = jnp.where(lse == -jnp.inf, 0.0, x["dlse"])
        return vjp(reference.attention, x, arrays, reference_options, dlse), dlse

    inputs = (up(x), up(arrays))
    if reference_on_cpu:
        inputs = jax.device_put(inputs, jax.devices("cpu")[0])
    want, dlse = reference_run(*inputs)
    if reference_on_cpu:
        want, dlse = jax.device_put((want, dlse), jax.devices()[0])

    @jax.jit
    def kernel_run(x, arrays, dlse):
        kernel = lambda *a, **kw: flashjax.flash_attention(*a, backend=backend, config=config, **kernel_kwargs, **kw)
        return vjp(kernel, x, arrays, options, dlse)

    return kernel_run(x, arrays, dlse), want


def assert_matches(got: Result, want: Result, dtype):
    check_close(got.o, want.o, dtype, "o")
    check_lse(got.lse, want.lse, dtype)
    assert got.grads.keys() == want.grads.keys()
    for name in want.grads:
        check_close(got.grads[name], want.grads[name], dtype, f"d{name}" if name not in ("dq", "dk", "dv") else name)


# ---- the ready mods, alone ---------------------------------------------------------------------
class Case(NamedTuple):
    shape: Shape
    arrays: Callable  # (rng, shape) -> dict of differentiable arrays (may be empty)
    options: Callable  # (arrays, shape) -> keyword arguments
    bf16: bool = False
    q_scale: float = 1.0


def _doc_ids(shape, lengths=((30, 25, 15), (7, 50, 13))):
    ids = [np.repeat(np.arange(len(ls)), ls)[: shape.seq_q] for ls in lengths]
    return jnp.asarray(np.stack(ids), jnp.int32)


def _table(rng, s):
    return dict(table=jnp.asarray(rng.standard_normal((s.heads, 32)), jnp.float32))


CROSS = Shape(seq_q=40, seq_k=70, heads=4)  # GQA: 2 query heads per kv head
SELF = Shape(heads=4)
MODS = {
    # score_mods
    "alibi-causal-q<k": Case(CROSS, lambda rng, s: {}, lambda a, s: dict(
        score_mod=mods.alibi(2.0 ** -jnp.arange(1, s.heads + 1, dtype=jnp.float32), offset=s.seq_k - s.seq_q),
        causal=True)),
    "t5-table-q<k": Case(CROSS, _table, lambda a, s: dict(score_mod=mods.t5_relative_bias(a["table"], max_distance=40)),
                         bf16=True),
    "t5-table-unidirectional-causal": Case(SELF, _table, lambda a, s: dict(
        score_mod=mods.t5_relative_bias(a["table"], bidirectional=False, max_distance=40), causal=True)),
    "tanh-softcap": Case(SELF, lambda rng, s: {}, lambda a, s: dict(score_mod=mods.tanh_softcap(2.0)), q_scale=4.0),
    # mask_mods
    "prefix-lm": Case(SELF, lambda rng, s: {}, lambda a, s: dict(mask_mod=mods.prefix_lm(jnp.array([20, 45])))),
    "document-window": Case(SELF, lambda rng, s: {}, lambda a, s: dict(mask_mod=mods.document_window(_doc_ids(s), 20)),
                            bf16=True),
    "chunked": Case(SELF, lambda rng, s: {}, lambda a, s: dict(mask_mod=mods.chunked(24))),
}


@pytest.mark.parametrize("case, dtype", _params(MODS))
def test_ready_mods(case, dtype, rng):
    """Each mod of flashjax.mods (GQA, odd lengths): o, lse and every gradient, a learned table's included."""
    s = case.shape
    x = draw(rng, s, dtype, case.q_scale)
    got, want = run_both(x, lambda a: case.options(a, s), case.arrays(rng, s))
    assert_matches(got, want, dtype)


def test_mods_are_the_builtins(rng):
    """The reference gives the same attention through a mod and through the built-in option."""
    s = CROSS
    x = draw(rng, s, jnp.float32, q_scale=3.0)
    q, k, v = x["q"], x["k"], x["v"]
    slopes = 2.0 ** -jnp.arange(1, s.heads + 1, dtype=jnp.float32)
    pairs = [
        (dict(score_mod=mods.alibi(slopes, offset=s.seq_k - s.seq_q)), dict(alibi_slopes=slopes)),
        (dict(score_mod=mods.tanh_softcap(2.0)), dict(softcap=2.0)),
        (dict(mask_mod=mods.causal(s.seq_k - s.seq_q)), dict(causal=True)),
    ]
    ids = _doc_ids(SELF)
    for mod_kwargs, builtin in pairs:
        np.testing.assert_allclose(reference.attention(q, k, v, **mod_kwargs), reference.attention(q, k, v, **builtin),
                                   rtol=1e-5, atol=1e-6)
    y = draw(rng, SELF, jnp.float32)
    q, k, v = y["q"], y["k"], y["v"]
    np.testing.assert_array_equal(
        reference.attention(q, k, v, mask_mod=mods.document_window(ids, 20)),
        reference.attention(q, k, v, segment_ids=ids, causal=True, window=(20, 0)),
    )
    chunk_ids = jnp.broadcast_to(jnp.arange(SELF.seq_q) // 24, (SELF.batch, SELF.seq_q))
    np.testing.assert_array_equal(
        reference.attention(q, k, v, mask_mod=mods.chunked(24)),
        reference.attention(q, k, v, segment_ids=chunk_ids, causal=True),
    )


def test_t5_buckets_match_t5():
    """mods.t5_relative_bucket is T5's bucketing (numbers from its definition, written out in NumPy)."""
    rel = np.arange(-300, 300)

    def t5(rel, bidirectional, num_buckets=32, max_distance=128):
        out = np.zeros_like(rel)
        n = -rel
        if bidirectional:
            num_buckets //= 2
            out += (n < 0) * num_buckets
            n = np.abs(n)
        else:
            n = np.maximum(n, 0)
        max_exact = num_buckets // 2
        with np.errstate(divide="ignore", invalid="ignore"):
            large = max_exact + (np.log(n / max_exact) / np.log(max_distance / max_exact)
                                 * (num_buckets - max_exact)).astype(np.int64)
        large = np.minimum(large, num_buckets - 1)
        return out + np.where(n < max_exact, n, large)

    for bidirectional in (True, False):
        got = mods.t5_relative_bucket(jnp.asarray(rel, jnp.int32), bidirectional=bidirectional)
        np.testing.assert_array_equal(np.asarray(got), t5(rel, bidirectional))


# ---- composition with the built-in options ----------------------------------------------------
def test_composed_with_every_builtin(rng):
    """score_mod (learned table) + a head-dependent mask_mod + sinks with causal, a window, segment
    ids, lengths, bias, mask, softcap, ALiBi and dropout: o, lse and the gradients of q, k, v, the
    table, the sinks and the bias."""
    s = Shape(heads=4, kv_heads=2, seq_q=50, seq_k=70)
    x = draw(rng, s, jnp.float32, q_scale=2.0)
    key = jax.random.key(7)
    widths = jnp.array([8, 30, 200, 60], jnp.int32)
    segments = (jnp.asarray(np.repeat([0, 1], [30, 20])[None].repeat(2, 0), jnp.int32),
                jnp.asarray(np.repeat([0, 1], [45, 25])[None].repeat(2, 0), jnp.int32))
    arrays = dict(
        table=jnp.asarray(rng.standard_normal((s.heads, 32)), jnp.float32),
        sinks=jnp.asarray(rng.standard_normal((s.heads,)), jnp.float32),
        bias=jnp.asarray(rng.standard_normal((1, s.heads, s.seq_q, s.seq_k)), jnp.float32),
    )

    def options(a):
        return dict(
            score_mod=mods.t5_relative_bias(a["table"], max_distance=40),
            mask_mod=lambda b, h, i, j: (i + 20 - j) <= widths[h],
            sinks=a["sinks"], bias=a["bias"], causal=True, window=(40, None), segment_ids=segments,
            q_lengths=jnp.array([50, 43]), kv_lengths=jnp.array([61, 70]),
            mask=jax.random.bernoulli(key, 0.9, (s.seq_q, s.seq_k)), softcap=6.0,
            alibi_slopes=jnp.array([0.1, 0.05, 0.02, 0.01]), dropout_rate=0.1, dropout_rng=jax.random.key(3),
        )

    got, want = run_both(x, options, arrays)
    assert_matches(got, want, jnp.float32)


# ---- rows without keys ---------------------------------------------------------------------------
def test_rows_without_keys(rng):
    """A mask_mod that empties rows (all of batch 1, and the rows a score_mod sets to -inf): o = 0,
    lse = -inf and zero gradients there, no NaN; with sinks the lse of such a row is its sink's."""
    s = CROSS
    x = draw(rng, s, jnp.float32)
    prefix = jnp.array([30, 0])

    def mask_mod(b, h, i, j):
        return j < prefix[b]

    def score_mod(score, b, h, i, j):
        return jnp.where(i % 7 == 3, -jnp.inf, score)

    sinks = jnp.asarray(rng.standard_normal((s.heads,)), jnp.float32)
    for arrays, options in (
        ({}, lambda a: dict(mask_mod=mask_mod, score_mod=score_mod, q_lengths=jnp.array([35, 40]))),
        (dict(sinks=sinks), lambda a: dict(mask_mod=mask_mod, score_mod=score_mod, sinks=a["sinks"],
                                           q_lengths=jnp.array([35, 40]))),
    ):
        got, want = run_both(x, options, arrays)
        assert_matches(got, want, jnp.float32)
        rows = np.asarray(want.o).sum(-1) == 0  # [B, Tq, H]
        empty = np.moveaxis(rows, 1, 2)  # [B, H, Tq]
        assert empty[1].all() and empty[0, :, 3].all()
        np.testing.assert_array_equal(np.moveaxis(np.asarray(got.o), 2, 1)[empty], 0.0)
        np.testing.assert_array_equal(np.moveaxis(np.asarray(got.grads["dq"]), 2, 1)[empty], 0.0)
        lse = np.asarray(got.lse)
        padding = np.zeros_like(empty)
        padding[0, :, 35:] = True
        np.testing.assert_array_equal(lse[padding], -np.inf)
        if arrays:  # a real row without keys puts all its weight on the sink: lse = sink
            np.testing.assert_allclose(lse[empty & ~padding], np.broadcast_to(np.asarray(sinks)[None, :, None], lse.shape)
                                       [empty & ~padding], rtol=1e-6)
        else:
            np.testing.assert_array_equal(lse[empty], -np.inf)
        for name, g in got.grads.items():
            assert np.all(np.isfinite(np.asarray(g))), name


# ---- attention sinks ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_sinks(dtype, rng):
    """Sinks alone (GQA, causal, q_len > kv_len so that the first rows see no key): o, lse, dq, dk,
    dv and dsinks, on the tuned tiles and on small ones."""
    s = Shape(seq_q=70, seq_k=40, heads=4)
    x = draw(rng, s, dtype)
    arrays = dict(sinks=jnp.asarray(3.0 * rng.standard_normal((s.heads,)), jnp.float32))
    for config in (None, SMALL_TILES):
        got, want = run_both(x, lambda a: dict(sinks=a["sinks"], causal=True), arrays, config=config)
        assert_matches(got, want, dtype)


def test_sinks_gradient_formula(rng):
    """dsinks = -sum over rows of exp(sink - lse) * (rowsum(dO * O) - dlse), checked against JAX's
    derivative of the reference (the reference's own gradient is a finite difference away)."""
    s = Shape(batch=1, seq_q=12, seq_k=12, heads=2, kv_heads=2, head_dim=8)
    x = draw(rng, s, jnp.float32)
    sinks = jnp.array([0.5, -1.0])
    f = lambda sinks: reference.attention(x["q"], x["k"], x["v"], sinks=sinks, causal=True, return_lse=True)
    (o, lse), pullback = jax.vjp(f, sinks)
    (want,) = pullback((x["do"], x["dlse"]))
    from flashjax.kernels.extras_grad import sinks_grad

    delta = jnp.einsum("bqhd,bqhd->bhq", x["do"], o) - x["dlse"]
    np.testing.assert_allclose(sinks_grad(sinks, lse, delta), want, rtol=1e-5, atol=1e-6)
    with jax.enable_x64(True):  # central differences of the reference, in float64
        y = {name: jnp.asarray(np.asarray(a), jnp.float64) for name, a in x.items()}
        loss = lambda sinks: sum(jnp.sum(out * ct) for out, ct in zip(
            reference.attention(y["q"], y["k"], y["v"], sinks=sinks, causal=True, return_lse=True), (y["do"], y["dlse"])))
        sinks64, eps = jnp.asarray([0.5, -1.0], jnp.float64), 1e-5
        numeric = [(loss(sinks64.at[h].add(eps)) - loss(sinks64.at[h].add(-eps))) / (2 * eps) for h in range(2)]
    np.testing.assert_allclose(want, np.asarray(numeric), rtol=1e-4, atol=1e-6)


# ---- MLA head dims -----------------------------------------------------------------------------------
@pytest.mark.parametrize("config", [None, SMALL_TILES], ids=["tuned", "small-tiles"])
def test_mla_head_dims(config, rng):
    """q, k with head dim 48 and v with 32 (padded to 64 and 32 in the kernels), GQA, causal,
    Tq != Tk, lengths; with a score_mod on the small tiles."""
    s = Shape(seq_q=40, seq_k=70, heads=4, head_dim=48, v_head_dim=32)
    x = draw(rng, s, jnp.float32)
    options = lambda a: dict(causal=True, kv_lengths=jnp.array([70, 61]))
    arrays = {}
    if config is not None:
        arrays = _table(rng, s)
        options = lambda a: dict(causal=True, kv_lengths=jnp.array([70, 61]), score_mod=mods.t5_relative_bias(a["table"]))
    got, want = run_both(x, options, arrays, config=config)
    assert got.o.shape == (2, 40, 4, 32) and got.grads["dv"].shape == (2, 70, 2, 32)
    assert_matches(got, want, jnp.float32)
    xla = flashjax.flash_attention(x["q"], x["k"], x["v"], backend="xla", causal=True)
    assert xla.shape == (2, 40, 4, 32)


# ---- block masks ----------------------------------------------------------------------------------
def _dense_classes(mask_mod, batch, heads, q_len, kv_len, block_q, block_k):
    """The classification from the dense mask (what block_mask must give without forming it)."""
    dense = np.asarray(reference.logits_mask(batch, q_len, kv_len, mask_mod=mask_mod, heads=heads))
    dense = np.broadcast_to(dense, (batch, heads, q_len, kv_len))
    nq, nk = -(-q_len // block_q), -(-kv_len // block_k)
    valid = np.zeros((nq * block_q, nk * block_k), bool)
    valid[:q_len, :kv_len] = True
    padded = np.zeros((batch, heads, nq * block_q, nk * block_k), bool)
    padded[..., :q_len, :kv_len] = dense
    tiles = lambda a: a.reshape(a.shape[:-2] + (nq, block_q, nk, block_k))
    meets = tiles(padded).any(axis=(-3, -1))
    full = (tiles(padded) | ~tiles(valid)).all(axis=(-3, -1))
    return np.where(meets, np.where(full, flex.FULL, flex.PARTIAL), flex.EMPTY)


CLASSIFY = [
    pytest.param(mods.chunked(24), 2, 3, 70, 70, 16, 16, id="chunked"),
    pytest.param(mods.prefix_lm(jnp.array([20, 64])), 2, 3, 70, 70, 32, 16, id="prefix-per-batch"),
    pytest.param(mods.document_window(_doc_ids(SELF), 9), 2, 3, 70, 70, 16, 32, id="document-window"),
    pytest.param(lambda b, h, i, j: (j % (h + 2)) == 0, 2, 3, 45, 100, 16, 16, id="per-head-strided"),
    pytest.param(lambda b, h, i, j: i + 60 >= j, 1, 1, 17, 77, 128, 128, id="one-block-default"),
    # An integer |q - k| band per head: the interval rule of abs (miscompiled on an H100 once).
    pytest.param(lambda b, h, i, j: jnp.abs(i - j) <= 7 + 20 * h, 1, 3, 150, 210, 16, 16, id="band-integer-abs"),
]


@pytest.mark.parametrize("mask_mod, batch, heads, q_len, kv_len, block_q, block_k", CLASSIFY)
def test_block_mask_is_exact(mask_mod, batch, heads, q_len, kv_len, block_q, block_k):
    """Each tile pair's class equals the dense mask's; batch/head axes a mod ignores are broadcast;
    re-tiling to coarser tiles is exact and to finer ones conservative."""
    bm = flashjax.block_mask(mask_mod, batch, heads, q_len, kv_len, block_q=block_q, block_k=block_k)
    want = _dense_classes(mask_mod, batch, heads, q_len, kv_len, block_q, block_k)
    blocks = np.asarray(bm.blocks)
    mod, _ = flex.trace(mask_mod, flex.MASK_MOD)
    assert blocks.shape[:2] == (batch if mod.uses_batch else 1, heads if mod.uses_head else 1)
    np.testing.assert_array_equal(np.broadcast_to(blocks, want.shape), want)
    for factor_q, factor_k in ((2, 4), (1, 2)):
        bq, bk = block_q * factor_q, block_k * factor_k
        nq, nk = -(-q_len // bq) + 1, -(-kv_len // bk)  # one tile of padding rows
        meets, full = flex.tile_flags(bm, bq, bk, nq, nk)
        coarse = _dense_classes(mask_mod, batch, heads, q_len, kv_len, bq, bk)
        np.testing.assert_array_equal(np.broadcast_to(meets, (batch, heads, nq, nk))[..., :-1, :], coarse != flex.EMPTY)
        np.testing.assert_array_equal(np.broadcast_to(full, (batch, heads, nq, nk))[..., :-1, :], coarse == flex.FULL)
        assert not np.asarray(meets)[..., -1, :].any(), "tiles past the lengths meet nothing"
    if min(block_q, block_k) >= 32:
        bq, bk = block_q // 2, block_k // 2
        nq, nk = -(-q_len // bq), -(-kv_len // bk)
        meets, full = flex.tile_flags(bm, bq, bk, nq, nk)
        fine = _dense_classes(mask_mod, batch, heads, q_len, kv_len, bq, bk)
        assert np.all(np.broadcast_to(meets, fine.shape) >= (fine != flex.EMPTY)), "a tile that attends is skipped"
        assert np.all(np.broadcast_to(full, fine.shape) <= (fine == flex.FULL)), "a partial tile is called full"


def _retile_reference(meets, full, have: int, want: int, n: int):
    """Along the last axis: tile i meets if a block it overlaps does, is full if every block it
    overlaps (blocks that exist) is; tiles wholly past the blocks meet nothing and are not full."""
    size, out_meets, out_full = meets.shape[-1], [], []
    for i in range(n):
        lo, hi = i * want // have, min((i * want + want - 1) // have + 1, size)
        out_meets.append(meets[..., lo:hi].any(-1) if lo < size else np.zeros(meets.shape[:-1], bool))
        out_full.append(full[..., lo:hi].all(-1) if lo < size else np.zeros(meets.shape[:-1], bool))
    return np.stack(out_meets, -1), np.stack(out_full, -1)


@pytest.mark.parametrize("seed", range(3))
def test_tile_flags_match_a_per_block_reference(seed):
    """Re-tiling a block mask along each axis, for tiles that are multiples of the blocks, divide
    them, or neither (48-row blocks under 64-row tiles), with more or fewer tiles than blocks."""
    rng = np.random.default_rng(seed)
    for _ in range(60):
        have, want = (int(rng.choice([16, 32, 48, 64, 128])) for _ in range(2))
        size, n, axis = int(rng.integers(1, 8)), int(rng.integers(1, 10)), int(rng.choice([2, 3]))
        shape = [1, 2, 3, 3]
        shape[axis] = size
        meets = rng.random(shape) < 0.5
        full = meets & (rng.random(shape) < 0.5)
        got = flex._retile(jnp.asarray(meets), jnp.asarray(full), axis, have, want, n)
        want_flags = _retile_reference(np.moveaxis(meets, axis, -1), np.moveaxis(full, axis, -1), have, want, n)
        for g, w in zip(got, want_flags):
            np.testing.assert_array_equal(np.asarray(g), np.moveaxis(w, -1, axis), err_msg=str((have, want, size, n, axis)))


@pytest.mark.parametrize("mask_mod, batch, heads, q_len, kv_len, block_q, block_k", CLASSIFY)
def test_block_mask_kernel_is_exact(mask_mod, batch, heads, q_len, kv_len, block_q, block_k):
    """The GPU builder (a Triton kernel; interpret mode here) gives the dense mask's classes."""
    from flashjax.kernels.triton import block_mask as triton_block_mask

    mod, consts = flex.trace(mask_mod, flex.MASK_MOD)
    n_batch, n_heads = (batch if mod.uses_batch else 1), (heads if mod.uses_head else 1)
    blocks = triton_block_mask.classify(mod, consts, n_batch, n_heads, q_len, kv_len, block_q, block_k,
                                        interpret=jax.default_backend() != "gpu")
    want = _dense_classes(mask_mod, batch, heads, q_len, kv_len, block_q, block_k)
    assert blocks.shape == (n_batch, n_heads) + want.shape[2:]
    np.testing.assert_array_equal(np.broadcast_to(np.asarray(blocks), want.shape), want)


def _interval_classes(mask_mod, batch, heads, q_len, kv_len, block_q, block_k):
    """The interval classification (flashjax.intervals), broadcast to [batch, heads, n_q, n_k]."""
    from flashjax import intervals

    mod, consts = flex.trace(mask_mod, flex.MASK_MOD)
    got = intervals.classify(mod.jaxpr, consts, batch if mod.uses_batch else 1, heads if mod.uses_head else 1,
                             q_len, kv_len, block_q, block_k)
    assert got is not None, "the program should have interval rules"
    nq, nk = -(-q_len // block_q), -(-kv_len // block_k)
    return np.broadcast_to(np.asarray(got), (batch, heads, nq, nk))


def _assert_sound(got, want):
    assert not np.any((got == flex.EMPTY) & (want != flex.EMPTY)), "a tile that attends is called empty"
    assert not np.any((got == flex.FULL) & (want != flex.FULL)), "a tile with masked pairs is called full"


_DOCS = jnp.asarray(np.repeat([0, 0, 1, 2, 2, 2, 3], [40, 3, 60, 1, 30, 2, 64])[None].repeat(2, 0), jnp.int32)
TIGHT = [
    pytest.param(mods.causal(), id="causal"),
    pytest.param(mods.causal(offset=-50), id="causal-offset"),
    pytest.param(mods.chunked(48), id="chunked"),
    pytest.param(mods.prefix_lm(jnp.array([20, 150])), id="prefix-per-batch"),
    pytest.param(mods.document_window(_DOCS, 33), id="document-window"),
    pytest.param(lambda b, h, i, j: jnp.abs(i - j) < 40, id="two-sided-window"),
    pytest.param(lambda b, h, i, j: (j <= i) & ((i - j) % 3 == 0), id="dilated"),
    pytest.param(lambda b, h, i, j: (j <= i) | (h == 1), id="head"),
    pytest.param(lambda b, h, i, j: jnp.minimum(i, 100) >= jnp.maximum(j, 30) - 5, id="min-max"),
]


@pytest.mark.parametrize("mask_mod", TIGHT)
def test_block_mask_on_intervals_is_tight(mask_mod):
    """On the patterns masks are built from, the interval classification (one evaluation per
    tile pair) equals the dense mask's, at odd lengths and Tq != Tk."""
    args = (2, 2, 203, 190, 16, 32)
    np.testing.assert_array_equal(_interval_classes(mask_mod, *args), _dense_classes(mask_mod, *args))


def test_block_mask_on_intervals_is_sound_where_loose():
    """Where bounds lose a relation ((i - j)^2 >= 0 is true everywhere, but the product's
    interval on a diagonal tile reaches below 0) the tile is called partial, never empty or
    full wrongly; exact=True evaluates every pair and is tight."""
    mask_mod = lambda b, h, i, j: (i - j) * (i - j) >= 0
    want = _dense_classes(mask_mod, 1, 1, 100, 100, 16, 16)
    got = _interval_classes(mask_mod, 1, 1, 100, 100, 16, 16)
    _assert_sound(got, want)
    assert np.any(got != want), "the case was meant to be loose"
    exact = flashjax.block_mask(mask_mod, 1, 1, 100, 100, block_q=16, block_k=16, exact=True)
    np.testing.assert_array_equal(np.broadcast_to(np.asarray(exact.blocks), want.shape), want)


def test_block_mask_on_intervals_trusts_only_jnp_floor_divide():
    """jnp.floor_divide and jnp.remainder by a constant get exact monotone rules; a user's own
    jitted function of the same name is evaluated by its body."""

    @jax.jit
    def floor_divide(a, b):  # not a division
        return a * b - 7 * (a % 5)

    mask_mod = lambda b, h, i, j: floor_divide(i, 3) >= j
    args = (1, 1, 150, 140, 16, 16)
    _assert_sound(_interval_classes(mask_mod, *args), _dense_classes(mask_mod, *args))


def test_block_mask_on_intervals_is_sound_when_int32_wraps():
    """i * 100000007 wraps around int32 more than once within a tile of 64 rows: bounds
    computed in int32 (both ends positive at tile 49) would call a tile full whose middle rows
    wrap to negative; the interval is widened where its float32 twin leaves the int32 range."""
    mask_mod = lambda b, h, i, j: (i * 100000007 + j) > 0
    args = (1, 1, 4096, 64, 64, 64)
    _assert_sound(_interval_classes(mask_mod, *args), _dense_classes(mask_mod, *args))


@pytest.mark.parametrize("mask_mod", [
    pytest.param(lambda b, h, i, j: (i - j).astype(jnp.uint32) < 5, id="negative-to-uint32"),
    pytest.param(lambda b, h, i, j: (i * 10).astype(jnp.int8) > j.astype(jnp.int8), id="int32-to-int8"),
    pytest.param(lambda b, h, i, j: (j - i).astype(jnp.uint8) >= 250, id="negative-to-uint8"),
])
def test_block_mask_on_intervals_is_sound_when_a_conversion_wraps(mask_mod):
    """A conversion to an integer type that cannot hold the interval wraps ((i - j) as uint32 <
    5 is 0 <= i - j < 5 in one comparison): the bounds widen to the type's range instead of
    converting, so no tile that attends is called empty; attention under the mask equals the
    reference's on the dense mask."""
    args = (1, 1, 64, 64, 16, 16)
    _assert_sound(_interval_classes(mask_mod, *args), _dense_classes(mask_mod, *args))
    ks = jax.random.split(jax.random.key(3), 3)
    q, k, v = (jax.random.normal(key, (1, 64, 2, 16), jnp.float32) for key in ks)
    dense = mask_mod(0, 0, jnp.arange(64)[:, None], jnp.arange(64)[None, :])
    want = flashjax.flash_attention(q, k, v, mask=dense[None, None], backend="xla")
    got = flashjax.flash_attention(q, k, v, mask_mod=mask_mod, backend="triton")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("mask_mod", TIGHT)
def test_block_mask_runs_its_interval_rules_under_jit(mask_mod, monkeypatch):
    """flashjax.block_mask classifies under jit, where a literal divisor (a chunk size, a
    dilation) is known only from the program's text: the division and remainder rules run
    there too (not a fallback to every pair), and the classes equal the dense mask's."""
    from flashjax import intervals

    results = []
    classify = intervals.classify
    monkeypatch.setattr(intervals, "classify", lambda *a, **kw: results.append(classify(*a, **kw)) or results[-1])
    args = (2, 2, 203, 190, 16, 32)
    blocks = flashjax.block_mask(mask_mod, *args[:4], block_q=16, block_k=32).blocks
    assert results and results[-1] is not None, "the interval rules should have run"
    want = _dense_classes(mask_mod, *args)
    np.testing.assert_array_equal(np.broadcast_to(np.asarray(blocks), want.shape), want)


_MIN_INT = np.iinfo(np.int32).min
_LIMITS = jnp.asarray(np.r_[_MIN_INT, 1:64], jnp.int32)  # a "no limit" marker at the minimum
_TENS = jnp.arange(8, dtype=jnp.int32) * 10


@pytest.mark.parametrize("mask_mod", [
    pytest.param(lambda b, h, i, j: -_LIMITS[j] > -5, id="negated-minimum-read"),
    pytest.param(lambda b, h, i, j: -(i * 100_000_000) > 0, id="negated-wrapped-product"),
    pytest.param(lambda b, h, i, j: jnp.abs(i * 1073741824) < 0, id="abs-of-the-minimum"),
    pytest.param(lambda b, h, i, j: _TENS[jnp.clip((b + 2) * 1_500_000_000, 0, 7)] > 5, id="read-at-a-widened-index"),
    pytest.param(lambda b, h, i, j: i.astype(jnp.float32) * jnp.inf > j.astype(jnp.float32), id="nan-bounds"),
    pytest.param(lambda b, h, i, j: ~(i.astype(jnp.float32) * jnp.inf > j.astype(jnp.float32)) | (j == 0),
                 id="nan-bounds-negated"),
    pytest.param(lambda b, h, i, j: jnp.clip(i.astype(jnp.float32) * jnp.inf, 0.0, 1.0) < 2.0, id="nan-through-clip"),
    pytest.param(lambda b, h, i, j: jnp.sign(i.astype(jnp.float32) * jnp.inf) < 2.0, id="nan-through-sign"),
    pytest.param(lambda b, h, i, j: jnp.remainder(j.astype(jnp.float32) * 0.5, 3.0) > 2.2, id="float-remainder"),
    pytest.param(lambda b, h, i, j: (j.astype(jnp.float32) + 0.25) % 0.5 > 0.1, id="float-remainder-by-half"),
    # jnp's float floor division is not floor(x / c): 16 // 0.1 is 159, floor(16 / 0.1) 160
    pytest.param(lambda b, h, i, j: jnp.floor_divide(j.astype(jnp.float32), 0.1) < 160.0, id="float-floor-divide"),
    pytest.param(lambda b, h, i, j: j.astype(jnp.float32) // 0.3 >= i.astype(jnp.float32) // 7.0,
                 id="float-floor-divide-both-sides"),
])
def test_block_mask_on_intervals_is_sound_at_the_integer_minimum_and_nan(mask_mod, request):
    """-min and |min| wrap to min in int32, a bound widened by an overflow is not one position
    of a read, 0 * inf gives NaN bounds and NaN values (for which every comparison is false),
    which a clip or a sign hides inside finite bounds, a float remainder lies in [0, c),
    not an integer's [0, c - 1], and jnp's float floor division may lie one off floor(x / c):
    none of these calls a tile empty or full that is not, and
    attention under the mask (with the first key always visible) equals the reference's on
    the dense mask."""
    args = (2, 1, 64, 64, 16, 16)
    want = _dense_classes(mask_mod, *args)
    blocks = flashjax.block_mask(mask_mod, *args[:4], block_q=16, block_k=16).blocks
    _assert_sound(np.broadcast_to(np.asarray(blocks), want.shape), want)
    if jax.default_backend() == "gpu" and request.node.callspec.id == "abs-of-the-minimum":
        # The compiled Triton kernel's |i * 2^30| at int32's minimum is not JAX's (it differed
        # from the reference on an H100): integer overflow inside a mod is each compiler's.
        return
    visible = lambda b, h, i, j: mask_mod(b, h, i, j) | (j == 0)
    ks = jax.random.split(jax.random.key(5), 3)
    q, k, v = (jax.random.normal(key, (2, 64, 1, 16), jnp.float32) for key in ks)
    dense = np.asarray(reference.logits_mask(2, 64, 64, mask_mod=visible, heads=1))
    ref = flashjax.flash_attention(q, k, v, mask=jnp.asarray(dense), backend="xla")
    try:
        got = flashjax.flash_attention(q, k, v, mask_mod=visible, backend="triton")
    except NotImplementedError as error:  # jnp's float floor division rounds: Triton has no round
        assert jax.default_backend() == "gpu" and "round" in str(error), error
        return
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-5, atol=2e-5)


def test_block_mask_without_interval_rules_evaluates_every_pair():
    """An operation without an interval rule (sin) falls back to evaluating every pair."""
    from flashjax import intervals

    mask_mod = lambda b, h, i, j: jnp.sin(i.astype(jnp.float32) * 0.1) > jnp.cos(j.astype(jnp.float32) * 0.05)
    mod, consts = flex.trace(mask_mod, flex.MASK_MOD)
    assert intervals.classify(mod.jaxpr, consts, 1, 1, 64, 64, 16, 16) is None
    bm = flashjax.block_mask(mask_mod, 1, 1, 64, 64, block_q=16, block_k=16)
    np.testing.assert_array_equal(np.broadcast_to(np.asarray(bm.blocks), (1, 1, 4, 4)),
                                  _dense_classes(mask_mod, 1, 1, 64, 64, 16, 16))


def _random_mask(rng, docs):
    """A random mask program over positions: comparisons of affine terms, document ids,
    floor divisions and remainders, abs / min / max, combined by and / or / xor / not (every
    random choice drawn here, so that each trace of the function is the same program)."""
    clip = lambda x: jnp.clip(x, 0, docs.shape[1] - 1)

    def draw_term():
        kind, (a, b), c, d = rng.integers(7), rng.integers(1, 4, size=2), int(rng.integers(-40, 41)), int(rng.integers(1, 50))
        m, e = int(rng.integers(1, 9)), int(rng.integers(0, 400))
        return [
            lambda i, j: a * i - b * j + c,
            lambda i, j: docs[0, clip(i)] - docs[0, clip(j)],
            lambda i, j: i // d - j // d,
            lambda i, j: (i - j) % m - e % 3,
            lambda i, j: jnp.abs(i - j + c) - e % 60,
            lambda i, j: jnp.minimum(i, 80 + c) - jnp.maximum(j, 40 - c),
            lambda i, j: (i - j) * (i - j + c) - e,
        ][kind]

    ops = [lambda x: x < 0, lambda x: x <= 0, lambda x: x == 0, lambda x: x != 0, lambda x: x > 0]
    leaves = [(draw_term(), ops[rng.integers(len(ops))], bool(rng.integers(2))) for _ in range(3)]
    joins = [int(j) for j in rng.integers(3, size=2)]

    def mask_mod(b, h, i, j):
        values = [~op(t(i, j)) if negate else op(t(i, j)) for t, op, negate in leaves]
        out = values[0]
        for v, join in zip(values[1:], joins):
            out = (out & v) if join == 0 else (out | v) if join == 1 else (out ^ v)
        return out

    return mask_mod


@pytest.mark.parametrize("seed", range(16))
def test_block_mask_on_intervals_is_sound_on_random_masks(seed):
    """Random combinations of what interval rules exist for: no tile is called empty or full
    that is not (the property the kernels rely on), at odd lengths and tiles."""
    rng = np.random.default_rng(seed)
    mask_mod = _random_mask(rng, _DOCS)
    q_len, kv_len = int(rng.integers(30, 220)), int(rng.integers(30, 220))
    block_q, block_k = (int(x) for x in rng.choice([16, 32, 64], size=2))
    args = (1, 1, q_len, kv_len, block_q, block_k)
    _assert_sound(_interval_classes(mask_mod, *args), _dense_classes(mask_mod, *args))


@pytest.mark.parametrize("mask_mod", [mods.chunked(64), mods.prefix_lm(jnp.array([40])), mods.document_window(
    jnp.asarray(np.repeat([0, 1], [20, 80])[None], jnp.int32), 70)], ids=["chunked", "prefix-lm", "document-window"])
def test_block_mask_ranges_skip_and_fill(mask_mod):
    """The kernels' per-tile ranges from a block mask (forward by query tile, dK/dV by key tile):
    tiles outside [lo, hi) are empty in the dense mask (never loaded), tiles in [full_lo, full_hi)
    are full (mask_mod not evaluated), and [lo, hi) is the hull of the non-empty tiles."""
    from flashjax import masks
    from flashjax.kernels.triton import backend as triton_backend
    from flashjax.params import AttentionParams, Extras

    seq = 100
    bm = flashjax.block_mask(mask_mod, 1, 2, seq, seq, block_q=16, block_k=16)
    q = jnp.zeros((1, seq, 2, 16), jnp.float32)
    layout = triton_backend._layout(q, q, q, Extras(), AttentionParams(scale=1.0), SMALL_TILES)
    for kernel, by_key in ((SMALL_TILES.fwd, False), (SMALL_TILES.dkv, True)):
        x = triton_backend._tile_inputs(Extras(block_mask=bm), q, q, layout, kernel.block_q, kernel.block_k,
                                        by_key_block=by_key)
        n_q, n_k = layout.q_len // kernel.block_q, layout.k_len // kernel.block_k
        classes = np.full((n_q, n_k), flex.EMPTY)
        dense = _dense_classes(mask_mod, 1, 1, seq, seq, kernel.block_q, kernel.block_k)[0, 0]
        classes[: dense.shape[0], : dense.shape[1]] = dense
        if by_key:
            classes = classes.T
        skipped = full = 0
        for row, fields in zip(classes, np.asarray(x.ranges)[0]):
            lo, full_lo, full_hi, hi = fields[[masks.LO, masks.FULL_LO, masks.FULL_HI, masks.HI]]
            met = np.flatnonzero(row != flex.EMPTY)
            assert (lo, hi) == ((met[0], met[-1] + 1) if met.size else (0, 0))
            assert np.all(row[full_lo:full_hi] == flex.FULL)
            skipped += row.size - (hi - lo)
            full += full_hi - full_lo
        assert skipped > 0 and full > 0, "the case was meant to skip tiles and fill others"


KEY_BOUNDS = {
    # mask_mod: the least c of a stated kv_idx <= q_idx + c (None: none stated)
    "causal": (mods.causal(), 0),
    "causal-offset": (mods.causal(-3), -3),
    "causal-past-the-diagonal": (mods.causal(2), 2),
    "strict": (lambda b, h, i, j: j < i, -1),
    "mirrored": (lambda b, h, i, j: i >= j, 0),
    "strict-mirrored-shifted": (lambda b, h, i, j: i > j + 2, -3),
    "difference": (lambda b, h, i, j: i - j >= 5, -5),
    "several-conjuncts": (lambda b, h, i, j: (j <= i) & (j < i - 3) & (b == 0), -4),
    "chunked": (mods.chunked(64), 0),
    "document-window": (mods.document_window(jnp.zeros((2, 64), jnp.int32), 16), 0),
    "anti-causal": (lambda b, h, i, j: j >= i, None),
    "disjunction": (lambda b, h, i, j: (j <= i) | (j == 0), None),
    "negation": (lambda b, h, i, j: ~(j > i), None),
    "scaled": (lambda b, h, i, j: 2 * j <= i, None),
    "prefix-lm": (mods.prefix_lm(jnp.array([3, 5])), None),
}


@pytest.mark.parametrize("name", KEY_BOUNDS)
def test_key_bound_of_mask_mods(name):
    """`Mod.key_bound` finds a bound kv_idx <= q_idx + c that a conjunct of the mask states, and
    no bound where none is stated (a disjunction, the other direction, a scaled position)."""
    mask_mod, bound = KEY_BOUNDS[name]
    assert flex.trace(mask_mod, flex.MASK_MOD)[0].key_bound == bound


def _random_mask_mod(rng, depth: int = 3):
    """A random mask_mod of position comparisons (sides: q_idx, kv_idx, their sums and
    differences, plus or minus constants), batch / head tests, &, | and ~."""

    def node(level):
        kind = rng.integers(6 if level < depth else 2)
        if kind <= 1:
            op = [jnp.less_equal, jnp.less, jnp.greater_equal, jnp.greater][rng.integers(4)]
            draws = rng.integers(0, 2**31, 4)  # drawn now: every call builds the same program
            return lambda b, h, i, j: op(_side(draws[:2], i, j), _side(draws[2:], i, j))
        if kind == 2:
            return lambda b, h, i, j: b == 0
        if kind == 3:
            inner = node(level + 1)
            return lambda b, h, i, j: ~inner(b, h, i, j)
        left, right = node(level + 1), node(level + 1)
        if kind == 4:
            return lambda b, h, i, j: left(b, h, i, j) & right(b, h, i, j)
        return lambda b, h, i, j: left(b, h, i, j) | right(b, h, i, j)

    return node(0)


def _side(draws, i, j):
    """One side of a comparison of `_random_mask_mod`, from two fixed draws."""
    c = int(draws[0] % 13) - 6
    return [i, j, i + c, j + c, i - c, j - c, i - j, j - i, i + j, jnp.int32(c)][int(draws[1] % 10)]


@pytest.mark.parametrize("seed", range(4))
def test_key_bound_is_sound_on_random_masks(seed):
    """Wherever `Mod.key_bound` finds a bound c, every pair the mask lets through has
    kv_idx <= q_idx + c (random comparisons of positions and constants under &, |, ~)."""
    rng = np.random.default_rng(seed)
    found = 0
    for _ in range(150):
        mask_mod = _random_mask_mod(rng)
        bound = flex.trace(mask_mod, flex.MASK_MOD)[0].key_bound
        if bound is None:
            continue
        found += 1
        b, h = jnp.arange(2)[:, None, None, None], jnp.arange(2)[None, :, None, None]
        i, j = jnp.arange(40)[None, None, :, None], jnp.arange(40)[None, None, None, :]
        allowed = np.broadcast_to(np.asarray(mask_mod(b, h, i, j)), (2, 2, 40, 40))
        qs, ks = np.nonzero(allowed)[2:]
        assert np.all(ks <= qs + bound), (bound, int(np.max(ks - qs)))
    assert found >= 5, "the draws were meant to state bounds"


@pytest.mark.parametrize("seq_q, seq_k", [(50, 50), (37, 70), (70, 37)], ids=["self", "q<k", "q>k"])
@pytest.mark.parametrize("name", ["causal", "causal-past-the-diagonal", "strict-mirrored-shifted", "document-window",
                                  "bottom-right"])
def test_mask_mod_within_the_causal_mask_runs_as_a_causal_call(name, seq_q, seq_k, rng):
    """A mask_mod that states kv_idx <= q_idx + c with c within the built-in causal mask's
    offset (seq_k - seq_q) runs as a causal call (the kernels' causal structure); one whose
    bound the causal mask would cut does not. Either way o, lse and the gradients equal the
    reference's with the mask_mod alone, rows without keys included (q > k: the built-in
    causal mask itself as a mask_mod, `mods.causal(seq_k - seq_q)`, runs as a causal call)."""
    mask_mod, bound = KEY_BOUNDS[name] if name in KEY_BOUNDS else (mods.causal(seq_k - seq_q), seq_k - seq_q)
    if name == "document-window":
        ids = jnp.asarray(np.sort(rng.integers(0, 3, (2, max(seq_q, seq_k))), axis=1), jnp.int32)
        mask_mod = mods.document_window(ids[:, :max(seq_q, seq_k)], 16)
    s = Shape(seq_q=seq_q, seq_k=seq_k, heads=4)
    x = draw(rng, s, jnp.float32)
    params = api._prepare(x["q"], x["k"], x["v"], mask_mod=mask_mod)[2]
    assert params["causal"] == (bound <= seq_k - seq_q)
    got, want = run_both(x, lambda a: dict(mask_mod=mask_mod))
    assert_matches(got, want, jnp.float32)


def test_mask_mod_with_a_key_bound_exports_with_symbolic_lengths():
    """With a symbolic sequence length (jax.export) the causal structure is not added (the
    comparison with the length is inconclusive): the call exports as before."""
    from jax import export

    (t,) = export.symbolic_shape("t")
    spec = jax.ShapeDtypeStruct((1, t, 2, 16), jnp.float32)
    fn = jax.jit(lambda q: flashjax.flash_attention(q, q, q, backend="xla", mask_mod=mods.causal()))
    exported = export.export(fn)(spec)
    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 24, 2, 16)), jnp.float32)
    check_close(exported.call(q), reference.attention(q, q, q, causal=True), jnp.float32, "o")


def test_block_mask_reused_across_calls_and_layers(rng):
    """A block mask built once (eagerly, or under the same jit) serves several calls: the results
    equal those of a call that builds its own, its mask_mod is used when none is given, a per-head
    one (GQA) goes through the per-head ranges, and a pytree of it is a jit argument."""
    s = SELF
    x = draw(rng, s, jnp.float32)
    q, k, v = x["q"], x["k"], x["v"]
    widths = jnp.array([3, 17, 40, 70], jnp.int32)
    per_head = lambda b, h, i, j: (j <= i) & (i - j <= widths[h])
    bm = flashjax.block_mask(per_head, s.batch, s.heads, s.seq_q, s.seq_k, block_q=16, block_k=16)
    assert bm.blocks.shape == (1, 4, 5, 5)
    kernel = lambda **kw: flashjax.flash_attention(q, k, v, backend="triton", config=SMALL_TILES, **kw)
    want = reference.attention(q, k, v, mask_mod=per_head)
    check_close(kernel(mask_mod=per_head), want, jnp.float32, "own block mask")

    @jax.jit
    def two_layers(q, k, v, bm):
        o = flashjax.flash_attention(q, k, v, block_mask=bm, backend="triton", config=SMALL_TILES)
        return flashjax.flash_attention(o, k, v, block_mask=bm, mask_mod=per_head, backend="triton", config=SMALL_TILES)

    out = two_layers(q, k, v, bm)
    prefix = jnp.array([20, 40])
    rebuilt = flashjax.block_mask(mods.prefix_lm(prefix), s.batch, s.heads, s.seq_q, s.seq_k, block_q=16, block_k=16)
    check_close(kernel(block_mask=rebuilt, mask_mod=mods.prefix_lm(prefix)),  # the same program on the same array
                reference.attention(q, k, v, mask_mod=mods.prefix_lm(prefix)), jnp.float32, "rebuilt mask_mod")
    check_close(out, reference.attention(want, k, v, mask_mod=per_head), jnp.float32, "two layers")

    @jax.jit
    def built_inside(q, k, v, ids):
        doc = mods.document_window(ids, 20)
        bm = flashjax.block_mask(doc, s.batch, s.heads, s.seq_q, s.seq_k, block_q=16, block_k=16)
        return flashjax.flash_attention(q, k, v, block_mask=bm, backend="triton", config=SMALL_TILES)

    ids = _doc_ids(s)
    check_close(built_inside(q, k, v, ids), reference.attention(q, k, v, mask_mod=mods.document_window(ids, 20)),
                jnp.float32, "built under jit")


# ---- statics, caching and errors ------------------------------------------------------------------
def test_closed_over_values_are_operands(rng):
    """The same score_mod with new values in the arrays it closes over, and a score_mod rebuilt
    around another table, reuse the compiled call (the values are operands, the key is the traced
    program) and give the new results; a new Python number in a mod compiles anew."""
    s = Shape(batch=1, seq_q=20, seq_k=20, heads=2, kv_heads=2)
    x = draw(rng, s, jnp.float32)
    state = {"table": jnp.zeros((2, 32), jnp.float32)}

    def score_mod(score, b, h, i, j):
        return score + state["table"][h, jnp.clip(i - j + 16, 0, 31)]

    attend = lambda score_mod: flashjax.flash_attention(x["q"], x["k"], x["v"], score_mod=score_mod, backend="triton")
    first = attend(score_mod)
    attend(score_mod)  # the first call of a process may change JAX's tracing context and miss once more
    compiled = api._attention._cache_size()
    state["table"] = jnp.asarray(rng.standard_normal((2, 32)), jnp.float32)
    second = attend(score_mod)
    table = jnp.asarray(rng.standard_normal((2, 32)), jnp.float32)
    attend(mods.t5_relative_bias(-table))
    rebuilt = mods.t5_relative_bias(table)  # another function object, another table
    third = attend(rebuilt)
    assert api._attention._cache_size() == compiled + 1, "new values, or a rebuilt mod, must not recompile"
    check_close(first, reference.attention(x["q"], x["k"], x["v"]), jnp.float32, "zero table")
    check_close(second, reference.attention(x["q"], x["k"], x["v"], score_mod=score_mod), jnp.float32, "new table")
    check_close(third, reference.attention(x["q"], x["k"], x["v"], score_mod=rebuilt), jnp.float32, "rebuilt mod")
    attend(mods.tanh_softcap(2.0))
    attend(mods.tanh_softcap(3.0))
    assert api._attention._cache_size() == compiled + 3, "a new number is a new program"


def _q(seq=16):
    return jnp.zeros((1, seq, 2, 16), jnp.float32)


ERRORS = [
    pytest.param(dict(mask_mod=lambda b, h, i, j: (i >= j).astype(jnp.float32)), "must return a bool", id="mask-float"),
    pytest.param(dict(score_mod=lambda s, b, h, i, j: jnp.stack([s, s])), "one scalar", id="score-shape"),
    pytest.param(dict(score_mod=lambda s, b, h, i, j: i), "float score", id="score-int"),
    pytest.param(dict(score_mod="tanh"), "score_mod must be a function", id="not-callable"),
    pytest.param(dict(sinks=jnp.zeros((3,))), "sinks", id="sinks-shape"),
    pytest.param(dict(sinks=jnp.zeros((2,), jnp.int32)), "sinks", id="sinks-int"),
    pytest.param(dict(block_mask=flashjax.block_mask(mods.causal(), 1, 2, 8, 16, block_q=16, block_k=16)),
                 "q_len=8", id="block-mask-lengths"),
    pytest.param(dict(block_mask=flashjax.block_mask(mods.causal(), 1, 2, 16, 16, block_q=16, block_k=16),
                      mask_mod=mods.causal(1)), "another mask_mod", id="block-mask-other-mod"),
    pytest.param(dict(block_mask=flashjax.block_mask(mods.prefix_lm(jnp.array([3])), 1, 2, 16, 16, block_q=16,
                                                     block_k=16), mask_mod=mods.prefix_lm(jnp.array([5]))),
                 "another mask_mod", id="block-mask-other-arrays"),
    pytest.param(dict(block_mask=jnp.ones((1, 1, 1, 1), jnp.int8)), "BlockMask", id="block-mask-array"),
]


@pytest.mark.parametrize("kwargs, message", ERRORS)
def test_bad_flex_arguments(kwargs, message):
    q = _q()
    with pytest.raises(ValueError, match=message):
        flashjax.flash_attention(q, q, q, **kwargs)


def test_block_mask_built_eagerly_compiles_once():
    """A mask_mod rebuilt per step (a new closure over new arrays of the same shapes) reuses
    the compiled builder, and its blocks follow the new arrays."""
    def build(doc_ids):
        return flashjax.block_mask(mods.document_window(doc_ids, 40), 2, 4, 256, 256, block_q=16, block_k=16)

    first = build(jnp.repeat(jnp.arange(4, dtype=jnp.int32), 64)[None].repeat(2, 0))
    compiled = flex._classify_compiled._cache_size()
    other_ids = jnp.repeat(jnp.arange(2, dtype=jnp.int32), 128)[None].repeat(2, 0)
    second = build(other_ids)
    assert flex._classify_compiled._cache_size() == compiled
    assert not np.array_equal(first.blocks, second.blocks)
    fresh = flex.classify(*flex.trace(mods.document_window(other_ids, 40), flex.MASK_MOD), 2, 4, 256, 256, 16, 16)
    np.testing.assert_array_equal(second.blocks, fresh)


def test_automatic_block_mask_is_built_once_per_call(rng, monkeypatch):
    """A mask_mod without a block mask: the block mask is built once, before the custom_vjp,
    and the backward reuses the forward's (it used to build its own)."""
    s = SELF
    x = draw(rng, s, jnp.float32)
    built = []
    real = flex.classify
    monkeypatch.setattr(flex, "classify", lambda *a, **kw: (built.append(a[2:]), real(*a, **kw))[1])
    mask_mod = mods.document_window(jnp.repeat(jnp.arange(3, dtype=jnp.int32), 40)[None, : s.seq_k].repeat(s.batch, 0), 7)

    def loss(q, k, v):
        out = flashjax.flash_attention(q, k, v, mask_mod=mask_mod, backend="triton", config=SMALL_TILES)
        return jnp.sum(out * x["do"])

    grads = jax.grad(loss, argnums=(0, 1, 2))(x["q"], x["k"], x["v"])
    assert len(built) == 1, built
    want = jax.grad(lambda q, k, v: jnp.sum(reference.attention(q, k, v, mask_mod=mask_mod) * x["do"]),
                    argnums=(0, 1, 2))(x["q"], x["k"], x["v"])
    for name, g, w in zip("qkv", grads, want):
        check_close(g, w, jnp.float32, f"d{name}")


def test_block_mask_returned_from_a_jit_raises_a_clear_error():
    """A BlockMask built inside a jit from traced document ids and returned from it keeps a
    mask_mod that reads that trace's values: using it raises an error that says so (JAX's
    was an unexpected-tracer error), and building it in the jit that uses it works."""
    docs = jnp.repeat(jnp.arange(4, dtype=jnp.int32), 16)[None]
    build = lambda docs: flashjax.block_mask(mods.document_window(docs, 8), 1, 1, 64, 64, block_q=16, block_k=16)
    leaked = jax.jit(build)(docs)
    q = jax.random.normal(jax.random.key(0), (1, 64, 1, 16))
    with pytest.raises(ValueError, match="trace that has ended"):
        flashjax.flash_attention(q, q, q, block_mask=leaked, backend="triton")
    inside = jax.jit(lambda q, docs: flashjax.flash_attention(q, q, q, block_mask=build(docs), backend="triton"))
    want = flashjax.flash_attention(q, q, q, mask_mod=mods.document_window(docs, 8), backend="xla")
    np.testing.assert_allclose(np.asarray(inside(q, docs)), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_block_mask_bad_arguments():
    with pytest.raises(ValueError, match="block_q"):
        flashjax.block_mask(mods.causal(), 1, 1, 16, 16, block_q=24)
    with pytest.raises(ValueError, match="heads"):
        flashjax.block_mask(mods.causal(), 1, 0, 16, 16)


def test_block_mask_built_for_one_row_of_an_axis_the_mask_reads():
    """A block mask built with batch=1 (heads=1) for a mask_mod that reads the batch (head)
    index is refused: row 0's empty and full tiles would stand for every row. One built so
    for a mask_mod that ignores the axis is taken."""
    q = jnp.zeros((2, 64, 2, 16), jnp.float32)
    prefix = jnp.array([0, 40])
    by_batch = lambda b, h, i, j: (j <= i) | (j < prefix[b])
    by_head = lambda b, h, i, j: j <= i + 20 * h
    for mask_mod, shape, axis in ((by_batch, (1, 2), "batch"), (by_head, (2, 1), "heads")):
        mask = flashjax.block_mask(mask_mod, *shape, 64, 64, block_q=16, block_k=16)
        with pytest.raises(ValueError, match=f"built with {axis}=1"):
            flashjax.flash_attention(q, q, q, block_mask=mask)
    mask = flashjax.block_mask(mods.causal(), 1, 1, 64, 64, block_q=16, block_k=16)
    assert flashjax.flash_attention(q, q, q, block_mask=mask).shape == q.shape


WHOLE_ARRAY_MODS = [
    pytest.param(dict(score_mod=lambda t: lambda s, b, h, i, j: s + jnp.sum(t)), r"float32\[2, 5\] in `reduce_sum`",
                 id="sum"),
    pytest.param(dict(score_mod=lambda t: lambda s, b, h, i, j: s + t[h % 2][j % 5]),
                 r"float32\[2, 5\] in `dynamic_slice`", id="row-then-element"),
    pytest.param(dict(mask_mod=lambda t: lambda b, h, i, j: jnp.max(t[h % 2]) + j > i), r"float32\[2, 5\]",
                 id="mask_mod-row"),
]


@pytest.mark.parametrize("make, used", WHOLE_ARRAY_MODS)
def test_closed_over_array_used_whole_runs_on_the_reference(monkeypatch, rng, make, used):
    """Inside the kernels a closed-over array is read one element per score (every axis indexed
    at once). A mod that uses one whole (a sum, a row then an element of it) is declined by
    both kernel families with a reason naming the array and the operation: auto runs the
    reference (forward and gradients equal to it), an explicit kernel backend raises."""
    table = jnp.asarray(rng.normal(size=(2, 5)), jnp.float32)
    options = {name: fn(table) for name, fn in make.items()}
    s = Shape(batch=1, seq_q=20, seq_k=28, heads=2, kv_heads=2, head_dim=16)
    x = draw(rng, s, jnp.float32)
    choice = flashjax.explain(x["q"], x["k"], x["v"], **options)
    assert choice.backend == "xla", choice
    assert re.search(used, str(dict(choice.passed)["triton"])), choice
    with pytest.raises(NotImplementedError, match=used):
        flashjax.flash_attention(x["q"], x["k"], x["v"], backend="triton", **options)
    got, want = run_both(x, lambda a: options, backend="auto", config=None)
    assert_matches(got, want, jnp.float32)
    monkeypatch.setattr(backends, "describe_device", lambda: ("gpu", "9.0"))
    q = jax.ShapeDtypeStruct((1, 64, 2, 64), jnp.bfloat16)
    why = dict(flashjax.explain(q, q, q, **options).passed)
    assert re.search(used, str(why["mosaic"])) and re.search(used, str(why["triton"])), why


def test_tile_reads_each_closed_over_value_at_its_own_shape():
    """On a [bq, bk] tile, a document id that depends on the row alone is read once per row
    ([bq, 1]) and one of the column once per column ([1, bk]), not once per score; the
    result is the full tile, equal to the elementwise evaluation."""
    bq, bk = 16, 32
    docs = jnp.asarray(np.random.default_rng(0).integers(0, 3, (2, 64)), jnp.int32)
    mod, consts = flex.trace(mods.document_window(docs, left=7), flex.MASK_MOD)
    rows = jnp.arange(bq, dtype=jnp.int32)[:, None] + 20
    cols = jnp.arange(bk, dtype=jnp.int32)[None, :] + 8
    batch, head = jnp.int32(1), jnp.int32(0)
    jaxpr = jax.make_jaxpr(lambda d, r, c: mod.tile((d,), batch, head, r, c))(docs, rows, cols)
    gathered = [tuple(e.outvars[0].aval.shape) for e in jaxpr.jaxpr.eqns if e.primitive.name in ("gather", "dynamic_slice")]
    # Each read's leading (tile) axes are [bq, 1] or [1, bk]; the rest are the read's own unit axes.
    assert gathered and all(int(np.prod(shape)) in (bq, bk) for shape in gathered), gathered
    assert mod.pair_read_bytes == 0  # the Triton tiles need no room for a [bq, bk] gather
    t5, _ = flex.trace(mods.t5_relative_bias(jnp.ones((4, 32), jnp.float32)), flex.SCORE_MOD)
    assert t5.pair_read_bytes == 4 + 4  # a float32 table at a (query, key) index: value and index
    got = mod.tile((docs,), batch, head, rows, cols)
    want = flex.elementwise(mod.bind(consts), batch, head, rows, cols)
    assert got.shape == (bq, bk)
    np.testing.assert_array_equal(got, want)


READS = ("gather", "dynamic_slice")


@pytest.mark.parametrize("program", ["value", "value-and-derivative", "term"])
@pytest.mark.parametrize("name", ["alibi", "scalar-temperature"])
def test_at_reads_what_depends_on_the_head_alone_once(rng, name, program):
    """`Mod.at` evaluates what a mod computes from the batch row, the head and its arrays alone
    (ALiBi's slopes[h], times the term's factor; a closed-over scalar) once, before the loop
    over key tiles the kernels run: inside the loop nothing reads an array. The tiles equal the
    elementwise evaluation."""
    slopes = jnp.asarray(rng.uniform(0.1, 1.0, 4), jnp.float32)
    temperature = jnp.asarray(0.7, jnp.float32)
    fn = {"alibi": mods.alibi(slopes),
          "scalar-temperature": lambda s, b, h, i, j: s * temperature - 0.5 * jnp.abs(i - j).astype(jnp.float32)}[name]
    mod, consts = flex.trace(fn, flex.SCORE_MOD)
    if program == "term" and mod.additive_term is None:
        pytest.skip("not a score plus a term")
    bq, bk, head, factor = 16, 32, jnp.int32(2), 0.25
    rows = jnp.arange(bq, dtype=jnp.int32)[:, None] + 40
    base = jnp.asarray(rng.standard_normal((bq, bk)), jnp.float32)

    def run(consts):
        at = mod.at(consts, 0, head, grad=program == "value-and-derivative",
                    term_factor=factor if program == "term" else None)

        def body(j, out):
            cols = j * bk + jnp.arange(bk, dtype=jnp.int32)[None, :]
            score = base + j.astype(jnp.float32)  # no read of an array inside the loop but the mod's
            tile = at.tile(rows, cols, shape=(bq, bk)) if program == "term" else at.tile(score, rows, cols)
            return out.at[j].set(tile[0] if program == "value-and-derivative" else tile)

        return lax.fori_loop(0, 4, body, jnp.zeros((4, bq, bk), jnp.float32))

    refs = flex.kernel_operands(consts)  # as the kernels receive them (a scalar as [1])
    jaxpr = jax.make_jaxpr(run)(refs).jaxpr
    (loop,) = [e for e in jaxpr.eqns if e.primitive.name in ("while", "scan")]
    inside = [e.primitive.name for e in loop.params["body_jaxpr" if "body_jaxpr" in loop.params else "jaxpr"].jaxpr.eqns]
    outside = [e.primitive.name for e in jaxpr.eqns]
    assert not set(inside) & set(READS), inside
    assert set(outside) & set(READS) or name == "scalar-temperature", outside
    got = run(refs)
    cols = jnp.arange(4 * bk, dtype=jnp.int32).reshape(4, 1, bk)
    if program == "term":
        want = factor * (flex.elementwise(mod.bind(consts), jnp.zeros((4, bq, bk)), 0, head, rows[None], cols))
    else:
        scores = base + jnp.arange(4, dtype=jnp.float32)[:, None, None]
        want = flex.elementwise(mod.bind(consts), scores, 0, head, rows[None], cols)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_tile_takes_heads_that_vary_and_keeps_effects(rng):
    """`Mod.tile` evaluates nothing ahead where the batch row or head varies over the tile (an
    array of heads: the result is the elementwise evaluation's), and an equation without
    results (a debug callback) still runs per tile beside what `Mod.at` evaluated ahead."""
    slopes = jnp.asarray(rng.uniform(0.1, 1.0, 4), jnp.float32)
    mod, consts = flex.trace(mods.alibi(slopes), flex.SCORE_MOD)
    heads = jnp.arange(4, dtype=jnp.int32)[:, None, None]
    rows, cols = jnp.arange(8, dtype=jnp.int32)[:, None], jnp.arange(16, dtype=jnp.int32)[None, :]
    scores = jnp.asarray(rng.standard_normal((4, 8, 16)), jnp.float32)
    got = mod.tile(flex.kernel_operands(consts), scores, 0, heads, rows, cols)
    np.testing.assert_allclose(got, flex.elementwise(mod.bind(consts), scores, 0, heads, rows, cols), rtol=1e-6)
    calls = []

    def score_mod(s, b, h, i, j):
        jax.debug.callback(lambda x: calls.append(x), s)
        return s - slopes[h] * jnp.abs(i - j).astype(jnp.float32)

    mod, consts = flex.trace(score_mod, flex.SCORE_MOD)
    mod.tile(flex.kernel_operands(consts), scores[0], 0, 2, rows, cols)
    assert calls, "the callback did not run"


def test_xla_backend_differentiates_closed_over_arrays(rng):
    s = Shape(batch=1, seq_q=20, seq_k=24, heads=2, kv_heads=1)
    x = draw(rng, s, jnp.float32)
    arrays = dict(_table(rng, s), sinks=jnp.array([0.3, -0.2]))
    options = lambda a: dict(score_mod=mods.t5_relative_bias(a["table"]), sinks=a["sinks"], mask_mod=mods.chunked(8))
    want = vjp(reference.attention, x, arrays, options, x["dlse"])
    got = vjp(lambda *a, **kw: flashjax.flash_attention(*a, backend="xla", **kw), x, arrays, options, x["dlse"])
    for name in want.grads:
        check_close(got.grads[name], want.grads[name], jnp.float32, name)


# ---- backend choice ----------------------------------------------------------------------------------
FLEX_OPTIONS = [
    pytest.param(dict(score_mod=mods.t5_relative_bias(jnp.zeros((2, 32)))),
                 ("score_mod reads the closed-over float32[2, 32] at an index that depends on q_idx",), id="t5-table"),
    pytest.param(dict(score_mod=lambda s, b, h, i, j: s + jnp.floor(i / 8.0)), ("score_mod uses floor",),
                 id="unlowered-primitive"),
    pytest.param(dict(v_head_dim=128), ("v head_dim 128 > q/k head_dim 64",), id="v-wider-than-qk"),
    pytest.param(dict(score_mod=lambda s, b, h, i, j: jnp.fmod(s, 8.0)), ("score_mod uses rem",), id="float-rem"),
    pytest.param(dict(score_mod=lambda s, b, h, i, j: s + jnp.arctan2(i - j, 8.0)), ("score_mod uses atan2",),
                 id="atan2"),
]


@pytest.mark.parametrize("options, reasons", FLEX_OPTIONS)
def test_auto_picks_triton_on_hopper(monkeypatch, options, reasons):
    """On an H100 the Hopper kernels decline a v head dim wider than q's, and mods that read a
    closed-over array at a pair of positions (a gather per score) or use a primitive Mosaic GPU
    does not lower: auto
    runs Triton forward and backward, and explain names the reason."""
    monkeypatch.setattr(backends, "describe_device", lambda: ("gpu", "9.0"))
    q = jax.ShapeDtypeStruct((1, 64, 2, 64), jnp.bfloat16)
    options = dict(options)
    v = jax.ShapeDtypeStruct((1, 64, 2, options.pop("v_head_dim", 64)), jnp.bfloat16)
    choice = flashjax.explain(q, q, v, **options)
    assert (choice.backend, choice.backward_backend) == ("triton", "triton")
    (name, why), = choice.passed
    assert name == "mosaic"
    for reason in reasons:
        assert any(reason in r for r in why), (reason, why)


def test_auto_falls_back_to_xla_for_what_no_kernel_lowers(monkeypatch):
    """A mod with a primitive neither Mosaic GPU nor Pallas' Triton lowering has (erf): on a GPU
    auto runs the reference (XLA) and explain names both kernels' reasons; without a GPU the
    Triton kernels run it in interpret mode."""
    score_mod = lambda s, b, h, i, j: s + jax.lax.erf((i - j).astype(jnp.float32) / 50.0)
    q = jax.ShapeDtypeStruct((1, 64, 2, 64), jnp.bfloat16)
    monkeypatch.setattr(backends, "describe_device", lambda: ("cpu", ""))
    assert flashjax.explain(q, q, q, score_mod=score_mod).backend == "triton"
    monkeypatch.setattr(backends, "describe_device", lambda: ("gpu", "9.0"))
    choice = flashjax.explain(q, q, q, score_mod=score_mod)
    assert choice.backend == "xla", choice
    why = dict(choice.passed)
    assert any("score_mod uses erf" in r for r in why["mosaic"]), why
    assert any("score_mod uses erf, which Pallas' Triton lowering does not have" in r for r in why["triton"]), why


def test_a_derivative_no_kernel_lowers_runs_the_backward_on_the_reference(monkeypatch):
    """The kernels' lowerings are checked against each program they run: a score_mod whose
    forward lowers and whose derivative does not (sin(s), whose derivative is cos(s), with cos
    taken from both lowerings) runs forward on the Hopper kernels and backward on the
    reference, and explain names the derivative."""
    from flashjax.kernels.mosaic import backend as mosaic_backend
    from flashjax.kernels.triton import backend as triton_backend

    for module in (mosaic_backend, triton_backend):
        lowered = module._lowered_primitives()
        monkeypatch.setattr(module, "_lowered_primitives", lambda lowered=lowered: lowered - {"cos"})
    monkeypatch.setattr(backends, "describe_device", lambda: ("gpu", "9.0"))
    q = jax.ShapeDtypeStruct((1, 64, 2, 64), jnp.bfloat16)
    choice = flashjax.explain(q, q, q, score_mod=lambda s, b, h, i, j: s + jnp.sin(s))
    assert (choice.backend, choice.backward_backend) == ("mosaic", "xla"), choice
    assert "score_mod's derivative uses cos" in str(choice), choice


HOPPER_MODS = [
    pytest.param(dict(score_mod=mods.tanh_softcap(30.0)), id="score_mod"),
    pytest.param(dict(score_mod=mods.alibi(jnp.ones((2,)))), id="per-head-read"),
    pytest.param(dict(mask_mod=mods.prefix_lm(jnp.array([3]))), id="per-batch-read"),
    pytest.param(dict(mask_mod=mods.chunked(16)), id="mask_mod"),
    pytest.param(dict(mask_mod=lambda b, h, i, j: jnp.abs(i - j) <= 8), id="integer-abs-mask_mod"),
    pytest.param(dict(block_mask=flashjax.block_mask(mods.causal(), 1, 2, 64, 64)), id="block_mask"),
    pytest.param(dict(mask_mod=mods.document_window(jnp.zeros((1, 64), jnp.int32), 16)), id="per-position-reads"),
]


@pytest.mark.parametrize("dims, sinks", [
    pytest.param((64, 64), True, id="sinks"),
    pytest.param((192, 128), False, id="mla"),
    pytest.param((96, 64), True, id="mla-padded-sinks"),
])
def test_auto_takes_hopper_for_sinks_and_mla_dims(monkeypatch, dims, sinks):
    """On an H100 auto runs sinks and MLA head dims (v's narrower than q's and k's) on the Hopper
    kernels, forward and backward; 192 / 192 too (its dK/dV kernel split between the consumers)."""
    monkeypatch.setattr(backends, "describe_device", lambda: ("gpu", "9.0"))
    qk_dim, v_dim = dims
    q = jax.ShapeDtypeStruct((1, 64, 2, qk_dim), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((1, 64, 2, v_dim), jnp.bfloat16)
    options = dict(sinks=jnp.zeros((2,))) if sinks else {}
    choice = flashjax.explain(q, q, v, **options)
    assert (choice.backend, choice.backward_backend) == ("mosaic", "mosaic"), choice
    wide = jax.ShapeDtypeStruct((1, 64, 2, 192), jnp.bfloat16)
    choice = flashjax.explain(wide, wide, wide, **options)
    assert (choice.backend, choice.backward_backend) == ("mosaic", "mosaic"), choice


@pytest.mark.parametrize("options", HOPPER_MODS)
def test_hopper_takes_mods(monkeypatch, options):
    """Mods that read closed-over arrays at the batch row or head only (one scalar load per tile)
    run on the Hopper kernels, forward and backward, asked for and under auto."""
    monkeypatch.setattr(backends, "describe_device", lambda: ("gpu", "9.0"))
    q = jax.ShapeDtypeStruct((1, 64, 2, 64), jnp.bfloat16)
    choice = flashjax.explain(q, q, q, backend="mosaic", **options)
    assert (choice.backend, choice.backward_backend) == ("mosaic", "mosaic"), choice
    choice = flashjax.explain(q, q, q, **options)
    assert (choice.backend, choice.backward_backend) == ("mosaic", "mosaic"), choice


def _grid(fn, batch, heads, q_len, kv_len, *extra):
    """fn(b, h, q_idx, kv_idx, *extra) over every index: [batch, heads, q_len, kv_len]. `extra`
    are per-row [batch, q_len] and per-column [batch, kv_len] values."""
    b, h = jnp.arange(batch)[:, None, None, None], jnp.arange(heads)[None, :, None, None]
    i, j = jnp.arange(q_len)[None, None, :, None], jnp.arange(kv_len)[None, None, None, :]
    values = [x[:, None, :, None] for x in extra[:1]] + [x[:, None, None, :] for x in extra[1:]]
    return flex.elementwise(fn, b, h, i, j, *values)


SPLIT_MODS = {
    "document-window": lambda ids, flags, floats: mods.document_window(ids, 9),
    "row-only-bool": lambda ids, flags, floats: lambda b, h, i, j: flags[b, i] | (j == 0),
    "column-only-float": lambda ids, flags, floats: lambda b, h, i, j: floats[j] < i.astype(jnp.float32) * 0.25,
    "derived-row-value": lambda ids, flags, floats: lambda b, h, i, j: ids[b, i] // 2 == ids[b, j] // 2,
    "batch-read-beside": lambda ids, flags, floats: lambda b, h, i, j: (ids[b, i] == ids[b, j]) | (j < ids[b, 0] + h),
    "int8-ids": lambda ids, flags, floats: _int8_documents(ids.astype(jnp.int8)),
}


def _int8_documents(ids):
    return lambda b, h, i, j: ids[b, i] >= ids[b, j]


@pytest.mark.parametrize("name", SPLIT_MODS)
def test_split_mask_mods_equal_the_user_function(name, rng):
    """`sides.split` moves a mask_mod's per-row and per-column reads out: its rest, given the
    row and column values `sides.values` computes, is the user's mask at every pair, past the
    arrays' ends too (where reads clamp, as in the kernels)."""
    from flashjax import sides

    batch, heads, q_len, kv_len = 2, 3, 45, 37
    ids = jnp.asarray(np.sort(rng.integers(0, 5, (batch, 40)), axis=1), jnp.int32)
    flags = jnp.asarray(rng.random((batch, 40)) < 0.7)
    floats = jnp.asarray(rng.uniform(-2.0, 12.0, 30), jnp.float32)
    mod, consts = flex.trace(SPLIT_MODS[name](ids, flags, floats), flex.MASK_MOD)
    split = sides.split(mod)
    assert isinstance(split, flex.Mod) and split.sides and not split.position_reads, split
    rows, cols = sides.values(split, consts, batch, q_len, kv_len)
    assert rows.shape == (batch, q_len) and cols.shape == (batch, kv_len) and rows.dtype == jnp.int32
    want = _grid(mod.bind(consts), batch, heads, q_len, kv_len)
    got = _grid(split.bind(consts), batch, heads, q_len, kv_len, rows, cols)
    assert 0.0 < float(jnp.mean(want)) < 1.0
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("fn, name", [
    pytest.param(mods.alibi(jnp.array([0.5, 0.25]), offset=3), flex.SCORE_MOD, id="alibi"),
    pytest.param(mods.tanh_softcap(4.0), flex.SCORE_MOD, id="score-only"),
    pytest.param(mods.chunked(5), flex.MASK_MOD, id="chunked"),
    pytest.param(lambda b, h, i, j: (i % 3 == 0) | (h == 1), flex.MASK_MOD, id="rows-only"),
    pytest.param(lambda b, h, i, j: j < 30, flex.MASK_MOD, id="columns-only"),
])
def test_tile_evaluation_on_row_and_column_vectors(fn, name, transposed, rng):
    """`Mod.tile` on `flex.Along` vectors (the Hopper kernels' rows and columns, either tile
    orientation) equals it on broadcastable [bq, 1] / [1, bk] arrays (the Triton kernels') and
    the XLA evaluation."""
    mod, consts = flex.trace(fn, name)
    bq, bk, q0, k0 = 16, 24, 40, 8
    rows, cols = jnp.arange(bq, dtype=jnp.int32) + q0, jnp.arange(bk, dtype=jnp.int32) + k0
    score = jnp.asarray(rng.standard_normal((bq, bk)) * 3.0, jnp.float32)
    lead = (score,) if name == flex.SCORE_MOD else ()
    want = mod.tile(consts, *lead, 0, 1, rows[:, None], cols[None, :])
    # As the Hopper kernels call it: a position the mod does not use passed as 0, the tile's shape given.
    q_dim, k_dim = (1, 0) if transposed else (0, 1)
    uses_q, uses_k = mod.uses_positions
    positions = (flex.Along(rows, q_dim) if uses_q else 0, flex.Along(cols, k_dim) if uses_k else 0)
    shape = (bk, bq) if transposed else (bq, bk)
    got = mod.tile(consts, *(x.T if transposed else x for x in lead), 0, 1, *positions, shape=shape)
    got = got.T if transposed else got
    np.testing.assert_array_equal(got, want)
    i, j = jnp.meshgrid(rows, cols, indexing="ij")
    np.testing.assert_array_equal(want, flex.elementwise(mod.bind(consts), *lead, 0, 1, i, j))


@pytest.mark.parametrize("mask_mod, why", [
    pytest.param(lambda b, h, i, j: TABLE[h, i - j + 64] > 0, "both q_idx and kv_idx", id="pair-read"),
    pytest.param(lambda b, h, i, j: TABLE[h, i] == TABLE[h, j], "depends on the head", id="per-head-row"),
    pytest.param(lambda b, h, i, j: (TABLE[0, i] == TABLE[0, j]) & (TABLE[1, i] <= j), "2 values per row",
                 id="two-row-values"),
])
def test_split_refuses_what_the_kernels_cannot_stream(monkeypatch, mask_mod, why):
    """Reads that `sides.split` cannot move out of the kernels say why, and keep the Hopper
    kernels from being chosen (auto explains it)."""
    from flashjax import sides

    mod, _ = flex.trace(mask_mod, flex.MASK_MOD)
    assert why in sides.split(mod)
    monkeypatch.setattr(backends, "describe_device", lambda: ("gpu", "9.0"))
    q = jax.ShapeDtypeStruct((1, 64, 2, 64), jnp.bfloat16)
    choice = flashjax.explain(q, q, q, mask_mod=mask_mod)
    assert choice.backend == "triton" and why in str(choice), choice


TABLE = jnp.arange(2 * 200, dtype=jnp.int32).reshape(2, 200) % 7


def test_split_documents_with_segment_ids_stay_on_triton(monkeypatch):
    """segment_ids and a mask_mod that reads ids per position both need the Hopper kernels' one
    vector per row: the call runs on Triton, and auto says why."""
    monkeypatch.setattr(backends, "describe_device", lambda: ("gpu", "9.0"))
    q = jax.ShapeDtypeStruct((1, 64, 2, 64), jnp.bfloat16)
    mask_mod = mods.document_window(jnp.zeros((1, 64), jnp.int32), 16)
    choice = flashjax.explain(q, q, q, mask_mod=mask_mod, segment_ids=jnp.zeros((1, 64), jnp.int32))
    assert choice.backend == "triton" and "one vector per row" in str(choice), choice


def test_sharded_attention_takes_flex_options(rng):
    """On a one-device mesh sharded_flash_attention with a score_mod, sinks and a block mask is
    flash_attention (tests/test_sharding.py checks the global indices on 4 devices); a block
    mask built from another mask_mod than the one given is refused, as flash_attention does."""
    mesh = jax.make_mesh((1,), ("data",))
    q, k, v = (jnp.asarray(rng.standard_normal((2, 32, 2, 16)), jnp.float32) for _ in range(3))
    mask_mod = lambda b, h, i, j: j <= i + b
    options = dict(score_mod=mods.tanh_softcap(2.0), sinks=jnp.asarray([0.5, -1.0]), backend="triton",
                   block_mask=flashjax.block_mask(mask_mod, 2, 2, 32, 32, block_q=16, block_k=16))
    got = flashjax.sharded_flash_attention(q, k, v, mesh=mesh, batch_axis="data", **options)
    check_close(got, flashjax.flash_attention(q, k, v, **options), jnp.float32, "o")
    with pytest.raises(ValueError, match="another mask_mod"):
        flashjax.sharded_flash_attention(q, k, v, mesh=mesh, batch_axis="data", mask_mod=lambda b, h, i, j: j <= i,
                                         **options)


def test_docs_show_the_tested_mods():
    """Every function docs/flex.md shows is the source of the flashjax.mods function the tests use."""
    import inspect
    import pathlib
    import re

    text = (pathlib.Path(__file__).parents[1] / "docs" / "flex.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if b.startswith("def ")]
    shown = {re.match(r"def (\w+)", b).group(1): b for b in blocks}
    assert set(shown) == set(mods.__all__) - {"causal"}, sorted(shown)
    for name, block in shown.items():
        assert block == inspect.getsource(getattr(mods, name)), f"docs/flex.md shows another {name} than flashjax.mods"


def test_scalar_bool_and_gathered_closed_over_arrays(rng):
    """A learned 0-d temperature (its gradient too), a bool per-head flag and a table read with
    .at[].get(mode="fill") (a point gather with out-of-range reads filled) inside the kernels."""
    s = Shape(seq_q=40, seq_k=70, heads=4)
    x = draw(rng, s, jnp.float32)
    flags = jnp.array([True, False, True, False])
    arrays = dict(temperature=jnp.float32(1.5), table=jnp.asarray(rng.standard_normal((s.heads, 16)), jnp.float32))

    def options(a):
        def score_mod(score, b, h, i, j):
            near = a["table"].at[h, j - i].get(mode="fill", fill_value=-1.0)
            return score * a["temperature"] + jnp.where(flags[h], near, 0.0)

        return dict(score_mod=score_mod, mask_mod=lambda b, h, i, j: flags[h] | (j <= i + 30))

    got, want = run_both(x, options, arrays)
    assert_matches(got, want, jnp.float32)


def test_arrays_built_inside_the_mods(rng):
    """Mods that build arrays themselves from constants (`jnp.arange`, `jnp.linspace`) run in
    the kernels: such arrays are evaluated once at trace time and passed as closed-over arrays
    (a kernel cannot capture one), beside a learned table read per score (its gradient too)."""
    s = Shape(seq_q=40, seq_k=70, heads=4)
    x = draw(rng, s, jnp.float32)
    arrays = dict(table=jnp.asarray(rng.standard_normal((s.heads, 16)), jnp.float32))

    def options(a):
        def score_mod(score, b, h, i, j):
            bucket = jnp.clip(j - i + 8, 0, 15)
            scaled = 2.0 * a["table"][h, bucket] + jnp.linspace(0.0, 1.0, 16)[bucket]
            return score / jnp.sqrt(16.0) + scaled * jnp.linspace(0.5, 1.5, s.seq_q)[i]

        return dict(score_mod=score_mod, mask_mod=lambda b, h, i, j: jnp.arange(s.seq_q)[i] + 30 >= j)

    # The built arrays are closed-over arrays like the table: their reads are loads, which
    # every kernel has (on a GPU, a read counted as a computation refuses the Triton kernels).
    for name, fn in options(arrays).items():
        mod, consts = flex.trace(fn, name)
        assert len(mod.jaxpr.constvars) == len(consts) == (3 if name == "score_mod" else 1)
        used = mod.primitives() | mod.primitives(derivative=True)
        assert not {"dynamic_slice", "gather"} & used, used
    got, want = run_both(x, options, arrays)
    assert_matches(got, want, jnp.float32)


def scalar_selects_of_constants():
    """(score_mod, mask_mod) choosing per head between Python constants: `jnp.where` on a scalar
    condition with weakly typed constant cases (Pallas' Triton lowering once gave them the
    condition's type: a module the GPU's Triton rejects)."""
    score_mod = lambda score, b, h, i, j: score * jnp.where(h < 2, 0.5, 1.0) + jnp.where(h == 1, 3, h).astype(jnp.float32)
    mask_mod = lambda b, h, i, j: j <= i + jnp.where(h < 1, 0, 30)
    return score_mod, mask_mod


def test_scalar_selects_of_constants(rng):
    s = Shape(seq_q=40, seq_k=70, heads=4)
    x = draw(rng, s, jnp.float32)
    score_mod, mask_mod = scalar_selects_of_constants()
    got, want = run_both(x, lambda a: dict(score_mod=score_mod, mask_mod=mask_mod), {})
    assert_matches(got, want, jnp.float32)


@pytest.mark.parametrize("backend", ["triton", "xla"])
def test_mods_keep_no_tracer_of_the_enclosing_trace(rng, backend):
    """Mods closing over traced arrays (a table and document ids, jit arguments), under jit
    and grad, with JAX's leak checker on: the traced mod (a jit static, cached) holds the
    arrays' shapes, not the tracers."""
    q = jnp.asarray(rng.standard_normal((1, 24, 2, 16)), jnp.float32)

    def loss(q, table, ids):
        o = flashjax.flash_attention(q, q, q, score_mod=lambda s, b, h, i, j: s + table[h, j],
                                     mask_mod=lambda b, h, i, j: ids[b, i] == ids[b, j], backend=backend)
        return jnp.sum(o)

    table, ids = jnp.asarray(rng.standard_normal((2, 24)), jnp.float32), jnp.zeros((1, 24), jnp.int32)
    with jax.checking_leaks():
        jax.block_until_ready(jax.jit(loss)(q, table, ids))
        jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1)))(q, table, ids))


def test_ready_mods_take_numpy_arrays():
    """The ready mods take NumPy arrays as JAX ones (they are indexed with traced positions)."""
    q = jax.random.normal(jax.random.key(4), (1, 32, 2, 16), jnp.float32)
    ids = np.repeat(np.arange(4), 8)[None].astype(np.int32)
    slopes, lengths, table = np.array([0.5, 0.25], np.float32), np.array([5], np.int32), np.zeros((2, 32), np.float32)
    for options in (dict(mask_mod=mods.document_window(ids, 8)), dict(score_mod=mods.alibi(slopes)),
                    dict(mask_mod=mods.prefix_lm(lengths)), dict(score_mod=mods.t5_relative_bias(table))):
        got = flashjax.flash_attention(q, q, q, backend="triton", **options)
        want = reference.attention(q, q, q, **options)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_float64_closed_over_array_under_x64():
    """Under x64 a score_mod may close over a float64 array (jnp.linspace's default there): the
    kernels' gradient of it (summed over chunks of rows) is float64, equal to the reference's."""
    with jax.enable_x64(True):
        ks = jax.random.split(jax.random.key(3), 3)
        q, k, v = (jax.random.normal(key, (1, 40, 2, 16), jnp.float32) for key in ks)
        slopes = jnp.linspace(0.1, 0.5, 2)
        assert slopes.dtype == jnp.float64

        def loss(attention, **kw):
            def run(q, slopes):
                mod = lambda s, b, h, i, j: s - slopes[h] * jnp.abs(i - j).astype(jnp.float32)
                return jnp.sum(jnp.sin(attention(q, k, v, score_mod=mod, causal=True, **kw)))
            return run

        got = jax.grad(loss(flashjax.flash_attention, backend="triton"), argnums=(0, 1))(q, slopes)
        want = jax.grad(loss(reference.attention), argnums=(0, 1))(q, slopes)
        assert got[1].dtype == jnp.float64
        for name, g, w in zip(("dq", "dslopes"), got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5, err_msg=name)


def test_vmap_over_examples_and_tables(rng):
    """Under jax.vmap, with a closed-over table batched along with the inputs (one table per example)."""
    q = jnp.asarray(rng.standard_normal((3, 1, 20, 2, 16)), jnp.float32)
    tables = jnp.asarray(rng.standard_normal((3, 2, 32)), jnp.float32)

    def attend(attention, q, table):
        return attention(q, q, q, score_mod=mods.t5_relative_bias(table), mask_mod=mods.chunked(8), sinks=table[:, 0])

    kernel = lambda *a, **kw: flashjax.flash_attention(*a, backend="triton", **kw)
    got = jax.vmap(lambda q, t: attend(kernel, q, t))(q, tables)
    want = jax.vmap(lambda q, t: attend(reference.attention, q, t))(q, tables)
    check_close(got, want, jnp.float32, "vmapped")


# ---- the Hopper kernels ----------------------------------------------------------------------------
HOPPER = backends.describe_device() == ("gpu", "9.0")
requires_hopper = pytest.mark.skipif(
    not HOPPER, reason="the Hopper kernels (Mosaic GPU) need an sm90 GPU; JAX cannot run them in interpret mode")


def _slopes(rng, s):
    return dict(slopes=jnp.asarray(rng.uniform(0.01, 0.2, s.heads), jnp.float32))


def _sinks(rng, s):
    return dict(sinks=jnp.asarray(2.0 * rng.standard_normal(s.heads), jnp.float32))


def _empty_rows_score_mod(score, b, h, i, j):
    return jnp.where(i % 7 == 3, -jnp.inf, score)


def _non_finite_past(seq_q):
    """A score_mod finite at every query row of a call of `seq_q` rows, -inf and NaN past them."""
    return lambda score, b, h, i, j: score + jnp.log(1.0 - i.astype(jnp.float32) / seq_q)


def _documents(q_ids, kv_ids):
    return lambda b, h, i, j: q_ids[b, i] == kv_ids[b, j]


def _flags_and_offsets(row_flags, col_offsets):
    return lambda b, h, i, j: row_flags[i] & (col_offsets[j] <= 0.5 * i.astype(jnp.float32) + 3.0)


HOPPER_CROSS = Shape(batch=2, seq_q=300, seq_k=517, heads=4, kv_heads=2, head_dim=64)  # GQA, odd lengths
HOPPER_MLA = Shape(batch=2, seq_q=300, seq_k=517, heads=4, kv_heads=2, head_dim=192, v_head_dim=128)
HOPPER_LONG_Q = Shape(batch=1, seq_q=700, seq_k=333, heads=4, kv_heads=1, head_dim=128)  # MQA, q_len > kv_len
HOPPER_SELF = Shape(batch=2, seq_q=1000, seq_k=1000, heads=2, kv_heads=2, head_dim=128)
HOPPER_WIDTHS = jnp.array([40, 300, 7, 1000], jnp.int32)
HOPPER_PREFIX = jnp.array([30, 0], jnp.int32)
HOPPER_CASES = {
    # score_mods (a learned per-head slope: its gradient comes from the XLA pullback)
    "alibi-learned-causal": Case(HOPPER_CROSS, _slopes, lambda a, s: dict(
        score_mod=mods.alibi(a["slopes"], offset=s.seq_k - s.seq_q), causal=True)),
    "alibi-learned-long-q-causal": Case(HOPPER_LONG_Q, _slopes, lambda a, s: dict(
        score_mod=mods.alibi(a["slopes"], offset=s.seq_k - s.seq_q), causal=True)),
    "tanh-softcap-large-logits": Case(HOPPER_SELF, lambda rng, s: {}, lambda a, s: dict(
        score_mod=mods.tanh_softcap(2.0)), q_scale=8.0),
    "tanh-mod-with-softcap-window": Case(HOPPER_CROSS, lambda rng, s: {}, lambda a, s: dict(
        score_mod=mods.tanh_softcap(5.0), softcap=3.0, window=(100, 50))),
    # the score used twice (its derivative's add_any runs as an add) through a jnp.copy
    "score-used-twice-copy": Case(HOPPER_CROSS, lambda rng, s: {}, lambda a, s: dict(
        score_mod=lambda sc, b, h, i, j: jnp.copy(sc * jax.nn.sigmoid(sc)), causal=True)),
    # mask_mods (the block mask narrows the tile ranges; boundary tiles evaluate mask_mod)
    "prefix-lm": Case(HOPPER_SELF, lambda rng, s: {}, lambda a, s: dict(mask_mod=mods.prefix_lm(jnp.array([20, 250])))),
    "chunked": Case(HOPPER_SELF, lambda rng, s: {}, lambda a, s: dict(mask_mod=mods.chunked(96))),
    "chunked-given-block-mask": Case(HOPPER_SELF, lambda rng, s: {}, lambda a, s: dict(
        block_mask=flashjax.block_mask(mods.chunked(96), 1, 1, s.seq_q, s.seq_k))),
    "causal-mod-long-q": Case(HOPPER_LONG_Q, lambda rng, s: {}, lambda a, s: dict(
        mask_mod=mods.causal(offset=s.seq_k - s.seq_q))),
    # finite at every query row, -inf / NaN at the kernels' padded rows past q_len
    "non-finite-past-q-len": Case(HOPPER_CROSS, lambda rng, s: {}, lambda a, s: dict(
        score_mod=_non_finite_past(s.seq_q), causal=True)),
    "per-head-band": Case(HOPPER_CROSS, lambda rng, s: {}, lambda a, s: dict(
        mask_mod=lambda b, h, i, j: (i - j <= HOPPER_WIDTHS[h]) & (j - i <= HOPPER_WIDTHS[h]))),
    "per-head-band-integer-abs": Case(HOPPER_CROSS, lambda rng, s: {}, lambda a, s: dict(
        mask_mod=lambda b, h, i, j: jnp.abs(i - j) <= HOPPER_WIDTHS[h])),
    # rows without keys: all of batch row 1 (mask_mod), every 7th row (score_mod -inf)
    "rows-without-keys": Case(HOPPER_CROSS, lambda rng, s: {}, lambda a, s: dict(
        mask_mod=lambda b, h, i, j: j < HOPPER_PREFIX[b], score_mod=_empty_rows_score_mod)),
    # closed-over arrays read per row and per column (`sides.split`: int32 vectors streamed beside K)
    "documents-window": Case(HOPPER_SELF, lambda rng, s: {}, lambda a, s: dict(
        mask_mod=mods.document_window(_doc_ids(s, ((300, 450, 250), (1000,))), 200))),
    # q and kv ids apart, causal; batch row 1's query ids match no key's: rows without keys
    "documents-cross-rows-without-keys": Case(HOPPER_CROSS, lambda rng, s: {}, lambda a, s: dict(
        mask_mod=_documents(_doc_ids(s, ((100, 150, 50), (300,))),
                            _doc_ids(Shape(seq_q=s.seq_k), ((200, 250, 67), (517,))) + jnp.array([[0], [7]])),
        causal=True)),
    # a bool read per row and a float read per column (converted / bit-cast to int32)
    "row-flags-column-floats": Case(HOPPER_CROSS, lambda rng, s: {}, lambda a, s: dict(
        mask_mod=_flags_and_offsets(jnp.asarray(np.arange(s.seq_q) % 5 != 2), jnp.linspace(-50.0, 250.0, s.seq_k)))),
    # with the built-in options
    # attention sinks (rows without keys: lse = the sink), MLA head dims
    "sinks-causal-long-q": Case(HOPPER_LONG_Q, lambda rng, s: _sinks(rng, s), lambda a, s: dict(
        sinks=a["sinks"], causal=True)),
    "sinks-window-lengths": Case(HOPPER_CROSS, lambda rng, s: _sinks(rng, s), lambda a, s: dict(
        sinks=a["sinks"], window=(100, 30), q_lengths=jnp.array([300, 41]), kv_lengths=jnp.array([517, 200]))),
    "mla-causal": Case(HOPPER_MLA, lambda rng, s: {}, lambda a, s: dict(causal=True)),
    "mla-long-q-window-sinks": Case(HOPPER_LONG_Q._replace(head_dim=192, v_head_dim=128), lambda rng, s: _sinks(rng, s),
                                    lambda a, s: dict(window=(100, 20), sinks=a["sinks"])),
    "mla-192-64-lengths": Case(HOPPER_MLA._replace(v_head_dim=64), lambda rng, s: {}, lambda a, s: dict(
        kv_lengths=jnp.array([517, 300]), window=(200, None))),
    "mla-d96-v64-score-mod": Case(HOPPER_CROSS._replace(head_dim=96, v_head_dim=64), lambda rng, s: {}, lambda a, s: dict(
        score_mod=mods.tanh_softcap(5.0), causal=True)),
    "composed": Case(HOPPER_CROSS, lambda rng, s: dict(_slopes(rng, s), **_sinks(rng, s)), lambda a, s: dict(
        score_mod=mods.alibi(a["slopes"]), mask_mod=mods.chunked(128), causal=True, sinks=a["sinks"],
        segment_ids=(_doc_ids(s, ((100, 150, 50), (300,))), _doc_ids(Shape(seq_q=s.seq_k), ((200, 250, 67), (517,)))),
        kv_lengths=jnp.array([480, 517]), dropout_rate=0.1, dropout_rng=jax.random.key(5))),
}


# float16 on the cases whose arithmetic differs from bfloat16's (a score_mod's exp/tanh, a learned slope).
HOPPER_F16 = ("alibi-learned-causal", "tanh-softcap-large-logits", "tanh-mod-with-softcap-window", "chunked",
              "sinks-causal-long-q", "mla-causal")


@requires_hopper
@pytest.mark.parametrize("case, dtype", [
    pytest.param(case, dtype, id=f"{name}-{dtype_name}") for name, case in HOPPER_CASES.items()
    for dtype, dtype_name in ((jnp.bfloat16, "bf16"), (jnp.float16, "f16")) if dtype_name == "bf16" or name in HOPPER_F16
])
def test_mods_on_hopper(case, dtype, rng):
    """score_mod, mask_mod, sinks and MLA head dims in the Hopper kernels (forward, dK/dV, dQ): o,
    lse and the gradients of q, k, v, of a learned closed-over slope and of the sinks, against the
    reference."""
    s = case.shape
    x = draw(rng, s, dtype, case.q_scale)
    got, want = run_both(x, lambda a: case.options(a, s), case.arrays(rng, s), config=None, backend="mosaic")
    assert_matches(got, want, dtype)


PERSISTENT_BLOCK_MASKS = {
    # (shape, mask_mod, causal): rings that differ from pair to pair and from row to row
    "prefix-lm": (HOPPER_SELF, lambda b, h, i, j: (j <= i) | (j < 300), False),
    "causal-documents": (HOPPER_SELF, mods.document_window(_doc_ids(HOPPER_SELF, ((300, 450, 250), (1000,))), 1000),
                         True),
    # a band: pairs whose keys start past 0; q_len < kv_len, GQA; some rows' ranges empty
    "band-cross": (HOPPER_CROSS, lambda b, h, i, j: (jnp.abs(i + 150 * b - j) <= 40) & (i < 280), False),
}


@requires_hopper
@pytest.mark.parametrize("name", PERSISTENT_BLOCK_MASKS)
def test_persistent_forward_with_a_block_mask_built_outside_jit(rng, monkeypatch, name):
    """A block mask built outside jit gives ranges known at trace time: the Hopper forward runs on
    the persistent grid, its table balanced by them (5 CTAs, so that each walks dozens of items
    of different rings through one ring), and matches the reference."""
    from flashjax.kernels.mosaic import fwd as mosaic_fwd

    s, mask_mod, causal = PERSISTENT_BLOCK_MASKS[name]
    jax.clear_caches()  # the SM count is no part of a compiled call's cache key
    monkeypatch.setattr(backends, "sm_count", lambda: 5)
    grids = []
    run_forward = mosaic_fwd.forward
    monkeypatch.setattr(mosaic_fwd, "forward", lambda *a, ctas=None, **kw: grids.append(ctas) or run_forward(*a, ctas=ctas, **kw))
    block_mask = flashjax.block_mask(mask_mod, s.batch, 1, s.seq_q, s.seq_k, block_q=64, block_k=64)
    x = draw(rng, s, jnp.bfloat16)
    got, want = run_both(x, lambda a: dict(block_mask=block_mask, causal=causal), config=None, backend="mosaic")
    assert_matches(got, want, jnp.bfloat16)
    assert grids and all(ctas == 5 for ctas in grids), grids


@pytest.mark.parametrize("backend", ["triton", "xla"])
def test_score_mod_with_a_non_finite_derivative_at_masked_pairs(rng, backend):
    """s * log(q_idx) has an infinite derivative at row 0, which the mask_mod masks whole: the
    gradients are zero there and the others those of a mod equal to it at every visible pair
    and finite everywhere (the reference's too: backend="xla")."""
    s = Shape(batch=1, seq_q=17, seq_k=33, heads=2, kv_heads=1, head_dim=16)
    mask_mod = lambda b, h, i, j: i > 0
    at_visible = lambda score, b, h, i, j: score * jnp.log(jnp.maximum(i, 1).astype(jnp.float32))
    x = draw(rng, s, jnp.float32)
    got, _ = run_both(x, lambda a: dict(score_mod=lambda score, b, h, i, j: score * jnp.log(i.astype(jnp.float32)),
                                        mask_mod=mask_mod), backend=backend,
                    config=SMALL_TILES if backend == "triton" else None)
    _, want = run_both(x, lambda a: dict(score_mod=at_visible, mask_mod=mask_mod))
    assert_matches(got, want, jnp.float32)


@pytest.mark.parametrize("causal", [False, True])
def test_score_mod_non_finite_past_the_query_rows(rng, causal):
    """A score_mod finite at every query row and non-finite past q_len, where the kernels
    compute padded rows of the last query tile: the gradients are the reference's (finite),
    a bias broadcast over the queries included (its gradient sums over the rows)."""
    s = Shape(batch=2, seq_q=17, seq_k=33, heads=4, kv_heads=2, head_dim=16)
    bias = dict(bias=jnp.asarray(rng.standard_normal((1, 1, 1, s.seq_k)), jnp.float32))
    for arrays in ({}, bias):
        options = lambda a: dict(score_mod=_non_finite_past(s.seq_q), causal=causal, **a)
        got, want = run_both(draw(rng, s, jnp.float32), options, arrays)
        assert_matches(got, want, jnp.float32)


@pytest.mark.parametrize("name, score_mod", [
    ("score-used-twice", lambda s, b, h, i, j: s * jax.nn.sigmoid(s)),  # its derivative sums two cotangents
    ("copy", lambda s, b, h, i, j: jnp.copy(s) - 0.01 * jnp.abs(i - j)),
])
def test_primitives_without_rules_run_as_what_they_compute(rng, monkeypatch, name, score_mod):
    """JAX's add_any (the sum of two cotangents in a derivative program) and copy have no
    lowering rule in either kernel family; the kernels evaluate them as an add and as the value
    itself, so such mods run on the kernels (forward and backward, the Hopper ones on an H100
    too) with the reference's results."""
    s = Shape(batch=2, seq_q=24, seq_k=33, heads=4, kv_heads=2, head_dim=16)
    options = lambda a: dict(score_mod=score_mod, causal=True)
    x = draw(rng, s, jnp.float32)
    got, want = run_both(x, options)
    assert_matches(got, want, jnp.float32)
    from flashjax import backends

    monkeypatch.setattr(backends, "describe_device", lambda: ("gpu", "9.0"))
    bf16 = {key: value.astype(jnp.bfloat16) for key, value in x.items() if key in "qkv"}
    choice = flashjax.explain(bf16["q"], bf16["k"], bf16["v"], **options({}))
    assert (choice.backend, choice.backward_backend) == ("mosaic", "mosaic"), choice


def test_custom_vjp_in_a_score_mod(rng):
    """A score_mod calling a jax.custom_vjp function (a straight-through estimator) runs forward on
    the kernels; its backward, which needs the derivative in forward mode, runs on the reference,
    with the function's own rule: `explain` says so, and the gradients are the reference's."""

    @jax.custom_vjp
    def straight_through(x):
        return jnp.floor(x + 0.5)

    straight_through.defvjp(lambda x: (straight_through(x), None), lambda _, g: (g,))
    s = Shape(batch=2, seq_q=24, seq_k=33, heads=4, kv_heads=2, head_dim=16)
    options = lambda a: dict(score_mod=lambda sc, b, h, i, j: sc + 0.3 * straight_through(sc), causal=True)
    x = draw(rng, s, jnp.float32)
    choice = flashjax.explain(x["q"], x["k"], x["v"], **options({}))
    assert choice.backend != "xla" and choice.backward_backend == "xla", choice
    assert "custom_vjp" in str(choice)
    got, want = run_both(x, options)
    assert_matches(got, want, jnp.float32)


@pytest.mark.parametrize("backend", ["triton", "xla"])
def test_mods_that_differ_only_in_rules_or_callbacks_are_not_alike(backend):
    """Two score_mods whose programs print alike but whose custom_jvp / custom_vjp rules or
    host callbacks differ are different mods (each call gets its own gradient / values, not
    a compiled program of the other's); the same function traced twice stays one mod, so it
    compiles once."""
    rng = np.random.default_rng(7)
    q, k, v, w = (jnp.asarray(rng.standard_normal((1, 16, 2, 16)), jnp.float32) for _ in range(4))

    def jvp_rule(slope):  # the identity, with derivative `slope`
        f = jax.custom_jvp(lambda x: x)
        f.defjvp(lambda p, t: (p[0], slope * t[0]))
        return lambda s, b, h, i, j: f(s)

    def vjp_rule(slope):
        f = jax.custom_vjp(lambda x: x)
        f.defvjp(lambda x: (x, None), lambda _, g: (slope * g,))
        return lambda s, b, h, i, j: f(s)

    def host(c):  # score * c, computed on the host
        return lambda s, b, h, i, j: jax.pure_callback(lambda x: np.asarray(x * c, np.float32),
                                                       jax.ShapeDtypeStruct((), jnp.float32), s,
                                                       vmap_method="sequential")

    plain = jax.grad(lambda q: jnp.sum(flashjax.flash_attention(q, k, v, backend="xla") * w))(q)
    for rule in (jvp_rule, vjp_rule):
        mods = [flex.trace(rule(slope), flex.SCORE_MOD)[0] for slope in (2.0, 3.0)]
        assert mods[0] != mods[1]
        same = rule(2.0)
        assert flex.trace(same, flex.SCORE_MOD)[0] == flex.trace(same, flex.SCORE_MOD)[0]
        for slope in (2.0, 3.0):
            loss = lambda q: jnp.sum(flashjax.flash_attention(q, k, v, score_mod=rule(slope), backend=backend) * w)
            check_close(jax.grad(loss)(q), slope * plain, jnp.float32, f"dq of {rule.__name__}({slope})")
    if backend == "xla":  # the kernels cannot call the host
        for c in (1.0, 0.5):
            got = flashjax.flash_attention(q, k, v, score_mod=host(c), backend=backend)
            check_close(got, reference.attention(q, k, v, scale=c / 4), jnp.float32, f"o of host({c})")


@pytest.mark.parametrize("backend", ["triton", "xla"])
def test_arrays_closed_over_in_nested_jits_and_custom_rules_are_not_baked(backend):
    """An array a mod closes over inside a nested jax.jit is an operand like any closed-over
    array (a later call with another value computes with it, the block mask built from such
    a mask_mod too); one a custom_jvp rule closes over is compared by value, so a rule over
    other values is another mod (its own gradient), and the kernels leave that backward to
    the reference, saying why."""
    rng = np.random.default_rng(11)
    q, k, v, w = (jnp.asarray(rng.standard_normal((1, 32, 2, 16)), jnp.float32) for _ in range(4))
    for c in (2.0, -3.0):
        table = jnp.asarray([c, c])  # per head
        score_mod = lambda s, b, h, i, j: jax.jit(lambda x, h: x * table[h])(s, h)
        got = flashjax.flash_attention(q, k, v, score_mod=score_mod, backend=backend)
        check_close(got, reference.attention(q, k, v, scale=c / 4), jnp.float32, f"o, a nested jit over {c}")
    for width in (1, 20):
        bound = jnp.asarray([width, width])  # per head
        mask_mod = lambda b, h, i, j: jax.jit(lambda h, i, j: jnp.abs(i - j) < bound[h])(h, i, j)
        mask = flashjax.block_mask(mask_mod, 1, 2, 32, 32, block_q=16, block_k=16)
        got = flashjax.flash_attention(q, k, v, block_mask=mask, backend=backend)
        want = reference.attention(q, k, v, window=(width - 1, width - 1))
        check_close(got, want, jnp.float32, f"o, a nested jit's band of {width}")

    def rule_over(slope):  # the identity, with derivative slope[0]
        f = jax.custom_jvp(lambda x: x)
        f.defjvp(lambda p, t: (p[0], slope[0] * t[0]))
        return lambda s, b, h, i, j: f(s)

    plain = jax.grad(lambda q: jnp.sum(flashjax.flash_attention(q, k, v, backend="xla") * w))(q)
    for slope in (1.0, 0.0, 1.0):
        score_mod = rule_over(jnp.asarray([slope]))
        loss = lambda q: jnp.sum(flashjax.flash_attention(q, k, v, score_mod=score_mod, backend=backend) * w)
        check_close(jax.grad(loss)(q), slope * plain, jnp.float32, f"dq, a rule over {slope}")
    choice = flashjax.explain(q, k, v, score_mod=rule_over(jnp.asarray([1.0])))
    assert choice.backward_backend == "xla" and "closes over arrays" in str(choice), choice


def test_a_block_mask_rebuilt_per_step_compiles_once(monkeypatch):
    """A block mask rebuilt every step from a rebuilt mask_mod over new document ids (what a
    training loop does per batch) reuses the compiled call: the function it carries is not
    part of the compiled call's key. The same mask_mod rebuilt over the same NumPy ids is
    accepted beside it, as one mask."""
    traces = []
    real = autodiff.attention
    monkeypatch.setattr(autodiff, "attention", lambda *args: traces.append(1) or real(*args))
    rng = np.random.default_rng(12)
    q = jnp.asarray(rng.standard_normal((2, 32, 2, 16)), jnp.float32)
    documents = lambda ids: (lambda b, h, i, j: jnp.asarray(ids)[b, i] == jnp.asarray(ids)[b, j])
    for step in range(3):
        ids = (np.arange(32) // (8 + 4 * step))[None].repeat(2, 0).astype(np.int32)
        mask = flashjax.block_mask(documents(ids), 2, 2, 32, 32, block_q=16, block_k=16)
        got = flashjax.flash_attention(q, q, q, block_mask=mask, mask_mod=documents(ids), backend="xla")
        check_close(got, reference.attention(q, q, q, segment_ids=jnp.asarray(ids)), jnp.float32, f"o, step {step}")
        if step == 0:
            first = len(traces)
    assert len(traces) == first, traces


def test_a_typed_key_in_a_mod_is_refused_by_name():
    key = jax.random.key(0)
    q = jnp.zeros((1, 16, 1, 16))
    with pytest.raises(ValueError, match="typed PRNG key.*key_data"):
        flashjax.flash_attention(q, q, q, score_mod=lambda s, b, h, i, j: s + jax.random.uniform(key), backend="xla")


def test_loops_in_mods(rng):
    """A fori_loop in a score_mod and in a mask_mod runs every iteration, in the kernels (forward
    and backward) and in the block mask built from the mask_mod."""
    s = Shape(batch=2, seq_q=40, seq_k=70, heads=4, kv_heads=2, head_dim=16)

    def options(a):
        score_mod = lambda sc, b, h, i, j: jax.lax.fori_loop(0, 3, lambda t, x: x + 0.4 * (j % 3), sc)
        mask_mod = lambda b, h, i, j: jax.lax.fori_loop(0, 30, lambda t, c: c + 1, j) <= i + 40
        return dict(score_mod=score_mod, mask_mod=mask_mod)

    got, want = run_both(draw(rng, s, jnp.float32), options)
    assert_matches(got, want, jnp.float32)
    mask_mod = options({})["mask_mod"]
    bounds = flashjax.block_mask(mask_mod, 1, 1, 40, 70, block_q=16, block_k=16)
    exact = flashjax.block_mask(mask_mod, 1, 1, 40, 70, block_q=16, block_k=16, exact=True)
    np.testing.assert_array_equal(np.asarray(bounds.blocks), np.asarray(exact.blocks))


@pytest.mark.parametrize("seq_k, lanes", [(40, 10), (97, 1)])
def test_closed_over_gradients_over_fewer_key_lanes(seq_k, lanes, monkeypatch):
    """The gradients of a learned table and slopes when their copies per lane of keys are capped
    (`extras_grad.SPREAD_ELEMENTS`): 40 keys over 10 lanes (the largest divisor under the cap),
    and a prime key count over one; with a softcap, causal and kv lengths, against the reference."""
    from flashjax.kernels import extras_grad

    rng = np.random.default_rng(seq_k)
    s = Shape(batch=2, seq_q=33, seq_k=seq_k, heads=4, kv_heads=2, head_dim=16)
    arrays = dict(table=jnp.asarray(rng.standard_normal((4, 16)), jnp.float32),
                  slopes=jnp.asarray(rng.uniform(0.01, 0.3, 4), jnp.float32))
    elements = 4 * 16 + 4
    monkeypatch.setattr(extras_grad, "SPREAD_ELEMENTS", elements * 12)
    assert extras_grad._key_lanes(seq_k, elements) == lanes
    jax.clear_caches()  # the backward's trace is cached with the default cap

    def options(a):
        def score_mod(s, b, h, i, j):
            return s + a["table"][h, jnp.clip(i - j + 8, 0, 15)] - a["slopes"][h] * jnp.abs(i - j).astype(jnp.float32)

        return dict(score_mod=score_mod, softcap=4.0, causal=True, kv_lengths=jnp.array([seq_k, seq_k // 2], jnp.int32))

    got, want = run_both(draw(rng, s, jnp.float32), options, arrays)
    assert_matches(got, want, jnp.float32)
    jax.clear_caches()


@pytest.mark.parametrize("score_mod, additive", [
    pytest.param(mods.alibi(jnp.ones((2,))), True, id="alibi"),
    pytest.param(mods.t5_relative_bias(jnp.zeros((2, 32))), True, id="t5-table"),
    pytest.param(lambda s, b, h, i, j: s + 1.0, True, id="plus-constant"),
    pytest.param(lambda s, b, h, i, j: s, True, id="identity"),
    pytest.param(mods.tanh_softcap(5.0), False, id="tanh"),
    pytest.param(lambda s, b, h, i, j: 2.0 * s, False, id="scaled"),
    pytest.param(lambda s, b, h, i, j: jnp.where(i % 7 == 3, -jnp.inf, s), False, id="where-on-positions"),
    pytest.param(lambda s, b, h, i, j: s * jnp.array([1.0, 1.0])[h], False, id="times-a-closed-over-one"),
])
def test_additive_score_mods_skip_the_derivative(score_mod, additive):
    """A score_mod whose derivative in the score is 1 everywhere is `additive` (the kernels then
    compute no derivative); one whose derivative depends on an input, even if it is 1 for these
    arrays, is not."""
    mod, _ = flex.trace(score_mod, flex.SCORE_MOD)
    assert mod.additive is additive


ONE_PER_HEAD = jnp.ones((4,), jnp.float32)
SLOPES_BF16 = jnp.asarray([0.5, 0.25, 0.125, 0.0625], jnp.bfloat16)


@pytest.mark.parametrize("score_mod, scaled_product", [
    pytest.param(mods.alibi(jnp.asarray([0.5, 0.25])), True, id="alibi"),
    pytest.param(mods.t5_relative_bias(jnp.asarray(np.random.default_rng(0).standard_normal((2, 32)), jnp.float32)),
                 False, id="t5-table"),
    pytest.param(lambda s, b, h, i, j: s - 0.5 * (i - j).astype(jnp.float32), True, id="minus-literal-times-distance"),
    pytest.param(lambda s, b, h, i, j: 1.0 + s, False, id="constant-plus"),
    pytest.param(lambda s, b, h, i, j: s, False, id="identity"),
    # terms of other types: the factor multiplies the term converted to float32
    pytest.param(lambda s, b, h, i, j: s - SLOPES_BF16[h] * jnp.abs(i - j), False, id="alibi-bf16-slopes"),
    pytest.param(lambda s, b, h, i, j: s + (h * (j % 3)).astype(jnp.float32), False, id="integer-term"),
    pytest.param(lambda s, b, h, i, j: s - (0.5 * jnp.abs(i - j).astype(jnp.float32) * 37.0).astype(jnp.bfloat16),
                 False, id="term-rounded-to-bf16"),
])
def test_additive_term(score_mod, scaled_product):
    """An additive score_mod's term program gives factor * (score_mod(s) - s) at random
    arguments, without reading the score; the factor enters the term's last product by its
    side that is uniform over a tile (ALiBi's slope) where there is one, so that the kernels'
    logit is one multiply-add per score."""
    mod, consts = flex.trace(score_mod, flex.SCORE_MOD)
    jaxpr, own = mod.additive_term
    term = jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(jaxpr, own))
    rng = np.random.default_rng(1)
    for _ in range(20):
        score, factor = np.float32(rng.normal() * 30), np.float32(rng.uniform(0.01, 3))
        index = [jnp.int32(x) for x in (rng.integers(0, 2), rng.integers(0, 2), rng.integers(0, 300), rng.integers(0, 300))]
        want = factor * (mod.bind(consts)(jnp.float32(score), *index) - score)
        got = term(*consts, jnp.float32(factor), *index)[0]
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6 * abs(score) * factor)
    factor_var = jaxpr.invars[len(jaxpr.invars) - 5]
    users = [eqn for eqn in jaxpr.eqns if factor_var in eqn.invars]
    assert len(users) == (1 if jaxpr.eqns else 0)  # one multiply by the factor (none for the identity's 0)
    if scaled_product:  # factor times a per-tile value, not times the per-score term
        (other,) = [x for x in users[0].invars if x is not factor_var]
        positions = set(jaxpr.invars[-2:])
        for eqn in jaxpr.eqns:
            if any(x in positions for x in eqn.invars if isinstance(x, jex_core.Var)):
                positions.update(eqn.outvars)
        assert isinstance(other, jex_core.Literal) or other not in positions


@pytest.mark.parametrize("score_mod", [
    pytest.param(mods.tanh_softcap(5.0), id="tanh"),
    pytest.param(lambda s, b, h, i, j: (i - j).astype(jnp.float32) - s, id="minus-score"),
    pytest.param(lambda s, b, h, i, j: jnp.where(i > j, s + 1.0, s - 2.0), id="where-of-sums"),
    pytest.param(lambda s, b, h, i, j: s.astype(jnp.bfloat16).astype(jnp.float32) - 0.1 * (i - j).astype(jnp.float32),
                 id="score-rounded-to-bf16"),
])
def test_no_additive_term_for_other_mods(score_mod):
    """Mods that are not the score plus a term have none (the kernels scale the score first),
    among them one that rounds the score (its derivative is 1, but the rounding is not a term)."""
    mod, _ = flex.trace(score_mod, flex.SCORE_MOD)
    assert mod.additive_term is None


SLOPE_MODS = {
    "tanh-softcap": mods.tanh_softcap(50.0),
    "tanh-softcap-small-cap": mods.tanh_softcap(0.7),
    "chain-with-neg": lambda s, b, h, i, j: -(s * 3.0) * 0.5 + 2.0 * -jnp.tanh(s * 0.25),
    "shared-product": lambda s, b, h, i, j: (lambda u: u * 3.0 + jnp.sin(u))(jnp.tanh(s) * 2.0 * 0.25),
    "factors-overflowing": lambda s, b, h, i, j: jnp.tanh(s) * 1e30 * 1e30 * 1e-35,
    "factors-underflowing": lambda s, b, h, i, j: (jnp.exp(s * 0.008) * 1e-30) * 1e-20,
    "zero-factor": lambda s, b, h, i, j: jnp.sin(s) * 0.0 + s,
    "positions-and-heads": lambda s, b, h, i, j: jnp.tanh(s * (h + 1).astype(jnp.float32)) * 0.5 * (i - j),
    "square": lambda s, b, h, i, j: 0.1 * (s * 0.5) ** 2,
    "atanh": lambda s, b, h, i, j: 4.0 * jnp.arctanh(jnp.tanh(s * 0.125) * 0.5),
    "bf16-tanh": lambda s, b, h, i, j: jnp.tanh(s.astype(jnp.bfloat16) * 0.5).astype(jnp.float32) * 3.0,
    "with-a-debug-callback": lambda s, b, h, i, j: jax.debug.callback(lambda *a: None, s) or jnp.tanh(s * 0.5) * 2.0,
}


@pytest.mark.parametrize("name", SLOPE_MODS)
def test_slope_program_is_the_mods_derivative(name, rng):
    """The backward kernels' (value, slope) program: the value bit for bit the mod's own, the
    slope d score_mod / d score as jax.jvp gives it, up to float32 rounding (its constant
    factors are multiplied first and 1 - t^2 is computed as such); scores up to +-1e4, so
    past tanh's saturation."""
    fn = SLOPE_MODS[name]
    mod, consts = flex.trace(fn, flex.SCORE_MOD)
    jaxpr, own = mod._value_and_slope
    scores = np.concatenate([rng.standard_normal(200) * 4, rng.uniform(-1e4, 1e4, 50), [0.0, 1e-30, -1e-30]])
    scores = jnp.asarray(scores, jnp.float32)
    heads, q_idx, kv_idx = (jnp.asarray(rng.integers(0, 9, scores.size), jnp.int32) for _ in range(3))
    program = jax.vmap(lambda *a: jax.core.eval_jaxpr(jaxpr, own, *consts, *a))
    value, slope = program(scores, jnp.zeros_like(heads), heads, q_idx, kv_idx)
    own_value = jax.vmap(lambda *a: jax.core.eval_jaxpr(mod.jaxpr, consts, *a)[0])(
        scores, jnp.zeros_like(heads), heads, q_idx, kv_idx)
    np.testing.assert_array_equal(value, own_value)
    want = jax.vmap(lambda s, *index: jax.jvp(lambda s: fn(s, 0, *index), (s,), (jnp.ones_like(s),))[1])(
        scores, heads, q_idx, kv_idx)
    np.testing.assert_allclose(slope, want, rtol=3e-6, atol=3e-6 * float(jnp.max(jnp.abs(want))))


def test_slope_program_of_the_softcap_mod_is_the_builtins():
    """`mods.tanh_softcap`'s slope is 1 - t * t (one FMA on the GPU): the chain rule's
    ``cap * (1 / cap * (1 + t)(1 - t))`` shortened, as the built-in softcap computes it."""
    mod, _ = flex.trace(mods.tanh_softcap(50.0), flex.SCORE_MOD)
    jaxpr, _ = mod._value_and_slope
    slope = flex._dependencies(jaxpr, jaxpr.outvars[1:]) - flex._dependencies(jaxpr, jaxpr.outvars[:1])
    ops = sorted(eqn.primitive.name for eqn in jaxpr.eqns if any(v in slope for v in eqn.outvars))
    assert ops == ["mul", "sub"]


@pytest.mark.parametrize("score_mod, grads", [
    pytest.param(lambda s, b, h, i, j: s - SLOPES_BF16[h] * jnp.abs(i - j), True, id="alibi-bf16-slopes"),
    pytest.param(lambda s, b, h, i, j: s + (h * (j % 3)).astype(jnp.float32), True, id="integer-term"),
    pytest.param(lambda s, b, h, i, j: s - (ONE_PER_HEAD[h] * jnp.abs(i - j).astype(jnp.float32) * 0.37
                                            ).astype(jnp.bfloat16), True, id="term-rounded-to-bf16"),
    # terms near float16's largest value (65504): scaled by log2(e) before the conversion
    # they would overflow to inf and mask every key
    pytest.param(lambda s, b, h, i, j: s - (ONE_PER_HEAD[h] * (j + 1000).astype(jnp.float32) * 46.0
                                            ).astype(jnp.float16), True, id="term-near-float16-max"),
    pytest.param(lambda s, b, h, i, j: s.astype(jnp.bfloat16).astype(jnp.float32) - 0.1 * (i - j).astype(jnp.float32),
                 False, id="score-rounded-to-bf16"),
])
def test_additive_mods_of_other_types_in_the_kernels(score_mod, grads, rng):
    """Score_mods that add a term of another type (bf16 slopes, an integer, a term rounded to
    bf16 or float16) or round the score: o and lse equal the reference's, and so do the
    gradients, except where the mod rounds the score (the reference's backward rounds its
    cotangent to bf16 there, the kernels take the mod's derivative, 1)."""
    x = draw(rng, CROSS, jnp.float32)
    got, want = run_both(x, lambda a: dict(score_mod=score_mod), reference_on_cpu=True)
    if grads:
        assert_matches(got, want, jnp.float32)
    else:
        check_close(got.o, want.o, jnp.float32, "o")
        check_lse(got.lse, want.lse, jnp.float32)


# ---- random mods (property tests) ----------------------------------------------------------------
def random_mods(rng, shape: Shape) -> tuple[dict, Callable]:
    """(arrays, options(arrays)): a random score_mod and/or mask_mod built of what user mods
    are made of, with random built-in options beside them.

    score_mod: one to three of a per-head or per-batch choice between Python constants (a
    scalar `where`), a per-head choice by a closed-over bool array, a square root of the
    score's magnitude, a learned table read at a clipped relative position, learned per-head
    slopes times a distance, a select on the positions, a tanh cap, integer arithmetic
    on the positions and a table the mod builds itself (`jnp.linspace`). mask_mod: a
    random program over positions (`_random_mask`), a per-head window made of constants,
    or both. Built-in options: causal, and at random a
    softcap, a window, kv lengths, packed documents and sinks. Every choice is drawn here,
    so that each trace of the functions is the same program. `arrays` are the learned
    table, slopes and sinks (differentiated by the tests).
    """
    n = int(rng.integers(1, shape.heads))
    c = [round(float(x), 3) for x in rng.uniform(0.3, 1.7, 3)]
    width = int(rng.integers(3, 40))
    flags = jnp.asarray(rng.integers(2, size=shape.heads).astype(bool))
    pieces = [
        lambda a, s, b, h, i, j: s * jnp.where(h < n, c[0], 1.0),
        lambda a, s, b, h, i, j: jnp.where(flags[h], s, 0.5 * s),
        lambda a, s, b, h, i, j: jnp.sqrt(jnp.abs(s) + 1.0),
        lambda a, s, b, h, i, j: s + jnp.where(b == 0, c[1], 0.0) + jnp.where(h == n, 1, h).astype(jnp.float32) * 0.1,
        lambda a, s, b, h, i, j: s + a["table"][h, jnp.clip(i - j + 8, 0, 15)],
        lambda a, s, b, h, i, j: s - a["slopes"][h] * jnp.abs(i - j).astype(jnp.float32),
        lambda a, s, b, h, i, j: jnp.where((i - j) % 3 == 0, s * c[2], s),
        lambda a, s, b, h, i, j: 3.0 * jnp.tanh(s / 3.0),
        lambda a, s, b, h, i, j: s + (i // 7 - j // 5).astype(jnp.float32) * 0.05,
        lambda a, s, b, h, i, j: s + c[1] * jnp.linspace(-0.5, 0.5, 16)[jnp.clip(j - i + 8, 0, 15)],
    ]
    chosen = [pieces[p] for p in rng.choice(len(pieces), size=int(rng.integers(1, 4)), replace=False)]
    positions = _random_mask(rng, _DOCS)
    per_head = lambda b, h, i, j: j <= i + jnp.where(h < n, 0, width)
    mask_mod = [None, positions, per_head, lambda b, h, i, j: positions(b, h, i, j) & per_head(b, h, i, j)][
        int(rng.integers(4))]
    with_score = mask_mod is None or bool(rng.integers(3))
    causal = bool(rng.integers(2))
    builtins = dict(causal=causal)
    if rng.integers(3) == 0:
        builtins["softcap"] = 4.0
    if rng.integers(4) == 0:
        builtins["window"] = (int(rng.integers(5, 60)), None if causal else int(rng.integers(0, 30)))
    if rng.integers(4) == 0:
        builtins["kv_lengths"] = jnp.asarray(rng.integers(1, shape.seq_k + 1, size=shape.batch), jnp.int32)
    if rng.integers(4) == 0:
        docs = lambda seq: packed_ids([rng.integers(5, seq // 2, size=2) for _ in range(shape.batch)], seq)
        builtins["segment_ids"] = docs(shape.seq_q) if shape.seq_q == shape.seq_k else (docs(shape.seq_q), docs(shape.seq_k))
    arrays = dict(table=jnp.asarray(rng.standard_normal((shape.heads, 16)), jnp.float32),
                  slopes=jnp.asarray(rng.uniform(0.01, 0.3, shape.heads), jnp.float32))
    if rng.integers(4) == 0:
        arrays["sinks"] = jnp.asarray(rng.normal(0.0, 2.0, shape.heads), jnp.float32)

    def options(a):
        def score_mod(s, b, h, i, j):
            for piece in chosen:
                s = piece(a, s, b, h, i, j)
            return s

        return dict(score_mod=score_mod if with_score else None, mask_mod=mask_mod, sinks=a.get("sinks"), **builtins)

    return arrays, options


def random_shape(rng, head_dim: int = 16) -> Shape:
    seq_q, seq_k = (int(x) for x in rng.choice([33, 40, 70, 97], size=2))
    return Shape(batch=2, seq_q=seq_q, seq_k=seq_k, heads=4, kv_heads=int(rng.choice([1, 2, 4])), head_dim=head_dim)


@pytest.mark.parametrize("seed", range(12))
def test_random_mods(seed):
    """Random mods (`random_mods`) on the Triton kernels, forward and backward, against the
    reference: o, lse and the gradients of q, k, v, the table and the slopes, at odd lengths,
    Tq != Tk, GQA/MQA and rows without keys; float32, and bfloat16 on every third seed."""
    rng = np.random.default_rng(seed)
    s = random_shape(rng)
    dtype = jnp.bfloat16 if seed % 3 == 2 else jnp.float32
    arrays, options = random_mods(rng, s)
    got, want = run_both(draw(rng, s, dtype), options, arrays)
    assert_matches(got, want, dtype)


@requires_hopper
@pytest.mark.parametrize("seed", range(8))
def test_random_mods_on_auto(seed):
    """Random mods on the kernels `auto` picks on an H100 (the Hopper kernels where they take
    the mods, else the Triton kernels), bf16, at Hopper-sized odd lengths."""
    rng = np.random.default_rng(1000 + seed)
    s = random_shape(rng, head_dim=64)._replace(seq_q=int(rng.choice([300, 517])), seq_k=int(rng.choice([300, 517])))
    arrays, options = random_mods(rng, s)
    got, want = run_both(draw(rng, s, jnp.bfloat16), options, arrays, config=None, backend="auto")
    assert_matches(got, want, jnp.bfloat16)


# Mods whose values, on some inputs, a kernel lowering's own rule computes unlike XLA
# (`xla_semantics.evaluate`); each reads its operands from closed-over arrays, so that they are
# runtime values in the kernels (constants fold in XLA), and keeps key 0 visible.
_ZERO_OR_3 = jnp.asarray([0, 3], jnp.int32)
_SHIFT_32_OR_2 = jnp.asarray([32, 2], jnp.int32)
_NEGATIVE_SHIFT = jnp.asarray([-1, 33], jnp.int32)
_INF = jnp.asarray([jnp.inf, jnp.inf], jnp.float32)
_RAMP = jnp.linspace(0.0, 1.0, 8)
_THREES = jnp.asarray([3.0, 7.0], jnp.float32)
_INT_MIN, _MINUS_ONE = jnp.asarray(np.iinfo(np.int32).min, jnp.int32), jnp.asarray(-1, jnp.int32)
LOWERING_MODS = [
    pytest.param(lambda b, h, i, j: (i // _ZERO_OR_3[h]) == (j // _ZERO_OR_3[h]), id="int-div-by-zero"),
    pytest.param(lambda b, h, i, j: lax.rem(j, _ZERO_OR_3[h]) == (i % 5), id="int-rem-by-zero"),
    pytest.param(lambda b, h, i, j: lax.div(j, _ZERO_OR_3[h]) < i, id="int-lax-div-by-zero"),
    pytest.param(lambda b, h, i, j: (_INT_MIN + j - j) // _MINUS_ONE < i - 40, id="int-min-over-minus-one"),
    pytest.param(lambda b, h, i, j: (i >> _SHIFT_32_OR_2[h]) == (j >> _SHIFT_32_OR_2[h]), id="shift-right-past-width"),
    pytest.param(lambda b, h, i, j: ((-i - 1) >> _SHIFT_32_OR_2[h]) < (j - 40), id="arithmetic-shift-of-negative"),
    pytest.param(lambda b, h, i, j: (jnp.left_shift(j, _NEGATIVE_SHIFT[h]) + i) % 3 == 0, id="shift-left-negative"),
    pytest.param(lambda b, h, i, j: lax.div(j, 0) < i, id="constant-div-by-zero"),
    pytest.param(lambda b, h, i, j: (lax.shift_left(j, 33) + i) % 3 == 0, id="constant-shift-past-width"),
    pytest.param(lambda b, h, i, j: ((j - i) & 2).astype(bool) | (j <= i), id="int-to-bool"),
    pytest.param(lambda b, h, i, j: ((j - i).astype(jnp.float32) * 0.25).astype(bool) & (j < i + 9), id="float-to-bool"),
    pytest.param(lambda b, h, i, j: jnp.sign(i.astype(jnp.float32) * _INF[h]) < 2.0, id="sign-of-nan"),
    pytest.param(lambda b, h, i, j: jnp.clip(i.astype(jnp.float32) * _INF[h], 0.0, 1.0) < 2.0, id="clip-of-nan"),
    pytest.param(lambda b, h, i, j: jnp.floor(i.astype(jnp.float32) / _THREES[h])
                 == jnp.floor(j.astype(jnp.float32) / _THREES[h]), id="float-division-floored"),
    # a uint32 index below 0 wraps past int32's range: XLA clamps it to the last element
    pytest.param(lambda b, h, i, j: _RAMP[j.astype(jnp.uint32) - 2] < _RAMP[i % 8], id="uint32-index-past-int32"),
]


def _as_a_gpu_may(jaxpr, consts, *args) -> list:
    """Evaluates a jaxpr as a GPU lowering may: an integer division or remainder by zero (or
    of the minimum by -1) and a shift by the width or more give a value of their own (LLVM
    leaves them undefined), where XLA defines them; nested calls are evaluated alike."""
    from jax.extend import core as jex_core

    env = dict(zip((*jaxpr.constvars, *jaxpr.invars), (*consts, *args)))
    read = lambda x: x.val if isinstance(x, jex_core.Literal) else env[x]
    for eqn in jaxpr.eqns:
        ins = [read(x) for x in eqn.invars]
        if (inner := flex.inner_jaxpr(eqn)) is not None:
            outs = _as_a_gpu_may(*inner, *ins)
        else:
            outs = eqn.primitive.bind(*ins, **eqn.params)
            outs = outs if eqn.primitive.multiple_results else [outs]
            dtype = np.dtype(eqn.invars[0].aval.dtype)
            undefined = None
            if eqn.primitive in (lax.div_p, lax.rem_p) and jnp.issubdtype(dtype, jnp.integer):
                x, y = ins
                undefined = y == 0
                if jnp.issubdtype(dtype, jnp.signedinteger):
                    undefined = undefined | ((x == np.iinfo(dtype).min) & (y == -1))
            elif eqn.primitive in (lax.shift_left_p, lax.shift_right_logical_p, lax.shift_right_arithmetic_p):
                y = jnp.asarray(ins[1])
                undefined = (y >= dtype.itemsize * 8) | ((y < 0) if jnp.issubdtype(dtype, jnp.signedinteger) else False)
            if undefined is not None:
                outs = [jnp.where(undefined, jnp.asarray(77, dtype), outs[0])]
        env.update(zip(eqn.outvars, outs))
    return [read(x) for x in jaxpr.outvars]


_PAST_THE_DOMAIN = {"int-rem-by-zero", "int-lax-div-by-zero", "int-min-over-minus-one", "arithmetic-shift-of-negative",
                    "shift-left-negative", "constant-div-by-zero", "constant-shift-past-width"}


@pytest.mark.parametrize("lowering", ["triton", "mosaic"])
@pytest.mark.parametrize("mask_mod", LOWERING_MODS)
def test_mod_rewrites_for_the_kernel_lowerings_equal_xla(mask_mod, lowering, request):
    """`Mod.tile(lowering=...)` evaluates the operations whose lowering rule differs from XLA
    (a zero divisor, a shift past the width, NaN through a sign or a clip, a number to bool)
    by other operations, and gives XLA's values even where division and shifts give their
    own past their domain (`_as_a_gpu_may`); without the rewrites such mods do not."""
    mod, consts = flex.trace(mask_mod, flex.MASK_MOD)
    rows, cols = jnp.arange(64)[:, None], jnp.arange(64)[None, :]
    refs = flex.kernel_operands(consts)  # the kernel operands stand for their refs
    undefined_somewhere = False
    for head in (0, 1):
        want = np.asarray(jax.vmap(jax.vmap(lambda i, j: mask_mod(0, head, i, j), (None, 0)), (0, None))(
            jnp.arange(64), jnp.arange(64)))
        for rule in (lowering, None):
            # Traced, as in a kernel: each read of a closed-over array is a runtime value.
            tile = jax.make_jaxpr(lambda refs, head: mod.tile(refs, 0, head, rows, cols, shape=(64, 64), lowering=rule))
            closed = tile(refs, head)
            got = np.asarray(_as_a_gpu_may(closed.jaxpr, closed.consts, *jax.tree.leaves(refs), head)[0])
            if rule is not None:
                np.testing.assert_array_equal(got, want, err_msg=f"head {head}")
            else:
                undefined_somewhere |= not np.array_equal(got, want)
    # jnp's // and >> keep their own operations in their domain; lax's do not.
    if request.node.callspec.id.removesuffix(f"-{lowering}") in _PAST_THE_DOMAIN:
        assert undefined_somewhere, "the case should reach an operation past its domain"


@pytest.mark.parametrize("lowering", ["triton", "mosaic"])
@pytest.mark.parametrize("divisor", [50.0, 3.0, 0.1, 2.0 ** -130, 0.0, -np.inf])
def test_float_division_by_a_constant_is_xlas_product(lowering, divisor):
    """A float divided by a constant in a mod is XLA's x * (1 / c) (its algebraic simplifier's
    rewrite, the reciprocal rounded to float32) in the kernels too: no division per score, and
    the values of the product, c = 0, a subnormal c and infinities included."""
    rows, cols = jnp.arange(64, dtype=jnp.int32)[:, None], jnp.arange(32, dtype=jnp.int32)[None, :]
    scores = jnp.asarray(np.random.default_rng(0).standard_normal((64, 32)) * 30, jnp.float32).at[0, :3].set(
        jnp.asarray([0.0, np.inf, np.nan]))
    with np.errstate(divide="ignore", over="ignore"):
        reciprocal = np.float32(1) / np.float32(divisor)
    # The score, and a row's position converted to float (evaluated once per row), divided.
    for fn, numerator in ((lambda s, b, h, i, j: s / divisor, np.asarray(scores)),
                          (lambda s, b, h, i, j: i.astype(jnp.float32) / divisor, np.asarray(rows, np.float32))):
        mod, _ = flex.trace(fn, flex.SCORE_MOD)
        tile = lambda s: mod.tile((), s, 0, 0, rows, cols, shape=(64, 32), lowering=lowering)
        assert "div" not in [e.primitive.name for e in jax.make_jaxpr(tile)(scores).jaxpr.eqns]
        want = np.broadcast_to(numerator * reciprocal, (64, 32))
        np.testing.assert_array_equal(np.asarray(jax.jit(tile)(scores)), want)


def test_softcap_tanh_rewrite_for_mosaic():
    """tanh on Mosaic (approximate math in its kernels) is the built-in softcap's exp2 form:
    within 2e-7 absolute of tanh where exp2 and division round to the nearest (XLA on the
    CPU), 6e-7 where they are the GPU's (a few ulps each: up to 4 ulps of 2 / (E + 1) < 2,
    and the final subtraction's rounding); +-1 at the extremes, NaN for NaN; not the
    approximate tanh instruction (~1e-3 relative)."""
    mod, consts = flex.trace(lambda s, b, h, i, j: jnp.tanh(s), flex.SCORE_MOD)
    rng = np.random.default_rng(0)
    x = np.r_[0.0, 1e-30, 1e-7, 1e-5, 9e-4, 1e-3, 2e-3, 0.1, 0.5, 1.0, 1.40844, 8.0, 9.5, 20.0, 300.0, 1e30,
              rng.uniform(0, 12, 2000)].astype(np.float32)
    scores = jnp.asarray(np.r_[x, -x, np.nan], jnp.float32)[None, :]
    index = jnp.zeros((1, 1), jnp.int32)
    got = np.asarray(mod.tile((), scores, 0, 0, index, index, lowering="mosaic"))[0]
    np.testing.assert_array_equal(got, np.asarray(xla_semantics.tanh_from_exp2(scores))[0])
    want = np.tanh(np.asarray(scores[0], np.float64))
    np.testing.assert_allclose(got[:-1], want[:-1], rtol=0, atol=2e-7 if jax.default_backend() == "cpu" else 6e-7)
    assert np.all(got[np.abs(scores[0]) >= 20.0] == np.sign(scores[0][np.abs(scores[0]) >= 20.0]))
    assert np.isnan(got[-1])


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", pytest.param("mosaic", marks=requires_hopper)])
@pytest.mark.parametrize("mask_mod", LOWERING_MODS)
def test_mods_in_the_compiled_kernels_equal_xla(mask_mod, backend):
    """The compiled kernels evaluate each of those mods as XLA does (the GPU's lowering rules
    differ on those inputs): attention under the mask (with key 0 always visible) equals the
    reference on the dense mask."""
    if jax.default_backend() != "gpu":
        pytest.skip("the compiled kernels' lowering needs a GPU (interpret mode evaluates in XLA)")
    visible = lambda b, h, i, j: mask_mod(b, h, i, j) | (j == 0)
    dtype = jnp.bfloat16 if backend == "mosaic" else jnp.float32
    ks = jax.random.split(jax.random.key(7), 3)
    q, k, v = (jax.random.normal(key, (1, 192, 2, 64), jnp.float32).astype(dtype) for key in ks)
    dense = np.asarray(reference.logits_mask(1, 192, 192, mask_mod=visible, heads=2))
    want = flashjax.flash_attention(q, k, v, mask=jnp.asarray(dense), backend="xla")
    try:
        got = flashjax.flash_attention(q, k, v, mask_mod=visible, backend=backend)
    except NotImplementedError as e:  # Mosaic GPU has no floor: refused up front
        assert backend == "mosaic" and "does not lower" in str(e), e
        return
    check_close(got, want, dtype, f"{backend} vs the dense mask")

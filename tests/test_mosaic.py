"""The Hopper backend (``backend="mosaic"``, Pallas Mosaic GPU kernels) against the oracle.

Runs only on an sm90 GPU (H100/H200): Mosaic GPU kernels use wgmma, TMA and
mbarriers, which JAX 0.11 cannot execute in CPU interpret mode. The API's refusals
(unsupported features, no Hopper GPU) are checked on every machine.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from flashjax import MosaicConfig, backends
from flashjax.kernels.mosaic import config as mosaic_config

HOPPER = backends.describe_device() == ("gpu", "9.0")
SKIP_REASON = "Mosaic GPU kernels need an sm90 (Hopper) GPU; JAX cannot run them in CPU interpret mode"
requires_hopper = pytest.mark.skipif(not HOPPER, reason=SKIP_REASON)

BF16, F16 = jnp.bfloat16, jnp.float16


def mosaic_vjp(kernel_vjp, x, **kwargs):
    return kernel_vjp(x.q, x.k, x.v, x.do, x.dlse, backend="mosaic", **kwargs)


SHAPES = [
    # (batch, seq_q, seq_k, heads, kv_heads, head_dim)
    pytest.param((2, 1024, 1024, 4, 4, 128), id="T1024-d128"),
    pytest.param((2, 1000, 1000, 4, 4, 64), id="T1000-d64"),
    pytest.param((1, 512, 512, 4, 4, 256), id="T512-d256"),
    pytest.param((2, 2047, 2047, 8, 2, 128), id="T2047-d128-gqa4"),
    pytest.param((1, 1024, 1024, 8, 4, 64), id="T1024-d64-gqa2"),
    pytest.param((2, 1024, 1024, 8, 1, 128), id="T1024-d128-mqa"),
    pytest.param((1, 130, 1000, 8, 2, 128), id="q130<k1000-gqa4"),
    pytest.param((1, 1000, 130, 4, 4, 64), id="q1000>k130"),
    pytest.param((2, 1, 17, 2, 1, 128), id="q1-k17-mqa"),
    pytest.param((2, 17, 1, 2, 2, 64), id="q17-k1"),
    pytest.param((1, 300, 257, 2, 2, 96), id="q300-k257-d96"),
    # The spot checks of the former benchmarks/mosaic_quick.py that the cases above miss.
    pytest.param((2, 1000, 1000, 4, 2, 64), id="T1000-d64-gqa2"),
    pytest.param((1, 2047, 2047, 4, 1, 128), id="T2047-d128-mqa"),
    pytest.param((1, 1000, 130, 8, 4, 64), id="q1000>k130-gqa2"),
    pytest.param((1, 1024, 1024, 2, 2, 256), id="T1024-d256"),
    pytest.param((1, 512, 512, 4, 2, 192), id="T512-d192-gqa2"),  # the dK/dV kernel split, as at 256
]


@requires_hopper
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_and_grads(make_inputs, kernel_vjp, reference_vjp, assert_result_close, shape, causal, dtype):
    x = make_inputs(*shape, dtype=dtype)
    got = mosaic_vjp(kernel_vjp, x, causal=causal)
    want = reference_vjp(x.q, x.k, x.v, x.do, x.dlse, causal=causal)
    assert_result_close(got, want, dtype)


@requires_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "shape",
    [
        pytest.param((2, 1024, 1024, 4, 2, 128), id="T1024-d128-gqa2"),
        pytest.param((1, 300, 300, 2, 2, 96), id="T300-d96"),  # head dim padded to 128, partial tiles
    ],
)
def test_large_logits(make_inputs, kernel_vjp, reference_vjp, assert_result_close, shape, causal):
    """q.k scaled up x30: the online softmax rescales hard; no overflow, no NaN."""
    x = make_inputs(*shape, dtype=BF16, q_scale=30.0)
    got = mosaic_vjp(kernel_vjp, x, causal=causal)
    want = reference_vjp(x.q, x.k, x.v, x.do, x.dlse, causal=causal)
    assert_result_close(got, want, BF16)


@requires_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "q_scale",
    [
        pytest.param(1e8, id="logits-5e8"),
        pytest.param(1e10, id="logits-5e10", marks=pytest.mark.xfail(
            strict=True, reason="past logits of ~1.5e9 the exponent leaves float32's range (README, Precision)")),
    ],
)
def test_logit_range(make_inputs, kernel_vjp, reference_vjp, assert_huge_logits_result, q_scale, causal):
    """The logit range the README states for the Hopper kernels: q x 1e8 (logits up to ~5e8)
    gives o and lse at the reference's and finite gradients; q x 1e10 returns NaN (strict
    xfail: a kernel that stays finite there must update the README)."""
    x = make_inputs(1, 256, 256, 2, 2, 128, dtype=BF16, q_scale=q_scale)
    got = kernel_vjp(x.q, x.k, x.v, x.do, None, backend="mosaic", causal=causal)
    want = reference_vjp(x.q, x.k, x.v, x.do, None, causal=causal)
    assert_huge_logits_result(got, want, BF16, q_scale)


@requires_hopper
def test_rows_without_keys(make_inputs, kernel_vjp, reference_vjp, assert_result_close):
    """Causal with Tq > Tk: the first Tq - Tk rows see no key: o = 0, lse = -inf, zero grads."""
    x = make_inputs(1, 700, 200, 4, 4, 128, dtype=BF16)
    got = mosaic_vjp(kernel_vjp, x, causal=True)
    want = reference_vjp(x.q, x.k, x.v, x.do, x.dlse, causal=True)
    assert_result_close(got, want, BF16)
    np.testing.assert_array_equal(np.asarray(got.o[:, :500], np.float32), 0.0)
    assert np.all(np.asarray(got.lse[:, :, :500]) == -np.inf)
    np.testing.assert_array_equal(np.asarray(got.dq[:, :500], np.float32), 0.0)


SCHEDULE_SHAPES = [
    pytest.param((2, 1024, 1024, 4, 2, 128), id="T1024-d128-gqa2"),
    pytest.param((1, 700, 200, 4, 4, 128), id="q700>k200"),  # causal: rows without keys
    pytest.param((1, 130, 1000, 8, 2, 64), id="q130<k1000-d64"),
    pytest.param((1, 300, 257, 2, 2, 256), id="q300-k257-d256"),
    pytest.param((1, 300, 257, 2, 2, 160), id="q300-k257-d160"),  # padded to 192
]


@requires_hopper
@pytest.mark.parametrize("schedule", ["pingpong", "overlap"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SCHEDULE_SHAPES)
def test_forward_schedules(make_inputs, reference_fwd, assert_close, assert_lse_close, shape, causal, schedule):
    """Every MosaicConfig.fwd_schedule, not only the one "auto" picks for this call."""
    head_dim = shape[-1]
    x = make_inputs(*shape, dtype=BF16)
    config = dataclasses.replace(MosaicConfig.default(head_dim), fwd_schedule=schedule)
    o, lse = flashjax.flash_attention(x.q, x.k, x.v, causal=causal, return_lse=True, backend="mosaic", config=config)
    want_o, want_lse = reference_fwd(x.q, x.k, x.v, causal=causal)
    assert_close(o, want_o, BF16, f"o ({schedule})")
    assert_lse_close(lse, want_lse, BF16)


BACKWARD_SHAPES = [
    pytest.param((2, 1024, 1024, 4, 2, 128), id="T1024-gqa2"),
    pytest.param((2, 2047, 2047, 8, 2, 128), id="T2047-gqa4"),
    pytest.param((1, 700, 200, 4, 4, 128), id="q700>k200"),  # causal: rows without keys
    pytest.param((1, 130, 1000, 8, 1, 128), id="q130<k1000-mqa"),
    pytest.param((2, 17, 1, 2, 2, 128), id="q17-k1"),
    pytest.param((1, 300, 257, 2, 2, 96), id="q300-k257-d96"),  # head dim padded to 128
    pytest.param((1, 1000, 1000, 2, 2, 64), id="T1000-d64"),
]


@requires_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", BACKWARD_SHAPES)
def test_backward_shapes(make_inputs, kernel_vjp, reference_vjp, assert_result_close, shape, causal):
    """The default backward (the dK/dV kernel, then the dQ kernel) over shapes: odd
    lengths, Tq != Tk, GQA and MQA, rows without keys, head dims 64 and 96."""
    x = make_inputs(*shape, dtype=BF16)
    got = mosaic_vjp(kernel_vjp, x, causal=causal)
    want = reference_vjp(x.q, x.k, x.v, x.do, x.dlse, causal=causal)
    assert_result_close(got, want, BF16)


@requires_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_deterministic(make_inputs, kernel_vjp, causal):
    """Two runs are bitwise equal (output, lse and every gradient): every dQ row is summed
    in a fixed order, by one warpgroup."""
    x = make_inputs(2, 2047, 2047, 8, 2, 128, dtype=BF16)
    first = mosaic_vjp(kernel_vjp, x, causal=causal)
    second = mosaic_vjp(kernel_vjp, x, causal=causal)
    for name in first._fields:
        np.testing.assert_array_equal(
            np.asarray(getattr(first, name), np.float32), np.asarray(getattr(second, name), np.float32), err_msg=name
        )


@requires_hopper
def test_jit_grad_vmap_return_lse(make_inputs, reference_fwd, assert_close, assert_lse_close):
    x = make_inputs(2, 256, 384, 4, 2, 64, dtype=BF16)
    attn = functools.partial(flashjax.flash_attention, causal=True, backend="mosaic")

    # vmap over an extra leading axis (the batch of 2 split into 2 x 1), under jit.
    o, lse = jax.jit(jax.vmap(lambda q, k, v: attn(q, k, v, return_lse=True)))(
        x.q[:, None], x.k[:, None], x.v[:, None]
    )
    want_o, want_lse = reference_fwd(x.q, x.k, x.v, causal=True)
    assert_close(o[:, 0], want_o, BF16, "o (vmap)")
    assert_lse_close(lse[:, 0], want_lse, BF16)

    def loss(q, k, v, f):
        return jnp.sum(f(q, k, v).astype(jnp.float32) * x.do.astype(jnp.float32))

    from flashjax import reference

    ref = lambda q, k, v: reference.attention(q, k, v, causal=True)
    got = jax.jit(jax.grad(functools.partial(loss, f=attn), argnums=(0, 1, 2)))(x.q, x.k, x.v)
    up = [a.astype(jnp.float32) for a in (x.q, x.k, x.v)]
    want = jax.jit(jax.grad(functools.partial(loss, f=ref), argnums=(0, 1, 2)))(*up)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert_close(g, w, BF16, name)


@requires_hopper
def test_auto_runs_on_hopper(make_inputs, reference_fwd, assert_close):
    x = make_inputs(1, 512, 512, 4, 4, 128, dtype=BF16)
    got = flashjax.flash_attention(x.q, x.k, x.v, causal=True)
    assert_close(got, reference_fwd(x.q, x.k, x.v, causal=True)[0], BF16)


# ---- refusals: on every machine ------------------------------------------------------------
def _arrays(dtype=BF16, d=64):
    q = jnp.ones((2, 16, 2, d), dtype)
    return q, q, q


PAIR_CASES = [
    # (bias, mask) as (shape, dtype) or None, the reason expected (None: supported)
    pytest.param(((16, 16), jnp.float32), None, "float32 bias with bfloat16 inputs", id="float32-bias"),
    pytest.param(None, ((1, 1, 1, 16), bool), "broadcast along q_len or kv_len", id="seq-broadcast-mask"),
    pytest.param(((1, 2, 16, 16), BF16), ((2, 1, 16, 16), bool), "larger than either", id="bias-mask-product"),
    pytest.param(((1, 2, 16, 16), BF16), ((1, 2, 16, 16), bool), None, id="bias-and-mask"),
    pytest.param(None, ((2, 1, 16, 16), bool), None, id="mask"),
    pytest.param(((16, 16), BF16), None, None, id="bias-2d"),
    pytest.param(((16, 16), BF16), None, None, id="bias-segments"),
]


@pytest.mark.parametrize("bias,mask,reason", PAIR_CASES)
def test_bias_and_mask_support(request, bias, mask, reason):
    """The Hopper kernels take a bias and a boolean mask of [Tq, Tk] tiles; what they cannot
    take is named (on every machine; without a Hopper GPU that reason comes too)."""
    arrays = {name: jnp.zeros(spec[0], spec[1]) for name, spec in (("bias", bias), ("mask", mask)) if spec is not None}
    q = _arrays()[0]
    if "segments" in request.node.callspec.id:
        arrays["segment_ids"] = jnp.zeros(q.shape[:2], jnp.int32)
    if reason is None:
        reasons = backends.get("mosaic").supports(dataclasses.replace(
            _hopper_call(), batch=2, seq_q=16, seq_k=16, heads=2, kv_heads=2, head_dim=64,
            arrays=frozenset(arrays), pair_arrays=tuple(
                (name, (1,) * (4 - x.ndim) + x.shape, jnp.dtype(x.dtype).name) for name, x in arrays.items()
                if name in ("bias", "mask"))))
        assert reasons == [], reasons
    else:
        with pytest.raises(NotImplementedError, match=f"mosaic.*{reason}"):
            flashjax.flash_attention(q, q, q, backend="mosaic", **arrays)


def _hopper_call(**options) -> backends.Call:
    return backends.Call(batch=1, seq_q=4096, seq_k=4096, heads=8, kv_heads=8, head_dim=128,
                         dtype=jnp.dtype(BF16), platform="gpu", compute_capability="9.0", **options)


@pytest.mark.parametrize("options", [
    dict(window=(256, 0)), dict(softcap=30.0), dict(causal=True, window=(1024, None), softcap=50.0),
    dict(arrays=frozenset({"q_lengths"})), dict(arrays=frozenset({"kv_lengths"})),
    dict(causal=True, arrays=frozenset({"q_lengths", "kv_lengths", "alibi_slopes"})),
    dict(causal=True, arrays=frozenset({"segment_ids"})), dict(causal=True, dropout_rate=0.1),
    dict(arrays=frozenset({"bias"}), pair_arrays=(("bias", (1, 8, 4096, 4096), "bfloat16"),)),
    dict(causal=True, softcap=30.0, arrays=frozenset({"mask"}), pair_arrays=(("mask", (1, 1, 4096, 4096), "bool"),))],
    ids=["window", "softcap", "window-softcap", "q-lengths", "kv-lengths", "lengths-alibi", "segments", "dropout",
         "bias", "mask-softcap"])
def test_auto_takes_hopper_for_its_options(options):
    """On an sm90 GPU `auto` runs windows, the softcap, ALiBi, lengths, segment ids, dropout,
    a bias and a mask on the Hopper kernels, forward and backward."""
    call = _hopper_call(**options)
    assert backends.get("mosaic").supports(call) == []
    choice = backends.choose(call)
    assert (choice.backend, choice.backward_backend) == ("mosaic", "mosaic"), str(choice)


WINDOW_SOFTCAP_CASES = [
    # (batch, seq_q, seq_k, heads, kv_heads, head_dim), causal, window, softcap
    pytest.param((2, 1024, 1024, 4, 2, 128), False, (256, 37), None, id="T1024-window-gqa2"),
    pytest.param((1, 1000, 1000, 4, 1, 64), True, (129, None), None, id="T1000-causal-window-mqa"),
    # The second consumer's key range starts a tile later than the first's: it passes
    # the skipped tile's barrier phases before its own range.
    pytest.param((1, 1536, 1536, 4, 4, 128), True, (64, None), None, id="T1536-causal-window64"),
    pytest.param((1, 300, 1000, 8, 2, 128), True, None, 30.0, id="q300<k1000-causal-softcap"),
    pytest.param((1, 1000, 130, 4, 4, 64), False, (64, 64), 20.0, id="q1000>k130-window-softcap-rows-without-keys"),
    pytest.param((2, 2047, 2047, 8, 2, 128), True, (1024, None), 50.0, id="T2047-causal-window-softcap"),
]


@requires_hopper
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("shape,causal,window,softcap", WINDOW_SOFTCAP_CASES)
def test_window_and_softcap(make_inputs, kernel_vjp, reference_vjp, assert_result_close, shape, causal, window,
                            softcap, dtype):
    """Band tiles only (`MaskSpec` ranges) and the tanh cap with its gradient (`common.logits`)."""
    x = make_inputs(*shape, dtype=dtype, q_scale=3.0)  # logits large enough for the cap to bend
    options = dict(causal=causal, window=window, softcap=softcap)
    got = mosaic_vjp(kernel_vjp, x, **options)
    want = reference_vjp(x.q, x.k, x.v, x.do, x.dlse, **options)
    assert_result_close(got, want, dtype)


ALIBI_CASES = [
    # (batch, seq_q, seq_k, heads, kv_heads, head_dim), causal, window, softcap
    pytest.param((2, 1024, 1024, 4, 2, 128), True, None, None, id="T1024-causal-gqa2"),
    pytest.param((1, 1000, 1000, 4, 1, 64), False, None, None, id="T1000-mqa-d64"),
    pytest.param((1, 300, 1000, 8, 2, 128), True, None, 30.0, id="q300<k1000-causal-softcap"),
    pytest.param((1, 1000, 130, 4, 4, 64), False, (64, 64), None, id="q1000>k130-window-rows-without-keys"),
]


@requires_hopper
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("shape,causal,window,softcap", ALIBI_CASES)
def test_alibi(make_inputs, kernel_vjp, reference_vjp, assert_result_close, shape, causal, window, softcap, dtype):
    """ALiBi in `common.logits` (every tile, not only the masked ones), with the other options."""
    x = make_inputs(*shape, dtype=dtype)
    heads = shape[3]
    slopes = jnp.asarray(2.0 ** (-8.0 * np.arange(1, heads + 1) / heads), jnp.float32)  # the ALiBi paper's
    options = dict(causal=causal, window=window, softcap=softcap, arrays=dict(alibi_slopes=slopes))
    got = mosaic_vjp(kernel_vjp, x, **options)
    want = reference_vjp(x.q, x.k, x.v, x.do, x.dlse, **options)
    assert_result_close(got, want, dtype)


LENGTHS_CASES = [
    # (batch, seq_q, seq_k, heads, kv_heads, head_dim), causal, window, q_lengths, kv_lengths
    pytest.param((3, 1024, 1024, 4, 2, 128), True, None, [1024, 513, 0], [1024, 513, 7], id="T1024-causal-gqa2"),
    pytest.param((2, 1000, 1000, 4, 1, 64), False, None, None, [999, 130], id="T1000-kv-only-mqa"),
    pytest.param((2, 300, 1000, 8, 2, 128), True, (256, None), [300, 17], [1000, 450], id="q300<k1000-causal-window"),
    pytest.param((2, 1000, 130, 4, 4, 64), False, None, [1000, 64], None, id="q1000>k130-q-only"),
]


@requires_hopper
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("shape,causal,window,q_lengths,kv_lengths", LENGTHS_CASES)
def test_lengths(make_inputs, kernel_vjp, reference_vjp, assert_result_close, shape, causal, window, q_lengths,
                 kv_lengths, dtype):
    """q/kv lengths (padding): tiles past a row's lengths never loaded, keys past it masked,
    padded query rows 0 with lse -inf and zero gradients; lengths 0 give empty rows."""
    x = make_inputs(*shape, dtype=dtype)
    arrays = {name: jnp.asarray(value, jnp.int32) for name, value in
              (("q_lengths", q_lengths), ("kv_lengths", kv_lengths)) if value is not None}
    options = dict(causal=causal, window=window, arrays=arrays)
    got = mosaic_vjp(kernel_vjp, x, **options)
    want = reference_vjp(x.q, x.k, x.v, x.do, x.dlse, **options)
    assert_result_close(got, want, dtype)


def _documents(rng, batch: int, seq: int, docs: int):
    """Sorted segment ids [batch, seq]: `docs` documents per row at random boundaries."""
    cuts = np.sort(rng.choice(np.arange(1, seq), size=(batch, docs - 1), replace=True), axis=1)
    return jnp.asarray((np.arange(seq)[None, :, None] >= cuts[:, None, :]).sum(-1), jnp.int32)


SEGMENT_CASES = [
    # (batch, seq_q, seq_k, heads, kv_heads, head_dim), causal, window, documents, kv_lengths
    pytest.param((2, 2048, 2048, 4, 2, 128), True, None, 4, None, id="T2048-causal-4docs-gqa2"),
    pytest.param((2, 1000, 1000, 4, 1, 64), False, None, 3, None, id="T1000-3docs-mqa"),
    pytest.param((1, 1500, 1500, 4, 4, 128), True, (200, None), 5, [1100], id="T1500-causal-window-5docs-kv-length"),
    pytest.param((2, 777, 777, 2, 2, 64), False, None, 1, None, id="T777-one-doc"),
]


@requires_hopper
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("shape,causal,window,docs,kv_lengths", SEGMENT_CASES)
def test_segments(make_inputs, kernel_vjp, reference_vjp, assert_result_close, rng, shape, causal, window, docs,
                  kv_lengths, dtype):
    """Packed documents (one segment_ids array): tiles of different documents never loaded,
    boundary tiles masked by id, with the other options."""
    x = make_inputs(*shape, dtype=dtype)
    arrays = dict(segment_ids=_documents(rng, shape[0], shape[1], docs))
    if kv_lengths is not None:
        arrays["kv_lengths"] = jnp.asarray(kv_lengths, jnp.int32)
    options = dict(causal=causal, window=window, arrays=arrays)
    got = mosaic_vjp(kernel_vjp, x, **options)
    want = reference_vjp(x.q, x.k, x.v, x.do, x.dlse, **options)
    assert_result_close(got, want, dtype)


DROPOUT_CASES = [
    # (batch, seq_q, seq_k, heads, kv_heads, head_dim), causal, rate, broadcast, other options
    pytest.param((2, 1024, 1024, 4, 2, 128), True, 0.1, False, {}, id="T1024-causal-gqa2"),
    pytest.param((1, 1000, 1000, 4, 1, 64), False, 0.5, False, dict(fwd_schedule="overlap"), id="T1000-mqa-overlap"),
    pytest.param((2, 300, 1000, 4, 4, 128), True, 0.3, True, dict(window=(256, None)),
                 id="q300<k1000-causal-window-broadcast"),
    pytest.param((2, 1000, 130, 2, 2, 64), False, 0.2, False, dict(softcap=30.0, kv_lengths=[130, 0]),
                 id="q1000>k130-softcap-rows-without-keys"),
    pytest.param((2, 1536, 1536, 4, 2, 128), True, 0.1, False, dict(segment_ids=3), id="T1536-causal-3docs"),
]


@requires_hopper
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("shape,causal,rate,broadcast,other", DROPOUT_CASES)
def test_dropout(make_inputs, kernel_vjp, reference_vjp, assert_result_close, rng, shape, causal, rate, broadcast,
                 other, dtype):
    """Dropout on the Hopper kernels draws `flashjax.dropout`'s keep bits: the reference with
    the same seed (whose keep mask tests/test_dropout.py finds in the Triton kernels) agrees,
    forward and backward, with the other options."""
    x = make_inputs(*shape, dtype=dtype)
    other = dict(other)
    config_fields = {name: other.pop(name) for name in ("fwd_schedule",) if name in other}
    arrays = dict(dropout_rng=jax.random.PRNGKey(int(rng.integers(1 << 30))))
    if "kv_lengths" in other:
        arrays["kv_lengths"] = jnp.asarray(other.pop("kv_lengths"), jnp.int32)
    if "segment_ids" in other:
        arrays["segment_ids"] = _documents(rng, shape[0], shape[1], other.pop("segment_ids"))
    options = dict(causal=causal, dropout_rate=rate, broadcast_dropout=broadcast, arrays=arrays, **other)
    config = dataclasses.replace(MosaicConfig.default(shape[5]), **config_fields)
    got = mosaic_vjp(kernel_vjp, x, config=config, **options)
    want = reference_vjp(x.q, x.k, x.v, x.do, x.dlse, **options)
    assert_result_close(got, want, dtype)


@pytest.mark.parametrize("dims, bias, want", [
    pytest.param((128, 128), False, (128, 2, None, False), id="d128"),
    pytest.param((128, 128), True, (64, 2, None, False), id="d128-bias"),
    pytest.param((192, 128), False, (64, 2, None, False), id="mla"),
    pytest.param((192, 192), False, (64, 2, None, True), id="d192"),
    pytest.param((256, 256), False, (64, 2, 1, True), id="d256"),
])
def test_backward_tilings_fit(dims, bias, want):
    """The dQ kernel's K/V ring (key tile, K stages, V stages where fewer) fits shared memory
    beside its query tiles, and the dK/dV kernel splits key tiles where dK and dV exceed the
    registers."""
    from flashjax.kernels.mosaic import backend as mosaic_backend
    from flashjax.params import AttentionParams, Extras

    qk_dim, v_dim = dims
    q = jax.ShapeDtypeStruct((1, 1024, 4, qk_dim), BF16)
    v = jax.ShapeDtypeStruct((1, 1024, 4, v_dim), BF16)
    config = MosaicConfig.default(qk_dim, device_kind="nvidia-h100-80gb-hbm3", v_head_dim=v_dim)
    params = AttentionParams(scale=qk_dim**-0.5, causal=True, backend="mosaic", config=config,
                             backward_backend="mosaic", backward_config=config, interpret=False)
    extras = Extras(bias=jnp.zeros((1, 4, 1024, 1024), BF16)) if bias else Extras()
    tilings = mosaic_backend._backward_tilings(q, q, v, extras, params, config)
    assert (tilings.dq.block_kv, tilings.dq.stages, tilings.dq.v_stages, tilings.split) == want


@pytest.mark.parametrize("options, want", [
    pytest.param(dict(), 128, id="dense"),
    pytest.param(dict(softcap=30.0, bias=True), 128, id="dense-bias-softcap"),
    pytest.param(dict(causal=True), 64, id="causal"),
    pytest.param(dict(window=(100, 100)), 64, id="window"),
    pytest.param(dict(kv_lengths=True), 64, id="kv-lengths"),
    pytest.param(dict(segment_ids=True), 64, id="segments"),
])
def test_backward_block_q_dense(options, want):
    """At head dim 64 the table runs 128-row backward tiles only where every query row
    sees every key (`MosaicConfig.bwd_block_q_dense`); masked calls keep `bwd_block_q`."""
    from flashjax.kernels.mosaic import backend as mosaic_backend
    from flashjax.params import AttentionParams, Extras

    q = jax.ShapeDtypeStruct((2, 1024, 4, 64), BF16)
    config = MosaicConfig.default(64, device_kind="nvidia-h100-80gb-hbm3")
    assert (config.bwd_block_q, config.bwd_block_q_dense) == (64, 128)
    options = dict(options)
    arrays = dict(
        bias=jnp.zeros((2, 4, 1024, 1024), BF16) if options.pop("bias", False) else None,
        kv_lengths=jnp.array([1024, 500], jnp.int32) if options.pop("kv_lengths", False) else None,
        q_segment_ids=jnp.zeros((2, 1024), jnp.int32) if options.pop("segment_ids", False) else None,
    )
    if arrays["q_segment_ids"] is not None:
        arrays["kv_segment_ids"] = arrays["q_segment_ids"]
    params = AttentionParams(scale=0.125, backend="mosaic", config=config, backward_backend="mosaic",
                             backward_config=config, interpret=False, **options)
    tilings = mosaic_backend._backward_tilings(q, q, q, Extras(**arrays), params, config)
    assert tilings.dkv.block_q == tilings.dq.block_q == want


DENSE_D64_CASES = [
    # 128-row backward tiles (`bwd_block_q_dense`) with the options that keep a call dense.
    pytest.param((2, 1000, 1000, 4, 1, 64), dict(softcap=30.0, alibi=True), id="T1000-d64-softcap-alibi-mqa"),
    pytest.param((1, 300, 1000, 4, 2, 64), dict(bias=True, dropout_rate=0.1), id="q300<k1000-d64-bias-dropout"),
    pytest.param((2, 1100, 257, 4, 4, 64), dict(), id="q1100>k257-d64"),
]


@requires_hopper
@pytest.mark.parametrize("shape,options", DENSE_D64_CASES)
def test_dense_head_dim_64(make_inputs, kernel_vjp, reference_vjp, assert_result_close, rng, shape, options):
    """Head dim 64 without a mask runs 128-row backward tiles; odd lengths, Tq != Tk and
    the dense options against the reference."""
    x = make_inputs(*shape, dtype=BF16)
    options = dict(options)
    arrays = {}
    if options.pop("alibi", False):
        arrays["alibi_slopes"] = jnp.asarray(2.0 ** (-8.0 * np.arange(1, shape[3] + 1) / shape[3]), jnp.float32)
    if options.pop("bias", False):
        arrays["bias"] = jnp.asarray(rng.normal(size=(shape[0], shape[3], shape[1], shape[2])), BF16)
    if options.get("dropout_rate"):
        arrays["dropout_rng"] = jax.random.PRNGKey(int(rng.integers(1 << 30)))
    config = MosaicConfig.default(64)
    assert config.backward_block_q(True) == 128, config  # the tuned table at head dim 64
    got = mosaic_vjp(kernel_vjp, x, config=config, arrays=arrays, **options)
    want = reference_vjp(x.q, x.k, x.v, x.do, x.dlse, arrays=arrays, **options)
    assert_result_close(got, want, BF16)


@pytest.mark.parametrize("head_dim,v_head_dim,options,persistent", [
    pytest.param(128, 128, {}, True, id="d128"),
    pytest.param(128, 128, dict(bias=True), True, id="d128-bias"),
    pytest.param(64, 64, dict(bias=True), False, id="d64-bias"),  # 3 stages of 128-key K, V and bias tiles
    pytest.param(128, 128, dict(segment_ids=True), False, id="d128-segments"),  # ranges: work known on the device
    pytest.param(256, 256, {}, False, id="d256"),
    pytest.param(192, 192, {}, False, id="d192"),
    pytest.param(192, 128, {}, False, id="mla"),
])
def test_forward_ctas(monkeypatch, head_dim, v_head_dim, options, persistent):
    """The persistent forward runs where O's own tiles fit shared memory beside the rings and
    the call has no ranges or ranges known at trace time, on one CTA per SM and never more
    than one per item; elsewhere one CTA per item."""
    from flashjax.kernels.mosaic import backend as mosaic_backend
    from flashjax.params import AttentionParams, Extras

    config = dataclasses.replace(MosaicConfig.default(head_dim, device_kind="", v_head_dim=v_head_dim),
                                 fwd_persistent=True)
    arrays = dict(
        bias=jnp.zeros((1, 4, 1024, 1024), BF16) if options.get("bias") else None,
        q_segment_ids=jnp.zeros((2, 1024), jnp.int32) if options.get("segment_ids") else None,
    )
    arrays["kv_segment_ids"] = arrays["q_segment_ids"]
    q = jax.ShapeDtypeStruct((2, 1024, 4, head_dim), BF16)
    v = jax.ShapeDtypeStruct((2, 1024, 4, v_head_dim), BF16)
    params = AttentionParams(scale=0.1, causal=True, backend="mosaic", config=config, interpret=False)
    t, q_len, _ = mosaic_backend._forward_tiling(q, q, v, Extras(**arrays), params, config)
    dims = (mosaic_config.padded_head_dim(head_dim), mosaic_config.padded_head_dim(v_head_dim))
    ctas = lambda: mosaic_backend.forward_ctas(config, t, (2, q_len, 4), *dims, 2)
    items = 2 * 4 * q_len // (2 * t.block_q)
    monkeypatch.setattr(backends, "sm_count", lambda: 5)
    assert ctas() == (5 if persistent else None)
    monkeypatch.setattr(backends, "sm_count", lambda: 10_000)
    assert ctas() == (items if persistent else None)
    assert mosaic_backend.forward_ctas(dataclasses.replace(config, fwd_persistent=False), t, (2, q_len, 4), *dims,
                                       2) is None
    # What the sm_90 lowering's shared-memory check would refuse is not chosen.
    fits = mosaic_backend.persistent_forward_smem_bytes(t, *dims, 2) <= mosaic_backend.SMEM_BYTES
    assert fits == persistent or t.ranges
    if t.ranges:  # known at trace time (a block mask built outside jit), ranges take the persistent grid
        monkeypatch.setattr(backends, "sm_count", lambda: 5)
        assert mosaic_backend.forward_ctas(config, t, (2, q_len, 4), *dims, 2, ranged_items=True) == 5


def test_config_overrides_parse_bools_and_none():
    """`--mosaic-config` values: booleans and None reach the config as such (the string
    "false" would turn the persistent forward on), and a config refuses a non-bool flag."""
    from flashjax import benchmark

    config = benchmark.config_overrides(MosaicConfig(), "fwd_persistent=false,bwd_block_q_dense=None,stages=3")
    assert (config.fwd_persistent, config.bwd_block_q_dense, config.stages) == (False, None, 3)
    assert benchmark.config_overrides(config, "fwd_persistent=True").fwd_persistent is True
    with pytest.raises(ValueError, match="fwd_persistent"):
        MosaicConfig(fwd_persistent="false")


@pytest.mark.parametrize("work", ["full", "causal", "ranges"])
@pytest.mark.parametrize("batch,pairs,heads,ctas", [(2, 64, 16, 132), (3, 5, 4, 7), (1, 1, 2, 2)])
def test_persistent_schedule(batch, pairs, heads, ctas, work):
    """The persistent forward's table gives every item to exactly one CTA, each CTA's in index
    order, and balances the key tiles where a round robin would not (causal); with ranges
    known at trace time, by each (pair, batch row)'s own tiles, some of them none."""
    from flashjax.kernels.mosaic.common import Items

    items = Items(heads, pairs, batch, ctas)
    if work == "ranges":
        tiles = np.random.default_rng(pairs).integers(0, 2 * pairs, (pairs, batch))
    else:  # the same for every batch row, the pairs at their (longest-first) positions
        per_pair = np.arange(pairs, 0, -1) if work == "causal" else np.full(pairs, pairs)
        tiles = np.broadcast_to(per_pair[:, None], (pairs, batch))
    table = items.table(tiles if work == "ranges" else tiles[:, 0])
    runs = [table[c, 1:1 + table[c, 0]] for c in range(ctas)]
    assert sorted(np.concatenate(runs).tolist()) == list(range(items.total))
    assert all(np.all(np.diff(run) > 0) for run in runs)
    cost = lambda run: sum(tiles[(i // batch) % pairs, i % batch] + 1 for i in run)
    longest_item = tiles.max() + 1
    ideal = sum(cost(run) for run in runs) / ctas
    assert max(cost(run) for run in runs) <= ideal + longest_item


PERSISTENT_CASES = [
    # (batch, seq_q, seq_k, heads, kv_heads, head_dim), options: the ring's length changes from
    # item to item (causal, documents, lengths), and what it carries besides K/V.
    pytest.param((3, 1000, 1000, 4, 2, 128), dict(causal=True), id="T1000-causal-gqa2"),
    pytest.param((2, 1024, 1024, 4, 4, 64), dict(fwd_schedule="overlap"), id="T1024-d64-overlap"),
    pytest.param((2, 1536, 1536, 4, 1, 128), dict(causal=True, window=(300, None), softcap=30.0, alibi=True),
                 id="T1536-causal-window-softcap-alibi-mqa"),
    pytest.param((1, 700, 200, 4, 4, 128), dict(causal=True, sinks=True), id="q700>k200-rows-without-keys-sinks"),
    pytest.param((2, 1000, 1300, 4, 2, 128), dict(bias=True, dropout_rate=0.1, window=(300, 20)),
                 id="q1000<k1300-bias-dropout-window"),
]


@requires_hopper
@pytest.mark.parametrize("sms", [5, None], ids=["5-ctas", "one-per-sm"])
@pytest.mark.parametrize("shape,options", PERSISTENT_CASES)
def test_persistent_forward(monkeypatch, make_inputs, kernel_vjp, reference_vjp, assert_result_close, rng, shape,
                            options, sms):
    """The persistent forward against the reference: with 5 CTAs each walks dozens of items of
    different lengths through one ring, and with one per SM as it runs by default."""
    from flashjax.kernels.mosaic import fwd as mosaic_fwd

    jax.clear_caches()  # the SM count is no part of a compiled call's cache key
    if sms is not None:
        monkeypatch.setattr(backends, "sm_count", lambda: sms)
    grids = []
    run_forward = mosaic_fwd.forward
    monkeypatch.setattr(mosaic_fwd, "forward", lambda *a, ctas=None, **kw: grids.append(ctas) or run_forward(*a, ctas=ctas, **kw))
    x = make_inputs(*shape, dtype=BF16)
    options = dict(options)
    arrays = {}
    if options.pop("bias", False):
        arrays["bias"] = jnp.asarray(rng.normal(size=(shape[0], shape[3], shape[1], shape[2])), BF16)
    if options.pop("sinks", False):
        # The last head's sink is -inf: no sink, and its rows without keys are empty rows.
        arrays["sinks"] = jnp.asarray(rng.normal(size=(shape[3],)), jnp.float32).at[-1].set(-jnp.inf)
    if options.pop("alibi", False):
        arrays["alibi_slopes"] = jnp.asarray(2.0 ** (-8.0 * np.arange(1, shape[3] + 1) / shape[3]), jnp.float32)
    if options.get("dropout_rate"):
        arrays["dropout_rng"] = jax.random.PRNGKey(int(rng.integers(1 << 30)))
    config = dataclasses.replace(MosaicConfig.default(shape[5]), fwd_schedule=options.pop("fwd_schedule", "auto"),
                                 fwd_persistent=True)
    got = mosaic_vjp(kernel_vjp, x, config=config, arrays=arrays, **options)
    want = reference_vjp(x.q, x.k, x.v, x.do, x.dlse, arrays=arrays, **options)
    assert_result_close(got, want, BF16)
    # One CTA per SM (or the 5), fewer only where the call has fewer items.
    assert grids and all(ctas is not None and ctas <= (sms or backends.sm_count()) for ctas in grids), grids
    assert sms is None or all(ctas == sms for ctas in grids), grids


WIDE_CASES = [
    # (batch, seq_q, seq_k, heads, kv_heads, head_dim), options, dtype. Head dims whose dK and dV
    # exceed the registers: the dK/dV kernel split between its consumers (one key tile, one
    # accumulating dV and the other dK), the dQ kernel's ring fitted to shared memory.
    pytest.param((2, 1024, 1024, 4, 2, 256), dict(causal=True, window=(300, None), softcap=30.0), BF16,
                 id="T1024-d256-causal-window-softcap-gqa2"),
    pytest.param((2, 1000, 1000, 4, 1, 256), dict(alibi=True, kv_lengths=[1000, 333]), F16,
                 id="T1000-d256-alibi-kv-lengths-mqa-f16"),
    pytest.param((2, 1536, 1536, 4, 2, 256), dict(causal=True, segment_ids=3, dropout_rate=0.1), BF16,
                 id="T1536-d256-causal-3docs-dropout"),
    pytest.param((1, 700, 200, 4, 4, 256), dict(causal=True), BF16, id="q700>k200-d256-rows-without-keys"),
    pytest.param((1, 300, 1000, 8, 2, 192), dict(causal=True, q_lengths=[250]), BF16, id="q300<k1000-d192-q-length"),
]


@requires_hopper
@pytest.mark.parametrize("shape,options,dtype", WIDE_CASES)
def test_wide_head_dims(make_inputs, kernel_vjp, reference_vjp, assert_result_close, rng, shape, options, dtype):
    """Head dims 192 and 256 forward and backward on the Hopper kernels, with the options."""
    x = make_inputs(*shape, dtype=dtype)
    options = dict(options)
    arrays = {}
    if options.pop("alibi", False):
        arrays["alibi_slopes"] = jnp.asarray(2.0 ** (-8.0 * np.arange(1, shape[3] + 1) / shape[3]), jnp.float32)
    for name in ("q_lengths", "kv_lengths"):
        if name in options:
            arrays[name] = jnp.asarray(options.pop(name), jnp.int32)
    if "segment_ids" in options:
        arrays["segment_ids"] = _documents(rng, shape[0], shape[1], options.pop("segment_ids"))
    if "dropout_rate" in options:
        arrays["dropout_rng"] = jax.random.PRNGKey(int(rng.integers(1 << 30)))
    choice = flashjax.explain(x.q, x.k, x.v, **options, **arrays)
    assert (choice.backend, choice.backward_backend) == ("mosaic", "mosaic"), choice
    got = mosaic_vjp(kernel_vjp, x, arrays=arrays, **options)
    want = reference_vjp(x.q, x.k, x.v, x.do, x.dlse, arrays=arrays, **options)
    assert_result_close(got, want, dtype)
    if shape[1] > shape[2] and options.get("causal"):
        np.testing.assert_array_equal(np.asarray(got.dq[:, :shape[1] - shape[2]], np.float32), 0.0)


BIAS_MASK_CASES = [
    # (batch, seq_q, seq_k, heads, kv_heads, head_dim), causal, bias shape, mask shape, other options
    pytest.param((1, 1024, 1024, 8, 2, 128), True, (1, 8, 1024, 1024), None, {}, id="T1024-causal-bias1H-gqa4"),
    pytest.param((2, 1000, 1000, 4, 1, 64), False, None, (2, 1, 1000, 1000), dict(fwd_schedule="overlap"),
                 id="T1000-mask-B1-mqa-overlap"),
    pytest.param((2, 300, 1000, 4, 4, 128), True, (2, 4, 300, 1000), (2, 4, 300, 1000),
                 dict(softcap=30.0), id="q300<k1000-causal-bias-mask-softcap"),
    pytest.param((2, 1000, 130, 4, 2, 64), False, (1, 1, 1000, 130), (1, 1, 1000, 130), dict(window=(64, 64)),
                 id="q1000>k130-window-bias11-mask11"),
    pytest.param((2, 1536, 1536, 4, 2, 128), True, (2, 1, 1536, 1536), None, {}, id="T1536-causal-biasB1-gqa2"),
    # With the per-tile ranges: packed documents, padding.
    pytest.param((2, 1500, 1500, 4, 2, 128), True, (1, 4, 1500, 1500), None, dict(segment_ids=4, kv_lengths=[1500, 1100]),
                 id="T1500-causal-bias1H-4docs-kv-lengths"),
    pytest.param((2, 1000, 1200, 4, 4, 64), False, (2, 1, 1000, 1200), (2, 1, 1000, 1200),
                 dict(q_lengths=[1000, 700], kv_lengths=[900, 1200], window=(300, 300)), id="q1000<k1200-bias-mask-lengths-window"),
]


@requires_hopper
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("shape,causal,bias_shape,mask_shape,other", BIAS_MASK_CASES)
def test_bias_and_mask(make_inputs, key, rng, shape, causal, bias_shape, mask_shape, other, dtype):
    """A bias (with dbias from the Triton dbias kernel, reduced over its broadcast dims) and a
    boolean mask folded into it: against the reference, forward and every gradient; mask
    rows all False (and bias entries at the masking value) give rows without keys: o = 0,
    lse = -inf, zero gradients."""
    from test_variants import assert_empty_rows_are_zero, assert_matches, run_both  # the variants' checks

    x = make_inputs(*shape, dtype=dtype)
    other = dict(other)
    config = dataclasses.replace(MosaicConfig.default(shape[5]),
                                 **{name: other.pop(name) for name in ("fwd_schedule",) if name in other})
    bias = None
    if bias_shape is not None:
        bias = (2.0 * jax.random.normal(key, bias_shape, jnp.float32)).astype(dtype)
        # Three rows at -3e38 (finite in bfloat16, -inf in float16): at or below
        # masks.MASKING_BIAS, masked like the mask's False.
        bias = bias.at[..., :3, :].set(-3e38)
    if mask_shape is not None:
        mask = jax.random.bernoulli(jax.random.fold_in(key, 1), 0.8, mask_shape)
        other["mask"] = mask.at[..., 5:9, :].set(False)  # rows without keys
    arrays = {"mask": other.pop("mask")} if "mask" in other else {}
    for name in ("q_lengths", "kv_lengths"):
        if name in other:
            arrays[name] = jnp.asarray(other.pop(name), jnp.int32)
    if "segment_ids" in other:
        arrays["segment_ids"] = _documents(rng, shape[0], shape[1], other.pop("segment_ids"))
    # One jit around both (op-by-op evaluation would compile every op of the reference).
    both = jax.jit(lambda x, bias, arrays: run_both(x, bias=bias, config=config, backend="mosaic", causal=causal,
                                                    **arrays, **other))
    got, want = both(x, bias, arrays)
    assert_matches(got, want, dtype)
    assert_empty_rows_are_zero(got, want)


DECODE_CASES = [
    # (batch, q_len, heads, kv_heads, head_dim, capacity, page_size, causal, lengths)
    pytest.param(8, 1, 32, 8, 128, 4096, None, True, [0, 1, 127, 128, 129, 2000, 4095, 4096], id="b8-q1-gqa4-d128"),
    pytest.param(2, 4, 8, 1, 64, 1024, None, False, [3, 1000], id="b2-q4-mqa-d64-full"),
    pytest.param(1, 1, 8, 8, 256, 2048, None, True, [1500], id="b1-q1-mha-d256"),
    pytest.param(4, 1, 32, 8, 128, 2496, 64, True, [0, 1, 65, 2496], id="paged64-b4-q1-gqa4-d128"),
    pytest.param(3, 2, 8, 2, 64, 2048, 256, False, [1, 700, 2048], id="paged256-b3-q2-gqa4-d64-full"),
    # 192-key pages: 64-key tiles (gcd(128, 192)), three a page.
    pytest.param(4, 1, 16, 4, 128, 1920, 192, True, [0, 191, 193, 1920], id="paged192-b4-q1-gqa4-d128"),
]


@requires_hopper
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("batch,q_len,heads,kv_heads,head_dim,capacity,page_size,causal,lengths", DECODE_CASES)
def test_decode(key, batch, q_len, heads, kv_heads, head_dim, capacity, page_size, causal, lengths, dtype, assert_close,
                assert_lse_close):
    """decode_attention(backend="mosaic"): the forward kernel on the split cache (a paged one
    through a shuffled page table over a pool with spare pages), against the reference on each
    sequence's valid keys (a q_len-1 query sees all of them; the q_len > 1 cases have no causal
    mask), including lengths 0 and 1 and a full cache."""
    from flashjax import reference

    keys = jax.random.split(key, 4)
    q = jax.random.normal(keys[0], (batch, q_len, heads, head_dim), jnp.float32).astype(dtype)
    k, v = (jax.random.normal(keys[i], (batch, capacity, kv_heads, head_dim), jnp.float32).astype(dtype) for i in (1, 2))
    lengths = jnp.asarray(lengths, jnp.int32)
    k_cache, v_cache, table = k, v, None
    if page_size is not None:
        pages = batch * capacity // page_size
        table = jax.random.permutation(keys[3], pages + 5)[:pages].astype(jnp.int32).reshape(batch, -1)
        pool = lambda x: jnp.zeros((pages + 5, page_size, kv_heads, head_dim), dtype).at[table.reshape(-1)].set(
            x.reshape(pages, page_size, kv_heads, head_dim))
        k_cache, v_cache = pool(k), pool(v)
    got_o, got_lse = flashjax.decode_attention(q, k_cache, v_cache, lengths, page_table=table, causal=causal,
                                               backend="mosaic", return_lse=True)
    up = lambda x: x.astype(jnp.float32)
    want_o, want_lse = reference.attention(up(q), up(k), up(v), kv_lengths=lengths, return_lse=True)
    assert got_o.dtype == dtype and got_o.shape == q.shape
    assert_close(got_o, want_o, dtype, "o")
    assert_lse_close(got_lse, want_lse, dtype)


def test_kernel_bias_folds_the_mask_and_pads():
    """The Hopper kernels' one bias input (on every machine): the mask folded in as -inf, the
    bias in the inputs' dtype, zero-padded to whole tiles."""
    from flashjax.kernels.mosaic import backend as mosaic_backend
    from flashjax.params import Extras

    key = jax.random.PRNGKey(0)
    bias = jax.random.normal(key, (1, 2, 5, 7), jnp.float32)
    mask = jax.random.bernoulli(jax.random.fold_in(key, 1), 0.6, (1, 2, 5, 7))
    for extras, want in [
        (Extras(bias=bias), bias),
        (Extras(mask=mask), jnp.where(mask, 0.0, -jnp.inf)),
        (Extras(bias=bias, mask=mask), jnp.where(mask, bias, -jnp.inf)),
    ]:
        got = mosaic_backend._kernel_bias(extras, BF16, 8, 9)
        assert got.shape == (1, 2, 8, 9) and got.dtype == BF16
        np.testing.assert_array_equal(np.asarray(got[..., :5, :7], np.float32), np.asarray(want.astype(BF16), np.float32))
        assert not np.any(np.asarray(got[..., 5:, :], np.float32)) and not np.any(np.asarray(got[..., 7:], np.float32))
    assert mosaic_backend._kernel_bias(Extras(), BF16, 8, 9) is None


def test_mask_narrows_the_tile_ranges(rng):
    """A boolean mask shared by the heads gives the Hopper kernels the tile ranges its tiles
    allow (computed on every machine): packed documents as a dense mask get the same ranges,
    forward and dK/dV, as the same documents given as segment ids; a per-head mask gets none."""
    from flashjax import masks
    from flashjax.kernels import common
    from flashjax.kernels.mosaic import backend as mosaic_backend
    from flashjax.params import AttentionParams, Extras

    batch, seq, block_q, block_kv = 2, 1000, 64, 128
    params = AttentionParams(scale=0.125, causal=False, backend="mosaic")
    ids = _documents(rng, batch, seq, 5)
    dense = (ids[:, None, :, None] == ids[:, None, None, :])
    q_len, k_len = 1024, 1024
    for by_key_block in (False, True):
        t = mosaic_backend._tiling(params, Extras(mask=dense), seq, seq, block_q, block_kv, 2)
        assert t.ranges
        got = mosaic_backend._optional(Extras(mask=dense), t, batch, seq, seq, q_len, k_len, BF16,
                                       by_key_block=by_key_block).ranges
        padded = common.pad_segment_ids(ids, q_len)
        want = masks.dynamic_ranges(batch=batch, seq_q=seq, seq_k=seq, block_q=block_q, block_k=block_kv,
                                    padded_q=q_len, padded_k=k_len, q_segment_ids=padded, kv_segment_ids=padded,
                                    by_key_block=by_key_block)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    meets, full = mosaic_backend._mask_tile_flags(dense, block_q, block_kv, q_len, k_len)
    tiles = np.zeros((batch, 1, q_len, k_len), bool)
    tiles[..., :seq, :seq] = np.asarray(dense)
    blocks = tiles.reshape(batch, 1, q_len // block_q, block_q, k_len // block_kv, block_kv)
    np.testing.assert_array_equal(np.asarray(meets), blocks.any(axis=(3, 5)))
    assert np.asarray(full).sum() > 0 and not np.any(np.asarray(full) & ~blocks.any(axis=(3, 5)))
    per_head = jnp.broadcast_to(dense, (batch, 3, seq, seq))
    assert not mosaic_backend._has_ranges(Extras(mask=per_head))


def test_bias_gradient_alone(make_inputs, key):
    """The Hopper backward's dbias: the Triton dbias kernel alone (`triton_backend.bias_gradient`,
    interpret mode on the CPU) from the reference's o and lse, against the reference's dbias,
    reduced over the bias's broadcast batch dim, with a mask and rows without keys."""
    from flashjax import reference
    from flashjax.kernels.triton import backend as triton_backend
    from flashjax.params import AttentionParams, Extras

    x = make_inputs(2, 40, 70, 4, 2, 16, dtype=jnp.float32)
    bias = jax.random.normal(key, (1, 4, 40, 70), jnp.float32)
    mask = jax.random.bernoulli(jax.random.fold_in(key, 1), 0.8, (2, 1, 40, 70)).at[:, :, 3].set(False)
    options = dict(causal=True, scale=0.25)
    (o, lse), pullback = jax.vjp(lambda b: reference.attention(x.q, x.k, x.v, bias=b, mask=mask, return_lse=True,
                                                               **options), bias)
    dlse = jnp.where(lse == -jnp.inf, 0.0, x.dlse)
    (want,) = pullback((x.do, dlse))
    params = AttentionParams(scale=0.25, causal=True, backend="mosaic", backward_backend="mosaic",
                             interpret=jax.default_backend() != "gpu")
    got = triton_backend.bias_gradient(x.q, x.k, x.v, o, lse, x.do, dlse, Extras(bias=bias, mask=mask), params)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=2e-5 * float(jnp.abs(want).max()))


def test_float32_is_refused():
    with pytest.raises(NotImplementedError, match="float32"):
        flashjax.flash_attention(*_arrays(jnp.float32), backend="mosaic")


@pytest.mark.skipif(HOPPER, reason="checks the refusal on machines without a Hopper GPU")
def test_needs_hopper():
    with pytest.raises(NotImplementedError, match="sm90"):
        flashjax.flash_attention(*_arrays(), backend="mosaic")

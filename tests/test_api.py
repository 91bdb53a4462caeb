"""`flashjax.flash_attention`'s argument checks and backend choice.

Every bad argument raises a ValueError whose message names the argument; these
checks run before any kernel is traced, so the tests are instant.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from flashjax import api

B, T, H, D = 1, 8, 2, 16


def arrays(q_shape=(B, T, H, D), kv_shape=(B, T, H, D), dtype=jnp.float32, v_shape=None, k_dtype=None, v_dtype=None):
    q = jnp.zeros(q_shape, dtype)
    k = jnp.zeros(kv_shape, k_dtype or dtype)
    v = jnp.zeros(v_shape or kv_shape, v_dtype or dtype)
    return q, k, v


ARRAY_ERRORS = [
    # (q, k, v) factory, a word the message must contain
    pytest.param(lambda: (np.zeros((B, T, H, D)).tolist(), *arrays()[1:]), "q must be an array", id="q-not-array"),
    pytest.param(lambda: arrays(q_shape=(T, H, D)), "q must have rank 4", id="q-rank3"),
    pytest.param(lambda: arrays(q_shape=(1, B, T, H, D)), "q must have rank 4", id="q-rank5"),
    pytest.param(lambda: arrays(kv_shape=(T, H, D)), "k must have rank 4", id="k-rank3"),
    pytest.param(lambda: arrays(v_shape=(B, T, H, D, 1)), "v must have rank 4", id="v-rank5"),
    pytest.param(lambda: arrays(v_shape=(B, T + 1, H, D)), "k and v must have the same shape", id="kv-shape"),
    pytest.param(lambda: arrays(kv_shape=(B + 1, T, H, D)), "batch", id="batch-mismatch"),
    pytest.param(lambda: arrays(kv_shape=(B, T, H, D * 2)), "head_dim", id="head-dim-mismatch"),
    pytest.param(lambda: arrays(q_shape=(B, 0, H, D)), "sequence lengths", id="q-len-0"),
    pytest.param(lambda: arrays(kv_shape=(B, 0, H, D)), "sequence lengths", id="kv-len-0"),
    pytest.param(lambda: arrays(q_shape=(B, T, 3, D), kv_shape=(B, T, 2, D)), "heads", id="heads-not-divisible"),
    pytest.param(lambda: arrays(q_shape=(B, T, 2, D), kv_shape=(B, T, 4, D)), "heads", id="more-kv-heads"),
    pytest.param(lambda: arrays(q_shape=(B, T, H, 0), kv_shape=(B, T, H, 0)), "head_dim", id="head-dim-0"),
    pytest.param(lambda: arrays(q_shape=(B, T, H, 264), kv_shape=(B, T, H, 264)), "head_dim", id="head-dim-264"),
    pytest.param(lambda: arrays(k_dtype=jnp.bfloat16), "dtype", id="dtype-mismatch-k"),
    pytest.param(lambda: arrays(v_dtype=jnp.float16), "dtype", id="dtype-mismatch-v"),
    pytest.param(lambda: arrays(dtype=jnp.int32), "dtype", id="dtype-int32"),
]


@pytest.mark.parametrize("make,message", ARRAY_ERRORS)
def test_bad_arrays(make, message):
    q, k, v = make()
    with pytest.raises(ValueError, match=message):
        flashjax.flash_attention(q, k, v)


OPTION_ERRORS = [
    # (keyword arguments, a word the message must contain)
    pytest.param(dict(scale=0.0), "scale", id="scale-0"),
    pytest.param(dict(scale=-0.5), "scale", id="scale-negative"),
    pytest.param(dict(scale=float("nan")), "scale", id="scale-nan"),
    pytest.param(dict(scale=float("inf")), "scale", id="scale-inf"),
    pytest.param(dict(scale=jnp.float32(0.25)[None]), "scale", id="scale-array"),
    pytest.param(dict(scale=True), "scale", id="scale-bool"),
    pytest.param(dict(scale="0.25"), "scale", id="scale-str"),
    pytest.param(dict(window=3), "window", id="window-int"),
    pytest.param(dict(window=(3,)), "window", id="window-len1"),
    pytest.param(dict(window=(1, 2, 3)), "window", id="window-len3"),
    pytest.param(dict(window=(-1, 0)), "window left", id="window-left-negative"),
    pytest.param(dict(window=(0, -2)), "window right", id="window-right-negative"),
    pytest.param(dict(window=(1.5, 0)), "window left", id="window-float"),
    pytest.param(dict(window=(True, 0)), "window left", id="window-bool"),
    pytest.param(dict(causal=1), "causal", id="causal-int"),
    pytest.param(dict(causal="yes"), "causal", id="causal-str"),
    pytest.param(dict(softcap=0.0), "softcap", id="softcap-0"),
    pytest.param(dict(softcap=-1.0), "softcap", id="softcap-negative"),
    pytest.param(dict(dropout_rate=-0.1), "dropout_rate", id="dropout-negative"),
    pytest.param(dict(dropout_rate=1.0), "dropout_rate", id="dropout-1"),
    pytest.param(dict(dropout_rate=0.1), "dropout_rng", id="dropout-without-rng"),
    pytest.param(dict(backend="cuda"), "backend", id="backend-unknown"),
    pytest.param(dict(backend=None), "backend", id="backend-none"),
    pytest.param(dict(config={"block_q": 64}), "config", id="config-dict"),
    pytest.param(dict(bias=[[0.0]]), "bias", id="bias-not-array"),
    pytest.param(dict(bias=jnp.zeros((1, B, H, T, T))), "bias", id="bias-rank5"),
    pytest.param(dict(bias=jnp.zeros((B, H, T, T + 1))), "bias", id="bias-not-broadcastable"),
    pytest.param(dict(bias=jnp.zeros((T, T), jnp.int32)), "bias", id="bias-int"),
    pytest.param(dict(mask=jnp.ones((T, T), jnp.float32)), "mask", id="mask-float"),
    pytest.param(dict(mask=jnp.ones((3, T, T), bool)), "mask", id="mask-not-broadcastable"),
    pytest.param(dict(segment_ids=(jnp.zeros((B, T), jnp.int32),) * 3), "segment_ids", id="segments-triple"),
    pytest.param(dict(segment_ids=jnp.zeros((B, T + 1), jnp.int32)), "segment_ids", id="segments-shape"),
    pytest.param(dict(segment_ids=jnp.zeros((B, T), jnp.float32)), "segment_ids", id="segments-float"),
    pytest.param(dict(q_lengths=jnp.zeros((B + 1,), jnp.int32)), "q_lengths", id="q-lengths-shape"),
    pytest.param(dict(kv_lengths=jnp.zeros((B,), jnp.float32)), "kv_lengths", id="kv-lengths-float"),
    pytest.param(dict(alibi_slopes=jnp.zeros((H + 1,))), "alibi_slopes", id="alibi-shape"),
]


@pytest.mark.parametrize("kwargs,message", OPTION_ERRORS)
def test_bad_options(kwargs, message):
    q, k, v = arrays()
    with pytest.raises(ValueError, match=message):
        flashjax.flash_attention(q, k, v, **kwargs)


def test_segment_ids_as_one_array_need_equal_lengths():
    q, k, v = arrays(kv_shape=(B, T + 2, H, D))
    with pytest.raises(ValueError, match="segment_ids"):
        flashjax.flash_attention(q, k, v, segment_ids=jnp.zeros((B, T), jnp.int32))


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(block_q=24, block_k=16), "block_q"),
        (dict(block_q=16, block_k=8), "block_k"),
        (dict(block_q=16, block_k=16, num_warps=3), "num_warps"),
        (dict(block_q=16, block_k=16, num_stages=0), "num_stages"),
    ],
)
def test_bad_kernel_config(kwargs, name):
    with pytest.raises(ValueError, match=name):
        flashjax.KernelConfig(**kwargs)


def test_mosaic_not_implemented():
    with pytest.raises(NotImplementedError, match="mosaic"):
        flashjax.flash_attention(*arrays(), backend="mosaic")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_xla_backend_is_the_reference(make_inputs, reference_fwd, assert_close, assert_lse_close, dtype, causal):
    x = make_inputs(2, 20, 24, 4, 2, 32, dtype=dtype)
    o, lse = flashjax.flash_attention(x.q, x.k, x.v, causal=causal, backend="xla", return_lse=True)
    want_o, want_lse = reference_fwd(x.q, x.k, x.v, causal=causal)
    assert o.dtype == jnp.dtype(dtype)
    assert_close(o, want_o, dtype)
    assert_lse_close(lse, want_lse, dtype)


# ---- backend="auto" on the CPU ---------------------------------------------------------
@pytest.fixture
def spies(monkeypatch):
    """Replaces the kernels' entry point and the reference by stubs that record their calls."""
    calls = {"kernels": [], "reference": []}

    def kernels(q, k, v, extras, params):
        calls["kernels"].append(params)
        return jnp.zeros(q.shape, q.dtype), jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)

    def reference(q, k, v, **kwargs):
        calls["reference"].append(kwargs)
        o = jnp.zeros(q.shape, jnp.float32)
        return (o, jnp.zeros((q.shape[0], q.shape[2], q.shape[1]))) if kwargs.get("return_lse") else o

    monkeypatch.setattr(flashjax.autodiff, "attention", kernels)
    monkeypatch.setattr(flashjax.reference, "attention", reference)
    return calls


# The stub of autodiff.attention is read when `api._kernel_attention` is traced; a
# scale used by no other test makes the jit cache miss, so each call below traces.
@pytest.mark.skipif(jax.default_backend() == "gpu", reason="on a GPU, auto always picks the kernels")
@pytest.mark.parametrize(
    "seq,limit,expected",
    [
        pytest.param(16, None, "kernels", id="small-interpret"),
        pytest.param(64, 2 * 64 * 64 - 1, "reference", id="over-limit-reference"),
        pytest.param(64, 2 * 64 * 64, "kernels", id="at-limit-interpret"),
    ],
)
def test_auto_backend_on_cpu(spies, monkeypatch, seq, limit, expected):
    """Without a GPU, auto runs the kernels in interpret mode up to INTERPRET_LIMIT scores (B*H*Tq*Tk)."""
    if limit is not None:
        monkeypatch.setattr(api, "INTERPRET_LIMIT", limit)
    q = jnp.zeros((1, seq, 2, 16), jnp.float32)
    flashjax.flash_attention(q, q, q, scale=0.123456 + seq + (limit or 0), backend="auto")
    assert len(spies[expected]) == 1
    assert len(spies["kernels" if expected == "reference" else "reference"]) == 0
    if expected == "kernels":
        assert spies["kernels"][0].interpret, "off the GPU the kernels must run in interpret mode"


def test_auto_default_limit_sends_large_problems_to_reference(spies):
    q = jnp.zeros((1, 2049, 1, 16), jnp.float32)  # 2049^2 scores > 2^22
    if jax.default_backend() == "gpu":
        pytest.skip("on a GPU, auto always picks the kernels")
    flashjax.flash_attention(q, q, q, backend="auto")
    assert len(spies["reference"]) == 1 and not spies["kernels"]


def test_triton_backend_forced(spies):
    q = jnp.zeros((1, 4096, 2, 16), jnp.float32)  # far over the interpret limit
    flashjax.flash_attention(q, q, q, scale=0.654321, backend="triton")
    assert len(spies["kernels"]) == 1 and not spies["reference"]
    assert spies["kernels"][0].interpret == (jax.default_backend() != "gpu")


def test_xla_backend_forced(spies):
    q = jnp.zeros((1, 16, 2, 16), jnp.float32)
    flashjax.flash_attention(q, q, q, backend="xla")
    assert len(spies["reference"]) == 1 and not spies["kernels"]


# ---- backend="auto" on a GPU: Mosaic on Hopper for what it supports, Triton otherwise ----
@pytest.mark.parametrize(
    "hopper,dtype,options,expected",
    [
        pytest.param(True, jnp.bfloat16, {}, "mosaic", id="hopper-bf16"),
        pytest.param(True, jnp.float16, dict(causal=True), "mosaic", id="hopper-f16-causal"),
        pytest.param(True, jnp.float32, {}, "triton", id="hopper-f32"),
        pytest.param(True, jnp.bfloat16, dict(window=(8, 0)), "triton", id="hopper-window"),
        pytest.param(True, jnp.bfloat16, dict(softcap=30.0), "triton", id="hopper-softcap"),
        pytest.param(False, jnp.bfloat16, {}, "triton", id="other-gpu-bf16"),
    ],
)
def test_auto_backend_on_a_gpu(spies, monkeypatch, hopper, dtype, options, expected):
    monkeypatch.setattr(api, "_platform", lambda: "gpu")
    monkeypatch.setattr(api, "_is_hopper", lambda: hopper)
    api._kernel_attention.clear_cache()  # so that the stub is traced, not a cached kernel call
    q = jnp.zeros((1, 64, 2, 64), dtype)
    flashjax.flash_attention(q, q, q, backend="auto", **options)
    assert [p.backend for p in spies["kernels"]] == [expected]
    assert not spies["kernels"][0].interpret, "on a GPU the kernels are compiled"

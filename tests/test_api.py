"""`flashjax.flash_attention`'s argument checks and backend choice.

Every bad argument raises a ValueError whose message names the argument; these
checks run before any kernel is traced, so the tests are instant.
"""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from flashjax import api, backends
from flashjax.kernels.triton import backend as triton_backend

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
    pytest.param(lambda: arrays(q_shape=(B, T, 0, D)), "query heads", id="no-query-heads"),
    pytest.param(lambda: arrays(q_shape=(B, T, 2, D), kv_shape=(B, T, 4, D)), "heads", id="more-kv-heads"),
    pytest.param(lambda: arrays(q_shape=(B, T, H, 0), kv_shape=(B, T, H, 0)), "head_dim", id="head-dim-0"),
    pytest.param(lambda: arrays(k_dtype=jnp.bfloat16), "dtype", id="dtype-mismatch-k"),
    pytest.param(lambda: arrays(v_dtype=jnp.float16), "dtype", id="dtype-mismatch-v"),
    pytest.param(lambda: arrays(dtype=jnp.int32), "dtype", id="dtype-int32"),
    pytest.param(lambda: arrays(dtype=jnp.float8_e4m3fn), "8-bit floats", id="dtype-float8"),
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
    pytest.param(dict(window=(2**31, 0)), "window left must be at most", id="window-past-int32"),
    pytest.param(dict(window=(0, 10**12)), "window right must be at most", id="window-right-past-int32"),
    pytest.param(dict(causal=1), "causal", id="causal-int"),
    pytest.param(dict(causal="yes"), "causal", id="causal-str"),
    pytest.param(dict(return_lse=1), "return_lse must be a bool", id="return-lse-int"),
    pytest.param(dict(softcap=0.0), "softcap", id="softcap-0"),
    pytest.param(dict(softcap=-1.0), "softcap", id="softcap-negative"),
    pytest.param(dict(dropout_rate=-0.1), "dropout_rate", id="dropout-negative"),
    pytest.param(dict(dropout_rate=1.0), "dropout_rate", id="dropout-1"),
    pytest.param(dict(dropout_rate=0.1), "dropout_rng", id="dropout-without-rng"),
    pytest.param(dict(backend="cuda"), "backend", id="backend-unknown"),
    pytest.param(dict(backend=None), "backend", id="backend-none"),
    pytest.param(dict(config={"block_q": 64}), "config", id="config-dict"),
    pytest.param(dict(softcap=float("inf")), "softcap", id="softcap-inf"),
    pytest.param(dict(softcap=True), "softcap", id="softcap-bool"),
    pytest.param(dict(softcap=jnp.float32(30.0)), "static Python number", id="softcap-array"),
    pytest.param(dict(dropout_rate=jnp.float32(0.1), dropout_rng=jax.random.key(0)), "static Python number",
                 id="dropout-rate-array"),
    pytest.param(dict(dropout_rate=0.1, dropout_rng=0), "dropout_rng", id="dropout-rng-int"),
    pytest.param(dict(dropout_rate=0.1, dropout_rng=jax.random.split(jax.random.key(0), 2)), "dropout_rng",
                 id="dropout-rng-two-keys"),
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
    pytest.param(dict(kv_lengths=[T] * B), r"kv_lengths must be an array .* got a list \(pass jnp.asarray",
                 id="kv-lengths-list"),
    pytest.param(dict(alibi_slopes=jnp.zeros((H + 1,))), "alibi_slopes", id="alibi-shape"),
    pytest.param(dict(alibi_slopes=jnp.ones((H,), jnp.int32)), "alibi_slopes must be a floating", id="alibi-int"),
]


@pytest.mark.parametrize("kwargs,message", OPTION_ERRORS)
def test_bad_options(kwargs, message):
    q, k, v = arrays()
    with pytest.raises(ValueError, match=message):
        flashjax.flash_attention(q, k, v, **kwargs)


def test_empty_batch_runs_on_the_reference():
    """Batch 0 (a shard or a vmapped slice can be empty): `auto` takes the reference, which
    returns the empty output and gradients; the kernels say they cannot run it."""
    q = jnp.ones((0, T, H, D), jnp.float32)
    assert flashjax.explain(q, q, q).backend == "xla"
    assert flashjax.flash_attention(q, q, q, causal=True).shape == q.shape
    assert jax.grad(lambda q: flashjax.flash_attention(q, q, q).sum())(q).shape == q.shape
    with pytest.raises(NotImplementedError, match="empty batch"):
        flashjax.flash_attention(q, q, q, backend="triton")


def test_unsigned_lengths_past_int32_mean_the_whole_sequence():
    """A uint32 length of 2^32 - 1 would wrap to -1 in int32 (every row empty); it clamps
    instead, as any length past the sequence does."""
    q = jax.random.normal(jax.random.key(0), (2, T, H, D), jnp.float32)
    lengths = jnp.array([2**32 - 1, 3], jnp.uint32)
    got = flashjax.flash_attention(q, q, q, kv_lengths=lengths)
    want = flashjax.flash_attention(q, q, q, kv_lengths=jnp.array([T, 3], jnp.int32), backend="xla")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_numpy_64_bit_lengths_and_ids():
    """NumPy int64 lengths past int32 clamp (the whole sequence) rather than wrap to 0, and
    negative ones below int32 stay negative (no key) rather than wrap to a positive length;
    int64 segment ids that int32 cannot hold stay distinct documents (not merged by a
    wrap), eagerly, traced under jit and closed over by a jitted function."""
    q = jax.random.normal(jax.random.key(0), (2, T, H, D), jnp.float32)
    got = flashjax.flash_attention(q, q, q, kv_lengths=np.array([2**33, 3], np.int64))
    want = flashjax.flash_attention(q, q, q, kv_lengths=jnp.array([T, 3], jnp.int32), backend="xla")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    got = flashjax.flash_attention(q, q, q, kv_lengths=np.array([-(2**32) + 5, 3], np.int64))
    want = flashjax.flash_attention(q, q, q, kv_lengths=jnp.array([0, 3], jnp.int32), backend="xla")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    ids = np.zeros((2, T), np.int64)
    ids[:, T // 2:] = 2**32  # the same id as 0 once wrapped to int32
    ids[1, :3] = -(2**40)
    small = np.where(ids == 2**32, 2, np.where(ids == 0, 1, 0)).astype(np.int32)  # the same documents
    want = flashjax.flash_attention(q, q, q, segment_ids=jnp.asarray(small), backend="xla")
    got = flashjax.flash_attention(q, q, q, segment_ids=ids)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    with jax.enable_x64(True):  # the same ids as a JAX array, eager and traced
        for fn in (flashjax.flash_attention, jax.jit(flashjax.flash_attention)):
            got = fn(q, q, q, segment_ids=jnp.asarray(ids))
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
        # Concrete ids closed over by a jitted function (checked in NumPy, not traced there).
        closed = jnp.asarray(ids)
        got = jax.jit(lambda q: flashjax.flash_attention(q, q, q, segment_ids=closed))(q)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
        kv_ids = np.where(ids < 0, 2**41, ids)  # a q/kv pair, ranked together: a kv-only document
        got = jax.jit(lambda q, s: flashjax.flash_attention(q, q, q, segment_ids=s))(q, (jnp.asarray(ids), jnp.asarray(kv_ids)))
        want_pair = flashjax.flash_attention(q, q, q, segment_ids=(jnp.asarray(small), jnp.asarray(
            np.where(ids < 0, 3, small))), backend="xla")
        np.testing.assert_allclose(np.asarray(got), np.asarray(want_pair), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["triton", "xla"])
@pytest.mark.parametrize("seq_q, seq_k", [(9, 5), (5, 9)])
def test_window_sides_past_every_key_are_unbounded(backend, seq_q, seq_k):
    """A window side of 2**31 - 1 (a common way to write "unbounded") is the side None, for
    Tq > Tk and Tq < Tk (it must never enter the int32 position arithmetic)."""
    key = jax.random.key(1)
    q = jax.random.normal(key, (1, seq_q, 2, 16), jnp.float32)
    k = v = jax.random.normal(jax.random.fold_in(key, 1), (1, seq_k, 2, 16), jnp.float32)
    big = 2**31 - 1
    for window, same in (((None, big), None), ((big, big), None), ((3, big), (3, None)), ((big, 0), (None, 0))):
        got = flashjax.flash_attention(q, k, v, window=window, backend=backend)
        want = flashjax.flash_attention(q, k, v, window=same, backend="xla")
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6, err_msg=str(window))


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


@pytest.mark.parametrize("make, error, field", [
    (lambda: flashjax.KernelConfig(64.0, 64), TypeError, "KernelConfig.block_q must be an int"),
    (lambda: flashjax.KernelConfig(64, 64, num_stages=2.5), TypeError, "KernelConfig.num_stages must be an int"),
    (lambda: flashjax.KernelConfig(64, 64, num_warps=64), ValueError, "KernelConfig.num_warps must be a power of two up to 32"),
    (lambda: flashjax.MosaicConfig(block_q=64.0), TypeError, "MosaicConfig.block_q must be an int"),
    (lambda: flashjax.MosaicConfig(stages=True), TypeError, "MosaicConfig.stages must be an int"),
    (lambda: flashjax.MosaicConfig(block_kv=320), ValueError, "MosaicConfig.block_kv must be a multiple of 64 from 64 to 256"),
    (lambda: flashjax.DecodeConfig(block_k="64"), TypeError, "DecodeConfig.block_k must be an int"),
    (lambda: flashjax.DecodeConfig(num_warps=64), ValueError, "DecodeConfig.num_warps must be None or a power of two up to 32"),
    (lambda: flashjax.TritonConfig(None, None, None), TypeError, "TritonConfig.fwd must be a KernelConfig"),
])
def test_config_fields_are_checked_by_name(make, error, field):
    """Every config field is checked when the config is built, the error naming the field:
    a float, bool or string where an int goes, a Hopper tile past wgmma's and TMA's 256, more
    than 32 warps (they failed inside Pallas, Mosaic GPU or Triton, or with an operator error)."""
    with pytest.raises(error, match=field):
        make()


def test_configs_take_numpy_integers():
    """NumPy integers (from a sweep's arrays) are ints: converted, so that the kernels see
    Python ints (a NumPy int reached Pallas as a dynamic grid bound)."""
    config = flashjax.KernelConfig(np.int64(64), np.int32(32), num_warps=np.int64(4))
    assert (config.block_q, config.block_k, config.num_warps) == (64, 32, 4)
    assert all(type(getattr(config, f)) is int for f in ("block_q", "block_k", "num_warps", "num_stages"))
    assert type(flashjax.MosaicConfig(block_q=np.int64(128)).block_q) is int
    assert type(flashjax.DecodeConfig(block_k=np.int16(64)).block_k) is int
    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 40, 2, 16)), jnp.float32)
    config = flashjax.TritonConfig(*(flashjax.KernelConfig(np.int64(16), np.int64(16)) for _ in range(3)))
    np.testing.assert_allclose(flashjax.flash_attention(q, q, q, backend="triton", config=config),
                               flashjax.flash_attention(q, q, q, backend="xla"), rtol=1e-5, atol=1e-5)


def test_mosaic_not_implemented():
    with pytest.raises(NotImplementedError, match="mosaic"):
        flashjax.flash_attention(*arrays(), backend="mosaic")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_xla_backend_is_the_reference(make_inputs, reference_fwd, assert_close, assert_lse_close, dtype, causal):
    """backend="xla" is the reference, wired through the API (its dtype, lse and options); the
    reference's mathematics is tested against NumPy in tests/test_reference.py."""
    x = make_inputs(2, 20, 24, 4, 2, 32, dtype=dtype)
    o, lse = flashjax.flash_attention(x.q, x.k, x.v, causal=causal, backend="xla", return_lse=True)
    want_o, want_lse = reference_fwd(x.q, x.k, x.v, causal=causal)
    assert o.dtype == jnp.dtype(dtype)
    assert_close(o, want_o, dtype)
    assert_lse_close(lse, want_lse, dtype)


# ---- the backend registry: what auto picks, on this machine and on a stubbed GPU ----------
@pytest.fixture
def spies(monkeypatch):
    """Replaces the backends' forward by stubs that record which backend ran, with what params."""
    calls = []

    def stub(name):
        def forward(q, k, v, extras, params, config):
            calls.append((name, params))
            return jnp.zeros(q.shape, q.dtype), jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)

        return forward

    stubs = {name: dataclasses.replace(backends.get(name), forward=stub(name)) for name in backends.names()}
    monkeypatch.setattr(backends, "get", stubs.__getitem__)
    api._attention.clear_cache()  # so that the stubs are traced, not a cached kernel call
    yield calls
    api._attention.clear_cache()


def on_device(monkeypatch, platform, capability=""):
    monkeypatch.setattr(backends, "describe_device", lambda: (platform, capability))


@pytest.mark.parametrize(
    "seq,limit,expected",
    [
        pytest.param(16, None, "triton", id="small-interpret"),
        pytest.param(64, 2 * 64 * 64 - 1, "xla", id="over-limit-reference"),
        pytest.param(64, 2 * 64 * 64, "triton", id="at-limit-interpret"),
    ],
)
def test_auto_without_a_gpu(spies, monkeypatch, seq, limit, expected):
    """Without a GPU, auto runs the Triton kernels in interpret mode up to INTERPRET_LIMIT
    scores (B*H*Tq*Tk) and the reference beyond; explain says why."""
    on_device(monkeypatch, "cpu")
    if limit is not None:
        monkeypatch.setattr(triton_backend, "INTERPRET_LIMIT", limit)
    q = jnp.zeros((1, seq, 2, 16), jnp.float32)
    flashjax.flash_attention(q, q, q, backend="auto")
    assert [name for name, _ in spies] == [expected]
    if expected == "triton":
        assert spies[0][1].interpret, "off the GPU the kernels must run in interpret mode"
    else:
        (passed, reasons), = flashjax.explain(q, q, q).passed
        assert passed == "triton" and "interpret" in reasons[0]


def test_auto_default_limit_sends_large_problems_to_reference(spies, monkeypatch):
    on_device(monkeypatch, "cpu")
    q = jnp.zeros((1, 2049, 1, 16), jnp.float32)  # 2049^2 scores > 2^22
    flashjax.flash_attention(q, q, q, backend="auto")
    assert [name for name, _ in spies] == ["xla"]


def test_triton_backend_forced(spies):
    q = jnp.zeros((1, 4096, 2, 16), jnp.float32)  # far over the interpret limit
    flashjax.flash_attention(q, q, q, backend="triton")
    assert [name for name, _ in spies] == ["triton"]
    assert spies[0][1].interpret == (jax.default_backend() != "gpu")


def test_xla_backend_forced(spies):
    q = jnp.zeros((1, 16, 2, 16), jnp.float32)
    flashjax.flash_attention(q, q, q, backend="xla")
    assert [name for name, _ in spies] == ["xla"]


@pytest.mark.parametrize(
    "capability,dtype,head_dim,options,forward,backward",
    [
        pytest.param("9.0", jnp.bfloat16, 64, {}, "mosaic", "mosaic", id="hopper-bf16"),
        pytest.param("9.0", jnp.float16, 64, dict(causal=True), "mosaic", "mosaic", id="hopper-f16-causal"),
        pytest.param("9.0", jnp.bfloat16, 256, {}, "mosaic", "mosaic", id="hopper-d256"),
        pytest.param("9.0", jnp.float32, 64, {}, "triton", "triton", id="hopper-f32"),
        pytest.param("9.0", jnp.bfloat16, 64, dict(window=(8, 0)), "mosaic", "mosaic", id="hopper-window"),
        pytest.param("9.0", jnp.bfloat16, 64, dict(softcap=30.0), "mosaic", "mosaic", id="hopper-softcap"),
        pytest.param("8.0", jnp.bfloat16, 64, {}, "triton", "triton", id="other-gpu-bf16"),
        pytest.param("9.0", jnp.float64, 64, {}, "xla", "xla", id="hopper-f64-reference"),
    ],
)
def test_auto_on_a_gpu(spies, monkeypatch, capability, dtype, head_dim, options, forward, backward):
    """On a GPU: the Hopper kernels on sm90 for what they support, Triton otherwise, the
    reference for what no kernel takes."""
    on_device(monkeypatch, "gpu", capability)
    with jax.enable_x64(dtype == jnp.float64):
        q = jnp.zeros((1, 64, 2, head_dim), dtype)
        choice = flashjax.explain(q, q, q, **options)
        assert (choice.backend, choice.backward_backend) == (forward, backward)
        flashjax.flash_attention(q, q, q, backend="auto", **options)
    assert [name for name, _ in spies] == [forward]
    params = spies[0][1]
    assert (params.backend, params.backward_backend) == (forward, backward)
    assert not params.interpret, "on a GPU the kernels are compiled"


def test_backward_moves_when_the_forward_backend_has_none(monkeypatch):
    """A backend that runs a call's forward but not its backward (`supports_backward` gives
    reasons): the backward goes to the next backend that can, and the choice says why."""
    on_device(monkeypatch, "gpu", "9.0")
    registered = backends.get
    forward_only = dataclasses.replace(registered("mosaic"), supports_backward=lambda call: ["no backward here"])
    monkeypatch.setattr(backends, "get", lambda name: forward_only if name == "mosaic" else registered(name))
    q = jax.ShapeDtypeStruct((1, 64, 2, 64), jnp.bfloat16)
    choice = flashjax.explain(q, q, q)
    assert (choice.backend, choice.backward_backend) == ("mosaic", "triton"), choice
    assert ("mosaic", ("no backward here",)) in choice.backward_passed


def test_explain_names_what_excluded_the_faster_backends(monkeypatch):
    on_device(monkeypatch, "gpu", "9.0")
    q = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
    choice = flashjax.explain(q, q, q, mask=jnp.ones((1, 64), bool), bias=jnp.zeros((64, 64), jnp.float32))
    assert choice.backend == "triton"
    (name, reasons), = choice.passed
    assert name == "mosaic" and any("mask" in r for r in reasons) and any("bias" in r for r in reasons)
    text = str(choice)
    assert "forward: triton" in text and "not mosaic" in text and "mask" in text


def test_explain_takes_shapes_only():
    q = jax.ShapeDtypeStruct((2, 128, 4, 64), jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((1, 4, 128, 128), jnp.float32)
    choice = flashjax.explain(q, q, q, bias=bias, causal=True)
    assert choice.backend in backends.names()
    # A keyword flash_attention does not take is refused by name, as flash_attention refuses it.
    with pytest.raises(TypeError, match=r"explain\(\) got an unexpected keyword argument 'is_causal'"):
        flashjax.explain(q, q, q, is_causal=True)
    # NumPy scalars are static options, as flash_attention takes them.
    numpy_options = dict(scale=np.float32(0.5), causal=np.bool_(True), window=(np.int64(4), np.int64(0)),
                         softcap=np.float64(30.0))
    assert flashjax.explain(q, q, q, **numpy_options).backend in backends.names()
    # A traced flag cannot choose the program: refused by name.
    with pytest.raises(ValueError, match="return_lse must be a bool"):
        jax.jit(lambda q, flag: flashjax.flash_attention(q, q, q, return_lse=flag))(jnp.zeros((1, 8, 1, 8)), True)


def test_a_named_backend_that_cannot_run_the_call_says_why_in_one_sentence():
    q = jnp.zeros((1, 16, 2, 16), jnp.float32)
    with pytest.raises(NotImplementedError) as raised:
        flashjax.flash_attention(q, q, q, score_mod=lambda s, b, h, i, j: s + jnp.sum(q), backend="triton")
    assert "close over them. Use backend='auto'" in str(raised.value) and ".." not in str(raised.value)


def test_config_selects_its_backend(spies, monkeypatch):
    on_device(monkeypatch, "gpu", "9.0")
    q = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
    tiles = flashjax.KernelConfig(16, 16)
    flashjax.flash_attention(q, q, q, config=flashjax.TritonConfig(tiles, tiles, tiles))
    assert [name for name, _ in spies] == ["triton"]
    with pytest.raises(ValueError, match="MosaicConfig"):
        flashjax.flash_attention(q, q, q, backend="triton", config=flashjax.MosaicConfig())
    with pytest.raises(ValueError, match="config"):
        flashjax.flash_attention(q, q, q, config={"block_q": 64})


def test_forced_backend_lists_its_reasons(monkeypatch):
    on_device(monkeypatch, "cpu")
    q = jnp.zeros((1, 16, 2, 64), jnp.float32)
    with pytest.raises(NotImplementedError, match="sm90.*float32"):
        flashjax.flash_attention(q, q, q, backend="mosaic")
    # A config with backend="auto" selected the backend: the message says to drop the config.
    with pytest.raises(NotImplementedError, match=r"The config \(MosaicConfig\) selected that backend"):
        flashjax.explain(q, q, q, config=flashjax.MosaicConfig())
    with pytest.raises(NotImplementedError, match="Use backend='auto'"):
        flashjax.explain(q, q, q, backend="mosaic", config=flashjax.MosaicConfig())


@pytest.mark.parametrize("dtype", ["float64", "complex64"])
def test_dtypes_no_kernel_takes_run_on_the_reference(dtype):
    """auto never raises where the reference works: float64 (under x64) and complex inputs run
    the reference in that dtype, and explain says why; a named kernel backend still raises."""
    with jax.enable_x64(dtype == "float64"):
        rng = np.random.default_rng(0)
        draw = lambda *shape: rng.standard_normal(shape) + (1j * rng.standard_normal(shape) if dtype == "complex64" else 0)
        q, k, v = (jnp.asarray(draw(1, 12, 2, 8), dtype) for _ in range(3))
        out = flashjax.flash_attention(q, k, v, causal=True)
        assert out.dtype == jnp.dtype(dtype)
        want = flashjax.reference.attention(q, k, v, causal=True)
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-12 if dtype == "float64" else 1e-6)
        choice = flashjax.explain(q, k, v, causal=True)
        assert choice.backend == "xla"
        assert any(dtype in reason for _, reasons in choice.passed for reason in reasons)
        with pytest.raises(NotImplementedError, match=dtype):
            flashjax.flash_attention(q, k, v, backend="triton")
        grads = jax.grad(lambda q: jnp.sum(jnp.abs(flashjax.flash_attention(q, k, v)) ** 2))(q)
        assert grads.dtype == jnp.dtype(dtype) and bool(jnp.all(jnp.isfinite(grads)))
        if dtype == "float64":  # ALiBi's slopes too stay in float64 (not rounded to float32)
            slopes = jnp.asarray(rng.uniform(0.1, 1.0, 2) / 3, jnp.float64)
            out = flashjax.flash_attention(q, k, v, causal=True, alibi_slopes=slopes)
            want = flashjax.reference.attention(q, k, v, causal=True, alibi_slopes=slopes)
            np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-12)


def test_first_interpret_call_does_not_retrace_the_callers_jit():
    """Without a GPU the kernels run in Pallas interpret mode, whose first lowering imports
    modules that register a JAX config option (a new jit cache key). flashjax imports them
    first: a fresh process's jitted step is traced once across calls."""
    import subprocess
    import sys

    program = """
import jax, jax.numpy as jnp, flashjax
traces = []
@jax.jit
def step(q):
    traces.append(1)
    return flashjax.flash_attention(q, q, q, causal=True, backend="triton")
for i in range(3):
    step(jax.random.normal(jax.random.key(i), (1, 16, 2, 16))).block_until_ready()
assert len(traces) == 1, traces
"""
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stderr[-3000:]

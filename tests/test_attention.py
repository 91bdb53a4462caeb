"""Forward pass of the Triton kernels (interpret mode on the CPU): output and lse vs the oracle.

Every new shape costs a compilation (~0.5-1 s on the CPU), so the shapes below are
a representative set, not a cross-product: each covers one property (a length of
1, odd lengths that are not multiples of any tile, Tq < Tk and Tq > Tk, the GQA
ratios 1, 2 and 4/MQA, head dims 16..256 including ones padded to a power of
two), crossed with causal or not and with two or three of the dtypes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
DTYPES = [F32, BF16, F16]
DTYPE_IDS = {F32: "f32", BF16: "bf16", F16: "f16"}

SHAPES = {
    # id: (batch, seq_q, seq_k, heads, kv_heads, head_dim), dtypes to try
    "len1": ((2, 1, 1, 2, 2, 64), (F32, BF16)),
    "T17-gqa2": ((1, 17, 17, 4, 2, 32), (F32, BF16, F16)),
    "T130-mqa": ((1, 130, 130, 4, 1, 64), (F32, BF16, F16)),
    "T257-d16": ((2, 257, 257, 2, 2, 16), (F32, BF16)),
    "q17<k130": ((1, 17, 130, 4, 4, 64), (F32, BF16, F16)),
    "q130>k17-mqa": ((1, 130, 17, 4, 1, 64), (F32, BF16)),
    "decode-q1-k257": ((1, 1, 257, 4, 2, 128), (F32, BF16)),
    "d128": ((1, 64, 64, 2, 2, 128), (F32, BF16, F16)),
    "d96": ((1, 33, 40, 2, 1, 96), (F32, BF16)),
    "d256": ((1, 20, 24, 2, 1, 256), (F32, BF16, F16)),
    "d40": ((1, 19, 19, 2, 2, 40), (F32, BF16)),
}
CASES = [
    pytest.param(shape, dtype, id=f"{name}-{DTYPE_IDS[dtype]}")
    for name, (shape, dtypes) in SHAPES.items()
    for dtype in dtypes
]


def flash(x, **kwargs):
    return flashjax.flash_attention(x.q, x.k, x.v, backend="triton", return_lse=True, **kwargs)


def check_forward(x, dtype, reference_fwd, assert_close, assert_lse_close, config=None, **kwargs):
    """Runs the kernels, checks dtypes, shapes, rows without keys, and values vs the oracle."""
    o, lse = flash(x, config=config, **kwargs)
    want_o, want_lse = reference_fwd(x.q, x.k, x.v, **kwargs)
    batch, seq_q, heads, _ = x.q.shape
    assert o.dtype == jnp.dtype(dtype) and o.shape == x.q.shape
    assert lse.dtype == jnp.float32 and lse.shape == (batch, heads, seq_q)
    assert_close(o, want_o, dtype, "o")
    assert_lse_close(lse, want_lse, dtype)
    # Rows that see no key are exactly 0 (not NaN, not a uniform average).
    empty = np.asarray(want_lse) == -np.inf  # [B, H, Tq]
    if empty.any():
        rows = np.asarray(o).astype(np.float32).swapaxes(1, 2)[empty]
        assert np.all(rows == 0.0), "rows without keys must output 0"
    return o, lse


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape,dtype", CASES)
def test_forward(make_inputs, reference_fwd, assert_close, assert_lse_close, shape, dtype, causal):
    x = make_inputs(*shape, dtype=dtype)
    check_forward(x, dtype, reference_fwd, assert_close, assert_lse_close, causal=causal)


def test_causal_rows_without_keys(make_inputs, reference_fwd, assert_close, assert_lse_close):
    """Causal with Tq > Tk: query i sees keys j <= i - (Tq - Tk); the first Tq - Tk rows see none."""
    seq_q, seq_k = 130, 17
    x = make_inputs(1, seq_q, seq_k, 2, 2, 32, dtype=jnp.bfloat16)
    o, lse = check_forward(x, jnp.bfloat16, reference_fwd, assert_close, assert_lse_close, causal=True)
    empty = seq_q - seq_k
    assert np.all(np.asarray(o[:, :empty]).astype(np.float32) == 0.0)
    assert np.all(np.asarray(lse[:, :, :empty]) == -np.inf)
    assert np.all(np.isfinite(np.asarray(lse[:, :, empty:])))


WINDOWS = [
    # (seq_q, seq_k, window, causal)
    pytest.param(130, 130, (None, 0), False, id="none-0"),  # causal spelled as a window
    pytest.param(150, 70, (None, 0), False, id="q>k-none-0"),
    pytest.param(130, 130, (0, 0), False, id="0-0-diagonal"),
    pytest.param(150, 70, (0, 0), False, id="q>k-diagonal-empty-rows"),
    pytest.param(130, 130, (5, 3), False, id="5-3"),
    pytest.param(70, 150, (5, 3), False, id="q<k-5-3"),
    pytest.param(130, 130, (40, None), False, id="40-none"),
    pytest.param(150, 70, (40, None), False, id="q>k-40-none"),
    pytest.param(70, 150, (33, 0), False, id="q<k-33-0"),
    pytest.param(130, 130, (33, None), True, id="33-none-causal"),
    pytest.param(150, 70, (7, 20), True, id="q>k-7-20-causal"),  # causal clips the right side to 0
    pytest.param(70, 150, (None, 50), True, id="q<k-none-50-causal"),
]


@pytest.mark.parametrize("seq_q,seq_k,window,causal", WINDOWS)
def test_window(make_inputs, reference_fwd, assert_close, assert_lse_close, seq_q, seq_k, window, causal):
    x = make_inputs(1, seq_q, seq_k, 2, 1, 32)
    check_forward(x, jnp.float32, reference_fwd, assert_close, assert_lse_close, window=window, causal=causal)


@pytest.mark.parametrize("window", [None, (16, 0)], ids=["no-window", "window"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_large_logits(make_inputs, reference_fwd, assert_close, assert_lse_close, dtype, window):
    """q * 30: logits of several hundred; the online softmax must rescale, not overflow."""
    x = make_inputs(1, 130, 130, 2, 2, 64, dtype=dtype, q_scale=30.0)
    o, lse = check_forward(x, dtype, reference_fwd, assert_close, assert_lse_close, causal=True, window=window)
    assert float(jnp.max(lse)) > 50.0  # the test really exercises large logits


@pytest.mark.parametrize("scale", [0.05, 1.0])
def test_custom_scale(make_inputs, reference_fwd, assert_close, assert_lse_close, scale):
    x = make_inputs(1, 40, 40, 2, 2, 32)
    check_forward(x, jnp.float32, reference_fwd, assert_close, assert_lse_close, scale=scale, causal=True)


def test_jit(make_inputs, reference_fwd, assert_close):
    x = make_inputs(2, 33, 33, 2, 1, 32, dtype=jnp.bfloat16)
    f = jax.jit(lambda q, k, v: flashjax.flash_attention(q, k, v, causal=True, backend="triton"))
    want, _ = reference_fwd(x.q, x.k, x.v, causal=True)
    assert_close(f(x.q, x.k, x.v), want, jnp.bfloat16)


def test_vmap(make_inputs, reference_fwd, assert_close, assert_lse_close):
    """An extra leading batch dimension through jax.vmap (the rank-4 API is vmapped, not widened)."""
    x = make_inputs(3, 33, 40, 4, 2, 32)
    add_dim = lambda a: a.reshape(3, 1, *a.shape[1:])
    f = jax.vmap(lambda q, k, v: flashjax.flash_attention(q, k, v, causal=True, backend="triton", return_lse=True))
    o, lse = f(add_dim(x.q), add_dim(x.k), add_dim(x.v))
    want_o, want_lse = reference_fwd(x.q, x.k, x.v, causal=True)
    assert_close(o.reshape(x.q.shape), want_o, jnp.float32)
    assert_lse_close(lse.reshape(want_lse.shape), want_lse, jnp.float32)


def test_explicit_config(make_inputs, reference_fwd, assert_close, assert_lse_close):
    """A user TritonConfig with small tiles: many tiles per row, so the online-softmax rescaling runs often."""
    tiles = flashjax.KernelConfig(block_q=16, block_k=16, num_warps=4, num_stages=2)
    config = flashjax.TritonConfig(fwd=tiles, dkv=tiles, dq=tiles)
    x = make_inputs(1, 100, 100, 2, 2, 32)
    check_forward(x, jnp.float32, reference_fwd, assert_close, assert_lse_close, causal=True, config=config)

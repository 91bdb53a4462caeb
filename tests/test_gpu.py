"""The compiled Triton kernels on a CUDA GPU at realistic sizes (skipped on the CPU).

Run on the GPU machine with ``pytest -m gpu`` or ``pytest tests/test_gpu.py``.
The CPU suite checks the same kernels in interpret mode at small sizes; these
cases add what only the real compilation shows: the tuned tiles (128-row blocks,
several pipeline stages), long rows where the online softmax rescales many times,
and lengths that leave a partial last tile. Speed is not tested here: the
benchmarks measure it.
"""

import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning"),
]

BF16 = jnp.bfloat16

CASES = [
    # (batch, seq_q, seq_k, heads, kv_heads, head_dim)
    pytest.param((2, 1024, 1024, 8, 8, 64), id="T1024-d64"),
    pytest.param((2, 1024, 1024, 8, 8, 128), id="T1024-d128"),
    pytest.param((2, 2047, 2047, 8, 8, 64), id="T2047-d64"),
    pytest.param((2, 2047, 2047, 8, 2, 128), id="T2047-d128-gqa4"),
    pytest.param((2, 1024, 1024, 8, 1, 128), id="T1024-d128-mqa"),
    pytest.param((2, 1000, 2047, 8, 4, 128), id="q1000<k2047-gqa2"),
    pytest.param((2, 2047, 1000, 8, 8, 64), id="q2047>k1000"),
    pytest.param((2, 512, 512, 8, 8, 256), id="T512-d256"),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", CASES)
def test_bf16_forward_and_grads(make_inputs, kernel_vjp, reference_vjp, assert_result_close, shape, causal):
    x = make_inputs(*shape, dtype=BF16)
    got = kernel_vjp(x.q, x.k, x.v, x.do, x.dlse, causal=causal)
    want = reference_vjp(x.q, x.k, x.v, x.do, x.dlse, causal=causal)
    assert_result_close(got, want, BF16)


@pytest.mark.parametrize(
    "dtype,window,causal",
    [
        pytest.param(jnp.float16, None, True, id="f16-causal"),
        pytest.param(jnp.float32, None, False, id="f32"),
        pytest.param(BF16, (256, 0), False, id="bf16-window-256-0"),
        pytest.param(BF16, (128, 128), True, id="bf16-window-128-128-causal"),
    ],
)
def test_other_dtypes_and_windows(make_inputs, kernel_vjp, reference_vjp, assert_result_close, dtype, window, causal):
    x = make_inputs(2, 1024, 1024, 8, 4, 128, dtype=dtype)
    got = kernel_vjp(x.q, x.k, x.v, x.do, x.dlse, causal=causal, window=window)
    want = reference_vjp(x.q, x.k, x.v, x.do, x.dlse, causal=causal, window=window)
    assert_result_close(got, want, dtype)


def test_large_logits(make_inputs, kernel_vjp, reference_vjp, assert_result_close):
    x = make_inputs(2, 1024, 1024, 8, 8, 128, dtype=BF16, q_scale=30.0)
    got = kernel_vjp(x.q, x.k, x.v, x.do, x.dlse, causal=True)
    want = reference_vjp(x.q, x.k, x.v, x.do, x.dlse, causal=True)
    assert_result_close(got, want, BF16)


@pytest.mark.parametrize("q_scale", [1e8, 1e20], ids=["logits-5e8", "logits-5e20"])
def test_logit_range(make_inputs, kernel_vjp, reference_vjp, assert_huge_logits_result, q_scale):
    """The compiled Triton kernels at logits far past the Hopper kernels' range (README,
    Precision): o and lse at the reference's, gradients finite."""
    x = make_inputs(1, 256, 256, 2, 2, 128, dtype=BF16, q_scale=q_scale)
    got = kernel_vjp(x.q, x.k, x.v, x.do, None, causal=True)
    want = reference_vjp(x.q, x.k, x.v, x.do, None, causal=True)
    assert_huge_logits_result(got, want, BF16, q_scale)


def test_deterministic_gradients(make_inputs, kernel_vjp):
    """On the GPU too: no atomics, so two backward passes are bitwise equal."""
    x = make_inputs(2, 2047, 2047, 8, 2, 128, dtype=BF16)
    first = kernel_vjp(x.q, x.k, x.v, x.do, x.dlse, causal=True)
    second = kernel_vjp(x.q, x.k, x.v, x.do, x.dlse, causal=True)
    for name in first._fields:
        np.testing.assert_array_equal(
            np.asarray(getattr(first, name), np.float32), np.asarray(getattr(second, name), np.float32), err_msg=name
        )

"""Backward pass of the Triton kernels (interpret mode on the CPU): dq, dk, dv vs the oracle.

Gradients are taken with `jax.vjp` and random cotangents for the output, for the
lse (which is differentiable: ring attention merges partial results through it),
or both. Each shape compiles a forward and two backward kernels (~2 s on the
CPU), so dtypes are crossed with a subset of the shapes only.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
DTYPE_IDS = {F32: "f32", BF16: "bf16", F16: "f16"}

SHAPES = {
    # id: (batch, seq_q, seq_k, heads, kv_heads, head_dim), dtypes to try
    "len1": ((2, 1, 1, 2, 2, 64), (F32, BF16)),
    "T17-gqa2": ((1, 17, 17, 4, 2, 32), (F32, BF16, F16)),
    "T130-mqa": ((1, 130, 130, 4, 1, 64), (F32, BF16, F16)),
    "T257-d16": ((2, 257, 257, 2, 2, 16), (F32, BF16)),
    "q17<k130": ((1, 17, 130, 4, 4, 64), (F32, BF16)),
    "q130>k17-mqa": ((1, 130, 17, 4, 1, 64), (F32, BF16, F16)),
    "decode-q1-k257": ((1, 1, 257, 4, 2, 128), (F32, BF16)),
    "d128": ((1, 64, 64, 2, 2, 128), (F32, BF16)),
    "d96": ((1, 33, 40, 2, 1, 96), (F32, BF16)),
    "d256": ((1, 20, 24, 2, 1, 256), (F32, BF16)),
    "d40": ((1, 19, 19, 2, 2, 40), (F32,)),
}
CASES = [
    pytest.param(shape, dtype, id=f"{name}-{DTYPE_IDS[dtype]}")
    for name, (shape, dtypes) in SHAPES.items()
    for dtype in dtypes
]


def check_empty_rows(got, want):
    """Rows that see no key (lse = -inf): output 0, dq 0; and no NaN anywhere."""
    for name, value in got._asdict().items():
        assert not np.any(np.isnan(np.asarray(value, np.float32))), f"{name}: NaN"
    empty = np.asarray(want.lse) == -np.inf  # [B, H, Tq]
    if empty.any():
        for name in ("o", "dq"):
            rows = np.asarray(getattr(got, name)).astype(np.float32).swapaxes(1, 2)[empty]
            assert np.all(rows == 0.0), f"{name}: rows without keys must be 0"


def check_grads(x, dtype, kernel_vjp, reference_vjp, assert_result_close, *, do=True, dlse=False, **kwargs):
    do = x.do if do else None
    dlse = x.dlse if dlse else None
    got = kernel_vjp(x.q, x.k, x.v, do, dlse, **kwargs)
    want = reference_vjp(x.q, x.k, x.v, do, dlse, **kwargs)
    for name in ("dq", "dk", "dv"):
        assert getattr(got, name).dtype == jnp.dtype(dtype), f"{name} must have the input dtype"
    assert_result_close(got, want, dtype)
    check_empty_rows(got, want)
    return got, want


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape,dtype", CASES)
def test_grads(make_inputs, kernel_vjp, reference_vjp, assert_result_close, shape, dtype, causal):
    x = make_inputs(*shape, dtype=dtype)
    check_grads(x, dtype, kernel_vjp, reference_vjp, assert_result_close, causal=causal)


@pytest.mark.parametrize("do,dlse", [(False, True), (True, True)], ids=["lse-only", "o-and-lse"])
@pytest.mark.parametrize(
    "shape,dtype,causal",
    [
        pytest.param((1, 130, 130, 4, 2, 64), F32, False, id="gqa2-f32"),
        pytest.param((1, 130, 17, 2, 1, 32), F32, True, id="q>k-causal-empty-rows-f32"),
        pytest.param((1, 33, 130, 4, 1, 64), BF16, True, id="q<k-causal-mqa-bf16"),
    ],
)
def test_lse_cotangent(make_inputs, kernel_vjp, reference_vjp, assert_result_close, shape, dtype, causal, do, dlse):
    """The lse is differentiable: d lse / d s = softmax, added to the backward through delta."""
    x = make_inputs(*shape, dtype=dtype)
    check_grads(x, dtype, kernel_vjp, reference_vjp, assert_result_close, do=do, dlse=dlse, causal=causal)


@pytest.mark.parametrize(
    "seq_q,seq_k,window,causal",
    [
        pytest.param(130, 130, (None, 0), False, id="none-0"),
        pytest.param(130, 130, (5, 3), False, id="5-3"),
        pytest.param(70, 150, (33, None), True, id="q<k-33-none-causal"),
        pytest.param(150, 70, (0, 0), False, id="q>k-diagonal-empty-rows"),
        pytest.param(150, 70, (20, 40), True, id="q>k-20-40-causal"),
    ],
)
def test_window_grads(make_inputs, kernel_vjp, reference_vjp, assert_result_close, seq_q, seq_k, window, causal):
    x = make_inputs(1, seq_q, seq_k, 2, 1, 32)
    check_grads(x, F32, kernel_vjp, reference_vjp, assert_result_close, dlse=True, window=window, causal=causal)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_large_logits_grads(make_inputs, kernel_vjp, reference_vjp, assert_result_close, dtype):
    """q * 30: nearly one-hot rows; the backward's recomputed P = exp(s - lse) must not overflow."""
    x = make_inputs(1, 130, 130, 2, 2, 64, dtype=dtype, q_scale=30.0)
    got, _ = check_grads(x, dtype, kernel_vjp, reference_vjp, assert_result_close, causal=True, dlse=True)
    assert float(jnp.max(got.lse)) > 50.0


def test_deterministic(make_inputs, kernel_vjp):
    """Two runs of the backward are bitwise equal (no atomics in the dK/dV or dQ accumulation)."""
    x = make_inputs(2, 130, 130, 4, 2, 64, dtype=BF16)
    first = kernel_vjp(x.q, x.k, x.v, x.do, x.dlse, causal=True)
    second = kernel_vjp(x.q, x.k, x.v, x.do, x.dlse, causal=True)
    for name in first._fields:
        np.testing.assert_array_equal(
            np.asarray(getattr(first, name), np.float32), np.asarray(getattr(second, name), np.float32), err_msg=name
        )


# ---- under JAX transformations -----------------------------------------------------
def _loss(backend, causal=True):
    """A scalar loss whose gradient is the vjp with cotangent (do, dlse)."""

    def loss(q, k, v, do, dlse):
        if backend == "reference":
            up = lambda a: a.astype(jnp.float32)
            o, lse = flashjax.reference.attention(up(q), up(k), up(v), causal=causal, return_lse=True)
        else:
            o, lse = flashjax.flash_attention(q, k, v, causal=causal, backend=backend, return_lse=True)
        finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)) + jnp.sum(finite * dlse)

    return loss


def _check_grad_tuple(got, want, dtype, assert_close):
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g.dtype == jnp.dtype(dtype)
        assert_close(g, w, dtype, name)


@pytest.mark.parametrize(
    "transform",
    [
        pytest.param(lambda f: jax.grad(f, argnums=(0, 1, 2)), id="grad"),
        pytest.param(lambda f: jax.jit(jax.grad(f, argnums=(0, 1, 2))), id="jit-grad"),
        pytest.param(lambda f: jax.grad(jax.checkpoint(f), argnums=(0, 1, 2)), id="checkpoint"),
        pytest.param(lambda f: jax.jit(jax.grad(jax.remat(jax.jit(f)), argnums=(0, 1, 2))), id="jit-remat-jit"),
    ],
)
def test_grad_transforms(make_inputs, assert_close, transform):
    x = make_inputs(2, 40, 33, 4, 2, 32, dtype=BF16)
    got = transform(_loss("triton"))(x.q, x.k, x.v, x.do, x.dlse)
    want = jax.jit(jax.grad(_loss("reference"), argnums=(0, 1, 2)))(x.q, x.k, x.v, x.do, x.dlse)
    _check_grad_tuple(got, want, BF16, assert_close)


def test_vmap_grad(make_inputs, assert_close):
    """jax.vmap over an extra leading dimension, of a gradient and (the other order) a gradient of a vmap."""
    x = make_inputs(3, 33, 40, 4, 2, 32)
    add_dim = lambda a: a.reshape(3, 1, *a.shape[1:])
    args = [add_dim(a) for a in x]
    want = jax.jit(jax.grad(_loss("reference"), argnums=(0, 1, 2)))(*x)
    vmapped_grad = jax.vmap(jax.grad(_loss("triton"), argnums=(0, 1, 2)))(*args)
    _check_grad_tuple([g.reshape(w.shape) for g, w in zip(vmapped_grad, want)], want, F32, assert_close)
    summed = lambda *a: jnp.sum(jax.vmap(_loss("triton"))(*a))
    grad_of_vmap = jax.grad(summed, argnums=(0, 1, 2))(*args)
    _check_grad_tuple([g.reshape(w.shape) for g, w in zip(grad_of_vmap, want)], want, F32, assert_close)


def test_xla_backend_takes_forward_mode_and_second_derivatives():
    """The kernels' gradient is a custom VJP (first-order reverse mode); the documented way to
    forward mode and second derivatives is backend="xla": its jvp agrees with its gradient,
    and its Hessian-vector product with a finite difference of gradients."""
    ks = jax.random.split(jax.random.key(0), 3)
    q, k, t = (jax.random.normal(key, (1, 12, 2, 8), jnp.float32) for key in ks)
    loss = lambda q: jnp.sum(jnp.sin(flashjax.flash_attention(q, k, k, causal=True, backend="xla")))
    _, tangent_out = jax.jvp(loss, (q,), (t,))
    np.testing.assert_allclose(tangent_out, jnp.vdot(jax.grad(loss)(q), t), rtol=1e-4)
    hvp = jax.jvp(jax.grad(loss), (q,), (t,))[1]
    eps = 1e-3
    fd = (jax.grad(loss)(q + eps * t) - jax.grad(loss)(q - eps * t)) / (2 * eps)
    np.testing.assert_allclose(hvp, fd, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("options", [{}, {"causal": True, "bias": "bias"}, {"score_mod": "halve"}])
def test_second_derivatives_on_the_kernels_raise_a_clear_error(options):
    """Grad of grad and a Hessian-vector product through the kernels raise an error that names
    backend="xla" (the kernels have no derivative rules of their own; JAX's message was an
    assertion inside Pallas), and the first-order gradient is unchanged by the guard."""
    ks = jax.random.split(jax.random.key(1), 3)
    q, k, t = (jax.random.normal(key, (1, 21, 2, 16), jnp.float32) for key in ks)
    extra = {"causal": options.get("causal", False)}
    if "bias" in options:
        extra["bias"] = jax.random.normal(ks[0], (1, 2, 21, 21))
    if "score_mod" in options:
        extra["score_mod"] = lambda s, b, h, i, j: 0.5 * s
    loss = lambda q, backend: jnp.sum(jnp.sin(flashjax.flash_attention(q, k, k, backend=backend, **extra)))
    for backend in ("triton", "auto"):
        with pytest.raises(NotImplementedError, match="second derivatives.*backend='xla'"):
            jax.grad(lambda q: jnp.sum(jax.grad(loss)(q, backend) ** 2))(q)
        with pytest.raises(NotImplementedError, match="second derivatives.*backend='xla'"):
            jax.jvp(lambda q: jax.grad(loss)(q, backend), (q,), (t,))
        np.testing.assert_allclose(jax.grad(loss)(q, backend), jax.grad(loss)(q, "xla"), rtol=1e-5, atol=1e-6)

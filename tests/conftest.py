"""Shared test helpers: random inputs, the reference oracle's outputs and gradients,
relative errors and per-dtype tolerances, and the GPU-only marker.

Every test compares against `flashjax.reference.attention` evaluated in float32 on
inputs upcast from the tested dtype, so the kernels' only error is their own
rounding (bf16/fp16 matmul operands, float32 accumulation), never the input
quantisation.

Fixtures:
  key, rng: a PRNG key / numpy Generator seeded from the test's node id (fresh per
    test, reproducible).
  make_inputs: factory of random q, k, v and cotangents do, dlse.
  reference_fwd: the oracle's (o, lse) for given inputs.
  reference_vjp: the oracle's (o, lse, dq, dk, dv) for given inputs and cotangents.
  kernel_vjp: the same through `flashjax.flash_attention(..., return_lse=True)`.
  assert_close: relative-error check with the dtype's tolerance and a finiteness check.
"""

from __future__ import annotations

import functools
import zlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from flashjax import reference

ON_GPU = jax.default_backend() == "gpu"
GPU_SKIP_REASON = (
    "needs a CUDA GPU: the Pallas Triton kernels only compile there; "
    "on the CPU they are tested in interpret mode"
)
requires_gpu = pytest.mark.skipif(not ON_GPU, reason=GPU_SKIP_REASON)

# Relative (Frobenius) error allowed against the float32 oracle on upcast inputs.
# float32: the kernels accumulate in float32 in a different order (online softmax,
# exp2 with the scale folded in), ~1e-6 observed; 2e-5 leaves room for long rows.
# bfloat16 (8-bit mantissa, unit roundoff 2^-9 ~ 2e-3): P and dS are rounded to bf16
# before their matmuls and the outputs are rounded once more, a few 1e-3 observed.
# float16 (11-bit mantissa, 2^-12 ~ 2.4e-4): the same roundings, 8x finer.
TOLERANCES = {
    jnp.dtype(jnp.float32): 2e-5,
    jnp.dtype(jnp.bfloat16): 1.6e-2,
    jnp.dtype(jnp.float16): 2e-3,
}
# The lse is float32 in every case and its value is dominated by the largest logit;
# an absolute error is the natural measure (lse differences are log-ratios of weights).
LSE_ATOL = {
    jnp.dtype(jnp.float32): 1e-5,
    jnp.dtype(jnp.bfloat16): 1e-4,
    jnp.dtype(jnp.float16): 1e-4,
}


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` are skipped without a CUDA GPU."""
    if ON_GPU:
        return
    skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def rel_err(a, b) -> float:
    """||a - b|| / ||b|| in float64 (0 when both are 0)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    denom = np.linalg.norm(b)
    num = np.linalg.norm(a - b)
    return float(num / denom) if denom > 0 else float(num)


def tolerance(dtype) -> float:
    return TOLERANCES[jnp.dtype(dtype)]


class Inputs(NamedTuple):
    """q [B, Tq, H, D], k and v [B, Tk, Hkv, D], do [B, Tq, H, D], dlse [B, H, Tq] float32."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    do: jax.Array
    dlse: jax.Array


class Outputs(NamedTuple):
    """o [B, Tq, H, D], lse [B, H, Tq], dq, dk, dv and dbias (None without a bias)."""

    o: jax.Array
    lse: jax.Array
    dq: jax.Array
    dk: jax.Array
    dv: jax.Array
    dbias: jax.Array | None


def check_rows_without_keys(got: Outputs, want: Outputs, what: str = ""):
    """Rows that see no key (reference lse = -inf): o = 0, lse = -inf and dq = 0 exactly;
    keys no query sees: dk = dv = 0; bias rows empty in every row they broadcast over: dbias = 0."""
    empty = np.asarray(want.lse) == -np.inf  # [B, H, Tq]
    np.testing.assert_array_equal(np.asarray(got.lse)[empty], -np.inf, err_msg=f"{what} lse of rows without keys")
    rows = lambda x: np.moveaxis(np.asarray(x, np.float32), 2, 1)[empty]  # [B, T, H, D] -> [n_empty, D]
    for name in ("o", "dq"):
        np.testing.assert_array_equal(rows(getattr(got, name)), 0.0, err_msg=f"{what} {name} of rows without keys")
    unseen = np.all(np.asarray(want.dk) == 0, axis=-1) & np.all(np.asarray(want.dv) == 0, axis=-1)
    for name in ("dk", "dv"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name), np.float32)[unseen], 0.0,
                                      err_msg=f"{what} {name} of keys no query sees")
    if want.dbias is not None:
        dbias = np.asarray(got.dbias, np.float32)
        dbias = dbias.reshape((1,) * (4 - dbias.ndim) + dbias.shape)
        if dbias.shape[2] > 1:
            empty_all = empty
            for axis in (0, 1):
                if dbias.shape[axis] == 1:
                    empty_all = empty_all.all(axis=axis, keepdims=True)
            empty_all = np.broadcast_to(empty_all[..., None], empty_all.shape + (dbias.shape[3],))
            np.testing.assert_array_equal(dbias[np.broadcast_to(empty_all, dbias.shape)], 0.0,
                                          err_msg=f"{what} dbias of rows without keys")


class Result(NamedTuple):
    """Output, logsumexp and the three input gradients of one attention call."""

    o: jax.Array
    lse: jax.Array
    dq: jax.Array
    dk: jax.Array
    dv: jax.Array


def _test_seed(request) -> int:
    return zlib.crc32(request.node.nodeid.encode())


@pytest.fixture
def key(request):
    """A PRNG key derived from the test's node id: fresh per test, reproducible."""
    return jax.random.key(_test_seed(request))


@pytest.fixture
def rng(request):
    """A numpy Generator seeded from the test's node id."""
    return np.random.default_rng(_test_seed(request))


@pytest.fixture
def make_inputs(rng):
    """Factory: ``make_inputs(batch, seq_q, seq_k, heads, kv_heads, head_dim, dtype, q_scale=1.0)``.

    Each call draws new standard-normal values (numpy, seeded from the test's node id:
    drawing with jax.random would compile a few ops for every new shape). ``q_scale``
    multiplies q to make large logits.
    """

    def make(batch, seq_q, seq_k, heads, kv_heads, head_dim, dtype=jnp.float32, q_scale=1.0):
        def draw(*shape, dtype=dtype, mult=1.0):
            x = mult * rng.standard_normal(shape, dtype=np.float32)
            return jnp.asarray(x.astype(jnp.dtype(dtype)))

        return Inputs(
            q=draw(batch, seq_q, heads, head_dim, mult=q_scale),
            k=draw(batch, seq_k, kv_heads, head_dim),
            v=draw(batch, seq_k, kv_heads, head_dim),
            do=draw(batch, seq_q, heads, head_dim),
            dlse=draw(batch, heads, seq_q, dtype=jnp.float32),
        )

    return make


def _vjp(fn, q, k, v, do, dlse):
    (o, lse), pullback = jax.vjp(fn, q, k, v)
    do = jnp.zeros_like(o) if do is None else do.astype(o.dtype)
    dlse = jnp.zeros_like(lse) if dlse is None else dlse
    dq, dk, dv = pullback((do, dlse))
    return Result(o, lse, dq, dk, dv)


@functools.partial(jax.jit, static_argnames=("options",))
def _reference_vjp(q, k, v, do, dlse, arrays, options):
    # Jitted: op-by-op evaluation of the oracle compiles every op for every new shape.
    up = lambda x: x.astype(jnp.float32)
    fn = lambda q, k, v: reference.attention(q, k, v, return_lse=True, **arrays, **dict(options))
    return _vjp(fn, up(q), up(k), up(v), None if do is None else up(do), dlse)


@functools.partial(jax.jit, static_argnames=("options",))
def _reference_forward(q, k, v, options):
    up = lambda x: x.astype(jnp.float32)
    return reference.attention(up(q), up(k), up(v), return_lse=True, **dict(options))


def reference_forward(q, k, v, **kwargs):
    """The oracle's (o, lse) in float32 on upcast inputs; static keyword arguments only."""
    return _reference_forward(q, k, v, tuple(sorted(kwargs.items())))


def reference_result(q, k, v, do=None, dlse=None, *, arrays=None, **kwargs) -> Result:
    """The oracle in float32 on upcast inputs; ``None`` cotangents are zeros.

    Keyword arguments go to `flashjax.reference.attention` and must be static
    (hashable): causal, scale, window, softcap; `arrays` holds the array options
    (e.g. ``dict(alibi_slopes=...)``), traced.
    """
    return _reference_vjp(q, k, v, do, dlse, arrays or {}, tuple(sorted(kwargs.items())))


@functools.partial(jax.jit, static_argnames=("options",))
def _kernel_vjp(q, k, v, do, dlse, arrays, options):
    # One jit around forward and backward: a single compilation per shape, where an
    # eager jax.vjp would compile the forward, the backward and each glue op apart.
    fn = lambda q, k, v: flashjax.flash_attention(q, k, v, return_lse=True, **arrays, **dict(options))
    return _vjp(fn, q, k, v, do, dlse)


def kernel_result(q, k, v, do=None, dlse=None, *, backend="triton", arrays=None, **kwargs) -> Result:
    """`flashjax.flash_attention` (default: the Triton kernels, interpret mode on the CPU).

    Keyword arguments go to `flash_attention` and must be static (hashable); `arrays`
    holds the array options, traced.
    """
    return _kernel_vjp(q, k, v, do, dlse, arrays or {}, tuple(sorted(dict(kwargs, backend=backend).items())))


@pytest.fixture
def reference_fwd():
    """``reference_fwd(q, k, v, **attention_kwargs) -> (o, lse)`` (float32)."""
    return reference_forward


@pytest.fixture
def reference_vjp():
    """``reference_vjp(q, k, v, do=None, dlse=None, **attention_kwargs) -> Result`` (float32)."""
    return reference_result


@pytest.fixture
def kernel_vjp():
    """``kernel_vjp(q, k, v, do=None, dlse=None, backend="triton", **attention_kwargs) -> Result``."""
    return kernel_result


def check_close(got, want, dtype, what: str = "", tol: float | None = None):
    """Asserts got is finite and within the dtype's relative tolerance of want."""
    got = np.asarray(got).astype(np.float32)
    want = np.asarray(want, dtype=np.float32)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != reference {want.shape}"
    assert np.all(np.isfinite(got)), f"{what}: {np.sum(~np.isfinite(got))} non-finite values"
    tol = tolerance(dtype) if tol is None else tol
    err = rel_err(got, want)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.3g} ({jnp.dtype(dtype).name})"


def check_under_remat_and_vmap(fn, oracle, q, k, v, weights):
    """fn(q, k, v) (float32) against the oracle: the gradients of sum(sin(o) * weights) with fn
    under jax.checkpoint and jit, and the output under vmap over an extra leading axis."""
    loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)) * weights)
    got = jax.jit(jax.grad(loss(jax.checkpoint(fn)), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(loss(oracle), argnums=(0, 1, 2))(q, k, v)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        check_close(g, w, jnp.float32, f"remat {name}")
    stacked = [jnp.stack([a, -0.5 * a]) for a in (q, k, v)]
    check_close(jax.jit(jax.vmap(fn))(*stacked), jax.vmap(oracle)(*stacked), jnp.float32, "vmap o")


def check_lse(got, want, dtype, what: str = "lse"):
    """Asserts the lse matches: same -inf entries (rows without keys), close elsewhere."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != reference {want.shape}"
    assert not np.any(np.isnan(got)), f"{what}: NaN"
    empty = want == -np.inf
    np.testing.assert_array_equal(got[empty], want[empty], err_msg=f"{what}: rows without keys must be -inf")
    assert np.all(np.isfinite(got[~empty])), f"{what}: non-finite lse for rows that see keys"
    atol = LSE_ATOL[jnp.dtype(dtype)] * max(1.0, float(np.max(np.abs(want[~empty]), initial=0.0)))
    np.testing.assert_allclose(got[~empty], want[~empty], rtol=0, atol=atol, err_msg=what)


@pytest.fixture
def assert_close():
    """``assert_close(got, want, dtype, what="", tol=None)``: relative error within the dtype's tolerance."""
    return check_close


@pytest.fixture
def assert_lse_close():
    """``assert_lse_close(got, want, dtype)``: equal -inf rows, small absolute error elsewhere."""
    return check_lse


@pytest.fixture
def assert_huge_logits_result():
    """``assert_huge_logits_result(got: Result, want: Result, dtype, q_scale)``: the logits
    really reach ~q_scale, o and lse match the reference, and the gradients are finite (at
    such logits they are not accurate: README, Precision)."""

    def check(got: Result, want: Result, dtype, q_scale: float):
        assert float(np.max(np.asarray(want.lse))) > 0.1 * q_scale, "the logits are not that large"
        check_close(got.o, want.o, dtype, "o")
        check_lse(got.lse, want.lse, dtype)
        for name in ("dq", "dk", "dv"):
            assert np.all(np.isfinite(np.asarray(getattr(got, name), np.float32))), f"{name}: non-finite values"

    return check


@pytest.fixture
def assert_result_close():
    """``assert_result_close(got: Result, want: Result, dtype, grads=True)``: o, lse and grads."""

    def check(got: Result, want: Result, dtype, grads: bool = True):
        check_close(got.o, want.o, dtype, "o")
        check_lse(got.lse, want.lse, dtype)
        if grads:
            for name in ("dq", "dk", "dv"):
                check_close(getattr(got, name), getattr(want, name), dtype, name)

    return check

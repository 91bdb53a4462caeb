"""The oracle itself, against attention written out naively in numpy float64.

The naive version builds its mask from the definitions, query by query, so it
shares nothing with `flashjax.masks` or the reference's vectorised mask.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashjax import reference

# Jitted so that each case compiles once instead of op by op.
oracle = jax.jit(reference.attention, static_argnames=("causal", "scale", "window", "return_lse"))


def naive_attention(q, k, v, *, causal=False, window=None, scale=None):
    """softmax(scale q k^T) v per head in float64, with an explicit double loop for the mask.

    Returns (o [B, Tq, H, D], lse [B, H, Tq]); rows without keys give o = 0, lse = -inf.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, seq_q, heads, dim = q.shape
    seq_k, kv_heads = k.shape[1], k.shape[2]
    scale = 1.0 / np.sqrt(dim) if scale is None else scale
    left, right = window if window is not None else (None, None)
    allowed = np.zeros((seq_q, seq_k), bool)
    for i in range(seq_q):
        pos = i + seq_k - seq_q  # bottom-right alignment: the last query sits on the last key
        for j in range(seq_k):
            ok = True
            if causal and j > pos:
                ok = False
            if right is not None and j > pos + right:
                ok = False
            if left is not None and j < pos - left:
                ok = False
            allowed[i, j] = ok
    o = np.zeros((batch, seq_q, heads, dim))
    lse = np.full((batch, heads, seq_q), -np.inf)
    for b in range(batch):
        for h in range(heads):
            hk = h // (heads // kv_heads)  # query head h reads K/V head h // group
            for i in range(seq_q):
                cols = np.flatnonzero(allowed[i])
                if cols.size == 0:
                    continue
                s = scale * (k[b, cols, hk] @ q[b, i, h])
                m = s.max()
                w = np.exp(s - m)
                o[b, i, h] = (w / w.sum()) @ v[b, cols, hk]
                lse[b, h, i] = m + np.log(w.sum())
    return o, lse


CASES = [
    # (batch, seq_q, seq_k, heads, kv_heads, head_dim, causal, window)
    pytest.param(2, 9, 9, 2, 2, 8, False, None, id="plain"),
    pytest.param(1, 9, 9, 2, 2, 8, True, None, id="causal"),
    pytest.param(1, 5, 12, 2, 2, 8, True, None, id="causal-q<k"),
    pytest.param(1, 12, 5, 2, 2, 8, True, None, id="causal-q>k-empty-rows"),
    pytest.param(1, 11, 11, 2, 2, 8, False, (3, 2), id="window"),
    pytest.param(1, 7, 13, 2, 2, 8, False, (2, 0), id="window-q<k"),
    pytest.param(1, 13, 7, 2, 2, 8, True, (None, 4), id="window-causal-q>k"),
    pytest.param(1, 10, 10, 2, 2, 8, False, (None, 0), id="window-none-0"),
    pytest.param(1, 10, 10, 2, 2, 8, True, (1, None), id="window-left-causal"),
    pytest.param(2, 8, 10, 4, 2, 8, True, None, id="gqa"),
    pytest.param(1, 8, 8, 4, 1, 8, False, (2, 2), id="mqa-window"),
]


@pytest.mark.parametrize("batch,seq_q,seq_k,heads,kv_heads,dim,causal,window", CASES)
def test_reference_matches_naive(make_inputs, batch, seq_q, seq_k, heads, kv_heads, dim, causal, window):
    x = make_inputs(batch, seq_q, seq_k, heads, kv_heads, dim)
    o, lse = oracle(x.q, x.k, x.v, causal=causal, window=window, return_lse=True)
    want_o, want_lse = naive_attention(x.q, x.k, x.v, causal=causal, window=window)
    # float32 oracle vs float64: a few ulps of float32.
    np.testing.assert_allclose(np.asarray(o), want_o, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-5, atol=1e-5)


def test_reference_scale(make_inputs):
    x = make_inputs(1, 6, 6, 2, 2, 8)
    o = oracle(x.q, x.k, x.v, scale=0.7)
    want, _ = naive_attention(x.q, x.k, x.v, scale=0.7)
    np.testing.assert_allclose(np.asarray(o), want, rtol=1e-5, atol=1e-5)


def test_reference_empty_rows_and_their_gradient(make_inputs):
    """Rows with no keys (causal, Tq > Tk): output 0, lse -inf, zero and finite gradients."""
    seq_q, seq_k = 9, 4
    x = make_inputs(1, seq_q, seq_k, 2, 1, 8)

    def loss(q, k, v):
        o, lse = reference.attention(q, k, v, causal=True, return_lse=True)
        finite_lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(o * x.do) + jnp.sum(finite_lse * x.dlse)

    o, lse = oracle(x.q, x.k, x.v, causal=True, return_lse=True)
    empty = seq_q - seq_k  # query i sees keys j <= i - 5
    assert np.all(np.asarray(o[:, :empty]) == 0.0)
    assert np.all(np.asarray(lse[:, :, :empty]) == -np.inf)
    assert np.all(np.isfinite(np.asarray(lse[:, :, empty:])))
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x.q, x.k, x.v)
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g)))
    assert np.all(np.asarray(grads[0][:, :empty]) == 0.0)


@pytest.mark.parametrize("seed", range(6))
def test_mask_spec_against_definitions(seed):
    """`MaskSpec.allowed` (the per-row key bounds `key_bounds` the kernels compare against)
    equals the mask written from the definitions, over random lengths, causal flags,
    windows (either side None, negative right) and kv lengths (0, partial, full)."""
    from flashjax.masks import MaskSpec

    rng = np.random.default_rng(seed)
    for _ in range(20):
        seq_q, seq_k = (int(x) for x in rng.integers(1, 40, 2))
        causal = bool(rng.integers(2))
        left = None if rng.integers(3) == 0 else int(rng.integers(0, 12))
        right = None if rng.integers(3) == 0 else int(rng.integers(-3, 12))
        kv_length = None if rng.integers(2) == 0 else int(rng.integers(0, seq_k + 1))
        spec = MaskSpec(seq_q, seq_k, causal, left, right)
        got = np.broadcast_to(spec.allowed(jnp.arange(seq_q)[:, None], jnp.arange(seq_k)[None, :], kv_length),
                              (seq_q, seq_k))
        want = np.zeros((seq_q, seq_k), bool)
        for i in range(seq_q):
            pos = i + seq_k - seq_q
            for j in range(seq_k):
                want[i, j] = (j < (seq_k if kv_length is None else kv_length) and not (causal and j > pos)
                              and not (right is not None and j > pos + right)
                              and not (left is not None and j < pos - left))
        np.testing.assert_array_equal(got, want, err_msg=str((seq_q, seq_k, causal, left, right, kv_length)))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("logit_scale", [1e9, 1e20, 1e30])
def test_compiled_reference_with_logits_past_float32_ulp(make_inputs, logit_scale, causal):
    """Compiled, with logits of 1e9 to 1e30 (half an ulp of float32 past 2**7), the reference's
    output and gradients are finite and equal the eagerly computed ones: XLA must not
    recompute the logits differently for the row max and for the exponent."""
    x = make_inputs(2, 33, 47, 4, 2, 32, q_scale=logit_scale)
    q, do = x.q, x.do
    loss = lambda q, k, v: jnp.sum(reference.attention(q, k, v, causal=causal) * do)
    o, lse = jax.jit(lambda q, k, v: reference.attention(q, k, v, causal=causal, return_lse=True))(q, x.k, x.v)
    want_o, want_lse = reference.attention(q, x.k, x.v, causal=causal, return_lse=True)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, x.k, x.v)
    want_grads = jax.grad(loss, argnums=(0, 1, 2))(q, x.k, x.v)
    for got, want in zip((o, lse, *grads), (want_o, want_lse, *want_grads)):
        assert np.isfinite(np.asarray(got)).all()
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)

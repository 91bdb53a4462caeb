"""The attention variants in the kernels, forward and backward, against the reference.

Every option of `flash_attention` (segment ids, lengths, sliding window, bias,
boolean mask, softcap, ALiBi) is checked alone and in combinations: output,
logsumexp and the gradients of q, k, v (and of the bias), with random cotangents
for both o and lse. Rows that see no key must give exactly 0, lse = -inf and zero
gradients, without a NaN anywhere.

Most cases run with small tiles (`SMALL_TILES`, three different tilings for the
three kernels) so that a sequence of 70 spans several tiles, tiles are skipped by
the block ranges, and boundary tiles are masked elementwise; the odd-length tests
use the tuned default tiles.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import Outputs, check_close, check_lse, check_rows_without_keys

import flashjax
from flashjax import reference
from flashjax import KernelConfig, TritonConfig

# Different tiles per kernel: the dK/dV kernel walks query tiles of another size
# than the forward's, so a mismatch between their block ranges would show.
SMALL_TILES = TritonConfig(fwd=KernelConfig(32, 16), dkv=KernelConfig(16, 32), dq=KernelConfig(16, 16))


# ---- helpers ---------------------------------------------------------------------------


def attention_vjp(attention, q, k, v, bias, do, dlse, kwargs) -> Outputs:
    """`attention(q, k, v, bias=bias, return_lse=True, **kwargs)` and its pullback of (do, dlse)."""
    if bias is None:
        fn = lambda q, k, v: attention(q, k, v, return_lse=True, **kwargs)
        (o, lse), pullback = jax.vjp(fn, q, k, v)
        return Outputs(o, lse, *pullback((do.astype(o.dtype), dlse)), None)
    fn = lambda q, k, v, b: attention(q, k, v, bias=b, return_lse=True, **kwargs)
    (o, lse), pullback = jax.vjp(fn, q, k, v, bias)
    return Outputs(o, lse, *pullback((do.astype(o.dtype), dlse)))


def run_both(inputs, *, bias=None, config=SMALL_TILES, backend="triton", **kwargs) -> tuple[Outputs, Outputs]:
    """(kernel, reference) outputs and gradients for the same inputs and options, the kernel
    on `backend` with `config`.

    The reference runs in float32 on upcast inputs. The lse cotangent is zeroed on
    rows whose reference lse is -inf (the lse is constant there, its cotangent moot).
    """
    up = lambda x: None if x is None else x.astype(jnp.float32)
    q, k, v, do = inputs.q, inputs.k, inputs.v, inputs.do
    _, ref_lse = reference.attention(up(q), up(k), up(v), bias=up(bias), return_lse=True, **kwargs)
    dlse = jnp.where(ref_lse == -jnp.inf, 0.0, inputs.dlse)
    want = attention_vjp(reference.attention, up(q), up(k), up(v), up(bias), up(do), dlse, kwargs)
    kernel = lambda *a, **kw: flashjax.flash_attention(*a, backend=backend, config=config, **kw)
    got = attention_vjp(kernel, q, k, v, bias, do, dlse, kwargs)
    return got, want


def assert_matches(got: Outputs, want: Outputs, dtype):
    """Output, lse and every gradient within the dtype's tolerance (and finite)."""
    check_close(got.o, want.o, dtype, "o")
    check_lse(got.lse, want.lse, dtype)
    for name in ("dq", "dk", "dv"):
        check_close(getattr(got, name), getattr(want, name), dtype, name)
    if want.dbias is not None:
        assert got.dbias.shape == want.dbias.shape, f"dbias shape {got.dbias.shape} != {want.dbias.shape}"
        check_close(got.dbias, want.dbias, dtype, "dbias")


def assert_empty_rows_are_zero(got: Outputs, want: Outputs):
    """Rows that see no key: o = 0, lse = -inf, dq = 0 exactly; keys no query sees: dk = dv = 0;
    no NaN or inf anywhere."""
    assert (np.asarray(want.lse) == -np.inf).any(), "the case was meant to have rows without keys"
    check_rows_without_keys(got, want)
    for name, x in got._asdict().items():
        if x is not None and name != "lse":
            assert np.all(np.isfinite(np.asarray(x, np.float32))), f"{name}: non-finite values"


# ---- option builders ---------------------------------------------------------------------
class Shape(NamedTuple):
    batch: int = 2
    seq_q: int = 70
    seq_k: int = 70
    heads: int = 2
    kv_heads: int = 2
    head_dim: int = 16
    v_head_dim: int | None = None  # v's, when it differs (tests/test_flex.py)


def packed_ids(lengths_per_row, total: int):
    """Sorted segment ids [B, total] from per-row document lengths (the last one runs to the end)."""
    rows = []
    for lengths in lengths_per_row:
        ids = np.concatenate([np.full(n, i) for i, n in enumerate(lengths)])
        ids = np.concatenate([ids, np.full(total - len(ids), len(lengths))])[:total]
        rows.append(ids)
    return jnp.asarray(np.stack(rows), jnp.int32)


def random_ids(key, batch, seq, n=3):
    return jax.random.randint(key, (batch, seq), 0, n, jnp.int32)


def random_mask(key, shape, p=0.7):
    return jax.random.bernoulli(key, p, shape)


def random_bias(key, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def alibi(heads):
    return 2.0 ** -(jnp.arange(heads, dtype=jnp.float32) + 1)


class Case(NamedTuple):
    """Options to test on one shape: `options(key, shape, dtype) -> [kwargs, ...]`.

    The kwargs of the list differ only in array values (one compilation); a `bias`
    entry is differentiated.
    """

    shape: Shape
    options: Callable
    bf16: bool = False  # also run in bfloat16
    q_scale: float = 1.0


S = Shape()
QK = Shape(seq_q=40, seq_k=70)  # Tq < Tk
KQ = Shape(seq_q=70, seq_k=40)  # Tq > Tk
GQA = Shape(heads=4, kv_heads=2)


def _lengths(*pairs):
    return [dict(q_lengths=jnp.array(q), kv_lengths=jnp.array(kv)) for q, kv in pairs]


def _rows_off_mask(s):
    """A [B, 1, Tq, Tk] mask with a few rows and one whole 16-row tile all False."""
    mask = np.ones((s.batch, 1, s.seq_q, s.seq_k), bool)
    mask[0, :, [3, 40, s.seq_q - 1]] = False
    mask[1, :, 16:32] = False
    return jnp.asarray(mask)


# Each case returns a list of option sets that differ only in array values, so they
# share one compilation. Option sets that leave rows without keys (a 0 length, a
# segment present only in the queries, a mask row all False) are also checked for
# exact zeros there by `_check_case`.
SINGLE = {
    # segment ids: packed (sorted) documents and unsorted random ids
    "segments": Case(S, lambda key, s, dt: [
        dict(segment_ids=packed_ids([[20, 25], [7, 1, 42]], s.seq_q)),
        dict(segment_ids=random_ids(key, s.batch, s.seq_q)),
    ], bf16=True),
    "segments-pair": Case(QK, lambda key, s, dt: [
        dict(segment_ids=(packed_ids([[10, 20], [5, 30]], s.seq_q), packed_ids([[30, 15], [16, 40]], s.seq_k))),
        dict(segment_ids=(random_ids(key, s.batch, s.seq_q), random_ids(jax.random.fold_in(key, 1), s.batch, s.seq_k))),
        # q segment 2 has no key: its rows are empty
        dict(segment_ids=(packed_ids([[10, 20], [25, 5]], s.seq_q),
                          jnp.zeros((s.batch, s.seq_k), jnp.int32).at[:, 35:].set(1))),
    ], bf16=True),
    # right padding: 0 lengths (empty rows), full lengths, lengths inside a tile
    "lengths": Case(S, lambda key, s, dt: _lengths(
        ([0, s.seq_q], [s.seq_k, s.seq_k]),
        ([s.seq_q, s.seq_q], [s.seq_k, 17]),
        ([5, s.seq_q], [s.seq_k, 1]),
        ([s.seq_q, 33], [0, 33]),
        ([s.seq_q, s.seq_q], [s.seq_k, s.seq_k]),
    ), bf16=True),
    # sliding window (static: one compilation each)
    "window-3-5": Case(S, lambda key, s, dt: [dict(window=(3, 5))], bf16=True),
    "window-none-4-q<k": Case(QK, lambda key, s, dt: [dict(window=(None, 4))]),
    "window-6-none": Case(S, lambda key, s, dt: [dict(window=(6, None))]),
    # additive bias, with its gradient reduced over the broadcast axes
    "bias-BHQK": Case(S, lambda key, s, dt: [dict(bias=random_bias(key, (s.batch, s.heads, s.seq_q, s.seq_k), dt))], bf16=True),
    "bias-1HQK": Case(S, lambda key, s, dt: [dict(bias=random_bias(key, (1, s.heads, s.seq_q, s.seq_k), dt))]),
    "bias-B11K": Case(S, lambda key, s, dt: [dict(bias=random_bias(key, (s.batch, 1, 1, s.seq_k), dt))]),
    "bias-QK": Case(QK, lambda key, s, dt: [dict(bias=random_bias(key, (s.seq_q, s.seq_k), dt))]),
    # boolean mask
    "mask-B1QK": Case(S, lambda key, s, dt: [
        dict(mask=random_mask(key, (s.batch, 1, s.seq_q, s.seq_k))),
        dict(mask=_rows_off_mask(s)),
    ], bf16=True),
    "mask-QK": Case(KQ, lambda key, s, dt: [dict(mask=random_mask(key, (s.seq_q, s.seq_k)))]),
    # logit transforms
    "softcap": Case(S, lambda key, s, dt: [dict(softcap=2.0)], bf16=True, q_scale=4.0),
    "alibi-gqa-q<k": Case(Shape(seq_q=40, seq_k=70, heads=4, kv_heads=2),
                          lambda key, s, dt: [dict(alibi_slopes=alibi(s.heads))], bf16=True),
}

COMBINED = {
    "causal+window+segments+gqa+lengths": Case(GQA, lambda key, s, dt: [dict(
        causal=True, window=(20, None), segment_ids=packed_ids([[30, 25], [12, 40]], s.seq_q),
        q_lengths=jnp.array([64, 50]), kv_lengths=jnp.array([55, s.seq_k]))], bf16=True),
    "bias+mask+softcap": Case(S, lambda key, s, dt: [dict(
        bias=random_bias(key, (s.batch, s.heads, s.seq_q, s.seq_k), dt),
        mask=random_mask(jax.random.fold_in(key, 1), (s.batch, 1, s.seq_q, s.seq_k)), softcap=3.0)], q_scale=3.0),
    "everything": Case(Shape(heads=4, kv_heads=1, seq_q=50, seq_k=70), lambda key, s, dt: [dict(
        causal=True, window=(30, 0), softcap=5.0, alibi_slopes=alibi(s.heads),
        bias=random_bias(key, (1, s.heads, s.seq_q, s.seq_k), dt),
        mask=random_mask(jax.random.fold_in(key, 1), (s.seq_q, s.seq_k), p=0.8),
        segment_ids=(random_ids(jax.random.fold_in(key, 2), s.batch, s.seq_q, 2),
                     random_ids(jax.random.fold_in(key, 3), s.batch, s.seq_k, 2)),
        q_lengths=jnp.array([47, s.seq_q]), kv_lengths=jnp.array([s.seq_k, 52]))]),
}

# Rows without keys from every source at once, and from a window with Tq > Tk; the
# single-option cases above add 0 lengths, query-only segments and all-False mask rows.
EMPTY_ROWS = {
    "window-q>k": Case(KQ, lambda key, s, dt: [dict(window=(3, 2))]),
    "causal-q>k+mask+segments+lengths+bias": Case(Shape(heads=4, kv_heads=2, seq_q=70, seq_k=50), lambda key, s, dt: [
        dict(causal=True, mask=_rows_off_mask(s),
             segment_ids=(packed_ids([[60, 10], [35, 35]], s.seq_q), packed_ids([[50], [25, 25]], s.seq_k)),
             q_lengths=jnp.array([s.seq_q, 61]), kv_lengths=jnp.array([44, s.seq_k]),
             bias=random_bias(key, (s.batch, s.heads, s.seq_q, s.seq_k), dt)),
        # every row empty: batch 0 by its mask, batch 1 by a 0 query length
        dict(causal=True, mask=jnp.zeros((s.batch, 1, s.seq_q, s.seq_k), bool).at[1].set(True),
             segment_ids=(jnp.zeros((s.batch, s.seq_q), jnp.int32), jnp.zeros((s.batch, s.seq_k), jnp.int32)),
             q_lengths=jnp.array([s.seq_q, 0]), kv_lengths=jnp.array([s.seq_k, s.seq_k]),
             bias=random_bias(key, (s.batch, s.heads, s.seq_q, s.seq_k), dt)),
    ]),
}


def _params(cases):
    params = []
    for name, case in cases.items():
        params.append(pytest.param(case, jnp.float32, id=f"{name}-f32"))
        if case.bf16:
            params.append(pytest.param(case, jnp.bfloat16, id=f"{name}-bf16"))
    return params


def _check_case(case: Case, dtype, key, make_inputs) -> list[tuple[Outputs, Outputs]]:
    """Runs every option set of a case on one set of inputs; returns the (kernel, reference) pairs."""
    s = case.shape
    inputs = make_inputs(s.batch, s.seq_q, s.seq_k, s.heads, s.kv_heads, s.head_dim, dtype, q_scale=case.q_scale)
    results = []
    for options in case.options(key, s, dtype):
        got, want = run_both(inputs, **options)
        assert_matches(got, want, dtype)
        if np.any(np.asarray(want.lse) == -np.inf):
            assert_empty_rows_are_zero(got, want)
        results.append((got, want))
    return results


# ---- tests -------------------------------------------------------------------------------
@pytest.mark.parametrize("case, dtype", _params(SINGLE))
def test_single_option(case, dtype, key, make_inputs):
    _check_case(case, dtype, key, make_inputs)


@pytest.mark.parametrize("case, dtype", _params(COMBINED))
def test_combined_options(case, dtype, key, make_inputs):
    _check_case(case, dtype, key, make_inputs)


@pytest.mark.parametrize("case", [pytest.param(c, id=n) for n, c in EMPTY_ROWS.items()])
def test_rows_without_keys(case, key, make_inputs):
    for _, want in _check_case(case, jnp.float32, key, make_inputs):
        assert np.any(np.asarray(want.lse) == -np.inf), "the case was meant to leave rows without keys"


@pytest.mark.parametrize("seq, group", [(17, 1), (70, 2), (130, 4)])
def test_odd_lengths_and_gqa(seq, group, key, make_inputs):
    """Lengths that are no multiple of the tuned tiles, with 1, 2 and 4 query heads per K/V head."""
    inputs = make_inputs(2, seq, seq, 4, 4 // group, 16, jnp.float32)
    got, want = run_both(inputs, config=None, causal=True, kv_lengths=jnp.array([seq, seq - 5]))
    assert_matches(got, want, jnp.float32)


@pytest.mark.parametrize("seq_q, seq_k, group, head_dim", [(17, 130, 2, 40), (130, 70, 4, 16), (70, 17, 1, 24)])
def test_odd_lengths_cross_causal_padded(seq_q, seq_k, group, head_dim, key, make_inputs):
    """Tq != Tk (both ways), neither a multiple of the tiles, causal with q and kv lengths, head dim padded."""
    inputs = make_inputs(2, seq_q, seq_k, 4, 4 // group, head_dim, jnp.float32)
    got, want = run_both(
        inputs, config=None, causal=True, q_lengths=jnp.array([seq_q, seq_q // 2]), kv_lengths=jnp.array([seq_k - 3, seq_k])
    )
    assert_matches(got, want, jnp.float32)
    if np.any(np.asarray(want.lse) == -np.inf):
        assert_empty_rows_are_zero(got, want)

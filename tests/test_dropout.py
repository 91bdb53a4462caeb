"""Dropout on the attention probabilities: the kernels against the reference, and the mask itself.

The kernels draw the keep mask from `flashjax.dropout`'s counter-based hash tile by
tile, forward and backward; the reference draws the whole mask from the same hash
(`dropout.keep_mask`). So with dropout the kernels must still match the reference
up to float32 rounding, in the output and every gradient. The mask is also checked
on its own: reproducible per seed, different across seeds, shared across batch and
heads with `broadcast_dropout`, and statistically a fair coin of the right bias.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_variants import (
    SMALL_TILES,
    Shape,
    assert_empty_rows_are_zero,
    assert_matches,
    attention_vjp,
    random_bias,
    run_both,
)

import flashjax
from flashjax import dropout


def kernel(q, k, v, **kwargs):
    return flashjax.flash_attention(q, k, v, backend="triton", config=SMALL_TILES, **kwargs)


# ---- against the reference -----------------------------------------------------------------
CASES = [
    # (shape, dtype, options without the rng)
    pytest.param(Shape(heads=4, kv_heads=2), jnp.float32, dict(dropout_rate=0.5, causal=True), id="rate0.5-causal-gqa"),
    pytest.param(Shape(heads=4, kv_heads=1, seq_q=40), jnp.float32,
                 dict(dropout_rate=0.3, broadcast_dropout=True, bias="BHQK", kv_lengths=jnp.array([70, 23])),
                 id="broadcast-bias-lengths-mqa"),
    pytest.param(Shape(seq_q=70, seq_k=40), jnp.float32, dict(dropout_rate=0.2, causal=True, window=(7, None)),
                 id="causal-window-q>k-empty-rows"),
    pytest.param(Shape(heads=4, kv_heads=2), jnp.bfloat16, dict(dropout_rate=0.1, causal=True), id="causal-gqa-bf16"),
]


@pytest.mark.parametrize("shape, dtype, options", CASES)
def test_dropout_matches_reference(shape, dtype, options, key, make_inputs):
    s = shape
    inputs = make_inputs(s.batch, s.seq_q, s.seq_k, s.heads, s.kv_heads, s.head_dim, dtype)
    options = dict(options, dropout_rng=jax.random.fold_in(key, 7))
    if options.get("bias") == "BHQK":
        options["bias"] = random_bias(jax.random.fold_in(key, 8), (s.batch, s.heads, s.seq_q, s.seq_k), dtype)
    got, want = run_both(inputs, **options)
    assert_matches(got, want, dtype)
    if np.any(np.asarray(want.lse) == -np.inf):
        assert_empty_rows_are_zero(got, want)


def test_same_seed_is_bitwise_reproducible_and_gradients_deterministic(key, make_inputs):
    inputs = make_inputs(2, 70, 70, 4, 2, 16, jnp.float32)
    rng = jax.random.fold_in(key, 1)
    options = dict(dropout_rate=0.5, dropout_rng=rng, causal=True)
    dlse = inputs.dlse
    first = attention_vjp(kernel, inputs.q, inputs.k, inputs.v, None, inputs.do, dlse, options)
    second = attention_vjp(kernel, inputs.q, inputs.k, inputs.v, None, inputs.do, dlse, options)
    for name in ("o", "lse", "dq", "dk", "dv"):
        np.testing.assert_array_equal(np.asarray(getattr(first, name)), np.asarray(getattr(second, name)), err_msg=name)
    # A new key with the same bits draws the same mask.
    again = kernel(inputs.q, inputs.k, inputs.v, dropout_rate=0.5, dropout_rng=jax.random.fold_in(key, 1), causal=True)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(first.o))


def test_different_seeds_give_different_outputs(key, make_inputs):
    inputs = make_inputs(2, 70, 70, 2, 2, 16, jnp.float32)
    run = lambda rng: np.asarray(kernel(inputs.q, inputs.k, inputs.v, dropout_rate=0.3, dropout_rng=rng))
    a, b = run(jax.random.fold_in(key, 1)), run(jax.random.fold_in(key, 2))
    # Every row drops a different subset of its 70 keys: every output row changes.
    assert np.mean(a != b) > 0.99
    masks = [dropout.keep_mask(dropout.seed_words(jax.random.fold_in(key, i)), 0.3, 2, 2, 70, 70) for i in (1, 2)]
    assert np.mean(np.asarray(masks[0]) != np.asarray(masks[1])) > 0.3  # independent: 2 * 0.3 * 0.7 = 0.42


# ---- the kernels' mask, made visible ---------------------------------------------------------
@pytest.mark.parametrize("broadcast", [False, True], ids=["per-head", "broadcast"])
def test_kernel_mask_equals_keep_mask(broadcast, key):
    """With q = 0 every visible weight is 1/Tk; with v = I the output row i is keep[i, :] / (Tk (1 - p)).

    Likewise with do = I the gradient dv[j] = sum_i P_ij do_i exposes column j of the
    mask as the dK/dV kernel regenerates it.
    """
    batch, seq, heads, rate = 2, 32, 2, 0.4
    eye = jnp.broadcast_to(jnp.eye(seq, dtype=jnp.float32)[None, :, None, :], (batch, seq, heads, seq))
    q = jnp.zeros((batch, seq, heads, seq), jnp.float32)
    k = jax.random.normal(key, (batch, seq, heads, seq), jnp.float32)
    rng = jax.random.fold_in(key, 1)
    fn = lambda q, k, v: kernel(q, k, v, dropout_rate=rate, dropout_rng=rng, broadcast_dropout=broadcast)
    o, pullback = jax.vjp(fn, q, k, eye)
    _, _, dv = pullback(eye)
    weight = 1.0 / (seq * (1.0 - rate))
    from_o = np.moveaxis(np.asarray(o), 2, 1) / weight  # [B, H, Tq, Tk]
    from_dv = np.moveaxis(np.asarray(dv), 2, 1).swapaxes(2, 3) / weight
    np.testing.assert_allclose(from_o, np.round(from_o), atol=1e-4)
    np.testing.assert_allclose(from_dv, np.round(from_dv), atol=1e-4)

    want = np.broadcast_to(np.asarray(dropout.keep_mask(dropout.seed_words(rng), rate, batch, heads, seq, seq, broadcast=broadcast)), from_o.shape)
    np.testing.assert_array_equal(from_o > 0.5, want, err_msg="forward kernel's mask")
    np.testing.assert_array_equal(from_dv > 0.5, want, err_msg="dK/dV kernel's mask")
    same_everywhere = np.all(want == want[:1, :1])
    assert same_everywhere == broadcast, "broadcast_dropout must share one mask across batch and heads, and only then"


def test_broadcast_dropout_identical_rows_give_identical_outputs(key):
    """Identical inputs in every batch row and head: broadcast dropout gives identical outputs."""
    q, k, v = (jnp.broadcast_to(jax.random.normal(jax.random.fold_in(key, i), (1, 40, 1, 16)), (2, 40, 2, 16)) for i in range(3))
    rng = jax.random.fold_in(key, 3)
    for broadcast in (True, False):
        o = np.asarray(kernel(q, k, v, dropout_rate=0.5, dropout_rng=rng, broadcast_dropout=broadcast))
        same = all(np.array_equal(o[b, :, h], o[0, :, 0]) for b in range(2) for h in range(2))
        assert same == broadcast


# ---- statistics of the mask -----------------------------------------------------------------
def _corr(a, b) -> float:
    a = a.astype(np.float64).ravel()
    b = b.astype(np.float64).ravel()
    return float(np.corrcoef(a, b)[0, 1])


@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_keep_mask_statistics(rate, key):
    """Keep rate within 4 standard errors of 1 - rate; rows, columns and streams uncorrelated."""
    batch, heads, seq = 2, 4, 256
    keep = np.asarray(dropout.keep_mask(dropout.seed_words(key), rate, batch, heads, seq, seq))
    assert keep.shape == (batch, heads, seq, seq) and keep.dtype == bool
    n = keep.size
    p = 1.0 - rate
    assert abs(keep.mean() - p) < 4 * math.sqrt(p * rate / n), f"keep fraction {keep.mean():.5f} vs {p}"

    # Per-row and per-column keep fractions spread as a binomial's: the sample std of
    # N fractions has relative standard error ~ 1/sqrt(2N).
    binomial_std = math.sqrt(p * rate / seq)
    for axis, name in ((3, "row"), (2, "column")):
        fractions = keep.mean(axis=axis).ravel()
        ratio = fractions.std(ddof=1) / binomial_std
        assert abs(ratio - 1) < 4 / math.sqrt(2 * fractions.size), f"{name} fraction std is {ratio:.3f}x binomial"

    # Neighbouring rows, neighbouring columns, heads and batch rows: no correlation.
    pairs = {
        "adjacent rows": (keep[:, :, :-1, :], keep[:, :, 1:, :]),
        "adjacent columns": (keep[..., :-1], keep[..., 1:]),
        "rows 2^k apart": (keep[:, :, :128, :], keep[:, :, 128:, :]),
        # Keys k and k + 64 of a 128-key block take the two halves of one draw.
        "keys sharing a draw": tuple(keep.reshape(*keep.shape[:-1], -1, 2, 64)[..., half, :] for half in (0, 1)),
        "heads": (keep[:, 0], keep[:, 1]),
        "batch rows": (keep[0], keep[1]),
        "transpose": (keep, keep.swapaxes(2, 3)),
    }
    for name, (a, b) in pairs.items():
        r = _corr(a, b)
        # The transpose counts each pair (i, j), (j, i) twice and shares its diagonal
        # with the mask itself (1/seq of the entries).
        bound = 4 / math.sqrt(a.size) if name != "transpose" else 4 * math.sqrt(2 / a.size) + 1.0 / seq
        assert abs(r) < bound, f"{name}: correlation {r:.4f} (bound {bound:.4f})"

    shared = np.asarray(dropout.keep_mask(dropout.seed_words(key), rate, batch, heads, seq, seq, broadcast=True))
    assert shared.shape == (1, 1, seq, seq)
    assert abs(shared.mean() - p) < 4 * math.sqrt(p * rate / shared.size)


def test_kernel_rescales_kept_weights(key):
    """q = 0 (uniform weights) and v = 1: each output is kept / (Tk (1 - p)), whose mean is 1."""
    batch, seq, heads, rate = 2, 128, 4, 0.5
    q = jnp.zeros((batch, seq, heads, 16), jnp.float32)
    k = jax.random.normal(key, q.shape, jnp.float32)
    v = jnp.ones(q.shape, jnp.float32)
    o = np.asarray(flashjax.flash_attention(q, k, v, dropout_rate=rate, dropout_rng=jax.random.fold_in(key, 1), backend="triton"))
    rows = o[..., 0].ravel()  # every column of a row is the same
    np.testing.assert_array_equal(o, np.broadcast_to(o[..., :1], o.shape))
    per_row_var = rate / ((1.0 - rate) * seq)  # Var(kept / (n (1 - p))) for n Bernoulli(1 - p) draws
    se = math.sqrt(per_row_var / rows.size)
    assert abs(rows.mean() - 1.0) < 4 * se, f"mean output {rows.mean():.5f}, 1 +- {4 * se:.5f}"
    ratio = rows.var(ddof=1) / per_row_var
    assert abs(ratio - 1) < 4 * math.sqrt(2 / (rows.size - 1)) * 1.5, f"per-row variance is {ratio:.3f}x the binomial's"


def test_keep_bits_are_lowbias32_of_each_pair():
    """`keep_bits` folds the hash's first step per row and per column; the bits must be those
    of lowbias32(row hash ^ pair column) per (row, key pair), written in full here: keys k and
    k + 64 of a 128-key block share the draw of pair column (k // 128) * 64 + k % 64, the
    first taking its low 16 bits, the second its high 16 (positions past 2**16 and 2**24
    included, where the column's own fold is not a no-op)."""
    def lowbias32(x):
        x = (x ^ (x >> 16)) * np.uint64(0x7FEB352D) % 2**32
        x = (x ^ (x >> 15)) * np.uint64(0x846CA68B) % 2**32
        return x ^ (x >> 16)

    rng = np.random.default_rng(0)
    base = np.uint64(rng.integers(0, 2**32))
    special = [2**16 - 1, 2**16, 2**16 + 64, 2**24 + 7, 2**24 + 71]
    rows = np.concatenate([np.arange(5), rng.integers(0, 2**31, 60), special]).astype(np.int64)
    cols = np.concatenate([np.arange(130), rng.integers(0, 2**31, 60), special]).astype(np.int64)
    threshold = dropout.keep_threshold(0.37)
    row_hash = lowbias32(base ^ (rows.astype(np.uint64) * np.uint64(0x9E3779B9) % 2**32))
    pair = ((cols // 128) * 64 + cols % 64).astype(np.uint64)
    draw = lowbias32(row_hash[:, None] ^ pair[None, :])
    bits = np.where((cols // 64) % 2 == 1, draw >> 16, draw & 0xFFFF)
    want = bits >= threshold
    got = dropout.tile_keep(jnp.uint32(int(base)), jnp.asarray(rows, jnp.int32)[:, None],
                            jnp.asarray(cols, jnp.int32)[None, :], threshold)
    np.testing.assert_array_equal(np.asarray(got), want)
    assert 0.5 < want.mean() < 0.75  # both outcomes occur: the check is not vacuous


def test_keep_pair_draws_the_bits_of_both_keys(key):
    """`keep_pair` (one hash per pair, the Hopper forward and dQ kernels' path over 128-key
    tiles) gives the per-key bits of `tile_keep` for keys k and k + 64 of each block."""
    base = dropout.stream_base(*dropout.seed_words(key), 3)
    rows = jnp.arange(40, dtype=jnp.int32)[:, None] + 1000
    for start in (0, 128, 2**24):
        first = start + jnp.arange(64, dtype=jnp.int32)[None, :]
        threshold = dropout.keep_threshold(0.3)
        low, high = dropout.keep_pair(dropout.row_keys(base, rows), dropout.column_words(first), threshold)
        want = dropout.tile_keep(base, rows, start + jnp.arange(128, dtype=jnp.int32)[None, :], threshold)
        np.testing.assert_array_equal(np.concatenate([low, high], axis=1), np.asarray(want))


def test_keep_threshold_rounds_the_rate_to_16_bits():
    assert dropout.keep_threshold(0.0) == 0
    assert dropout.keep_threshold(0.5) == 2**15
    assert dropout.keep_threshold(0.1) == round(0.1 * 2**16)
    assert dropout.keep_threshold(1 - 2**-20) == 2**16 - 1  # never a threshold that drops every key


@pytest.mark.parametrize("rate", [0.1, 0.3, 0.5, 0.9, 1 - 1e-5, 1 - 1e-6])
def test_kept_weights_are_scaled_by_the_rate_as_drawn(rate, key):
    """A kept weight is scaled by 1 / P(keep) of the rate rounded to 16 bits, so that a weight's
    expectation is unchanged: at a rate of 1 - 1e-5, 1 / (1 - rate) would make it 1.53."""
    keep_probability = (2**16 - dropout.keep_threshold(rate)) / 2**16
    assert dropout.keep_scale(rate) * keep_probability == pytest.approx(1.0, rel=1e-15)
    if rate <= 0.9:  # where the rate's rounding (<= 2^-17) is small against 1 - rate
        assert dropout.keep_scale(rate) == pytest.approx(1 / (1 - rate), rel=2**-16 / (1 - rate))
    # The reference and the kernels scale alike: q = 0 (uniform weights) and v = 1 make each
    # output row (number kept) * keep_scale / Tk.
    q = jnp.zeros((1, 64, 2, 16), jnp.float32)
    v = jnp.ones((1, 64, 2, 16), jnp.float32)
    rng = jax.random.fold_in(key, 2)
    keep = np.asarray(dropout.keep_mask(dropout.seed_words(rng), rate, 1, 2, 64, 64))
    want = keep.sum(-1).transpose(0, 2, 1) * dropout.keep_scale(rate) / 64  # [1, Tq, H]
    for backend in ("triton", "xla"):
        o = flashjax.flash_attention(q, q, v, dropout_rate=rate, dropout_rng=rng, backend=backend)
        np.testing.assert_allclose(np.asarray(o)[..., 0], want, rtol=1e-6, err_msg=backend)


@pytest.fixture
def rbg_default():
    """JAX's default PRNG implementation set to rbg (raw keys uint32[4]) for one test."""
    before = jax.config.jax_default_prng_impl
    jax.config.update("jax_default_prng_impl", "rbg")
    yield
    jax.config.update("jax_default_prng_impl", before)


def test_raw_keys_of_the_default_implementation(rbg_default):
    """Under jax_default_prng_impl="rbg" (large training setups), `jax.random.PRNGKey` is a
    raw uint32[4] key, which linen's make_rng hands to attention_fn: accepted, with the mask
    of the same key typed; a uint32[2] key is not of that implementation and is refused."""
    raw = jax.random.PRNGKey(3)
    assert raw.shape == (4,)
    q = jax.random.normal(jax.random.key(0), (1, 24, 2, 16), jnp.float32)
    run = lambda rng: flashjax.flash_attention(q, q, q, dropout_rate=0.5, dropout_rng=rng)
    np.testing.assert_array_equal(np.asarray(run(raw)), np.asarray(run(jax.random.wrap_key_data(raw))))
    with pytest.raises(ValueError, match=r"uint32\[4\]"):
        run(jnp.zeros((2,), jnp.uint32))

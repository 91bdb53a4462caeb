"""flashjax.flax against Flax's own attention: same parameters, same inputs.

Every test builds a Flax module twice, once with Flax's default attention and
once with flashjax (the `attention_fn` drop-in or our `FlashMultiHeadAttention`),
gives both the same parameters and inputs, and compares outputs and parameter
gradients under `jax.jit` / `nnx.jit`. Dimensions are tiny so the Pallas kernels
run quickly in interpret mode on the CPU.

Tolerances: everything is float32 on both sides; the kernels' online softmax
sums in a different order than Flax's `softmax`, ~1e-6 relative error observed,
so we allow conftest's float32 tolerance (2e-5) on outputs and 1e-4 on parameter
gradients (which sum over batch, positions and heads, a longer accumulation).
The bfloat16 test uses conftest's bfloat16 tolerance.

Rows whose keys are all masked (padded queries) differ on purpose: Flax fills
them with -big and returns the mean of V, flashjax returns 0. Losses weight those
rows by 0, as any training loss over padded positions does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import flashjax.flax
from flashjax import backends
from flashjax.flax import linen as fj_linen
from flashjax.flax import nnx as fj_nnx

FEATURES, HEADS, SEQ = 32, 4, 8  # head_dim 8
GRAD_TOL = 1e-4
OUT_TOL = 2e-5


@pytest.fixture(autouse=True)
def _exact_float32_matmuls():
    """Both sides in exact float32: Flax's projections and default attention use JAX's
    default matmul precision, which on a GPU rounds float32 operands to TF32 (~1e-3
    relative), far above the float32 tolerance. On the CPU this changes nothing."""
    with jax.default_matmul_precision("highest"):
        yield


def _tree_close(got, want, tol, what):
    """Leafwise relative error, measured against max(leaf norm, 1% of the tree's norm).

    The floor matters for leaves whose exact gradient is 0: the key projection's
    bias shifts every logit of a row by the same amount, which the softmax
    ignores, so both sides return rounding noise (~1e-7) there.
    """
    got_leaves = jax.tree_util.tree_leaves_with_path(got)
    want_leaves = [np.asarray(w, np.float64) for w in jax.tree.leaves(want)]
    assert len(got_leaves) == len(want_leaves), what
    floor = 1e-2 * np.sqrt(sum(np.sum(w**2) for w in want_leaves))
    for (path, g), w in zip(got_leaves, want_leaves):
        g = np.asarray(g, np.float64)
        assert g.shape == w.shape and np.all(np.isfinite(g)), f"{what}{jax.tree_util.keystr(path)}"
        err = np.linalg.norm(g - w) / max(np.linalg.norm(w), floor, 1e-30)
        assert err <= tol, f"{what}{jax.tree_util.keystr(path)}: relative error {err:.3g} > {tol:.3g}"


def _row_weight(mask, shape):
    """[batch..., q, 1] weights: 0 for query rows that see no key (see the module docstring)."""
    if mask is None:
        return jnp.ones(shape[:-1] + (1,))
    visible = jnp.max(mask, axis=(-3, -1)) > 0  # [batch..., q]
    return jnp.broadcast_to(visible, shape[:-1])[..., None].astype(jnp.float32)


def _tokens(key, shape, lengths=None):
    """Token ids >= 1, right-padded with 0 past `lengths` (per leading row)."""
    tokens = jax.random.randint(key, shape, 1, 10)
    if lengths is not None:
        positions = jnp.arange(shape[-1])
        tokens = jnp.where(positions < jnp.asarray(lengths)[..., None], tokens, 0)
    return tokens


def _case(name, key):
    """(inputs_q, inputs_kv, mask) for a named attention pattern."""
    kq, kkv, kt = jax.random.split(key, 3)
    x = jax.random.normal(kq, (2, SEQ, FEATURES))
    if name == "self":
        return x, x, None
    if name == "cross":
        return x, jax.random.normal(kkv, (2, SEQ + 5, FEATURES)), None
    if name == "padding":  # the usual encoder padding mask; the 2nd row has 5 real tokens
        tokens = _tokens(kt, (2, SEQ), lengths=[SEQ, 5])
        return x, x, nn.make_attention_mask(tokens > 0, tokens > 0)
    if name == "causal":
        return x, x, nn.make_causal_mask(_tokens(kt, (2, SEQ)))
    if name == "batch_dims":  # [batch, beams, seq, features]: extra batch dims are flattened
        x = jax.random.normal(kq, (2, 3, SEQ, FEATURES))
        return x, x, nn.make_causal_mask(_tokens(kt, (2, 3, SEQ)))
    raise ValueError(name)


# ---- linen ----------------------------------------------------------------------------
def _linen_loss(module, params, xq, xkv, mask, ct):
    out = module.apply(params, xq, xkv, mask=mask)
    return jnp.sum(out * ct * _row_weight(mask, out.shape)), out


# Cases split between linen and nnx so that each path (mask array, causal flag, GQA,
# cross lengths, extra batch dims) is covered once: each new shape costs a compile.
@pytest.mark.parametrize("case", ["cross", "padding", "batch_dims"])
def test_linen_attention_fn_matches_flax(case, key, assert_close):
    xq, xkv, mask = _case(case, key)
    flax_mha = nn.MultiHeadDotProductAttention(num_heads=HEADS)
    ours = nn.MultiHeadDotProductAttention(num_heads=HEADS, attention_fn=flashjax.flax.attention_fn)
    params = flax_mha.init(jax.random.fold_in(key, 1), xq, xkv)
    ct = jax.random.normal(jax.random.fold_in(key, 2), xq.shape)

    def run(module):
        grad_fn = jax.jit(jax.grad(functools.partial(_linen_loss, module), has_aux=True))
        return grad_fn(params, xq, xkv, mask, ct)

    (g_ours, out_ours), (g_flax, out_flax) = run(ours), run(flax_mha)
    w = _row_weight(mask, out_flax.shape)
    assert_close(out_ours * w, out_flax * w, jnp.float32, "out", tol=OUT_TOL)
    _tree_close(g_ours, g_flax, GRAD_TOL, "grad")


def test_linen_module_loads_flax_params(key, assert_close):
    """Our module with a Flax checkpoint == Flax's module; `causal=True` == Flax + causal mask."""
    x, _, mask = _case("causal", key)
    flax_mha = nn.MultiHeadDotProductAttention(num_heads=HEADS)
    params = flax_mha.init(key, x)
    ours = fj_linen.FlashMultiHeadAttention(num_heads=HEADS, causal=True)
    assert jax.tree.map(jnp.shape, ours.init(key, x)) == jax.tree.map(jnp.shape, params)
    out_ours = jax.jit(ours.apply)(params, x)
    out_flax = jax.jit(lambda p, x, m: flax_mha.apply(p, x, mask=m))(params, x, mask)
    assert_close(out_ours, out_flax, jnp.float32, "out", tol=OUT_TOL)


@pytest.mark.parametrize("causal", [False, True])
def test_linen_module_gqa_matches_repeated_kv(causal, key, assert_close):
    """GQA: our module == Flax's MHA whose key/value projections repeat each kv head."""
    kv_heads = 2
    x, _, _ = _case("self", key)
    ours = fj_linen.FlashMultiHeadAttention(num_heads=HEADS, num_kv_heads=kv_heads, causal=causal)
    params = ours.init(key, x)
    assert params["params"]["key"]["kernel"].shape == (FEATURES, kv_heads, FEATURES // HEADS)

    def repeat_heads(p):  # kernel [F, Hkv, D] / bias [Hkv, D] -> [F, H, D] / [H, D]
        axis = p.ndim - 2
        return jnp.repeat(p, HEADS // kv_heads, axis=axis)

    flax_params = {"params": dict(params["params"])}
    for name in ("key", "value"):
        flax_params["params"][name] = jax.tree.map(repeat_heads, params["params"][name])
    mask = nn.make_causal_mask(x[..., 0]) if causal else None
    out_ours = jax.jit(ours.apply)(params, x)
    out_flax = nn.MultiHeadDotProductAttention(num_heads=HEADS).apply(flax_params, x, mask=mask)
    assert_close(out_ours, out_flax, jnp.float32, "out", tol=OUT_TOL)


def test_linen_decode_matches_flax(key, assert_close):
    """Flax's KV cache (one query vs the cache plus a cache mask), step by step."""
    x = jax.random.normal(key, (2, SEQ, FEATURES))
    flax_mha = nn.MultiHeadDotProductAttention(num_heads=HEADS, decode=True)
    variables = flax_mha.init(key, x)  # init with the full length creates the cache
    params, cache = {"params": variables["params"]}, variables["cache"]
    modules = {
        "flax": flax_mha,
        "attention_fn": nn.MultiHeadDotProductAttention(
            num_heads=HEADS, decode=True, attention_fn=flashjax.flax.attention_fn),
        "module": fj_linen.FlashMultiHeadAttention(num_heads=HEADS, decode=True),
    }
    outputs = {}
    for name, module in modules.items():
        step = jax.jit(lambda c, xt, m=module: m.apply({**params, "cache": c}, xt, mutable=["cache"]))
        c, outs = cache, []
        for t in range(SEQ):
            out, mutated = step(c, x[:, t:t + 1])
            c = mutated["cache"]
            outs.append(out)
        outputs[name] = jnp.concatenate(outs, axis=1)
    for name in ("attention_fn", "module"):
        assert_close(outputs[name], outputs["flax"], jnp.float32, name, tol=OUT_TOL)
    # Decoding token by token == causal attention over the whole sequence.
    full = fj_linen.FlashMultiHeadAttention(num_heads=HEADS, causal=True).apply(params, x)
    assert_close(outputs["module"], full, jnp.float32, "decode vs causal", tol=OUT_TOL)


@pytest.mark.parametrize("page_size", [2, 8], ids=["page2", "page8"])
def test_linen_paged_cache(page_size, key, assert_close):
    """linen's page_size: the "cache" collection holds page pools and a page table; a prompt
    chunk, then one token per step, equals causal attention over the whole sequence."""
    x = jax.random.normal(key, (2, SEQ, FEATURES))
    paged = fj_linen.FlashMultiHeadAttention(num_heads=HEADS, num_kv_heads=2, causal=True, decode=True,
                                             page_size=page_size)
    variables = paged.init(key, x)
    params, cache = {"params": variables["params"]}, variables["cache"]
    pages_per_seq = -(-SEQ // page_size)
    assert cache["cached_key"].shape == (2 * pages_per_seq, page_size, 2, FEATURES // HEADS)
    assert cache["page_table"].shape == (2, pages_per_seq)
    step = jax.jit(lambda c, xt: paged.apply({**params, "cache": c}, xt, mutable=["cache"]))
    outs = []
    for chunk in (x[:, :3], *(x[:, t:t + 1] for t in range(3, SEQ))):
        out, mutated = step(cache, chunk)
        cache = mutated["cache"]
        outs.append(out)
    full = fj_linen.FlashMultiHeadAttention(num_heads=HEADS, num_kv_heads=2, causal=True).apply(params, x)
    assert_close(jnp.concatenate(outs, axis=1), full, jnp.float32, "paged decode vs causal", tol=OUT_TOL)


# ---- nnx ------------------------------------------------------------------------------
def _nnx_pair(key, **kwargs):
    """Flax's nnx.MultiHeadAttention with its default attention and with ours, same params."""
    seed = int(jax.random.randint(key, (), 0, 2**30))
    make = lambda **kw: nnx.MultiHeadAttention(  # noqa: E731
        num_heads=HEADS, in_features=FEATURES, decode=False, rngs=nnx.Rngs(seed), **kwargs, **kw)
    return make(), make(attention_fn=flashjax.flax.attention_fn)


@nnx.jit(static_argnames="is_causal")
def _nnx_loss_and_grad(module, xq, xkv, mask, ct, is_causal=False):
    def loss(m):
        out = m(xq, xkv, mask=mask, is_causal=is_causal)
        return jnp.sum(out * ct * _row_weight(mask, out.shape)), out

    return nnx.grad(loss, has_aux=True)(module)


@pytest.mark.parametrize("case", ["self", "causal", "is_causal", "gqa"])
def test_nnx_attention_fn_matches_flax(case, key, assert_close):
    is_causal = case == "is_causal"
    xq, xkv, mask = _case("self" if case in ("is_causal", "gqa") else case, key)
    flax_mha, ours = _nnx_pair(key, num_kv_heads=2 if case == "gqa" else None)
    ct = jax.random.normal(jax.random.fold_in(key, 2), xq.shape)
    g_flax, out_flax = _nnx_loss_and_grad(flax_mha, xq, xkv, mask, ct, is_causal=is_causal)
    g_ours, out_ours = _nnx_loss_and_grad(ours, xq, xkv, mask, ct, is_causal=is_causal)
    w = _row_weight(mask, out_flax.shape)
    assert_close(out_ours * w, out_flax * w, jnp.float32, "out", tol=OUT_TOL)
    _tree_close(nnx.state(g_ours, nnx.Param), nnx.state(g_flax, nnx.Param), GRAD_TOL, "grad")


def test_nnx_attention_fn_is_causal_cross_is_top_left(key, assert_close):
    """Flax's is_causal with q_len != kv_len is jnp.tril: aligned to the top left."""
    xq, xkv, _ = _case("cross", key)
    flax_mha, ours = _nnx_pair(key)
    out_flax = flax_mha(xq, xkv, is_causal=True)
    out_ours = nnx.jit(lambda m, a, b: m(a, b, is_causal=True))(ours, xq, xkv)
    assert_close(out_ours, out_flax, jnp.float32, "out", tol=OUT_TOL)


def test_attention_fn_values_with_their_own_head_dim(key, assert_close):
    """Values of another head dim than the queries' (MLA-style): the output takes the values'
    head dim, as Flax's own dot_product_attention does, with extra batch dims kept."""
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (2, 3, 10, HEADS, 16))
    k = jax.random.normal(kk, (2, 3, 12, HEADS, 16))
    v = jax.random.normal(kv, (2, 3, 12, HEADS, 32))
    got = flashjax.flax.attention_fn(q, k, v)
    assert got.shape == (2, 3, 10, HEADS, 32)
    flat = lambda x: x.reshape((6,) + x.shape[2:])
    want = flashjax.flash_attention(flat(q), flat(k), flat(v), backend="xla")
    assert_close(flat(got), want, jnp.float32, "out")


def test_nnx_module_matches_flax(key, assert_close):
    """Same rngs -> same params as nnx.MultiHeadAttention (GQA); same outputs and grads."""
    kv_heads = 2
    x, _, _ = _case("self", key)
    ct = jax.random.normal(jax.random.fold_in(key, 2), x.shape)
    flax_mha = nnx.MultiHeadAttention(
        num_heads=HEADS, in_features=FEATURES, num_kv_heads=kv_heads, decode=False, rngs=nnx.Rngs(3))
    ours = fj_nnx.FlashMultiHeadAttention(
        num_heads=HEADS, in_features=FEATURES, num_kv_heads=kv_heads, causal=True, rngs=nnx.Rngs(3))
    _tree_close(nnx.state(ours, nnx.Param), nnx.state(flax_mha, nnx.Param), 0.0, "init")

    @nnx.jit
    def loss_and_grad(m, x, ct):
        def loss(m):
            out = m(x) if isinstance(m, fj_nnx.FlashMultiHeadAttention) else m(x, is_causal=True)
            return jnp.sum(out * ct), out

        return nnx.grad(loss, has_aux=True)(m)

    g_flax, out_flax = loss_and_grad(flax_mha, x, ct)
    g_ours, out_ours = loss_and_grad(ours, x, ct)
    assert_close(out_ours, out_flax, jnp.float32, "out", tol=OUT_TOL)
    _tree_close(nnx.state(g_ours, nnx.Param), nnx.state(g_flax, nnx.Param), GRAD_TOL, "grad")


def test_nnx_module_loads_flax_checkpoint(key, assert_close):
    """A trained nnx.MultiHeadAttention's params load into ours with nnx.update."""
    x, _, _ = _case("self", key)
    flax_mha = nnx.MultiHeadAttention(num_heads=HEADS, in_features=FEATURES, decode=False, rngs=nnx.Rngs(1))
    ours = fj_nnx.FlashMultiHeadAttention(num_heads=HEADS, in_features=FEATURES, rngs=nnx.Rngs(2))
    nnx.update(ours, nnx.state(flax_mha, nnx.Param))
    assert_close(nnx.jit(lambda m, x: m(x))(ours, x), flax_mha(x), jnp.float32, "out", tol=OUT_TOL)


def test_nnx_module_qk_norm(key, assert_close):
    """qk_norm = RMSNorm over head_dim on q and k, then plain attention."""
    x, _, _ = _case("self", key)
    ours = fj_nnx.FlashMultiHeadAttention(num_heads=HEADS, in_features=FEATURES, qk_norm=True, rngs=nnx.Rngs(0))
    ours.query_norm.scale[...] = jax.random.uniform(key, (FEATURES // HEADS,), minval=0.5, maxval=2.0)
    q, k, v = ours.query_norm(ours.query(x)), ours.key_norm(ours.key(x)), ours.value(x)
    want = ours.out(nnx.dot_product_attention(q, k, v))
    assert_close(nnx.jit(lambda m, x: m(x))(ours, x), want, jnp.float32, "out", tol=OUT_TOL)


def test_nnx_decode(key, assert_close):
    """nnx's init_cache / decode=True: Flax's module with our attention_fn vs its default,
    and our GQA module (cache of kv heads) decoding vs its causal full-sequence output."""
    x = jax.random.normal(key, (2, SEQ, FEATURES))
    flax_mha, flax_ours = _nnx_pair(key)
    gqa = fj_nnx.FlashMultiHeadAttention(
        num_heads=HEADS, in_features=FEATURES, num_kv_heads=2, causal=True, rngs=nnx.Rngs(0))
    full = gqa(x)
    for m in (flax_mha, flax_ours, gqa):
        m.init_cache(x.shape)
    assert gqa.cached_key.shape == (2, SEQ, 2, FEATURES // HEADS)

    step = nnx.jit(lambda m, xt: m(xt, decode=True))
    outs = {name: [] for name in ("flax", "ours", "gqa")}
    for t in range(SEQ):
        for name, m in (("flax", flax_mha), ("ours", flax_ours), ("gqa", gqa)):
            outs[name].append(step(m, x[:, t:t + 1]))
    outs = {name: jnp.concatenate(v, axis=1) for name, v in outs.items()}
    assert_close(outs["ours"], outs["flax"], jnp.float32, "attention_fn decode", tol=OUT_TOL)
    assert_close(outs["gqa"], full, jnp.float32, "gqa decode vs causal", tol=OUT_TOL)


@pytest.mark.parametrize("cache_dtype", [jnp.float32, jnp.bfloat16], ids=["f32-cache", "bf16-cache"])
def test_nnx_decode_prefill_chunk_then_tokens(cache_dtype, key, assert_close, monkeypatch):
    """A prompt chunk fed through the cache at once, then one token per step, with two batch
    dims and GQA: equal to the causal full-sequence output. The steps are
    `flashjax.decode_attention` calls (the split-KV path), on the batch dims flattened."""
    from flashjax.flax import common as flax_common

    shapes, real = [], flax_common.decode_attention

    def spy(q, *args, **kwargs):
        shapes.append((q.shape, q.dtype))
        return real(q, *args, **kwargs)

    monkeypatch.setattr(flax_common, "decode_attention", spy)
    x = jax.random.normal(key, (2, 3, SEQ, FEATURES))
    m = fj_nnx.FlashMultiHeadAttention(num_heads=HEADS, in_features=FEATURES, num_kv_heads=2, causal=True,
                                       rngs=nnx.Rngs(0))
    full = m(x)
    m.init_cache(x.shape, dtype=cache_dtype)
    prompt = 5
    outs = [m(x[..., :prompt, :], decode=True)]
    step = nnx.jit(lambda m, xt: m(xt, decode=True))
    outs += [step(m, x[..., t:t + 1, :]) for t in range(prompt, SEQ)]
    got = jnp.concatenate(outs, axis=-2)
    # A bfloat16 cache rounds K/V (and the query, cast to the cache's dtype) to bf16.
    tol = OUT_TOL if cache_dtype == jnp.float32 else 1.6e-2
    assert_close(got, full, jnp.float32, "prefill + decode vs causal", tol=tol)
    assert got.dtype == jnp.float32
    assert shapes[0] == ((6, prompt, HEADS, FEATURES // HEADS), jnp.dtype(cache_dtype))
    assert shapes[-1][0] == (6, 1, HEADS, FEATURES // HEADS)
    assert int(m.cache_index[...]) == SEQ
    with pytest.raises(ValueError, match="holds 8 positions"):
        m(x[..., :1, :], decode=True)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_refuses_a_prompt_chunk_without_causal(paged, key, assert_close):
    """A module built as Flax's are (causality from a training mask, causal=False) takes one
    position per decode call, each seeing the filled cache (= the causal output); a chunk
    of several positions would see its own later positions, so it is refused, naming causal=True."""
    x = jax.random.normal(key, (2, SEQ, FEATURES))
    m = fj_nnx.FlashMultiHeadAttention(num_heads=HEADS, in_features=FEATURES, num_kv_heads=2, rngs=nnx.Rngs(0))
    full = m(x, mask=nnx.make_causal_mask(x[..., 0]))
    m.init_cache(x.shape, **({"page_size": 4} if paged else {}))
    with pytest.raises(ValueError, match="causal=True"):
        m(x[:, :3], decode=True)
    got = jnp.concatenate([m(x[:, t:t + 1], decode=True) for t in range(SEQ)], axis=1)
    assert_close(got, full, jnp.float32, "one position per call vs the causal mask", tol=OUT_TOL)


def test_decode_leaves_a_named_backend_it_cannot_use_to_auto(key, monkeypatch):
    """A module built with backend="mosaic" (the Hopper kernels, for training) on an H100:
    decode steps the Hopper decode path can run use it, and those it cannot (a causal prompt
    chunk, a float32 cache) leave the choice to auto instead of raising."""
    from flashjax.flax import common as flax_common

    monkeypatch.setattr(backends, "describe_device", lambda: ("gpu", "9.0"))
    used, real = [], flax_common.decode_attention

    def spy(q, *args, backend, **kwargs):  # records the choice, computes on the reference
        used.append((q.shape[1], backend))
        return real(q, *args, backend="xla", **kwargs)

    monkeypatch.setattr(flax_common, "decode_attention", spy)
    x = jax.random.normal(key, (2, 128, 256)).astype(jnp.bfloat16)
    for cache_dtype, want in ((jnp.bfloat16, [(4, "auto"), (1, "mosaic")]), (jnp.float32, [(4, "auto"), (1, "auto")])):
        m = fj_nnx.FlashMultiHeadAttention(num_heads=2, in_features=256, causal=True, dtype=jnp.bfloat16,
                                           backend="mosaic", rngs=nnx.Rngs(0))
        m.init_cache(x.shape, dtype=cache_dtype)
        used.clear()
        m(x[:, :4], decode=True)
        m(x[:, 4:5], decode=True)
        assert used == want, (cache_dtype, used)


@pytest.mark.parametrize("page_size", [1, 4], ids=["page1", "page4"])
def test_nnx_paged_cache(page_size, key, assert_close):
    """init_cache(page_size=): a paged cache (pools + page table) decodes like the causal
    full-sequence pass, with the prompt in one chunk; a page table rewritten to other pages
    of a larger pool (as a server assigns them) gives the same outputs."""
    x = jax.random.normal(key, (2, SEQ, FEATURES))
    m = fj_nnx.FlashMultiHeadAttention(num_heads=HEADS, in_features=FEATURES, num_kv_heads=2, causal=True,
                                       rngs=nnx.Rngs(0))
    full = m(x)
    pages_per_seq = -(-SEQ // page_size)
    for shuffled in (False, True):
        m.init_cache(x.shape, page_size=page_size)
        assert m.cached_key.shape == (2 * pages_per_seq, page_size, 2, FEATURES // HEADS)
        assert m.page_table.shape == (2, pages_per_seq)
        if shuffled:  # a pool of twice the pages, each sequence's pages scattered through it
            pool = 4 * pages_per_seq
            order = jax.random.permutation(jax.random.fold_in(key, 1), pool)[: 2 * pages_per_seq]
            m.page_table[...] = order.reshape(2, pages_per_seq).astype(jnp.int32)
            m.cached_key = nnx.Cache(jnp.zeros((pool, *m.cached_key.shape[1:])))
            m.cached_value = nnx.Cache(jnp.zeros((pool, *m.cached_value.shape[1:])))
        step = nnx.jit(lambda m, xt: m(xt, decode=True))
        outs = [m(x[:, :3], decode=True)] + [step(m, x[:, t:t + 1]) for t in range(3, SEQ)]
        assert_close(jnp.concatenate(outs, axis=1), full, jnp.float32, f"paged (shuffled={shuffled})", tol=OUT_TOL)
    with pytest.raises(ValueError, match="paged KV cache holds"):
        m(x[:, :1], decode=True)
    with pytest.raises(NotImplementedError, match="paged KV cache decodes without a mask"):
        m.cache_index[...] = jnp.int32(0)
        m(x[:, :1], decode=True, mask=jnp.ones((2, 1, 1, SEQ), bool))
    with pytest.raises(ValueError, match="one batch dim"):
        m.init_cache(x.shape, page_size=4)
        m(x[None, :, :1], decode=True)


def test_decode_with_a_mask_feeds_one_position(key):
    """A mask (or bias, or dropout) in decode mode goes through flash_attention with the
    filled length, one position per call; a chunk with a mask is refused, not misaligned."""
    x = jax.random.normal(key, (2, SEQ, FEATURES))
    m = fj_nnx.FlashMultiHeadAttention(num_heads=HEADS, in_features=FEATURES, rngs=nnx.Rngs(0))
    m.init_cache(x.shape)
    with pytest.raises(ValueError, match="one position per call"):
        m(x[:, :3], decode=True, mask=jnp.ones((2, 1, 3, SEQ), bool))


# ---- dropout, dtype, errors -----------------------------------------------------------
@pytest.mark.parametrize("broadcast", [True, False])
def test_nnx_dropout(broadcast, key):
    """Dropout: reproducible per key, and Flax's broadcast_dropout shares one mask across
    batch and heads (identical batch rows stay identical only when broadcast)."""
    x = jnp.broadcast_to(jax.random.normal(key, (1, SEQ, FEATURES)), (2, SEQ, FEATURES))
    layer = nnx.MultiHeadAttention(
        num_heads=HEADS, in_features=FEATURES, decode=False, dropout_rate=0.5,
        broadcast_dropout=broadcast, attention_fn=flashjax.flax.attention_fn, rngs=nnx.Rngs(0))
    run = nnx.jit(lambda m, x, seed: m(x, deterministic=False, rngs=nnx.Rngs(dropout=seed)))
    a, b, c = (run(layer, x, jax.random.key(seed)) for seed in (1, 1, 2))
    clean = layer(x, deterministic=True)
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c) and not np.allclose(a, clean)
    assert np.allclose(a[0], a[1], atol=1e-6) == broadcast


def test_nnx_bfloat16(key, assert_close):
    x, _, mask = _case("causal", key)
    flax_mha, ours = _nnx_pair(key, dtype=jnp.bfloat16)
    out_flax = flax_mha(x, mask=mask)
    out_ours = nnx.jit(lambda m, x, mask: m(x, mask=mask))(ours, x, mask)
    assert out_ours.dtype == out_flax.dtype == jnp.bfloat16
    assert_close(out_ours, out_flax.astype(jnp.float32), jnp.bfloat16, "out")


def test_sow_weights_raises(key):
    x, _, _ = _case("self", key)
    linen_mha = nn.MultiHeadDotProductAttention(num_heads=HEADS, attention_fn=flashjax.flax.attention_fn)
    params = linen_mha.init(key, x)
    with pytest.raises(NotImplementedError, match="sow"):
        linen_mha.apply(params, x, sow_weights=True, mutable=["intermediates"])
    _, ours = _nnx_pair(key)
    with pytest.raises(NotImplementedError, match="sow"):
        ours(x, sow_weights=True)
    # Our linen module takes the argument as Flax's does: False runs, True raises.
    linen_ours = fj_linen.FlashMultiHeadAttention(num_heads=HEADS)
    linen_params = linen_ours.init(key, x)
    assert linen_ours.apply(linen_params, x, sow_weights=False).shape == x.shape
    with pytest.raises(NotImplementedError, match="sow"):
        linen_ours.apply(linen_params, x, sow_weights=True)


def test_misused_arguments_raise_as_in_flax(key):
    """A negative dropout rate raises (also where no dropout runs: with deterministic=True and
    in cache decoding), as Flax's MultiHeadAttention does, rather than passing as no dropout;
    so do values given without keys."""
    x, _, _ = _case("self", key)
    flax_mha, ours = _nnx_pair(key, dropout_rate=-0.1)
    with pytest.raises(ValueError, match=r"dropout_rate must be in \[0, 1\)"):
        ours(x, deterministic=True)
    nnx_module = fj_nnx.FlashMultiHeadAttention(num_heads=HEADS, in_features=FEATURES, dropout_rate=-0.1,
                                                deterministic=True, rngs=nnx.Rngs(0))
    linen_module = fj_linen.FlashMultiHeadAttention(num_heads=HEADS, dropout_rate=-0.1, deterministic=True)
    with pytest.raises(ValueError, match="dropout_rate must be in"):
        nnx_module(x)
    with pytest.raises(ValueError, match="dropout_rate must be in"):
        linen_module.init(key, x)
    nnx_module.init_cache(x.shape)
    with pytest.raises(ValueError, match="dropout_rate must be in"):
        nnx_module(x[:, :1], decode=True)

    nnx_module = fj_nnx.FlashMultiHeadAttention(num_heads=HEADS, in_features=FEATURES, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="inputs_k` cannot be None"):
        nnx_module(x, None, x)
    linen_module = fj_linen.FlashMultiHeadAttention(num_heads=HEADS)
    with pytest.raises(ValueError, match="inputs_k` cannot be None"):
        linen_module.init(key, x, None, x)


def test_make_attention_fn_options(key, assert_close):
    """Static options through the factory: causal (bottom-right) and the xla backend."""
    x, _, mask = _case("causal", key)
    flax_mha, _ = _nnx_pair(key)
    want = flax_mha(x, mask=mask)
    for fn in (flashjax.flax.make_attention_fn(causal=True), flashjax.flax.make_attention_fn(backend="xla")):
        flax_mha.attention_fn = fn
        got = flax_mha(x, mask=None if fn.keywords["causal"] else mask)
        assert_close(got, want, jnp.float32, str(fn.keywords), tol=OUT_TOL)


def test_models_built_alike_share_a_compiled_step(key):
    """Each model built with its own make_attention_fn(...) of the same options keys the
    jitted step alike (Flax keeps attention_fn as a static attribute): one trace for three
    models; other options trace again."""
    x = jax.random.normal(key, (2, SEQ, FEATURES))
    traces = []

    @nnx.jit
    def step(model, x):
        traces.append(1)
        return model(x)

    def build(**options):
        return nnx.MultiHeadAttention(num_heads=HEADS, in_features=FEATURES, decode=False, rngs=nnx.Rngs(0),
                                      attention_fn=flashjax.flax.make_attention_fn(**options))

    for _ in range(3):
        step(build(causal=True), x)
    assert len(traces) == 1
    step(build(causal=False), x)
    assert len(traces) == 2
    assert flashjax.flax.make_attention_fn(window=(2, 0)) == flashjax.flax.make_attention_fn(window=(2, 0))
    assert flashjax.flax.make_attention_fn(window=(2, 0)) != flashjax.flax.make_attention_fn(window=(3, 0))


def test_window_in_flax_cache_decoding_raises(key):
    """make_attention_fn(window=) aligns the window to the arrays' ends: right for a full
    sequence, wrong for Flax's KV-cache decoding (the query sits at the cache index, which
    attention_fn is not given), which raises instead of returning a wrong output."""
    x = jax.random.normal(key, (2, SEQ, FEATURES))
    fn = flashjax.flax.make_attention_fn(causal=True, window=(3, 0))
    layer = nnx.MultiHeadAttention(num_heads=HEADS, in_features=FEATURES, decode=False, attention_fn=fn,
                                   rngs=nnx.Rngs(0))
    band = (jnp.arange(SEQ)[None, :] <= jnp.arange(SEQ)[:, None]) & (jnp.arange(SEQ)[None, :] >= jnp.arange(SEQ)[:, None] - 3)
    want = nnx.MultiHeadAttention(num_heads=HEADS, in_features=FEATURES, decode=False, rngs=nnx.Rngs(0))(x, mask=band)
    np.testing.assert_allclose(np.asarray(layer(x)), np.asarray(want), rtol=1e-5, atol=1e-5)
    layer.init_cache(x.shape)
    with pytest.raises(ValueError, match="KV-cache decoding"):
        layer(x[:, :1], decode=True)


def test_nnx_view_sets_eval_and_decode_modes(key):
    """`nnx.view`, Flax's way to switch a model to eval or decode mode, reaches the module
    (its `set_view`, as nnx.MultiHeadAttention's): deterministic=True turns dropout off in a
    block beside an nnx.Dropout, and decode=True with batch_size and max_length allocates the
    cache, whose token-by-token outputs are the causal forward's."""
    x = jax.random.normal(key, (2, SEQ, FEATURES))

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.attention = fj_nnx.FlashMultiHeadAttention(num_heads=HEADS, in_features=FEATURES, causal=True,
                                                            dropout_rate=0.5, deterministic=False, rngs=rngs)
            self.dropout = nnx.Dropout(0.5, deterministic=False, rngs=rngs)

        def __call__(self, x):
            return self.dropout(self.attention(x))

    block = Block(nnx.Rngs(0))
    evaluated = nnx.view(block, deterministic=True)
    assert evaluated.attention.deterministic and not block.attention.deterministic
    np.testing.assert_array_equal(np.asarray(evaluated(x)), np.asarray(evaluated(x)))
    np.testing.assert_allclose(np.asarray(evaluated(x)), np.asarray(block.attention(x, deterministic=True)),
                               rtol=1e-6, atol=1e-6)
    # A model whose only viewable module is ours: no "Unused keys".
    alone = nnx.view(block.attention, deterministic=True)
    assert alone.deterministic

    decoding = nnx.view(block.attention, decode=True, batch_size=2, max_length=SEQ, deterministic=True)
    assert decoding.cached_key.shape == (2, SEQ, HEADS, FEATURES // HEADS) and block.attention.cached_key is None
    steps = jnp.concatenate([decoding(x[:, t:t + 1]) for t in range(SEQ)], axis=1)
    np.testing.assert_allclose(np.asarray(steps), np.asarray(block.attention(x, deterministic=True)),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="batch_size and max_length"):
        nnx.view(block.attention, decode=True)


def test_nnx_module_takes_multi_head_attentions_initialisers_and_metadata(key):
    """The output projection's own initialisers and every projection's metadata (sharding
    names), as nnx.MultiHeadAttention takes them: the same parameters, the same metadata;
    the call takes out_sharding / qkv_sharding, and input_positions (RoPE inside Flax's
    attention_fn) only as None."""
    init = nnx.initializers.lecun_normal()
    options = dict(num_heads=HEADS, in_features=FEATURES, out_kernel_init=nnx.initializers.normal(0.3),
                   out_bias_init=nnx.initializers.ones, kernel_metadata={"out_sharding": (None, "model", None)},
                   out_kernel_metadata={"out_sharding": ("model", None, None)}, kernel_init=init)
    mesh = jax.make_mesh((1,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh):
        ours = fj_nnx.FlashMultiHeadAttention(rngs=nnx.Rngs(0), **options)
        theirs = nnx.MultiHeadAttention(decode=False, rngs=nnx.Rngs(0), **options)
    for name in ("query", "key", "value", "out"):
        for param in ("kernel", "bias"):
            a, b = getattr(getattr(ours, name), param), getattr(getattr(theirs, name), param)
            np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=f"{name}.{param}")
            assert a.get_metadata().get("out_sharding") == b.get_metadata().get("out_sharding"), (name, param)
    assert ours.out.kernel.get_metadata()["out_sharding"] == ("model", None, None)
    x = jax.random.normal(key, (2, SEQ, FEATURES))
    got = ours(x, out_sharding=None, qkv_sharding=None)
    np.testing.assert_allclose(np.asarray(got), np.asarray(theirs(x)), rtol=1e-5, atol=1e-5)
    with pytest.raises(NotImplementedError, match="input_positions"):
        ours(x, input_positions=jnp.arange(SEQ))


def test_nnx_call_takes_multi_head_attentions_keywords(key):
    """The nnx module's call takes nnx.MultiHeadAttention's is_causal (top-left aligned, with
    q_len != kv_len too) and sow_weights=False, so that swapping the class keeps call sites;
    sow_weights=True and inputs of the wrong width raise clear errors."""
    x = jax.random.normal(key, (2, SEQ, FEATURES))
    ours = fj_nnx.FlashMultiHeadAttention(num_heads=HEADS, in_features=FEATURES, rngs=nnx.Rngs(0))
    flax_mha = nnx.MultiHeadAttention(num_heads=HEADS, in_features=FEATURES, decode=False, rngs=nnx.Rngs(0))
    for inputs_k in (None, x[:, :SEQ - 3]):
        got = ours(x, inputs_k, is_causal=True, sow_weights=False)
        want = flax_mha(x, inputs_k, is_causal=True)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    with pytest.raises(NotImplementedError, match="sow"):
        ours(x, sow_weights=True)
    with pytest.raises(ValueError, match="in_features=32"):
        ours(x[..., :16])
    # A mask that does not fit names itself and the shape the user passed, in our module and
    # through attention_fn in Flax's.
    drop_in = nnx.MultiHeadAttention(num_heads=HEADS, in_features=FEATURES, decode=False, rngs=nnx.Rngs(0),
                                     attention_fn=flashjax.flax.attention_fn)
    for mask in (jnp.ones((3, 1, SEQ, SEQ), bool), jnp.ones((2, SEQ + 1), bool)):
        for module in (ours, drop_in):
            with pytest.raises(ValueError, match=rf"mask of shape \({mask.shape[0]}, .* not broadcastable"):
                module(x, mask=mask)
    assert drop_in(x, mask=jnp.ones((2, 1, SEQ, SEQ), bool)).shape == x.shape

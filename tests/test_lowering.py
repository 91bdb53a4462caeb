"""The kernels lower for an H100 (sm_90) without a GPU, and hold no [Tq, Tk] tensor.

Lowering for the "cuda" platform needs no device, except that the Pallas Triton
lowering asks the local GPU for its compute capability; we stand a fake in for
that query. Nothing is compiled, so each case takes a fraction of a second. This
checks the real (non-interpret) kernel lowering on any machine: Pallas accepts the
kernels' block shapes, index maps and loop structure for Triton, and the Hopper
kernels go through Pallas' Mosaic GPU lowering (which needs no device at all).

The lowered module is also the static half of the memory evidence: with the
distinctive lengths Tq = 1000 and Tk = 1200, no tensor outside the kernels has
both a query-length and a key-length dimension, and none has Tq * Tk elements,
so no score-sized buffer exists in HBM. The same check on the xla backend finds
such tensors (a positive control).
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cuda_lowering import as_on_h100
from flashjax import MosaicConfig, TritonConfig, autodiff, backends, mods, reference
from flashjax.params import AttentionParams, DecodeParams, Extras, KVCache

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

SEQ_Q, SEQ_K = 1000, 1200
TRITON_CALL = "__gpu$xla.gpu.triton"


@pytest.fixture
def fake_h100():
    """Lowers as for an H100, each Triton module verified (`cuda_lowering.as_on_h100`)."""
    with as_on_h100():
        yield


def lower_attention_for_cuda(params, q, kv, extras: Extras = Extras()) -> str:
    """StableHLO of jit(grad) of a loss on flashjax's o and lse, lowered for CUDA."""

    def loss(q, k, v):
        o, lse = autodiff.attention(q, k, v, extras, params)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(lse)

    return lower_for_cuda(loss, q, kv, kv)


def lower_for_cuda(loss, q, k, v) -> str:
    """StableHLO text of jit(grad(loss)) lowered for the CUDA platform."""
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return grad.trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()


def tensor_shapes(text: str) -> list[tuple[int, ...]]:
    """The static shapes of every `tensor<AxBx...xdtype>` type in an MLIR text."""
    shapes = []
    for body in re.findall(r"tensor<([^>]*)>", text):
        dims = body.split("x")[:-1]  # the last part is the element type
        if all(d.isdigit() for d in dims):
            shapes.append(tuple(int(d) for d in dims))
    return shapes


def score_sized(shapes, q_lens, k_lens) -> list[tuple[int, ...]]:
    """Shapes with a query-length dim and a key-length dim, or a multiple of Tq * Tk elements.

    The second test catches scores flattened or reshaped; 1000 * 1200 = 2^7 3 5^5, and
    no other tensor here has the factor 5^5 (it needs both lengths). Empty tensors (slices of
    zero rows in the block-mask builder) hold nothing.
    """
    return [
        s for s in shapes
        if math.prod(s) and ((set(s) & q_lens and set(s) & k_lens) or math.prod(s) % (SEQ_Q * SEQ_K) == 0)
    ]


CASES = [
    # (heads, kv_heads, head_dim, causal, window, float32_residual)
    pytest.param(4, 4, 64, False, None, False, id="d64"),
    pytest.param(4, 4, 64, True, None, False, id="d64-causal"),
    pytest.param(4, 4, 128, False, None, False, id="d128"),
    pytest.param(8, 2, 128, True, None, False, id="d128-causal-gqa4"),
    pytest.param(4, 1, 64, False, None, False, id="d64-mqa"),
    pytest.param(4, 2, 64, False, (256, 256), False, id="d64-window"),
    pytest.param(4, 2, 128, True, (256, None), False, id="d128-window-causal"),
    pytest.param(2, 2, 256, True, None, False, id="d256-causal"),
    pytest.param(4, 2, 128, True, None, True, id="d128-causal-float32-residual"),
]


@pytest.mark.parametrize("heads,kv_heads,head_dim,causal,window,float32_residual", CASES)
def test_lowers_to_triton_for_sm90(fake_h100, heads, kv_heads, head_dim, causal, window, float32_residual):
    dtype = jnp.bfloat16
    config = TritonConfig.default(head_dim, dtype)
    params = AttentionParams(
        scale=head_dim**-0.5, causal=causal, window=window, backend="triton", config=config,
        backward_backend="triton", backward_config=config, interpret=False, float32_residual=float32_residual,
    )
    q = jax.ShapeDtypeStruct((2, SEQ_Q, heads, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((2, SEQ_K, kv_heads, head_dim), dtype)
    text = lower_attention_for_cuda(params, q, kv)
    # The forward, the dK/dV and the dQ kernels; nothing falls back to XLA attention.
    assert text.count(TRITON_CALL) == 3, f"expected 3 Triton kernels, found {text.count(TRITON_CALL)}"
    # Padded lengths count too: the kernels see Tq, Tk rounded up to whole tiles.
    fitted = config.fit(SEQ_Q, SEQ_K)
    q_lens = {SEQ_Q, -(-SEQ_Q // fitted.q_multiple) * fitted.q_multiple}
    k_lens = {SEQ_K, -(-SEQ_K // fitted.k_multiple) * fitted.k_multiple}
    shapes = tensor_shapes(text)
    assert shapes, "no tensor types parsed: the check below would be vacuous"
    assert not score_sized(shapes, q_lens, k_lens), f"score-sized tensors: {score_sized(shapes, q_lens, k_lens)}"


def test_score_check_finds_xla_scores():
    """Positive control: the reference materialises [B, H, Tq, Tk] and the check sees it."""
    q = jax.ShapeDtypeStruct((1, SEQ_Q, 2, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, SEQ_K, 2, 64), jnp.bfloat16)
    text = lower_for_cuda(lambda q, k, v: reference.attention(q, k, v, causal=True).sum(), q, kv, kv)
    assert TRITON_CALL not in text
    shapes = tensor_shapes(text)
    assert (1, 2, SEQ_Q, SEQ_K) in shapes
    assert score_sized(shapes, {SEQ_Q}, {SEQ_K})
    assert score_sized([(SEQ_Q * SEQ_K * 2,)], {SEQ_Q}, {SEQ_K}), "flattened scores are caught too"


MOSAIC_CALL = "custom_call @mosaic_gpu_v2"
MOSAIC_CASES = [
    # (heads, kv_heads, head_dim, causal, MosaicConfig overrides, kernels expected)
    pytest.param(4, 2, 128, False, {}, ("fwd", "dkv", "dq"), id="d128-gqa2"),
    pytest.param(4, 2, 128, False, {"fwd_schedule": "pingpong"}, ("fwd", "dkv", "dq"), id="d128-pingpong"),
    pytest.param(8, 2, 128, True, {"fwd_schedule": "overlap"}, ("fwd", "dkv", "dq"), id="d128-causal-overlap"),
    pytest.param(4, 1, 64, True, {}, ("fwd", "dkv", "dq"), id="d64-causal-mqa"),
    pytest.param(4, 4, 96, True, {}, ("fwd", "dkv", "dq"), id="d96-causal"),
    # A dQ key tile of 192 that does not fit at head dim 256: halved to a multiple of 64, not 96.
    pytest.param(4, 4, 256, True, {"dq_block_kv": 192}, ("fwd", "dkv", "dq"), id="d256-dq-keys-192"),
    # Windows and the softcap (`common.logits`).
    pytest.param(4, 2, 128, False, {}, ("fwd", "dkv", "dq"), id="d128-window"),
    pytest.param(4, 1, 64, True, {"fwd_schedule": "overlap"}, ("fwd", "dkv", "dq"), id="d64-causal-window-overlap"),
    pytest.param(4, 2, 128, True, {}, ("fwd", "dkv", "dq"), id="d128-causal-softcap"),
    pytest.param(4, 4, 128, False, {}, ("fwd", "dkv", "dq"), id="d128-window-softcap"),
    # ALiBi (slopes as a kernel input).
    pytest.param(4, 2, 128, True, {}, ("fwd", "dkv", "dq"), id="d128-causal-alibi"),
    pytest.param(4, 1, 64, False, {"fwd_schedule": "overlap"}, ("fwd", "dkv", "dq"), id="d64-alibi-softcap-window"),
    # q/kv lengths (per-tile ranges as an input); with d64-kv-lengths-alibi-overlap and
    # d128-causal-softcap, sinks (an input of the forward kernel only) on both forward schedules.
    pytest.param(4, 2, 128, True, {}, ("fwd", "dkv", "dq"), id="d128-causal-lengths"),
    pytest.param(4, 1, 64, False, {"fwd_schedule": "overlap"}, ("fwd", "dkv", "dq"), id="d64-kv-lengths-alibi-overlap"),
    # Segment ids (the ids streamed beside K, or Q in the dK/dV kernel), with lengths.
    pytest.param(4, 2, 128, True, {}, ("fwd", "dkv", "dq"), id="d128-causal-segments-lengths"),
    pytest.param(4, 4, 64, False, {"fwd_schedule": "overlap"}, ("fwd", "dkv", "dq"), id="d64-segments-window-overlap"),
    # Dropout (the seed as an input).
    pytest.param(4, 2, 128, True, {}, ("fwd", "dkv", "dq"), id="d128-causal-dropout"),
    pytest.param(4, 1, 128, False, {"fwd_schedule": "overlap"}, ("fwd", "dkv", "dq"), id="d128-dropout-broadcast-overlap"),
    # A bias, a mask (folded into the bias), each tile-streamed beside K/V (Q in the dK/dV kernel).
    pytest.param(8, 2, 128, True, {}, ("fwd", "dkv", "dq"), id="d128-causal-bias-gqa4"),
    pytest.param(4, 1, 64, False, {"fwd_schedule": "overlap"}, ("fwd", "dkv", "dq"), id="d64-mask-overlap-mqa"),
    pytest.param(4, 4, 128, False, {}, ("fwd", "dkv", "dq"), id="d128-bias-mask-segments-softcap"),
    # Head dims whose dK and dV exceed the registers: the dK/dV kernel split between its
    # consumers (one key tile, one accumulating dV and one dK), the dQ ring fitted to shared
    # memory; with the optional inputs the Hopper kernels take at these head dims (a bias or a
    # mask only up to 128).
    pytest.param(4, 2, 256, True, {}, ("fwd", "dkv", "dq"), id="d256-causal-dropout-gqa2"),
    pytest.param(4, 1, 256, False, {}, ("fwd", "dkv", "dq"), id="d256-window-softcap-alibi-lengths-segments-mqa"),
    pytest.param(4, 4, 192, True, {}, ("fwd", "dkv", "dq"), id="d192-causal-lengths"),
    # 128-row backward tiles where every row sees every key (the H100's entry at head dim 64),
    # alone and with the options that keep a call dense.
    pytest.param(4, 1, 64, False, {"bwd_block_q_dense": 128}, ("fwd", "dkv", "dq"), id="d64-dense-mqa"),
    pytest.param(4, 2, 64, False, {"bwd_block_q_dense": 128}, ("fwd", "dkv", "dq"),
                 id="d64-dense-bias-dropout-softcap-alibi"),
    # The persistent forward (each CTA walks its items, the ring running on across them), on
    # both schedules and with the optional inputs that change what the ring carries.
    pytest.param(4, 2, 128, False, {"fwd_persistent": True}, ("fwd", "dkv", "dq"), id="d128-persistent-gqa2"),
    pytest.param(8, 2, 128, True, {"fwd_persistent": False}, ("fwd", "dkv", "dq"), id="d128-causal-grid"),
    pytest.param(8, 2, 128, True, {"fwd_persistent": True}, ("fwd", "dkv", "dq"), id="d128-causal-persistent"),
    pytest.param(4, 2, 128, True, {"fwd_persistent": True}, ("fwd", "dkv", "dq"), id="d128-causal-persistent-window-sinks"),
    pytest.param(4, 1, 128, False, {"fwd_persistent": True, "fwd_schedule": "overlap"}, ("fwd", "dkv", "dq"),
                 id="d128-persistent-bias-dropout-window-mqa"),
    pytest.param(4, 4, 64, True, {"fwd_persistent": True}, ("fwd", "dkv", "dq"),
                 id="d64-causal-persistent-alibi-softcap"),
]
# AttentionParams options of the cases above (by id).
MOSAIC_OPTIONS = {
    "d128-window": dict(window=(200, 37)),
    "d64-causal-window-overlap": dict(window=(129, None)),
    "d128-causal-softcap": dict(softcap=30.0),
    "d128-window-softcap": dict(window=(64, 64), softcap=20.0),
    "d64-alibi-softcap-window": dict(softcap=30.0, window=(100, 100)),
    "d64-segments-window-overlap": dict(window=(300, 20)),
    "d128-causal-dropout": dict(dropout_rate=0.1),
    "d64-dense-bias-dropout-softcap-alibi": dict(dropout_rate=0.1, softcap=30.0),
    "d128-dropout-broadcast-overlap": dict(dropout_rate=0.25, broadcast_dropout=True),
    "d128-bias-mask-segments-softcap": dict(softcap=30.0),
    "d256-causal-dropout-gqa2": dict(dropout_rate=0.1),
    "d128-persistent-bias-dropout-window-mqa": dict(dropout_rate=0.1, window=(300, 20)),
    "d64-causal-persistent-alibi-softcap": dict(softcap=30.0),
    "d128-causal-persistent-window-sinks": dict(window=(200, None)),
    "d256-window-softcap-alibi-lengths-segments-mqa": dict(window=(200, 37), softcap=30.0),
}
# Extras (optional arrays) of the cases above (by id).
MOSAIC_EXTRAS = {
    "d128-causal-dropout": Extras(dropout_seed=jnp.array([7, 11], jnp.uint32)),
    "d128-dropout-broadcast-overlap": Extras(dropout_seed=jnp.array([7, 11], jnp.uint32)),
    "d128-causal-alibi": Extras(alibi_slopes=jnp.linspace(0.1, 0.5, 4, dtype=jnp.float32)),
    "d64-alibi-softcap-window": Extras(alibi_slopes=jnp.linspace(0.1, 0.5, 4, dtype=jnp.float32)),
    "d128-causal-lengths": Extras(q_lengths=jnp.array([SEQ_Q, 7], jnp.int32),
                                  kv_lengths=jnp.array([300, SEQ_K], jnp.int32)),
    "d64-kv-lengths-alibi-overlap": Extras(kv_lengths=jnp.array([0, 901], jnp.int32),
                                           alibi_slopes=jnp.linspace(0.1, 0.5, 4, dtype=jnp.float32),
                                           sinks=jnp.linspace(-1.0, 1.0, 4, dtype=jnp.float32)),
    "d128-causal-softcap": Extras(sinks=jnp.zeros((4,), jnp.float32)),
    "d128-causal-segments-lengths": Extras(q_segment_ids=jnp.zeros((2, SEQ_Q), jnp.int32),
                                           kv_segment_ids=jnp.zeros((2, SEQ_K), jnp.int32),
                                           kv_lengths=jnp.array([SEQ_K, 500], jnp.int32)),
    "d64-segments-window-overlap": Extras(q_segment_ids=jnp.zeros((2, SEQ_Q), jnp.int32),
                                          kv_segment_ids=jnp.zeros((2, SEQ_K), jnp.int32)),
    "d128-causal-bias-gqa4": Extras(bias=jnp.zeros((1, 8, SEQ_Q, SEQ_K), jnp.bfloat16)),
    "d64-mask-overlap-mqa": Extras(mask=jnp.ones((2, 1, SEQ_Q, SEQ_K), bool)),
    "d128-bias-mask-segments-softcap": Extras(
        bias=jnp.zeros((1, 4, SEQ_Q, SEQ_K), jnp.bfloat16), mask=jnp.ones((1, 4, SEQ_Q, SEQ_K), bool),
        q_segment_ids=jnp.zeros((2, SEQ_Q), jnp.int32), kv_segment_ids=jnp.zeros((2, SEQ_K), jnp.int32)),
    "d256-causal-dropout-gqa2": Extras(dropout_seed=jnp.array([7, 11], jnp.uint32)),
    "d256-window-softcap-alibi-lengths-segments-mqa": Extras(
        alibi_slopes=jnp.linspace(0.1, 0.5, 4, dtype=jnp.float32), q_lengths=jnp.array([SEQ_Q, 7], jnp.int32),
        kv_lengths=jnp.array([300, SEQ_K], jnp.int32), q_segment_ids=jnp.zeros((2, SEQ_Q), jnp.int32),
        kv_segment_ids=jnp.zeros((2, SEQ_K), jnp.int32)),
    "d192-causal-lengths": Extras(kv_lengths=jnp.array([SEQ_K, 500], jnp.int32)),
    "d128-causal-persistent-window-sinks": Extras(sinks=jnp.zeros((4,), jnp.float32)),
    "d128-persistent-bias-dropout-window-mqa": Extras(
        bias=jnp.zeros((2, 1, SEQ_Q, SEQ_K), jnp.bfloat16), dropout_seed=jnp.array([7, 11], jnp.uint32)),
    "d64-causal-persistent-alibi-softcap": Extras(alibi_slopes=jnp.linspace(0.1, 0.5, 4, dtype=jnp.float32)),
    "d64-dense-bias-dropout-softcap-alibi": Extras(
        bias=jnp.zeros((1, 4, SEQ_Q, SEQ_K), jnp.bfloat16), dropout_seed=jnp.array([7, 11], jnp.uint32),
        alibi_slopes=jnp.linspace(0.1, 0.5, 4, dtype=jnp.float32)),
}


@pytest.mark.parametrize("heads,kv_heads,head_dim,causal,overrides,kernels", MOSAIC_CASES)
def test_mosaic_kernels_lower_for_sm90(request, fake_h100, heads, kv_heads, head_dim, causal, overrides, kernels):
    """The Hopper kernels go through Pallas' Mosaic GPU lowering (layouts, wgmma operand
    shapes, barriers, semaphores, the shared-memory limit) without a GPU; what only ptxas or
    the device checks (register allocation, running) is left to tests/test_mosaic.py on the
    device. A bias or mask is the one score-sized array: in its own broadcast shape
    [1 or B, 1 or H, ...] (padded, transposed for the dK/dV kernel), never [B, H, ...]."""
    import dataclasses

    dtype = jnp.bfloat16
    config = dataclasses.replace(MosaicConfig.default(head_dim, device_kind=""), **overrides)
    options = MOSAIC_OPTIONS.get(request.node.callspec.id, {})
    params = AttentionParams(
        scale=head_dim**-0.5, causal=causal, backend="mosaic", config=config, backward_backend="mosaic",
        backward_config=config, interpret=False, **options,
    )
    q = jax.ShapeDtypeStruct((2, SEQ_Q, heads, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((2, SEQ_K, kv_heads, head_dim), dtype)
    extras = MOSAIC_EXTRAS.get(request.node.callspec.id, Extras())
    text = lower_attention_for_cuda(params, q, kv, extras)
    assert text.count(MOSAIC_CALL) == len(kernels), f"expected {len(kernels)} Mosaic GPU kernels, found {text.count(MOSAIC_CALL)}"
    names = set(re.findall(r"flashjax_mosaic_(fwd|dkv|dq)\b", text))
    assert names == set(kernels), names
    # The glue pads both lengths to whole tiles (at most 256 rows); padded lengths count too.
    q_lens = {SEQ_Q} | {-(-SEQ_Q // m) * m for m in (64, 128, 256)}
    k_lens = {SEQ_K} | {-(-SEQ_K // m) * m for m in (64, 128, 256)}
    shapes = tensor_shapes(text)
    pair_dims = {x.shape[:2] for x in (extras.bias, extras.mask) if x is not None}
    assert all(dims != (2, heads) for dims in pair_dims), "the case would hide score tensors behind the bias's shape"
    found = [s for s in score_sized(shapes, q_lens, k_lens) if not (len(s) == 4 and s[:2] in pair_dims)]
    assert shapes and not found, found


DECODE_CASES = [
    # (page_size, cache dtype, scales, q_len, window)
    pytest.param(None, jnp.bfloat16, None, 1, None, id="contiguous"),
    pytest.param(256, jnp.bfloat16, None, 1, None, id="paged256"),  # two key tiles per page
    pytest.param(16, jnp.float8_e4m3fn, "page", 7, (128, None), id="paged16-fp8-per-page-q7-window"),  # pages gathered
    pytest.param(None, jnp.float8_e4m3fn, "head", 33, None, id="contiguous-fp8-per-head-q33"),  # two query tiles
]


def typed_tensors(text: str) -> list[tuple[tuple[int, ...], str]]:
    """(shape, element type) of every static `tensor<...>` type in an MLIR text."""
    found = []
    for body in re.findall(r"tensor<([^>]*)>", text):
        *dims, element = body.split("x")
        if all(d.isdigit() for d in dims):
            found.append((tuple(int(d) for d in dims), element))
    return found


def lower_decode(backend: str, page_size, cache_dtype, scales, q_len, window, capacity: int = 4000, causal=True,
                 head_dim: int = 128, v_head_dim: int | None = None, latent: bool = False, kv_heads: int = 8):
    """(StableHLO text of a decode call lowered for CUDA, the cache's shape, its capacity);
    `capacity`: a contiguous cache's max_len; `v_head_dim`: the values' own (with `latent`,
    the leading features of the keys, no value cache)."""
    batch, heads = 2, 32
    S = jax.ShapeDtypeStruct
    if page_size is None:
        table = None
        cache_shape = (batch, capacity, kv_heads, head_dim)
    else:
        capacity, table = 37 * page_size, S((batch, 37), jnp.int32)
        cache_shape = (100, page_size, kv_heads, head_dim)
    scale = None if scales is None else S((100, kv_heads) if scales == "page" else (kv_heads,), jnp.float32)
    v_cache = None if latent else S((*cache_shape[:3], v_head_dim or head_dim), cache_dtype)
    cache = KVCache(S(cache_shape, cache_dtype), v_cache, S((batch,), jnp.int32), table, scale, scale)
    params = DecodeParams(scale=head_dim**-0.5, causal=causal, window=window, sm_count=132, interpret=False,
                          v_head_dim=v_head_dim if latent else None)
    decode = backends.get(backend).decode.run
    text = jax.jit(lambda q, cache: decode(q, cache, params)).trace(
        S((batch, q_len, heads, head_dim), jnp.bfloat16), cache).lower(lowering_platforms=("cuda",)).as_text()
    return text, cache_shape, capacity


def cache_copies(text: str, cache_shape, capacity: int, cache_element: str, v_head_dim: int | None = None) -> list:
    """Tensors that copy the cache: of its shape in another element type (converted), or
    [B, capacity, ...] other than the cache itself (gathered or padded); `v_head_dim`: a value
    cache of its own head dim is the cache too."""
    tensors = typed_tensors(text)
    assert tensors, "no tensor types parsed: the check would be vacuous"
    caches = {tuple(cache_shape), (*cache_shape[:3], v_head_dim or cache_shape[3])}
    return [
        (shape, element) for shape, element in tensors
        if (shape in caches and element != cache_element) or (shape[:2] == (2, capacity) and shape not in caches)
    ]


@pytest.mark.parametrize("page_size,cache_dtype,scales,q_len,window", DECODE_CASES)
def test_decode_kernel_lowers_to_triton_for_sm90(fake_h100, page_size, cache_dtype, scales, q_len, window):
    """The split-KV decode kernel lowers for sm_90 (page-table reads, float8 conversions), and the
    cache is read in place: no gathered [B, capacity, Hkv, D] copy, no converted copy."""
    text, cache_shape, capacity = lower_decode("triton", page_size, cache_dtype, scales, q_len, window)
    assert text.count(TRITON_CALL) == 1 and "flashjax_decode" in text
    cache_element = {jnp.bfloat16: "bf16", jnp.float8_e4m3fn: "f8E4M3FN"}[cache_dtype]
    assert not cache_copies(text, cache_shape, capacity, cache_element)


@pytest.mark.parametrize("capacity,cache_dtype,scales", [(4097, jnp.bfloat16, None), (8225, jnp.float8_e4m3fn, "head")])
def test_decode_ragged_cache_lowers_to_triton_for_sm90(fake_h100, capacity, cache_dtype, scales):
    """A contiguous cache of an odd length (a ragged last key tile) lowers, read in place."""
    text, cache_shape, capacity = lower_decode("triton", None, cache_dtype, scales, 1, None, capacity=capacity)
    assert text.count(TRITON_CALL) == 1 and "flashjax_decode" in text
    assert not cache_copies(text, cache_shape, capacity, {jnp.bfloat16: "bf16", jnp.float8_e4m3fn: "f8E4M3FN"}[cache_dtype])


@pytest.mark.parametrize(
    "head_dim,v_head_dim,latent,page_size,cache_dtype,scales",
    [
        pytest.param(576, 512, True, 64, jnp.bfloat16, None, id="absorbed-mla-latent-paged"),
        pytest.param(576, 512, True, None, jnp.float8_e4m3fn, "head", id="absorbed-mla-latent-fp8"),
        pytest.param(192, 128, False, 64, jnp.bfloat16, None, id="mla-192-128-paged"),
        pytest.param(64, 512, False, None, jnp.bfloat16, None, id="narrow-keys-512-values"),
    ],
)
def test_decode_head_dims_lower_to_triton_for_sm90(fake_h100, head_dim, v_head_dim, latent, page_size, cache_dtype,
                                                   scales):
    """Head dims read in column blocks (576 = 512 + 64), values of their own head dim, and a
    latent cache (the values inside the keys) lower for sm_90 with the cache read in place."""
    text, cache_shape, capacity = lower_decode("triton", page_size, cache_dtype, scales, 1, None, head_dim=head_dim,
                                               v_head_dim=v_head_dim, latent=latent, kv_heads=1 if latent else 8)
    assert text.count(TRITON_CALL) == 1 and "flashjax_decode" in text
    cache_element = {jnp.bfloat16: "bf16", jnp.float8_e4m3fn: "f8E4M3FN"}[cache_dtype]
    assert not cache_copies(text, cache_shape, capacity, cache_element, None if latent else v_head_dim)


def test_decode_wide_values_over_many_rows_lower_to_triton_for_sm90(fake_h100):
    """Values 192 wide with 64 query rows per kv head (q_len 2, 32 heads over one kv head):
    query tiles of 32 rows, the power of two under what the accumulator allows, read in place."""
    text, cache_shape, capacity = lower_decode("triton", None, jnp.bfloat16, None, 2, None, head_dim=192, kv_heads=1)
    assert text.count(TRITON_CALL) == 1 and "flashjax_decode" in text
    assert not cache_copies(text, cache_shape, capacity, "bf16")


@pytest.mark.parametrize("q_len,causal,head_dim,page_size", [(1, True, 128, None), (5, False, 128, None),
                                                             (1, True, 192, None), (1, True, 128, 64),
                                                             (3, False, 64, 256), (1, True, 128, 192)])
def test_mosaic_decode_lowers_for_sm90(q_len, causal, head_dim, page_size):
    """The Hopper decode path (the forward kernel on the cache split into batch rows, a paged
    cache's pages read through its table) lowers for sm_90 and reads the cache in place: one
    Mosaic GPU kernel, no copy of the cache (no converted or gathered copy, and nothing of the
    cache's heads larger than it: no pad)."""
    text, cache_shape, capacity = lower_decode("mosaic", page_size, jnp.bfloat16, None, q_len, None, capacity=4096,
                                               causal=causal, head_dim=head_dim)
    assert text.count(MOSAIC_CALL) == 1 and "flashjax_mosaic_fwd" in text
    assert not cache_copies(text, cache_shape, capacity, "bf16")
    padded = [shape for shape, _ in typed_tensors(text)
              if shape[-2:] == cache_shape[-2:] and math.prod(shape) > math.prod(cache_shape)]
    assert not padded, padded


def test_cache_copy_check_finds_xla_copies():
    """Positive control: the xla decode path dequantises and gathers the cache, and the check sees it."""
    text, cache_shape, capacity = lower_decode("xla", 16, jnp.float8_e4m3fn, "page", 1, None)
    assert TRITON_CALL not in text
    copies = cache_copies(text, cache_shape, capacity, "f8E4M3FN")
    assert (cache_shape, "f32") in copies and any(shape[:2] == (2, capacity) for shape, _ in copies)


@pytest.fixture
def on_hopper(monkeypatch, fake_h100):
    """flash_attention chooses and lowers as on an H100: compiled kernels, not interpret mode."""
    from flashjax import backends

    monkeypatch.setattr(backends, "describe_device", lambda: ("gpu", "9.0"))


def _kernel_count_and_scores(text, config):
    fitted = config.fit(SEQ_Q, SEQ_K)
    q_lens = {SEQ_Q, -(-SEQ_Q // fitted.q_multiple) * fitted.q_multiple}
    k_lens = {SEQ_K, -(-SEQ_K // fitted.k_multiple) * fitted.k_multiple}
    return text.count(TRITON_CALL), score_sized(tensor_shapes(text), q_lens, k_lens)


@pytest.mark.parametrize("dims, backward", [
    pytest.param((192, 64), "mosaic", id="192-64"),
    pytest.param((256, 64), "mosaic", id="256-64"),
    pytest.param((128, 64), "mosaic", id="128-64"),
    pytest.param((256, 256), "mosaic", id="256-256"),  # the dK/dV kernel split, the dQ ring at 64 keys x 1 stage
    pytest.param((192, 192), "mosaic", id="192-192"),  # split
])
def test_head_dims_lower_for_sm90(on_hopper, dims, backward):
    """Head dims on the Hopper kernels, v's narrower than q's or not: forward and backward
    lowered for sm_90 with the default tiles (the lowering checks the shared-memory limit),
    the dK/dV kernel split where the two accumulators exceed the registers."""
    import flashjax

    qk_dim, v_dim = dims
    dtype = jnp.bfloat16
    q = jax.ShapeDtypeStruct((1, SEQ_Q, 4, qk_dim), dtype)
    k = jax.ShapeDtypeStruct((1, SEQ_K, 2, qk_dim), dtype)
    v = jax.ShapeDtypeStruct((1, SEQ_K, 2, v_dim), dtype)
    choice = flashjax.explain(q, k, v, causal=True)
    assert (choice.backend, choice.backward_backend) == ("mosaic", backward), choice

    def loss(q, k, v):
        o, lse = flashjax.flash_attention(q, k, v, causal=True, return_lse=True)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(lse)

    text = lower_for_cuda(loss, q, k, v)
    kernels = set(re.findall(r"flashjax_mosaic_(fwd|dkv|dq)\b", text))
    assert kernels == ({"fwd", "dkv", "dq"} if backward == "mosaic" else {"fwd"}), kernels


@pytest.mark.parametrize("backend", ["mosaic", "triton"])
def test_mla_head_dims_lower_for_sm90(on_hopper, backend):
    """MLA's 192 (q, k) / 128 (v) head dims lower for sm_90 on both backends (auto picks the
    Hopper kernels), forward and backward (3 kernels), with no score-sized tensor, and the
    output has v's head dim."""
    import flashjax

    dtype = jnp.bfloat16
    q = jax.ShapeDtypeStruct((1, SEQ_Q, 8, 192), dtype)
    k = jax.ShapeDtypeStruct((1, SEQ_K, 2, 192), dtype)
    v = jax.ShapeDtypeStruct((1, SEQ_K, 2, 128), dtype)
    choice = flashjax.explain(q, k, v, causal=True)
    assert (choice.backend, choice.backward_backend) == ("mosaic", "mosaic"), choice

    def loss(q, k, v):
        o, lse = flashjax.flash_attention(q, k, v, causal=True, return_lse=True, backend=backend)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(lse)

    text = lower_for_cuda(loss, q, k, v)
    if backend == "mosaic":
        assert text.count(MOSAIC_CALL) == 3
        assert set(re.findall(r"flashjax_mosaic_(fwd|dkv|dq)\b", text)) == {"fwd", "dkv", "dq"}
        q_lens = {SEQ_Q} | {-(-SEQ_Q // m) * m for m in (64, 128, 256)}
        k_lens = {SEQ_K} | {-(-SEQ_K // m) * m for m in (64, 128, 256)}
        scores = score_sized(tensor_shapes(text), q_lens, k_lens)
    else:
        count, scores = _kernel_count_and_scores(text, TritonConfig.default(192, dtype))
        assert count == 3
    assert not scores, scores
    assert "tensor<1x1000x8x128xbf16>" in text, "the output has v's head dim"


def test_flex_lowers_to_triton_for_sm90(on_hopper):
    """A learned-table score_mod (read through pointer loads: Triton has no gather; also a 0-d array,
    a bool array and a point gather), a head-dependent mask_mod (per-head tile ranges) and sinks
    lower for sm_90: 3 kernels, and outside them (the block mask, the table's gradient over query
    chunks) no score-sized tensor."""
    import flashjax
    from flashjax import mods

    dtype = jnp.bfloat16
    q = jax.ShapeDtypeStruct((2, SEQ_Q, 4, 64), dtype)
    kv = jax.ShapeDtypeStruct((2, SEQ_K, 2, 64), dtype)
    widths = jnp.array([64, 128, 256, 4096], jnp.int32)
    flags = jnp.array([True, False, True, False])

    def loss(q, k, v, table, sinks, temperature):
        t5 = mods.t5_relative_bias(table)

        def score_mod(score, b, h, i, j):  # plain reads, a 0-d array, a bool array, a point gather
            near = table.at[h, j - i].get(mode="fill", fill_value=0.0)
            return t5(score * temperature, b, h, i, j) + jnp.where(flags[h], near, 0.0)

        o, lse = flashjax.flash_attention(
            q, k, v, score_mod=score_mod, sinks=sinks, return_lse=True,
            mask_mod=lambda b, h, i, j: (j <= i + SEQ_K - SEQ_Q) & (i + SEQ_K - SEQ_Q - j <= widths[h]),
        )
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(lse)

    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)))
    text = grad.trace(q, kv, kv, f32(4, 32), f32(4), f32()).lower(lowering_platforms=("cuda",)).as_text()
    count, scores = _kernel_count_and_scores(text, TritonConfig.default(64, dtype))
    assert count == 3 and not scores, (count, scores)


def test_flex_scalar_selects_lower_to_triton_for_sm90(on_hopper):
    """Mods that choose between Python constants per head lower to valid Triton modules (the
    fixture verifies each): the constants keep their own type, not the condition's."""
    import flashjax
    from test_flex import scalar_selects_of_constants

    score_mod, mask_mod = scalar_selects_of_constants()
    q = jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.bfloat16)

    def loss(q, k, v):
        o = flashjax.flash_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, backend="triton")
        return jnp.sum(o.astype(jnp.float32))

    lower_for_cuda(loss, q, q, q)


@pytest.mark.parametrize("bias_shape", [(45,), (1, 1, 1, 45), (2, 1, 1, 45)])
def test_bias_gradient_of_one_query_tile_lowers_to_triton_for_sm90(on_hopper, bias_shape):
    """dbias of a bias broadcast over the queries, with one query tile (a decoding step): the
    dbias kernel's tile indices are then static (it once marked the constant 0 with
    pl.multiple_of, which Triton's lowering rejects)."""
    import flashjax

    q = jax.ShapeDtypeStruct((2, 1, 1, 32), jnp.float16)
    kv = jax.ShapeDtypeStruct((2, 45, 1, 32), jnp.float16)

    def loss(q, k, v, bias):
        return jnp.sum(flashjax.flash_attention(q, k, v, bias=bias, backend="triton").astype(jnp.float32))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    grad.trace(q, kv, kv, jax.ShapeDtypeStruct(bias_shape, jnp.float16)).lower(lowering_platforms=("cuda",))


_FLAGS = jnp.array([True, False, True, True])
# Mods whose lowering once failed on one backend (each note says how), forward and backward.
USER_MODS = {
    # Mosaic GPU: a logical not of a boolean tile ("Register bitwidth ... got 2").
    "negated-mask": dict(mask_mod=lambda b, h, i, j: ~((i - j) % 3 == 0) ^ (j < 40)),
    # Mosaic GPU: a scalar predicate over tile cases ("Implicit broadcast not implemented").
    "scalar-flag-score": dict(score_mod=lambda s, b, h, i, j: jnp.where(_FLAGS[h], s, s * 0.5)),
    "scalar-choice-mask": dict(mask_mod=lambda b, h, i, j: jnp.where(h < 2, i >= j, True)),
    # Triton: a negated constant in the derivative program (no rule takes a constant).
    "sqrt-of-magnitude": dict(score_mod=lambda s, b, h, i, j: jnp.sqrt(jnp.abs(s) + 1.0)),
    "power": dict(score_mod=lambda s, b, h, i, j: jnp.power(jnp.abs(s) + 1.0, 1.5)),
    # Neither backend: erf (auto takes the reference), float % and atan2 (Triton only).
    "erf": dict(score_mod=lambda s, b, h, i, j: s + jax.lax.erf((i - j).astype(jnp.float32) / 50.0)),
    "float-rem": dict(score_mod=lambda s, b, h, i, j: jnp.fmod(s, 8.0)),
    "atan2": dict(score_mod=lambda s, b, h, i, j: s + jnp.arctan2(i - j, 8.0)),
    # Both: add_any (a derivative's sum of cotangents) and copy have no rule; they run as an add
    # and as the value itself.
    "score-used-twice": dict(score_mod=lambda s, b, h, i, j: s * jax.nn.sigmoid(s)),
    "copy": dict(score_mod=lambda s, b, h, i, j: jnp.copy(s) + 0.0 * i),
    # Loops: their body runs every iteration inside the kernels.
    "fori-loop-score": dict(score_mod=lambda s, b, h, i, j: jax.lax.fori_loop(0, 3, lambda t, x: x + 0.5 * (j % 2), s)),
    "fori-loop-mask": dict(mask_mod=lambda b, h, i, j: jax.lax.fori_loop(0, 3, lambda t, c: c + 1, j) <= i + 1),
    # Forms of lowered primitives the lowerings do not take (`flex.Mod.unlowered_forms`): refused
    # up front, or (a cond on the head) lowered.
    "select-three-way": dict(score_mod=lambda s, b, h, i, j: jnp.select([i > j, i == j], [s, s * 2.0], -1.0)),
    "select_n-three-cases": dict(mask_mod=lambda b, h, i, j: jax.lax.select_n(jnp.clip(i - j, 0, 2), i >= j, j < 4,
                                                                              i > j + 3)),
    "concatenate-three": dict(score_mod=lambda s, b, h, i, j: s + jnp.concatenate(
        [jnp.atleast_1d(i), jnp.atleast_1d(j), jnp.atleast_1d(h)]).sum().astype(jnp.float32)),
    "cond-on-score": dict(score_mod=lambda s, b, h, i, j: jax.lax.cond(s > 0, lambda: s, lambda: -s)),
    "switch-on-head": dict(score_mod=lambda s, b, h, i, j: jax.lax.switch(h % 3, [lambda: s, lambda: s * 0.5,
                                                                                  lambda: s + 1.0])),
    # Additive mods: the term added to the kernels' own logits (`flex.Mod.additive_term`).
    "alibi-mod": dict(score_mod=mods.alibi(jnp.asarray([0.5, 0.25, 0.125, 0.0625]))),
    "plus-column-term": dict(score_mod=lambda s, b, h, i, j: 0.5 * (j % 4).astype(jnp.float32) + s),
}


@pytest.mark.parametrize("backend", ["auto", "mosaic", "triton"])
@pytest.mark.parametrize("name", list(USER_MODS))
def test_user_mods_lower_for_sm90(on_hopper, name, backend):
    """Mods lower for sm_90 forward and backward, each Triton module verified, or the named
    backend refuses them up front with its reason: never a failure inside the lowering."""
    import flashjax

    q = jax.ShapeDtypeStruct((1, 300, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 517, 2, 64), jnp.bfloat16)

    def loss(q, k, v):
        o = flashjax.flash_attention(q, k, v, backend=backend, causal=True, **USER_MODS[name])
        return jnp.sum(o.astype(jnp.float32))

    try:
        lower_for_cuda(loss, q, kv, kv)
    except NotImplementedError as e:
        assert backend != "auto" and f"backend={backend!r}" in str(e) and "cannot run this call" in str(e), e


def _lowering_mods():
    from test_flex import LOWERING_MODS

    return LOWERING_MODS


@pytest.mark.parametrize("backend", ["mosaic", "triton"])
@pytest.mark.parametrize("mask_mod", _lowering_mods())
def test_mods_evaluated_as_in_xla_lower_for_sm90(on_hopper, mask_mod, backend):
    """The mods whose operations the kernels evaluate as XLA does (`xla_semantics.evaluate`: runtime
    divisors and shift amounts, conversions to bool, the sign of NaN) lower for sm_90 on
    both backends, forward and backward."""
    import flashjax

    q = jax.ShapeDtypeStruct((1, 300, 2, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 517, 2, 64), jnp.bfloat16)

    def loss(q, k, v):
        o = flashjax.flash_attention(q, k, v, backend=backend, mask_mod=lambda b, h, i, j: mask_mod(b, h, i, j) | (j == 0))
        return jnp.sum(o.astype(jnp.float32))

    try:
        lower_for_cuda(loss, q, kv, kv)
    except NotImplementedError as e:  # Mosaic GPU has no floor
        assert backend == "mosaic" and "does not lower" in str(e), e


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_random_mods_lower_for_sm90(on_hopper, backend, seed):
    """Random mods (`test_flex.random_mods`) and their gradients, the learned arrays' too,
    lower for sm_90 on the kernels `auto` picks on an H100 (Hopper where they take the mods)
    and on the Triton kernels, every Triton module verified."""
    import flashjax
    from test_flex import random_mods, random_shape

    rng = np.random.default_rng(seed)
    s = random_shape(rng, head_dim=64)._replace(seq_q=300, seq_k=517)
    arrays, options = random_mods(rng, s)
    q = jax.ShapeDtypeStruct((s.batch, s.seq_q, s.heads, s.head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((s.batch, s.seq_k, s.kv_heads, s.head_dim), jnp.bfloat16)

    def loss(q, k, v, arrays):
        o = flashjax.flash_attention(q, k, v, backend=backend, **options(arrays))
        return jnp.sum(o.astype(jnp.float32))

    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), arrays)
    jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(q, kv, kv, shapes).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("block", [16, 128])
def test_block_mask_kernel_lowers_to_triton_for_sm90(fake_h100, block):
    """`flashjax.block_mask`'s GPU builder (a document mask reading a closed-over array) lowers
    for sm_90: one Triton kernel and nothing of [q_len, kv_len] outside it."""
    from flashjax import flex, mods
    from flashjax.kernels.triton import block_mask as triton_block_mask

    doc_ids = jnp.zeros((2, SEQ_Q), jnp.int32)
    mod, consts = flex.trace(mods.document_window(doc_ids, 100), flex.MASK_MOD)
    build = jax.jit(lambda *c: triton_block_mask.classify(mod, c, 2, 1, SEQ_Q, SEQ_Q, block, block))
    text = build.trace(*consts).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(TRITON_CALL) == 1 and "flashjax_block_mask" in text
    assert not [s for s in tensor_shapes(text) if s.count(SEQ_Q) >= 2], "a [q_len, kv_len] tensor outside the kernel"


# Document ids of 2 batch rows, non-decreasing, for the queries and the keys.
Q_DOCS = jnp.asarray(np.sort(np.random.default_rng(0).integers(0, 4, (2, SEQ_Q)), axis=1), jnp.int32)
KV_DOCS = jnp.asarray(np.sort(np.random.default_rng(1).integers(0, 4, (2, SEQ_K)), axis=1), jnp.int32)
MOSAIC_FLEX_CASES = {
    # score_mod reading a per-head slope (learned: its gradient runs in XLA) with a causal mask_mod
    "alibi-mod-causal-mask-mod": lambda slopes: dict(
        score_mod=lambda s, b, h, i, j: s - slopes[h] * jnp.abs(i - j).astype(jnp.float32),
        mask_mod=lambda b, h, i, j: j <= i + SEQ_K - SEQ_Q),
    # a tanh softcap as a score_mod beside the built-in causal mask and softcap
    "tanh-mod-softcap-causal": lambda slopes: dict(score_mod=lambda s, b, h, i, j: 20.0 * jnp.tanh(s / 20.0),
                                                   causal=True, softcap=30.0),
    # chunks (an integer floor division) and a per-batch prefix (a scalar read at the batch row)
    "chunked-prefix-mask-mod": lambda slopes: dict(
        mask_mod=lambda b, h, i, j: ((i // 128 == j // 128) & (j <= i)) | (j < jnp.array([5, 300])[b])),
    # packed documents read per row and per column from closed-over ids, with a window: the
    # ids travel to the kernels as vectors (`sides.split`)
    "documents-window-mask-mod": lambda slopes: dict(
        mask_mod=lambda b, h, i, j: ((Q_DOCS[b, i] == KV_DOCS[b, j]) & (j <= i + SEQ_K - SEQ_Q)
                                     & (i + SEQ_K - SEQ_Q - j <= 300))),
    # a flag read per row only (the column vector streams, unused)
    "row-flags-mask-mod": lambda slopes: dict(mask_mod=lambda b, h, i, j: (Q_DOCS[b, i] != 2) | (j <= i)),
    # functions of one side only: keys below a per-batch bound, every 7th query row dropped
    "one-sided-mods": lambda slopes: dict(mask_mod=lambda b, h, i, j: j < jnp.array([5, 300])[b],
                                          score_mod=lambda s, b, h, i, j: jnp.where(i % 7 == 3, -jnp.inf, s)),
    # a score_mod using the score twice (its derivative sums two cotangents: JAX's add_any,
    # evaluated as an add) and a jnp.copy (evaluated as the value itself)
    "nonlinear-score-mod-and-copy": lambda slopes: dict(score_mod=lambda s, b, h, i, j: jnp.copy(s * jnp.tanh(s / 8.0)),
                                                        causal=True),
    # a per-head band: the block mask differs per head (the ranges take every head's tiles)
    "per-head-band-mask-mod": lambda slopes: dict(
        mask_mod=lambda b, h, i, j: (i - j <= jnp.array([64, 128, 256, 4096])[h]) & (j - i <= 64), window=(500, 500)),
}


@pytest.mark.parametrize("case", MOSAIC_FLEX_CASES)
def test_flex_lowers_to_mosaic_for_sm90(on_hopper, case):
    """score_mod and mask_mod go through the Hopper kernels' scoring path and lower for sm_90:
    the forward, dK/dV and dQ kernels, and outside them (the block mask, a learned slope's
    gradient over query chunks) no score-sized tensor."""
    import flashjax

    dtype = jnp.bfloat16
    q = jax.ShapeDtypeStruct((2, SEQ_Q, 4, 128), dtype)
    kv = jax.ShapeDtypeStruct((2, SEQ_K, 2, 128), dtype)
    slopes = jax.ShapeDtypeStruct((4,), jnp.float32)
    options = MOSAIC_FLEX_CASES[case]
    assert flashjax.explain(q, kv, kv, backend="mosaic", **options(jnp.ones((4,)))).backward_backend == "mosaic"

    def loss(q, k, v, slopes):
        o, lse = flashjax.flash_attention(q, k, v, return_lse=True, backend="mosaic", **options(slopes))
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(lse)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    text = grad.trace(q, kv, kv, slopes).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(MOSAIC_CALL) == 3, text.count(MOSAIC_CALL)
    assert set(re.findall(r"flashjax_mosaic_(fwd|dkv|dq)\b", text)) == {"fwd", "dkv", "dq"}
    q_lens = {SEQ_Q} | {-(-SEQ_Q // m) * m for m in (64, 128, 256)}
    k_lens = {SEQ_K} | {-(-SEQ_K // m) * m for m in (64, 128, 256)}
    assert not score_sized(tensor_shapes(text), q_lens, k_lens)


def _bidirectional_documents(ids):
    return lambda b, h, i, j: ids[b, i] == ids[b, j]


def _forward_grids(monkeypatch) -> list:
    """The `ctas` of each Hopper forward kernel traced from now on (None: the per-item grid)."""
    from flashjax.kernels.mosaic import fwd as mosaic_fwd

    grids = []
    run_forward = mosaic_fwd.forward
    monkeypatch.setattr(mosaic_fwd, "forward",
                        lambda *a, ctas=None, **kw: grids.append(ctas) or run_forward(*a, ctas=ctas, **kw))
    return grids


FOLDED_MASKS = {  # (mask_mod of the document ids, causal (structurally), whether it reads the ids)
    "window": (lambda ids: lambda b, h, i, j: (j <= i) & (i - j <= 100), True, False),
    "chunked": (lambda ids: mods.chunked(256), True, False),
    "documents": (_bidirectional_documents, False, True),
    "causal-documents": (lambda ids: mods.document_window(ids, 100), True, True),
}


@pytest.mark.parametrize("via", ["block_mask", "mask_mod"])
@pytest.mark.parametrize("name", FOLDED_MASKS)
def test_constant_masks_are_folded_at_trace_time(on_hopper, monkeypatch, name, via):
    """A block mask built outside jit, and a mask_mod passed as such that closes over no traced
    array (its block mask built when the call is traced), are constants of the caller's
    trace: the Hopper kernels' tile ranges and pair order are computed from them once, the
    compiled program computes nothing around the kernels (no reduction, sort or gather of
    tile classes), and the forward runs on the persistent grid (its table balanced by the
    known ranges). Built inside jit from traced ids, the same call computes them in the
    program (with the pair order's sort where the call is not causal: a document window is,
    through its mask_mod's `key_bound`), and the forward keeps one CTA per item."""
    import flashjax

    mask, causal, of_ids = FOLDED_MASKS[name]
    grids = _forward_grids(monkeypatch)
    q = jax.ShapeDtypeStruct((2, 1024, 4, 128), jnp.bfloat16)
    ids = jnp.repeat(jnp.arange(4, dtype=jnp.int32), 256)[None].repeat(2, 0)
    build = lambda ids: flashjax.block_mask(mask(ids), 2, 1, 1024, 1024, block_q=64, block_k=64)
    prebuilt = build(ids)

    def ops(fn, *args):
        grids.clear()
        jax.clear_caches()  # the kernels' inner jit, traced by an earlier test, would not call `forward`
        text = jax.jit(jax.grad(fn)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count(MOSAIC_CALL) == 3
        names = re.findall(r"stablehlo\.(\w+)", text)
        return {name: names.count(name) for name in ("sort", "reduce", "gather")}, tuple(grids)

    def loss(q, ids, block_mask=None):
        mask_given = dict(block_mask=block_mask if block_mask is not None else build(ids)) if via == "block_mask" \
            else dict(mask_mod=mask(ids))
        o = flashjax.flash_attention(q, q, q, backend="mosaic", **mask_given)
        return jnp.sum(o.astype(jnp.float32))

    folded, ctas = ops(lambda q: loss(q, ids, prebuilt), q)
    assert folded == {"sort": 0, "reduce": 0, "gather": 0}, folded
    assert ctas and all(c is not None for c in ctas), ctas
    if of_ids:
        traced, ctas = ops(loss, q, ids)
        assert (traced["sort"] == 0) == causal and traced["reduce"] > 1, traced
        assert ctas == (None,) * len(ctas), ctas


def test_large_constant_masks_stay_in_the_program(on_hopper, monkeypatch):
    """Past `flex.TRACE_TIME_TILES` tiles a mask_mod's constant block mask is built in the
    program, as a traced one is (the forward on the per-item grid): its size would burden the
    program, and any XLA op reading it would be folded by XLA's compiler."""
    import flashjax
    from flashjax import flex

    grids = _forward_grids(monkeypatch)
    monkeypatch.setattr(flex, "TRACE_TIME_TILES", (1024 // 64) ** 2 - 1)
    q = jax.ShapeDtypeStruct((2, 1024, 4, 128), jnp.bfloat16)
    jax.clear_caches()
    loss = lambda q: jnp.sum(flashjax.flash_attention(q, q, q, backend="mosaic", mask_mod=mods.chunked(256)).astype(jnp.float32))
    text = jax.jit(jax.grad(loss)).trace(q).lower(lowering_platforms=("cuda",)).as_text()
    assert re.findall(r"stablehlo\.reduce\b", text)
    assert grids and all(c is None for c in grids), grids


def test_persistent_table_of_constant_ranges_only_under_jit(on_hopper, monkeypatch):
    """Constant ranges give the persistent forward's table (a static part of the kernels'
    call, `ItemTiles`) only where the caller's program is staged: under `jit` a block mask
    built outside is a constant of that program anyway. Under an eager `jax.grad` (a new
    mask each step) the ranges stay operands of one cached call: no table, no recompile."""
    import flashjax
    from flashjax import api

    seen = []

    def kernels(q, k, v, extras, params):  # records what the kernels' call receives
        tiles = (extras.tile_inputs or {}).get("fwd")
        seen.append(None if tiles is None else tiles.ranged_items)
        return jnp.zeros(q.shape, q.dtype), jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)

    monkeypatch.setattr(api, "_attention", kernels)
    q = jnp.ones((2, 512, 4, 128), jnp.bfloat16)
    block_mask = flashjax.block_mask(lambda b, h, i, j: (j <= i) | (j < 100), 2, 1, 512, 512, block_q=64, block_k=64)
    loss = lambda q: jnp.sum(flashjax.flash_attention(q, q, q, backend="mosaic", block_mask=block_mask).astype(jnp.float32))
    jax.grad(loss)(q)
    assert seen[-1] is None, seen
    jax.jit(jax.grad(loss)).trace(q)
    assert seen[-1] is not None and seen[-1].array().shape == (512 // 128, 2), seen  # (pairs, batch rows)


WIDE_FIT_CASES = [
    # (q/k head dim, v head dim, kv heads, options): pairs whose dQ ring is fitted to shared
    # memory (`backend._dq_tile`), with the options that add scratch to it. Segment ids at 256
    # and at 224 / 192 overflowed before the fitting counted their scratch's alignment.
    pytest.param(256, 256, 2, dict(causal=True, segments=True), id="256-256-segments"),
    pytest.param(224, 192, 2, dict(softcap=30.0, kv_lengths=True, dropout=True, window=(64, 64), segments=True),
                 id="224-192-segments-lengths-dropout-window-softcap"),
    pytest.param(224, 192, 1, dict(causal=True), id="224-192-causal-mqa"),
    pytest.param(160, 96, 4, dict(segments=True, dropout=True), id="160-96-segments-dropout"),
]


@pytest.mark.parametrize("device", ["", "nvidia-h100-80gb-hbm3"], ids=["built-in", "h100"])
@pytest.mark.parametrize("qk_dim,v_dim,kv_heads,options", WIDE_FIT_CASES)
def test_hopper_backward_fits_wide_head_dims(on_hopper, qk_dim, v_dim, kv_heads, options, device):
    """Wide and odd head-dim pairs with the options that add shared-memory scratch lower for
    sm_90 on the Hopper kernels, forward and backward, within shared memory (the lowering
    checks the limit), with either tuned table."""
    import flashjax

    batch, heads = 2, 4
    q = jax.ShapeDtypeStruct((batch, SEQ_Q, heads, qk_dim), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((batch, SEQ_K, kv_heads, qk_dim), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((batch, SEQ_K, kv_heads, v_dim), jnp.bfloat16)
    kwargs = {name: options[name] for name in ("causal", "window", "softcap") if name in options}
    if options.get("segments"):
        kwargs["segment_ids"] = (jnp.zeros((batch, SEQ_Q), jnp.int32), jnp.zeros((batch, SEQ_K), jnp.int32))
    if options.get("kv_lengths"):
        kwargs["kv_lengths"] = jnp.array([SEQ_K, 301], jnp.int32)
    if options.get("dropout"):
        kwargs.update(dropout_rate=0.1, dropout_rng=jax.random.key(0))
    config = MosaicConfig.default(qk_dim, device_kind=device, v_head_dim=v_dim)

    def loss(q, k, v):
        o = flashjax.flash_attention(q, k, v, backend="mosaic", config=config, **kwargs)
        return jnp.sum(o.astype(jnp.float32))

    text = lower_for_cuda(loss, q, k, v)
    assert set(re.findall(r"flashjax_mosaic_(fwd|dkv|dq)\b", text)) == {"fwd", "dkv", "dq"}


@pytest.mark.parametrize("backend", ["mosaic", "triton"])
@pytest.mark.parametrize("options", [
    pytest.param(dict(causal=True), id="causal"),
    pytest.param(dict(causal=True, window=(300, 0), sinks=True, lengths=True), id="window-sinks-lengths"),
    pytest.param(dict(causal=False, segments=True, softcap=20.0, dropout=True), id="segments-softcap-dropout"),
])
def test_lowers_for_sm90_under_x64(on_hopper, backend, options):
    """With ``jax_enable_x64`` on (Python ints become int64), bf16 calls still lower for sm_90,
    forward and backward: the kernels' index arithmetic stays int32."""
    import flashjax

    options = dict(options)
    q = jax.ShapeDtypeStruct((2, SEQ_Q, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, SEQ_K, 2, 128), jnp.bfloat16)
    kwargs = dict(causal=options.pop("causal"), window=options.pop("window", None), softcap=options.pop("softcap", None))
    if options.pop("sinks", False):
        kwargs["sinks"] = jnp.zeros((4,), jnp.float32)
    if options.pop("lengths", False):
        kwargs["kv_lengths"] = jnp.array([SEQ_K, 300], jnp.int32)
    if options.pop("segments", False):
        kwargs["segment_ids"] = (jnp.zeros((2, SEQ_Q), jnp.int32), jnp.zeros((2, SEQ_K), jnp.int32))
    if options.pop("dropout", False):
        kwargs.update(dropout_rate=0.1, dropout_rng=jax.random.PRNGKey(0))
    assert not options

    def loss(q, k, v):
        o, lse = flashjax.flash_attention(q, k, v, backend=backend, return_lse=True, **kwargs)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(lse)

    with jax.enable_x64(True):
        text = lower_for_cuda(loss, q, kv, kv)
    assert (MOSAIC_CALL if backend == "mosaic" else TRITON_CALL) in text


@pytest.mark.parametrize("backend", ["mosaic", "triton"])
def test_x64_mode_lowers_for_sm90(on_hopper, backend):
    """With ``jax_enable_x64`` on, 32-bit calls with closed-over arrays in the mods (per-head
    slopes, per-sequence prefixes), masks and sinks lower for sm_90, forward and backward: the
    kernels' index arithmetic stays int32."""
    import flashjax
    from flashjax import mods

    slopes = jnp.linspace(-0.1, 0.1, 4, dtype=jnp.float32)
    q = jax.ShapeDtypeStruct((2, 300, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 517, 2, 64), jnp.bfloat16)

    def loss(q, k, v):
        o = flashjax.flash_attention(q, k, v, backend=backend, causal=True, window=(200, None),
                                     kv_lengths=jnp.array([517, 400], jnp.int32), sinks=jnp.zeros(4, jnp.float32),
                                     score_mod=lambda s, b, h, i, j: s + slopes[h] * (i - j),
                                     mask_mod=mods.prefix_lm(jnp.array([12, 30], jnp.int32)))
        return jnp.sum(o.astype(jnp.float32))

    with jax.enable_x64(True):
        lower_for_cuda(loss, q, kv, kv)

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
import types

import jax
import jax.numpy as jnp
import pytest
from jax._src.pallas.triton import pallas_call_registration

from flashjax import MosaicConfig, TritonConfig, autodiff, reference
from flashjax.params import AttentionParams, Extras

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

SEQ_Q, SEQ_K = 1000, 1200
TRITON_CALL = "__gpu$xla.gpu.triton"


@pytest.fixture
def fake_h100(monkeypatch):
    """Answers the Triton lowering's compute-capability query with 9.0 (Hopper)."""
    fake = types.SimpleNamespace(get_gpu_info=lambda *args, **kwargs: types.SimpleNamespace(compute_capability="9.0"))
    monkeypatch.setattr(pallas_call_registration, "gpu_info_lib", fake)


def lower_attention_for_cuda(params, q, kv) -> str:
    """StableHLO of jit(grad) of a loss on flashjax's o and lse, lowered for CUDA."""

    def loss(q, k, v):
        o, lse = autodiff.attention(q, k, v, Extras(), params)
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
    no other tensor here has the factor 5^5 (it needs both lengths).
    """
    return [
        s for s in shapes
        if (set(s) & q_lens and set(s) & k_lens) or math.prod(s) % (SEQ_Q * SEQ_K) == 0
    ]


CASES = [
    # (heads, kv_heads, head_dim, causal, window)
    pytest.param(4, 4, 64, False, None, id="d64"),
    pytest.param(4, 4, 64, True, None, id="d64-causal"),
    pytest.param(4, 4, 128, False, None, id="d128"),
    pytest.param(8, 2, 128, True, None, id="d128-causal-gqa4"),
    pytest.param(4, 1, 64, False, None, id="d64-mqa"),
    pytest.param(4, 2, 64, False, (256, 256), id="d64-window"),
    pytest.param(4, 2, 128, True, (256, None), id="d128-window-causal"),
    pytest.param(2, 2, 256, True, None, id="d256-causal"),
]


@pytest.mark.parametrize("heads,kv_heads,head_dim,causal,window", CASES)
def test_lowers_to_triton_for_sm90(fake_h100, heads, kv_heads, head_dim, causal, window):
    dtype = jnp.bfloat16
    config = TritonConfig.default(head_dim, dtype)
    params = AttentionParams(
        scale=head_dim**-0.5, causal=causal, window=window, backend="triton", config=config,
        backward_backend="triton", backward_config=config, interpret=False,
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
    pytest.param(4, 2, 128, False, {"bwd_dq": "accumulate"}, ("fwd", "dkv_dq"), id="d128-accumulate"),
    pytest.param(4, 4, 96, True, {"bwd_dq": "accumulate"}, ("fwd", "dkv_dq"), id="d96-causal-accumulate"),
]


@pytest.mark.parametrize("heads,kv_heads,head_dim,causal,overrides,kernels", MOSAIC_CASES)
def test_mosaic_kernels_lower_for_sm90(heads, kv_heads, head_dim, causal, overrides, kernels):
    """The Hopper kernels go through Pallas' Mosaic GPU lowering (layouts, wgmma operand
    shapes, barriers, semaphores) without a GPU; what only ptxas or the device checks
    (register allocation, running) is left to tests/test_mosaic.py on the device."""
    import dataclasses

    dtype = jnp.bfloat16
    config = dataclasses.replace(MosaicConfig.default(head_dim, device_kind=""), **overrides)
    params = AttentionParams(
        scale=head_dim**-0.5, causal=causal, backend="mosaic", config=config, backward_backend="mosaic",
        backward_config=config, interpret=False,
    )
    q = jax.ShapeDtypeStruct((2, SEQ_Q, heads, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((2, SEQ_K, kv_heads, head_dim), dtype)
    text = lower_attention_for_cuda(params, q, kv)
    assert text.count(MOSAIC_CALL) == len(kernels), f"expected {len(kernels)} Mosaic GPU kernels, found {text.count(MOSAIC_CALL)}"
    names = set(re.findall(r"flashjax_mosaic_(fwd|dkv_dq|dkv|dq)\b", text))
    assert names == set(kernels), names
    # The glue pads both lengths to whole tiles (at most 256 rows); padded lengths count too.
    q_lens = {SEQ_Q} | {-(-SEQ_Q // m) * m for m in (64, 128, 256)}
    k_lens = {SEQ_K} | {-(-SEQ_K // m) * m for m in (64, 128, 256)}
    shapes = tensor_shapes(text)
    assert shapes and not score_sized(shapes, q_lens, k_lens), score_sized(shapes, q_lens, k_lens)

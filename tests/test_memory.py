"""Memory: the compiled forward and forward+backward never hold a [Tq, Tk] buffer.

We compare XLA's compiled memory analysis (temp buffers, i.e. everything besides
arguments and outputs) at T and 4T. Attention that materialises the scores grows
16x; ours must grow about 4x (the padded copies of q, k, v, o, do, lse and delta).

Why the CPU's numbers mean something: interpret mode lowers each `pallas_call` to
an XLA while loop over the grid whose body slices one tile of every operand, so
the compiled module allocates what the GPU kernels allocate (whole inputs and
outputs, tile-sized intermediates) and nothing N x N unless the algorithm has it;
the xla backend, which does materialise the scores, shows the quadratic growth
under the same analysis (a positive control). The same test runs unchanged on a
GPU, where it measures the real kernels. `test_lowering.py` adds the static
evidence for the CUDA lowering: no tensor there has a [Tq, Tk] shape.
"""

import jax
import jax.numpy as jnp
import pytest

import flashjax

SEQ = 256  # and 4 * SEQ; long enough that O(T^2) dominates the xla backend's temps


def temp_bytes(backend: str, seq: int, *, grad: bool, causal: bool) -> int:
    """Temp bytes of the compiled (jit) loss or its gradient for [1, seq, 2, 64] float32 inputs."""
    x = jax.ShapeDtypeStruct((1, seq, 2, 64), jnp.float32)

    def loss(q, k, v):
        return flashjax.flash_attention(q, k, v, causal=causal, backend=backend).sum()

    fn = jax.grad(loss, argnums=(0, 1, 2)) if grad else loss
    analysis = jax.jit(fn).lower(x, x, x).compile().memory_analysis()
    if analysis is None:
        pytest.skip("this platform's compiler gives no memory analysis")
    return analysis.temp_size_in_bytes


# The causal mask changes no buffer's size, so one of each direction suffices.
@pytest.mark.parametrize("grad,causal", [(False, False), (True, True)], ids=["forward", "forward+backward-causal"])
def test_temp_memory_is_linear_in_length(grad, causal):
    ours = [temp_bytes("triton", t, grad=grad, causal=causal) for t in (SEQ, 4 * SEQ)]
    xla = [temp_bytes("xla", t, grad=grad, causal=causal) for t in (SEQ, 4 * SEQ)]
    ours_growth, xla_growth = ours[1] / max(ours[0], 1), xla[1] / max(xla[0], 1)
    report = f"temp bytes at T={SEQ}, {4 * SEQ}: triton {ours}, xla {xla}"
    # Linear growth is 4x (plus tile padding); quadratic is 16x.
    assert ours_growth <= 5.0, f"flash attention's temp memory grows {ours_growth:.1f}x for 4x the length; {report}"
    assert xla_growth >= 12.0, f"positive control: the xla backend should grow ~16x, got {xla_growth:.1f}x; {report}"
    assert 2 * ours[1] < xla[1], report

"""Lowering for the CUDA platform on a machine without a GPU (no device is needed, except
that Pallas' Triton lowering asks the local GPU for its compute capability)."""

from __future__ import annotations

import contextlib
import types

from jax._src.pallas.triton import lowering as triton_lowering
from jax._src.pallas.triton import pallas_call_registration


@contextlib.contextmanager
def as_on_h100():
    """Within: Pallas' Triton lowering is answered compute capability 90 (Hopper; an int, as
    `gpu_info.GpuInfo` has it: the float8 conversions compare it with 89), and each Triton
    module is verified as it is built: Pallas serialises it unverified, and an invalid one
    fails only when the GPU's Triton parses it."""
    fake = types.SimpleNamespace(get_gpu_info=lambda *args, **kwargs: types.SimpleNamespace(compute_capability=90))
    lower = triton_lowering.lower_jaxpr_to_triton_module

    def lower_and_verify(*args, **kwargs):
        result = lower(*args, **kwargs)
        result.module.operation.verify()  # raises MLIRError naming the failing operation
        return result

    saved = pallas_call_registration.gpu_info_lib
    pallas_call_registration.gpu_info_lib = fake
    triton_lowering.lower_jaxpr_to_triton_module = lower_and_verify
    try:
        yield
    finally:
        pallas_call_registration.gpu_info_lib = saved
        triton_lowering.lower_jaxpr_to_triton_module = lower

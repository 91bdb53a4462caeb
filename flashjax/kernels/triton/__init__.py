"""The Triton backend: FlashAttention-2 kernels in Pallas, lowered through Triton (any CUDA
GPU; Pallas interpret mode without one). `backend.BACKEND` is what the registry uses."""

from flashjax.kernels.triton.backend import BACKEND
from flashjax.kernels.triton.config import DecodeConfig, KernelConfig, TritonConfig

__all__ = ["BACKEND", "DecodeConfig", "KernelConfig", "TritonConfig"]

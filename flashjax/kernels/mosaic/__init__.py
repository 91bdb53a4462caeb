"""The Hopper backend: FlashAttention-3-style kernels in Pallas Mosaic GPU (sm90 only).
`backend.BACKEND` is what the registry uses."""

from flashjax.kernels.mosaic.backend import BACKEND
from flashjax.kernels.mosaic.config import MosaicConfig

__all__ = ["BACKEND", "MosaicConfig"]

"""flashjax: exact, IO-aware attention for JAX, written as Pallas GPU kernels."""

from flashjax.api import flash_attention
from flashjax.config import Config, KernelConfig

__version__ = "0.1.0"
__all__ = ["flash_attention", "Config", "KernelConfig", "__version__"]

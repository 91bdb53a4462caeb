"""flashjax: exact, IO-aware attention for JAX, written as Pallas GPU kernels.

`flash_attention` is the function; `Config` / `KernelConfig` / `MosaicConfig` tune its kernels;
`sharded_flash_attention` and `ring_attention` run it over a device mesh (batch/head
parallelism, and context parallelism around a ring). Flax users: `flashjax.flax`.
"""

from flashjax.api import flash_attention
from flashjax.config import Config, KernelConfig, MosaicConfig
from flashjax.ring import ring_attention, zigzag_order, zigzag_restore
from flashjax.sharding import sharded_flash_attention

__version__ = "0.1.0"
__all__ = [
    "flash_attention",
    "Config",
    "KernelConfig",
    "MosaicConfig",
    "sharded_flash_attention",
    "ring_attention",
    "zigzag_order",
    "zigzag_restore",
    "__version__",
]

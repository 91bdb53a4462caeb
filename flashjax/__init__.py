"""flashjax: exact, IO-aware attention for JAX, written as Pallas GPU kernels.

`flash_attention` is the function and `explain` says which backend it runs a call on;
`decode_attention` runs a few new queries against a (paged, float8) KV cache, forward only
(`explain_decode` says which backend);
`flash_attention`'s `score_mod`/`mask_mod` take user functions (FlexAttention), and
`block_mask` builds the tile classification of a mask_mod once for many calls;
`TritonConfig` (of `KernelConfig`s) and `MosaicConfig` tune the kernels;
`sharded_flash_attention` and `ring_attention` run it over a device mesh (batch/head
parallelism, and context parallelism around a ring). Flax users: `flashjax.flax`.
"""

from flashjax.api import explain, flash_attention
from flashjax.decode import decode_attention, explain_decode
from flashjax.flex import BlockMask, block_mask
from flashjax.kernels.mosaic.config import MosaicConfig
from flashjax.kernels.triton.config import DecodeConfig, KernelConfig, TritonConfig
from flashjax.ring import ring_attention, zigzag_order, zigzag_restore
from flashjax.sharding import sharded_flash_attention

__version__ = "0.1.0"
__all__ = [
    "flash_attention",
    "explain",
    "decode_attention",
    "explain_decode",
    "block_mask",
    "BlockMask",
    "TritonConfig",
    "DecodeConfig",
    "KernelConfig",
    "MosaicConfig",
    "sharded_flash_attention",
    "ring_attention",
    "zigzag_order",
    "zigzag_restore",
    "__version__",
]

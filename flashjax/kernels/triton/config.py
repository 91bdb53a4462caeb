"""`TritonConfig`: the tiling of the three Triton kernels, and its tuned defaults."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from flashjax import checks, tuning

__all__ = ["TritonConfig", "KernelConfig", "DecodeConfig"]

TUNED = Path(__file__).with_name("tuned.json")
# Shared memory a Triton program may use on sm90 (227 KB), less a margin for the
# compiler's own layout-conversion buffers.
SHARED_MEMORY_BUDGET = 200 * 1024
MAX_HEAD_DIM = 256


def _is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


# Warps of one program: CUDA's 1024 threads a block.
MAX_WARPS = 32


def _check_launch(config):
    """Triton's launch parameters of a config: num_warps a power of two up to 32, num_stages >= 1."""
    name = type(config).__name__
    if not (_is_power_of_two(config.num_warps) and config.num_warps <= MAX_WARPS):
        raise ValueError(f"{name}.num_warps must be a power of two up to {MAX_WARPS}, got {config.num_warps}.")
    if config.num_stages < 1:
        raise ValueError(f"{name}.num_stages must be >= 1, got {config.num_stages}.")


def next_power_of_two(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tiling of one Triton kernel.

    Attributes:
      block_q: rows of the query tile (a power of two >= 16).
      block_k: rows of the key/value tile (a power of two >= 16).
      num_warps: warps per program.
      num_stages: software-pipelining depth of the key/value (or query) loop.
    """

    block_q: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        checks.check_config_ints(self, "block_q", "block_k", "num_warps", "num_stages")
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if not (_is_power_of_two(value) and value >= 16):
                raise ValueError(f"KernelConfig.{name} must be a power of two >= 16, got {value}.")
        _check_launch(self)

    def fit_shared_memory(self, streamed_bytes_per_key: int, pair_bytes: int,
                          streamed_bytes_per_query: int = 0) -> "KernelConfig":
        """Fewer pipeline stages, then shorter key tiles, until the streamed tiles fit.

        Each stage holds a key tile of every streamed operand (`streamed_bytes_per_key`
        bytes per key row, e.g. K and V), a [block_q, block_k] tile of each
        broadcastable input (`pair_bytes` per element, e.g. 2 for a bf16 bias) and, for a
        loop that also streams query tiles (the dbias kernel's), a query tile of each
        (`streamed_bytes_per_query` bytes per query row, e.g. Q and dO). block_q stays:
        the per-query-tile inputs (lengths' ranges) are laid out by it.
        """
        config = self
        while True:
            per_stage = (config.block_k * (streamed_bytes_per_key + config.block_q * pair_bytes)
                         + config.block_q * streamed_bytes_per_query)
            if per_stage * config.num_stages <= SHARED_MEMORY_BUDGET:
                return config
            if config.num_stages > 2:
                config = dataclasses.replace(config, num_stages=config.num_stages - 1)
            elif config.block_k > 16:
                config = dataclasses.replace(config, block_k=config.block_k // 2)
            else:
                return config

    def fit(self, seq_q: int, seq_k: int) -> "KernelConfig":
        """Shrinks the tiles for short sequences (never below 16, Triton's smallest dot)."""
        return dataclasses.replace(
            self,
            block_q=min(self.block_q, max(16, next_power_of_two(seq_q))),
            block_k=min(self.block_k, max(16, next_power_of_two(seq_k))),
        )


@dataclasses.dataclass(frozen=True)
class TritonConfig:
    """Tiling of the Triton (``backend="triton"``) kernels.

    Attributes:
      fwd: the forward kernel (one program per query tile, loop over key tiles).
      dkv: the dK/dV kernel (one program per key tile, loop over query tiles).
      dq: the dQ kernel (one program per query tile, loop over key tiles).
    """

    fwd: KernelConfig
    dkv: KernelConfig
    dq: KernelConfig

    def __post_init__(self):
        for name in ("fwd", "dkv", "dq"):
            if not isinstance(getattr(self, name), KernelConfig):
                raise TypeError(f"TritonConfig.{name} must be a KernelConfig, got {getattr(self, name)!r}.")

    @classmethod
    def default(cls, head_dim: int, dtype=np.float32, device_kind: str | None = None) -> "TritonConfig":
        """The tuned tiling for a (padded) head dimension and input dtype.

        kernels/triton/tuned.json: this GPU model's entry if `benchmarks/tune.py` wrote
        one, else the default (measured on an H100). Nothing is timed here.
        """
        padded = max(16, next_power_of_two(head_dim))
        if padded > MAX_HEAD_DIM:
            raise ValueError(f"the Triton kernels support head_dim <= {MAX_HEAD_DIM}, got {head_dim}.")
        if device_kind is None:
            device_kind = tuning.first_gpu_kind()
        entry = tuning.entry(TUNED, padded, device_kind)
        fwd, dkv, dq = (KernelConfig(**entry[name]) for name in ("fwd", "dkv", "dq"))
        if np.dtype(dtype) == np.float32:
            # float32 tiles take twice the registers and shared memory of bf16 ones, and
            # their full-precision dots are FMA loops that Triton unrolls over the whole
            # tile: at 128 x 128 (head dim 64) one kernel took minutes to compile on an H100.
            halve = lambda c: dataclasses.replace(c, block_q=max(16, c.block_q // 2), block_k=max(16, c.block_k // 2))
            fwd, dkv, dq = halve(fwd), halve(dkv), halve(dq)
        return cls(fwd=fwd, dkv=dkv, dq=dq)

    def fit(self, seq_q: int, seq_k: int) -> "TritonConfig":
        """Shrinks every kernel's tiles for short sequences."""
        return TritonConfig(self.fwd.fit(seq_q, seq_k), self.dkv.fit(seq_q, seq_k), self.dq.fit(seq_q, seq_k))

    @property
    def q_multiple(self) -> int:
        """Query lengths are padded to a multiple of this (every kernel's query tile divides it)."""
        return max(self.fwd.block_q, self.dkv.block_q, self.dq.block_q)

    @property
    def k_multiple(self) -> int:
        """Key lengths are padded to a multiple of this."""
        return max(self.fwd.block_k, self.dkv.block_k, self.dq.block_k)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Tiling of the Triton decode kernel (`flashjax.decode_attention`).

    Attributes:
      block_k: keys per step of the key loop (a power of two >= 16); None: by the features
        read per key, 128 up to 64, 64 up to 256, else 32 (halved for float32 past 128), at
        most the page size of a paged cache with pages of >= 64 keys. With a paged cache a
        tile is a slice of one page (pages >= block_k) or a gather of whole pages; a
        contiguous cache whose length it does not divide ends in a ragged tile.
      num_warps: warps per program; None: 4, or 2 for a float8 cache whose batch fills the
        GPU without splitting the keys (measured on an H100: 1.4x faster at batch 64, and
        slower than 4 warps where the keys are split).
      num_stages: software-pipelining depth of the key loop.
    """

    block_k: int | None = None
    num_warps: int | None = None
    num_stages: int = 2

    def __post_init__(self):
        checks.check_config_ints(self, "block_k", "num_warps", "num_stages", optional=("block_k", "num_warps"))
        if self.block_k is not None and not (_is_power_of_two(self.block_k) and self.block_k >= 16):
            raise ValueError(f"DecodeConfig.block_k must be None or a power of two >= 16, got {self.block_k}.")
        if self.num_warps is not None and not (_is_power_of_two(self.num_warps) and self.num_warps <= MAX_WARPS):
            raise ValueError(f"DecodeConfig.num_warps must be None or a power of two up to {MAX_WARPS}, "
                             f"got {self.num_warps}.")
        if self.num_stages < 1:
            raise ValueError(f"DecodeConfig.num_stages must be >= 1, got {self.num_stages}.")

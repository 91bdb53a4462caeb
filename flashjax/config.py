"""Kernel configuration: tile sizes, warps and pipeline stages.

A `Config` holds one `KernelConfig` per kernel (forward, dK/dV, dQ). It is a
frozen dataclass so that it can be a static argument of `jax.jit` and a key of
the compilation cache. `Config.default(head_dim, dtype)` returns the tuned
defaults; pass your own to `flash_attention(..., config=...)` to override them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from pathlib import Path

import numpy as np

__all__ = ["Config", "KernelConfig", "MosaicConfig"]

# Per-GPU tilings of the Hopper kernels measured by `benchmarks/tune.py --backend mosaic`.
MOSAIC_TUNING_FILE = Path(__file__).with_name("tuned_mosaic.json")


def _is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tiling of one kernel.

    Attributes:
      block_q: rows of the query tile (a power of two >= 16).
      block_k: rows of the key/value tile (a power of two >= 16).
      num_warps: warps per program (Triton).
      num_stages: software-pipelining depth of the key/value (or query) loop.
    """

    block_q: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if not (_is_power_of_two(value) and value >= 16):
                raise ValueError(f"KernelConfig.{name} must be a power of two >= 16, got {value}.")
        if not _is_power_of_two(self.num_warps):
            raise ValueError(f"KernelConfig.num_warps must be a power of two, got {self.num_warps}.")
        if self.num_stages < 1:
            raise ValueError(f"KernelConfig.num_stages must be >= 1, got {self.num_stages}.")

    def fit_shared_memory(self, streamed_bytes_per_key: int, pair_bytes: int) -> "KernelConfig":
        """Fewer pipeline stages, then shorter key tiles, until the streamed tiles fit.

        Each stage holds a key tile of every streamed operand (`streamed_bytes_per_key`
        bytes per key row, e.g. K and V) plus a [block_q, block_k] tile of each
        broadcastable input (`pair_bytes` per element, e.g. 2 for a bf16 bias).
        """
        config = self
        while True:
            per_stage = config.block_k * (streamed_bytes_per_key + config.block_q * pair_bytes)
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
            block_q=min(self.block_q, max(16, _next_power_of_two(seq_q))),
            block_k=min(self.block_k, max(16, _next_power_of_two(seq_k))),
        )


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# Measured on an H100 80GB HBM3, bf16, T = 8k, non-causal (benchmarks/quick.py sweep:D;
# figures in benchmarks/results/). The forward keeps a 128-row query tile on chip;
# D=128 streams 128-row key tiles (428 TF/s vs 404 with 64). The dK/dV kernel walks
# 64-row query tiles against a 128-row key tile on 8 warps (389 TF/s fwd+bwd; 64x128 on
# 4 warps spills and drops to 204); the dQ kernel mirrors it. D=256 tiles are halved
# in one direction to fit the registers (fwd 436 TF/s, fwd+bwd ~195).
_TUNED: dict[int, tuple[KernelConfig, KernelConfig, KernelConfig]] = {
    16: (KernelConfig(128, 64, 4, 3), KernelConfig(32, 128, 4, 3), KernelConfig(128, 64, 4, 3)),
    32: (KernelConfig(128, 64, 4, 3), KernelConfig(32, 128, 4, 3), KernelConfig(128, 64, 4, 3)),
    64: (KernelConfig(128, 128, 4, 3), KernelConfig(32, 128, 4, 3), KernelConfig(128, 64, 4, 3)),
    128: (KernelConfig(128, 128, 8, 3), KernelConfig(64, 128, 8, 3), KernelConfig(128, 64, 8, 3)),
    256: (KernelConfig(128, 64, 8, 2), KernelConfig(64, 32, 4, 2), KernelConfig(64, 32, 4, 2)),
}

# Shared memory a Triton program may use on sm90 (227 KB), less a margin for the
# compiler's own layout-conversion buffers.
SHARED_MEMORY_BUDGET = 200 * 1024


@dataclasses.dataclass(frozen=True)
class Config:
    """Tiling of the three kernels of flash attention.

    Attributes:
      fwd: the forward kernel (one program per query tile, loop over key tiles).
      dkv: the dK/dV kernel (one program per key tile, loop over query tiles).
      dq: the dQ kernel (one program per query tile, loop over key tiles).
      mosaic: the Hopper kernels' tiling (``backend="mosaic"``); None picks
        `MosaicConfig.default` for the head dim.
    """

    fwd: KernelConfig
    dkv: KernelConfig
    dq: KernelConfig
    mosaic: MosaicConfig | None = None

    @classmethod
    def default(cls, head_dim: int, dtype=np.float32) -> "Config":
        """The tuned configuration for a (padded) head dimension and input dtype."""
        padded = max(16, _next_power_of_two(head_dim))
        if padded not in _TUNED:
            raise ValueError(f"No kernel configuration for head_dim={head_dim} (padded to {padded}); at most 256 is supported.")
        fwd, dkv, dq = _TUNED[padded]
        if np.dtype(dtype) == np.float32 and padded >= 128:
            # float32 tiles take twice the registers and shared memory of bf16 ones.
            halve = lambda c: dataclasses.replace(c, block_q=max(16, c.block_q // 2), block_k=max(16, c.block_k // 2))
            fwd, dkv, dq = halve(fwd), halve(dkv), halve(dq)
        return cls(fwd=fwd, dkv=dkv, dq=dq)

    def fit(self, seq_q: int, seq_k: int) -> "Config":
        """Shrinks every kernel's tiles for short sequences."""
        return Config(self.fwd.fit(seq_q, seq_k), self.dkv.fit(seq_q, seq_k), self.dq.fit(seq_q, seq_k), self.mosaic)

    @property
    def q_multiple(self) -> int:
        """Query lengths are padded to a multiple of this (every kernel's query tile divides it)."""
        return max(self.fwd.block_q, self.dkv.block_q, self.dq.block_q)

    @property
    def k_multiple(self) -> int:
        """Key lengths are padded to a multiple of this."""
        return max(self.fwd.block_k, self.dkv.block_k, self.dq.block_k)


# ---- Hopper (Pallas Mosaic GPU) backend ---------------------------------------------------
FWD_SCHEDULES = ("auto", "pingpong", "overlap", "overlap_pingpong")
BWD_DQ = ("recompute", "accumulate")


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """Tiling of the Hopper (``backend="mosaic"``) kernels.

    Each forward CTA runs two consumer warpgroups of `block_q` query rows (wgmma
    wants 64-row multiples per warpgroup) and one producer warpgroup streaming
    `block_kv`-row K/V tiles through a ring of `stages` shared-memory slots.

    Attributes:
      block_q: query rows per consumer warpgroup in the forward (a multiple of 64).
      block_kv: key rows per tile in the forward (a multiple of 64).
      stages: depth of the forward's K/V ring (>= 1).
      bwd_block_q: query rows per step of the dK/dV kernel and per tile of the dQ kernel.
      bwd_block_kv: key rows per consumer warpgroup of the dK/dV kernel.
      bwd_stages: depth of the backward kernels' rings.
      dq_block_kv: key rows per step of the dQ kernel.
      tile_major: launch the CTAs of one (batch, head) back to back (the tile index
        is the fastest grid axis) instead of the heads. Sharing K/V in L2 that way
        measured 3-10% slower on the H100 (d128 and d64), hence off.
      fwd_schedule: how the forward's two consumer warpgroups share the tensor cores.
        "pingpong": each key step waits for its products; a shared barrier alternates
        the warpgroups so that one's softmax runs under the other's products (JAX's
        FA3 example). "overlap": the key loop is software-pipelined instead
        (FlashAttention-3's intra-warpgroup overlap: tile j's softmax runs while the
        P V product of tile j-1 is on the tensor cores), no barrier between the
        warpgroups. "overlap_pingpong": both. "auto" (default): "overlap" without a
        causal mask (measured 2-13% faster on the H100 at T >= 4k), "pingpong" with
        one (overlap was no faster there and now and then much slower).
      bwd_dq: how the backward gets dQ (both deterministic). "recompute": a second
        kernel walks the key tiles of each query tile and recomputes S and dP (7
        matrix products per tile pair). "accumulate": the dK/dV kernel also forms
        dQ = dS K and adds it into a float32 dQ in global memory, in key-tile order
        enforced by semaphores (FlashAttention-3's deterministic mode; 5 products);
        head dim 128 only, others fall back to "recompute". "recompute" is the
        default: "accumulate" measured 15-30% slower on the H100 (its consumers
        spill registers), see benchmarks/results/mosaic-notes.md.
    """

    block_q: int = 64
    block_kv: int = 128
    stages: int = 2
    bwd_block_q: int = 64
    bwd_block_kv: int = 64
    bwd_stages: int = 2
    dq_block_kv: int = 128
    tile_major: bool = False
    fwd_schedule: str = "auto"
    bwd_dq: str = "recompute"

    def __post_init__(self):
        for name in ("block_q", "block_kv", "bwd_block_q", "bwd_block_kv", "dq_block_kv"):
            value = getattr(self, name)
            if value < 64 or value % 64:
                raise ValueError(f"MosaicConfig.{name} must be a positive multiple of 64, got {value}.")
        if self.fwd_schedule not in FWD_SCHEDULES:
            raise ValueError(f"MosaicConfig.fwd_schedule must be one of {FWD_SCHEDULES}, got {self.fwd_schedule!r}.")
        if self.bwd_dq not in BWD_DQ:
            raise ValueError(f"MosaicConfig.bwd_dq must be one of {BWD_DQ}, got {self.bwd_dq!r}.")
        for name in ("stages", "bwd_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"MosaicConfig.{name} must be >= 1, got {getattr(self, name)}.")

    @classmethod
    def default(cls, head_dim: int, device_kind: str | None = None) -> "MosaicConfig":
        """The tiling for a head dim of 64, 128 or 256 on a GPU (default: the first JAX device).

        The entry `benchmarks/tune.py --backend mosaic` measured for this GPU model in
        flashjax/tuned_mosaic.json where there is one, else the built-in H100 table.
        Nothing is timed here.
        """
        builtin = _MOSAIC_TUNED[head_dim]
        if device_kind is None:
            device_kind = _first_gpu_kind()
        measured = _mosaic_tuning_table().get(device_slug(device_kind or ""), {}).get(str(head_dim))
        return dataclasses.replace(builtin, **measured) if measured else builtin


def device_slug(name: str) -> str:
    """A file-name-safe device name: 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def _first_gpu_kind() -> str | None:
    import jax

    device = jax.devices()[0]
    return device.device_kind if device.platform == "gpu" else None


@functools.cache
def _mosaic_tuning_table() -> dict:
    """{device slug: {head dim: MosaicConfig fields}}, read once from MOSAIC_TUNING_FILE."""
    if not MOSAIC_TUNING_FILE.exists():
        return {}
    with open(MOSAIC_TUNING_FILE) as f:
        table = json.load(f)
    fields = {field.name for field in dataclasses.fields(MosaicConfig)}
    return {
        device: {dim: {k: v for k, v in entry.items() if k in fields} for dim, entry in dims.items() if dim.isdigit()}
        for device, dims in table.items()
    }


# Shared memory bounds the K/V tiles: D=256 holds 64-row tiles (2 stages of K and V
# = 128 KB, plus 64 KB of Q), D=128 128-row tiles.
_MOSAIC_TUNED = {
    64: MosaicConfig(block_q=64, block_kv=128, stages=3),
    128: MosaicConfig(block_q=64, block_kv=128, stages=2),
    256: MosaicConfig(block_q=64, block_kv=64, stages=2),
}

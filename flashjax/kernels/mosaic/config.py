"""`MosaicConfig`: the tiling of the Hopper kernels, and its tuned defaults."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp

from flashjax import checks, tuning

__all__ = ["MosaicConfig", "DTYPES", "HEAD_DIMS", "padded_head_dim", "device_reasons"]

TUNED = Path(__file__).with_name("tuned.json")
DTYPES = ("bfloat16", "float16")
# wgmma and the 128-byte swizzle work in 64-column slabs: head dims are padded to these.
HEAD_DIMS = (64, 128, 192, 256)
FWD_SCHEDULES = ("auto", "pingpong", "overlap")
# A tile's rows or keys: wgmma's N and a TMA copy's extent along a dim are at most 256.
MAX_TILE = 256


def device_reasons(platform: str, compute_capability: str, dtype, what: str = "inputs") -> list[str]:
    """Why no Hopper kernel runs here or on these `what` (the attention and decode paths alike)."""
    reasons = []
    if platform != "gpu" or compute_capability != "9.0":
        reasons.append("needs an sm90 (Hopper: H100/H200) GPU; Mosaic GPU kernels have no interpret mode")
    if jnp.dtype(dtype).name not in DTYPES:
        reasons.append(f"{jnp.dtype(dtype).name} {what} (use bfloat16 or float16)")
    return reasons


def padded_head_dim(head_dim: int) -> int:
    """The head dim the kernels run at: the smallest of HEAD_DIMS that holds it."""
    for d in HEAD_DIMS:
        if head_dim <= d:
            return d
    raise ValueError(f"the Hopper kernels support head_dim <= {HEAD_DIMS[-1]}, got {head_dim}.")


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """Tiling of the Hopper (``backend="mosaic"``) kernels.

    Each forward CTA runs two consumer warpgroups of `block_q` query rows (wgmma
    wants 64-row multiples per warpgroup) and one producer warpgroup streaming
    `block_kv`-row K/V tiles through a ring of `stages` shared-memory slots.

    Tiles are multiples of 64 up to 256 (wgmma's and TMA's limits). A config is not fitted to
    shared memory: one whose rings do not fit (more stages or larger tiles than the tuned
    entry of a head dim) fails when the kernel compiles, with Mosaic GPU's "exceeds available
    shared memory".

    Attributes:
      block_q: query rows per consumer warpgroup in the forward (a multiple of 64).
      block_kv: key rows per tile in the forward (a multiple of 64).
      stages: depth of the forward's K/V ring (>= 1).
      bwd_block_q: query rows per step of the dK/dV kernel and per tile of the dQ kernel.
      bwd_block_q_dense: `bwd_block_q` for calls in which every query row sees every key (no
        causal mask, window, lengths, segment ids, mask or mask_mod); None: `bwd_block_q`.
        At head dim 64 on an H100, 128-row tiles are 5-10% faster on such calls and 1-2%
        slower with a causal mask (ptxas spills in the masked tiles), hence the two fields
        (`backward_block_q`).
      bwd_block_kv: key rows per tile of the dK/dV kernel (each consumer's own; where q/k and v head
        dims sum to more than 320, one tile that the two consumers share, `bwd.dkv(split=True)`).
      bwd_stages: depth of the backward kernels' rings.
      dq_block_kv: key rows per step of the dQ kernel (halved, down to 64, where one stage of
        its K/V ring would not fit shared memory beside the query tiles; the ring takes as
        many of `bwd_stages` as fit: head dim 256 runs 64 keys, two K tiles beside one V tile).
      fwd_schedule: how the forward's two consumer warpgroups share the tensor cores:
        "pingpong" (a barrier alternates them, so that one's softmax runs under the
        other's products), "overlap" (each consumer software-pipelines its key loop:
        tile j's softmax runs while tile j-1's P V product is on the tensor cores), or
        "auto": overlap without a causal mask, pingpong with one (the faster of the two
        on an H100 in each case; benchmarks/results/mosaic-notes.md), and pingpong with a
        bias, a score_mod or a mask_mod (the backend's `_forward_schedule`).
      fwd_persistent: run the forward on one CTA per SM, each walking its share of the
        (head, pair of query tiles, batch row) items with the K/V ring running on across
        them, so that an item's first K/V tiles and Q load and its output store overlap the
        neighbouring items' work. Where the output's own shared memory does not fit beside
        the rings (head dims above 128, MLA, head dim 64 with a bias), or the call has
        ranges (lengths, documents, block masks) known only on the device (a block mask
        built outside `jit` is known at trace time), the forward keeps one CTA per item
        (`backend.forward_ctas`). On an H100 at head dims 64 and 128 the persistent forward
        measured 1.01-1.19x the per-item grid from 1k to 8k tokens (causal 1.05-1.19x),
        0.96-0.99x at head dim 64 without a mask from 4k (benchmarks/results/mosaic-notes.md).
    """

    block_q: int = 64
    block_kv: int = 128
    stages: int = 2
    bwd_block_q: int = 64
    bwd_block_q_dense: int | None = None
    bwd_block_kv: int = 64
    bwd_stages: int = 2
    dq_block_kv: int = 128
    fwd_schedule: str = "auto"
    fwd_persistent: bool = True

    def __post_init__(self):
        tiles = ("block_q", "block_kv", "bwd_block_q", "bwd_block_q_dense", "bwd_block_kv", "dq_block_kv")
        checks.check_config_ints(self, *tiles, "stages", "bwd_stages", optional=("bwd_block_q_dense",))
        for name in tiles:
            value = getattr(self, name)
            if value is None:  # bwd_block_q_dense unset
                continue
            if value < 64 or value % 64 or value > MAX_TILE:
                raise ValueError(f"MosaicConfig.{name} must be a multiple of 64 from 64 to {MAX_TILE}, got {value}.")
        if not isinstance(self.fwd_persistent, bool):
            raise ValueError(f"MosaicConfig.fwd_persistent must be a bool, got {self.fwd_persistent!r}.")
        if self.fwd_schedule not in FWD_SCHEDULES:
            raise ValueError(f"MosaicConfig.fwd_schedule must be one of {FWD_SCHEDULES}, got {self.fwd_schedule!r}.")
        for name in ("stages", "bwd_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"MosaicConfig.{name} must be >= 1, got {getattr(self, name)}.")

    @classmethod
    def default(cls, head_dim: int, device_kind: str | None = None, v_head_dim: int | None = None) -> "MosaicConfig":
        """The tiling for a head dim (and v's, when it differs: MLA) on a GPU model (default:
        the first JAX device's).

        The entry `benchmarks/tune.py --backend mosaic` measured for this GPU model in
        kernels/mosaic/tuned.json over the built-in default; a narrower v has its own
        entry ("192x128": the K/V ring holds 128-key tiles that 192-wide V tiles would not
        leave room for) where the table has one. Nothing is timed here.
        """
        if device_kind is None:
            device_kind = tuning.first_gpu_kind()
        fields = {f.name for f in dataclasses.fields(cls)}
        key = padded_head_dim(head_dim)
        if v_head_dim is not None and padded_head_dim(v_head_dim) != key:
            pair = f"{key}x{padded_head_dim(v_head_dim)}"
            key = pair if pair in tuning.entries(TUNED) else key
        entry = tuning.entry(TUNED, key, device_kind)
        return cls(**{k: v for k, v in entry.items() if k in fields})

    def backward_block_q(self, dense: bool) -> int:
        """The backward's query rows per step: `bwd_block_q_dense` (when set) for a call in
        which every query row sees every key, else `bwd_block_q`."""
        return self.bwd_block_q_dense if dense and self.bwd_block_q_dense is not None else self.bwd_block_q

    def forward_schedule(self, causal: bool) -> str:
        """The forward schedule a call runs: "pingpong" or "overlap"."""
        if self.fwd_schedule == "auto":
            return "pingpong" if causal else "overlap"
        return self.fwd_schedule

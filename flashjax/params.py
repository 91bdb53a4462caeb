"""What one attention call carries besides q, k, v: static parameters and optional arrays."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from flashjax.config import Config
from flashjax.masks import MaskSpec

Array = Any


class Extras(NamedTuple):
    """Optional per-call arrays, normalised by the API (absent ones are None).

    Attributes:
      bias: float [Bb, Hb, Tqb, Tkb], each dim 1 (broadcast) or full; differentiable.
      mask: bool, same convention as `bias`; True = attend.
      q_segment_ids: int32 [B, Tq]; kv_segment_ids: int32 [B, Tk].
      q_lengths, kv_lengths: int32 [B]; positions at or past them are padding.
      alibi_slopes: float32 [H]; adds -slope * |i + Tk - Tq - j| to the logits.
      dropout_seed: uint32 [2], from the dropout rng.
    """

    bias: Array = None
    mask: Array = None
    q_segment_ids: Array = None
    kv_segment_ids: Array = None
    q_lengths: Array = None
    kv_lengths: Array = None
    alibi_slopes: Array = None
    dropout_seed: Array = None


@dataclasses.dataclass(frozen=True)
class AttentionParams:
    """Everything about a call that is known at trace time (hashable, so a jit static).

    Attributes:
      scale: the logit scale.
      causal: bottom-right aligned causal mask.
      window: (left, right) sliding window, None sides unbounded, or None.
      softcap: if set, logits = softcap * tanh(logits / softcap) (before the bias).
      dropout_rate: probability of dropping an attention weight.
      broadcast_dropout: one dropout mask for all batch rows and heads (Flax's default).
      config: the kernels' tiling.
      backend: name of the kernel backend ("triton").
      interpret: run the Pallas kernels in interpret mode (CPU).
    """

    scale: float
    causal: bool = False
    window: tuple[int | None, int | None] | None = None
    softcap: float | None = None
    dropout_rate: float = 0.0
    broadcast_dropout: bool = False
    config: Config | None = None
    backend: str = "triton"
    interpret: bool = False

    def mask_spec(self, seq_q: int, seq_k: int) -> MaskSpec:
        left, right = self.window if self.window is not None else (None, None)
        return MaskSpec(seq_q, seq_k, causal=self.causal, window_left=left, window_right=right)

"""The static parameters of one attention call, shared by the autodiff layer and the kernels."""

from __future__ import annotations

import dataclasses

from flashjax.config import Config
from flashjax.masks import MaskSpec


@dataclasses.dataclass(frozen=True)
class AttentionParams:
    """Everything about a call that is known at trace time (hashable, so a jit static).

    Attributes:
      scale: the logit scale.
      causal: bottom-right aligned causal mask.
      window: (left, right) sliding window, None sides unbounded, or None.
      config: the kernels' tiling.
      backend: name of the kernel backend ("triton").
      interpret: run the Pallas kernels in interpret mode (CPU).
    """

    scale: float
    causal: bool = False
    window: tuple[int | None, int | None] | None = None
    config: Config | None = None
    backend: str = "triton"
    interpret: bool = False

    def mask_spec(self, seq_q: int, seq_k: int) -> MaskSpec:
        left, right = self.window if self.window is not None else (None, None)
        return MaskSpec(seq_q, seq_k, causal=self.causal, window_left=left, window_right=right)

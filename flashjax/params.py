"""What one attention call carries besides q, k, v: its description, static parameters and optional arrays."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np

from flashjax.masks import MaskSpec

Array = Any


class Extras(NamedTuple):
    """Optional per-call arrays (absent ones are None).

    The API fills the user-facing fields; a kernel backend's glue pads them to its tiles
    and may fold lengths and segment ids into `ranges`.

    Attributes:
      ranges: int32 [B, n_blocks, masks.RANGE_FIELDS] from `masks.dynamic_ranges` (kernel side only).
      q_segment_ids: int32 [B, Tq]; kv_segment_ids: int32 [B, Tk].
      mask: bool [Bm, Hm, Tqm, Tkm], each dim 1 (broadcast) or full; True = attend.
      bias: float, same convention as `mask`; differentiable.
      alibi_slopes: float32 [H]; adds -slope * |i + Tk - Tq - j| to the logits.
      dropout_seed: uint32 [2], from the dropout rng.
      q_lengths, kv_lengths: int32 [B]; positions at or past them are padding.
      sinks: float [H]; a learned logit per head that joins every row's softmax denominator
        (attention sinks); differentiable.
      score_consts, mask_consts: tuples of the arrays the call's score_mod / mask_mod close
        over, hoisted out as operands (`flex.Mod`); the float ones of score_consts are
        differentiable.
      block_mask: a `flex.BlockMask` (which tile pairs mask_mod empties or fills); the
        Triton glue folds it into `ranges`.
      tile_inputs: a backend's per-kernel inputs derived from the others (tile ranges, their
        order), computed by its `prepare` before the custom_vjp (kernel side only).
    """

    ranges: Array = None
    q_segment_ids: Array = None
    kv_segment_ids: Array = None
    mask: Array = None
    bias: Array = None
    alibi_slopes: Array = None
    dropout_seed: Array = None
    q_lengths: Array = None
    kv_lengths: Array = None
    sinks: Array = None
    score_consts: Any = None
    mask_consts: Any = None
    block_mask: Any = None
    tile_inputs: Any = None


# The names of the optional arrays a call may use, as `Call.arrays` lists them.
ARRAY_OPTIONS = ("bias", "mask", "segment_ids", "q_lengths", "kv_lengths", "alibi_slopes", "sinks")
# The user functions and their block mask, as `Call.options` names them.
MOD_OPTIONS = ("score_mod", "mask_mod", "block_mask")


@dataclasses.dataclass(frozen=True)
class Call:
    """What a backend needs to know to say whether it can run a call (hashable).

    Attributes:
      batch, seq_q, seq_k, heads, kv_heads, head_dim: the problem's shape.
      v_head_dim: the values' head dim when it differs from q's and k's (MLA), else None.
      dtype: of q, k, v.
      causal, window, softcap, dropout_rate, float32_residual: the static options.
      arrays: names of the optional arrays given (a subset of ARRAY_OPTIONS).
      mods: names of the user functions given (a subset of MOD_OPTIONS).
      platform: JAX's default backend ("gpu", "cpu", ...).
      compute_capability: of the first GPU ("9.0" on Hopper), "" elsewhere.
      pair_arrays: (name, 4-D shape, dtype name) of each [B, H, Tq, Tk] array given (bias,
        mask), with size-1 broadcast dims.
      score_mod, mask_mod: the user functions as traced `flex.Mod`s (what a backend's kernels
        must evaluate), or None.
      varying_axes: the mesh axes the inputs vary over inside `jax.shard_map` with
        check_vma=True (sorted), else ().
    """

    batch: int
    seq_q: int
    seq_k: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: np.dtype
    causal: bool = False
    window: tuple[int | None, int | None] | None = None
    softcap: float | None = None
    dropout_rate: float = 0.0
    float32_residual: bool = False
    arrays: frozenset[str] = frozenset()
    mods: frozenset[str] = frozenset()
    v_head_dim: int | None = None
    platform: str = "cpu"
    compute_capability: str = ""
    pair_arrays: tuple[tuple[str, tuple[int, ...], str], ...] = ()
    score_mod: Any = None
    mask_mod: Any = None
    varying_axes: tuple[str, ...] = ()

    @property
    def scores(self) -> int:
        """Entries of the [B, H, Tq, Tk] score tensor (what the reference materialises)."""
        return self.batch * self.heads * self.seq_q * self.seq_k

    def options(self) -> list[str]:
        """The names of every option the call uses besides causal, in a fixed order."""
        used = [name for name in ARRAY_OPTIONS if name in self.arrays]
        used += [name for name in MOD_OPTIONS if name in self.mods]
        if self.window is not None:
            used.append("window")
        if self.softcap is not None:
            used.append("softcap")
        if self.dropout_rate > 0.0:
            used.append("dropout")
        if self.float32_residual:
            used.append("float32_residual")
        return used


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
      float32_residual: the forward returns o in float32, kept for the backward's delta.
      score_mod, mask_mod: the user functions as traced `flex.Mod`s (equal when they trace to
        the same program on closed-over arrays of the same shapes), or None.
      backend: the registered backend that runs the forward, and `config` its config.
      backward_backend: the one that runs the backward, and `backward_config` its config.
      interpret: run the Pallas kernels in interpret mode (CPU).
    """

    scale: float
    causal: bool = False
    window: tuple[int | None, int | None] | None = None
    softcap: float | None = None
    dropout_rate: float = 0.0
    broadcast_dropout: bool = False
    float32_residual: bool = False
    score_mod: Any = None
    mask_mod: Any = None
    backend: str = "triton"
    config: Any = None
    backward_backend: str = "triton"
    backward_config: Any = None
    interpret: bool = False

    def mask_spec(self, seq_q: int, seq_k: int) -> MaskSpec:
        left, right = self.window if self.window is not None else (None, None)
        return MaskSpec(seq_q, seq_k, causal=self.causal, window_left=left, window_right=right)


# ---- decoding (`flashjax.decode_attention`) ---------------------------------------------
class KVCache(NamedTuple):
    """The arrays of a decode call's KV cache (checked by the API; absent ones are None).

    Attributes:
      k: contiguous [B, max_len, Hkv, D], or paged [num_pages, page_size, Hkv, D].
      v: the same with its own head dim Dv; None for a latent cache (MLA's), whose values
        are the first `DecodeParams.v_head_dim` features of `k`.
      lengths: int32 [B], valid tokens per sequence, clamped to [0, capacity].
      page_table: int32 [B, pages_per_seq] (paged caches), entries clamped to [0, num_pages).
      k_scale, v_scale: float32 dequantisation scales of a float8 cache, [Hkv] (per kv
        head) or [num_pages, Hkv] (per page); the cache holds value / scale. A latent
        cache has k_scale only.
    """

    k: Array
    v: Array
    lengths: Array
    page_table: Array = None
    k_scale: Array = None
    v_scale: Array = None

    @property
    def capacity(self) -> int:
        """Keys a sequence can hold: max_len, or pages_per_seq * page_size."""
        return self.k.shape[1] if self.page_table is None else self.page_table.shape[1] * self.k.shape[1]


@dataclasses.dataclass(frozen=True)
class DecodeCall:
    """What a backend needs to know to say whether it can run a decode call (hashable).

    Attributes:
      batch, q_len, heads, kv_heads, head_dim: the queries' shape and the cache's heads.
      v_head_dim: the values' head dim (head_dim unless the values have their own).
      latent: the values are the first v_head_dim features of the keys (one cache, MLA's).
      dtype: of q; cache_dtype: of the cache (q's, or float8_e4m3fn).
      capacity: keys a sequence can hold (max_len, or pages_per_seq * page_size).
      page_size: None for a contiguous cache.
      scales: "head", "page" (float8 scales per kv head / per page) or None.
      causal, window, softcap: the static options.
      platform, compute_capability, varying_axes: as in `Call`.
    """

    batch: int
    q_len: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: np.dtype
    cache_dtype: np.dtype
    capacity: int
    page_size: int | None = None
    scales: str | None = None
    causal: bool = True
    window: tuple[int | None, int | None] | None = None
    softcap: float | None = None
    platform: str = "cpu"
    compute_capability: str = ""
    v_head_dim: int | None = None
    latent: bool = False
    varying_axes: tuple[str, ...] = ()

    @property
    def scores(self) -> int:
        """Entries of the [B, H, q_len, capacity] score tensor (what the reference materialises)."""
        return self.batch * self.heads * self.q_len * self.capacity


@dataclasses.dataclass(frozen=True)
class DecodeParams:
    """Everything about a decode call known at trace time (hashable, a jit static).

    Attributes:
      scale, causal, window, softcap: as in `AttentionParams`; causal and the window are
        aligned to each sequence's own length (query i at key position L - q_len + i).
      num_splits: splits of each sequence's keys (None: the backend chooses).
      sm_count: streaming multiprocessors of the GPU (0 without one), for the splits.
      backend: the registered backend that runs the call.
      interpret: run the Pallas kernels in interpret mode (CPU).
      config: the backend's decode config (a frozen dataclass), or None for its default.
      v_head_dim: the values' head dim of a latent cache (`KVCache.v` None); else None.
    """

    scale: float
    causal: bool = True
    window: tuple[int | None, int | None] | None = None
    softcap: float | None = None
    num_splits: int | None = None
    sm_count: int = 0
    backend: str = "triton"
    interpret: bool = False
    config: Any = None
    v_head_dim: int | None = None

    def mask_spec(self, q_len: int) -> MaskSpec:
        """The mask with its offset 0: callers pass query rows as key positions (each
        sequence's ``L - q_len`` added) and the sequence's length as ``kv_length``."""
        left, right = self.window if self.window is not None else (None, None)
        return MaskSpec(q_len, q_len, causal=self.causal, window_left=left, window_right=right)

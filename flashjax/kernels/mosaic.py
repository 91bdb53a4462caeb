"""The Hopper backend: pads inputs to whole tiles and runs the Pallas Mosaic GPU kernels.

Same contract as `flashjax.kernels.triton`: ``forward`` returns o and the
natural-log lse; ``backward`` takes the cotangents of both. The kernels want the
query length a multiple of two query tiles (one per consumer warpgroup), the key
length a multiple of the key tile and a head dim of 64, 128 or 256 (wgmma and the
128-byte swizzle work in 64-column slabs). Inputs are zero-padded here; the
kernels know the true lengths and mask the padded keys, and padded query rows are
dropped.

Supported: bfloat16 and float16, causal (bottom-right aligned) or not, GQA/MQA,
any lengths. Everything else (float32, bias, mask, segment ids, lengths, window,
softcap, ALiBi, dropout) is refused by `flashjax.api` before it gets here.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from flashjax.config import MosaicConfig
from flashjax.kernels import common, mosaic_bwd, mosaic_fwd
from flashjax.params import AttentionParams, Extras

HEAD_DIMS = (64, 128, 256)


def padded_head_dim(head_dim: int) -> int:
    for d in HEAD_DIMS:
        if head_dim <= d:
            return d
    raise NotImplementedError(f"backend='mosaic' supports head_dim <= 256, got {head_dim}.")


def config_for(params: AttentionParams, head_dim: int) -> MosaicConfig:
    config = getattr(params.config, "mosaic", None)
    return config if config is not None else MosaicConfig.default(padded_head_dim(head_dim))


def _fwd_schedule(schedule: str, causal: bool) -> dict:
    """FwdTiling's overlap and pingpong flags for a MosaicConfig.fwd_schedule."""
    if schedule == "auto":
        schedule = "pingpong" if causal else "overlap"
    return {"overlap": schedule.startswith("overlap"), "pingpong": schedule.endswith("pingpong")}


def _fwd_tiling(q, k, params: AttentionParams) -> mosaic_fwd.FwdTiling:
    seq_q, seq_k, head_dim = q.shape[1], k.shape[1], q.shape[3]
    config = config_for(params, head_dim)
    # Short key sequences: a smaller key tile wastes less work on padding.
    block_kv = min(config.block_kv, common.round_up(seq_k, 64))
    return mosaic_fwd.FwdTiling(
        block_q=config.block_q, block_kv=block_kv, stages=config.stages,
        seq_q=seq_q, seq_k=seq_k, causal=params.causal, scale=params.scale, tile_major=config.tile_major,
        **_fwd_schedule(config.fwd_schedule, params.causal),
    )


def forward(q, k, v, extras: Extras, params: AttentionParams):
    """Returns o [B, Tq, H, D] and the natural-log lse [B, H, Tq] (-inf for rows that see no key)."""
    del extras  # the API lets only calls without optional arrays through
    seq_q, head_dim = q.shape[1], q.shape[3]
    t = _fwd_tiling(q, k, params)
    dim = padded_head_dim(head_dim)
    q_len = common.round_up(seq_q, mosaic_fwd.COMPUTE_WGS * t.block_q)
    k_len = common.round_up(k.shape[1], t.block_kv)
    pad = common.pad_tokens
    o, lse2 = mosaic_fwd.forward(pad(q, q_len, dim), pad(k, k_len, dim), pad(v, k_len, dim), t)
    return o[:, :seq_q, :, :head_dim], lse2[:, :, :seq_q] * common.LN2


def backward(q, k, v, o, lse, do, dlse, extras: Extras, params: AttentionParams):
    """Returns (dq, dk, dv, None) given the forward's o and lse and the cotangents of both."""
    seq_q, seq_k, head_dim = q.shape[1], k.shape[1], q.shape[3]
    dim = padded_head_dim(head_dim)
    if dim > 128:
        # D=256: a 64-row key tile's dK and dV accumulators alone are 256 float32
        # registers per thread of a warpgroup, over the 255 limit; the Triton kernels
        # (which split the work differently) do this case.
        from flashjax.kernels import triton

        return triton.backward(q, k, v, o, lse, do, dlse, extras, params)
    config = config_for(params, head_dim)
    # "accumulate" needs 128 dQ columns, two 64-wide halves (one per consumer).
    accumulate = config.bwd_dq == "accumulate" and dim == 128
    block_q, block_kv = config.bwd_block_q, config.bwd_block_kv
    pair = mosaic_fwd.COMPUTE_WGS * block_kv  # the dK/dV kernels take key tiles in pairs
    if accumulate:
        q_len, k_len = common.round_up(seq_q, block_q), common.round_up(seq_k, pair)
    else:
        dq_block_kv = min(config.dq_block_kv, common.round_up(seq_k, 64))
        # The dQ kernel takes query tiles in pairs.
        q_len = common.round_up(seq_q, mosaic_fwd.COMPUTE_WGS * block_q)
        k_len = common.round_up(seq_k, math.lcm(pair, dq_block_kv))
    lse2, delta = common.backward_rows(o, do, lse, dlse, q_len)
    pad = common.pad_tokens
    qp, dop = pad(q, q_len, dim), pad(do.astype(q.dtype), q_len, dim)
    kp, vp = pad(k, k_len, dim), pad(v, k_len, dim)
    t = mosaic_fwd.FwdTiling(
        block_q=block_q, block_kv=block_kv, stages=config.bwd_stages,
        seq_q=seq_q, seq_k=seq_k, causal=params.causal, scale=params.scale, tile_major=config.tile_major,
    )
    if accumulate:
        dk, dv, dq = mosaic_bwd.dkv_dq(qp, kp, vp, dop, lse2, delta, t)
        dq = dq[:, :seq_q, :, :head_dim]
        if params.causal and seq_q > seq_k:
            # Rows that see no key (bottom-right alignment) are visited by no key tile:
            # their dQ was never written.
            sees_a_key = jnp.arange(seq_q) + (seq_k - seq_q) >= 0
            dq = jnp.where(sees_a_key[None, :, None, None], dq, 0.0)
        dq = (dq * params.scale).astype(q.dtype)
    else:
        dk, dv = mosaic_bwd.dkv(qp, kp, vp, dop, lse2, delta, t)
        dq = mosaic_bwd.dq(qp, kp, vp, dop, lse2, delta, dataclasses.replace(t, block_kv=dq_block_kv))
        dq = dq[:, :seq_q, :, :head_dim]
    return dq, dk[:, :seq_k, :, :head_dim], dv[:, :seq_k, :, :head_dim], None

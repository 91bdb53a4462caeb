"""The Triton backend: pads inputs to whole tiles and runs the Pallas kernels.

The kernels want every length a multiple of their tiles and a power-of-two
head dimension. Rather than masking every load, inputs are zero-padded here
(a copy only when a length is not already aligned) and the structural mask,
which knows the true lengths, hides padded keys. Padded query rows are computed
and dropped; in the backward their logsumexp is +inf, so they contribute nothing.
"""

from __future__ import annotations

import jax.numpy as jnp

from flashjax.kernels import common, triton_bwd, triton_fwd
from flashjax.params import AttentionParams


def _padded_head_dim(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())


def _pad(x, length: int, head_dim: int):
    """Zero-pads [B, T, H, D] to [B, length, H, head_dim]."""
    pad_t, pad_d = length - x.shape[1], head_dim - x.shape[3]
    if pad_t == 0 and pad_d == 0:
        return x
    return jnp.pad(x, ((0, 0), (0, pad_t), (0, 0), (0, pad_d)))


def _pad_rows(x, length: int, value: float):
    """Pads per-row statistics [B, H, T] along T."""
    if x.shape[2] == length:
        return x
    return jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[2])), constant_values=value)


def _layout(q, k, params: AttentionParams):
    seq_q, seq_k, head_dim = q.shape[1], k.shape[1], q.shape[3]
    config = params.config.fit(seq_q, seq_k)
    return (
        config,
        common.round_up(seq_q, config.q_multiple),
        common.round_up(seq_k, config.k_multiple),
        _padded_head_dim(head_dim),
    )


def forward(q, k, v, params: AttentionParams):
    """Returns o [B, Tq, H, D] and the natural-log lse [B, H, Tq] (-inf for empty rows)."""
    seq_q, head_dim = q.shape[1], q.shape[3]
    config, q_len, k_len, d_pad = _layout(q, k, params)
    o, lse2 = triton_fwd.forward(
        _pad(q, q_len, d_pad), _pad(k, k_len, d_pad), _pad(v, k_len, d_pad),
        spec=params.mask_spec(seq_q, k.shape[1]), scale=params.scale,
        config=config.fwd, interpret=params.interpret,
    )
    return o[:, :seq_q, :, :head_dim], lse2[:, :, :seq_q] * common.LN2


def backward(q, k, v, o, lse, do, dlse, params: AttentionParams):
    """Returns dq, dk, dv given the forward's o and lse and the cotangents of both."""
    seq_q, seq_k, head_dim = q.shape[1], k.shape[1], q.shape[3]
    config, q_len, k_len, d_pad = _layout(q, k, params)
    # delta_i = sum_j P_ij dP_ij = rowsum(dO * O); subtracting the lse cotangent adds its
    # path (d lse / d S = P) to dS = P * (dP - delta) for free.
    delta = jnp.einsum("bqhd,bqhd->bhq", o.astype(jnp.float32), do.astype(jnp.float32))
    if dlse is not None:
        delta = delta - dlse
    # Empty rows (lse = -inf) and padded rows get +inf so that P = exp2(S - lse2) = 0.
    lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse * common.LOG2E)
    dq, dk, dv = triton_bwd.backward(
        _pad(q, q_len, d_pad), _pad(k, k_len, d_pad), _pad(v, k_len, d_pad), _pad(do, q_len, d_pad),
        _pad_rows(lse2, q_len, jnp.inf), _pad_rows(delta, q_len, 0.0),
        spec=params.mask_spec(seq_q, seq_k), scale=params.scale,
        dkv_config=config.dkv, dq_config=config.dq, interpret=params.interpret,
    )
    return dq[:, :seq_q, :, :head_dim], dk[:, :seq_k, :, :head_dim], dv[:, :seq_k, :, :head_dim]

"""The Triton backend: pads inputs to whole tiles and runs the Pallas kernels.

The kernels want every length a multiple of their tiles and a power-of-two
head dimension. Rather than masking every load, inputs are zero-padded here
(a copy only when a length is not already aligned) and the structural mask,
which knows the true lengths, hides padded keys. Padded query rows are computed
and dropped; in the backward their logsumexp is +inf, so they contribute nothing.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp

from flashjax import backends, masks
from flashjax.kernels import common
from flashjax.kernels.triton import bwd as triton_bwd, decode as triton_decode, fwd as triton_fwd
from flashjax.kernels.triton.config import MAX_HEAD_DIM, TritonConfig
from flashjax.kernels.triton.scoring import Scorer
from flashjax.params import AttentionParams, Call, Extras

# Without a GPU the kernels run in Pallas interpret mode: exact, but slow. `auto` uses
# them up to this many score entries (B * H * Tq * Tk) and the reference beyond.
INTERPRET_LIMIT = 1 << 22
DTYPES = ("bfloat16", "float16", "float32")


def supports(call: Call) -> list[str]:
    reasons = []
    if jnp.dtype(call.dtype).name not in DTYPES:
        reasons.append(f"{jnp.dtype(call.dtype).name} inputs (the kernels take bfloat16, float16 or float32)")
    if call.head_dim > MAX_HEAD_DIM:
        reasons.append(f"head_dim {call.head_dim} > {MAX_HEAD_DIM}")
    return reasons


def declines(call: Call) -> list[str]:
    """Why auto passes the kernels by: interpret mode past INTERPRET_LIMIT score entries
    (for a `Call` and, through `scores`, a decode call's `DecodeCall` alike)."""
    if call.platform != "gpu" and call.scores > INTERPRET_LIMIT:
        return [f"no GPU: interpret mode is used up to {INTERPRET_LIMIT} score entries (B*H*Tq*Tk), "
                f"this call has {call.scores}"]
    return []


def default_config(call: Call) -> TritonConfig:
    return TritonConfig.default(call.head_dim, call.dtype)


class _Layout(NamedTuple):
    config: TritonConfig
    q_len: int  # padded lengths
    k_len: int
    head_dim: int  # padded head dim


def _layout(q, k, extras: Extras, config: TritonConfig) -> _Layout:
    seq_q, seq_k, head_dim = q.shape[1], k.shape[1], q.shape[3]
    padded_dim = max(16, 1 << (head_dim - 1).bit_length())
    config = config.fit(seq_q, seq_k)
    # The forward and dQ kernels stream K and V tiles (and bias/mask tiles) through
    # shared memory, one set per pipeline stage; keep them within the budget.
    pair_bytes = sum(jnp.dtype(a.dtype).itemsize for a in (extras.bias, extras.mask) if a is not None)
    kv_bytes = 2 * padded_dim * jnp.dtype(k.dtype).itemsize
    config = dataclasses.replace(
        config,
        fwd=config.fwd.fit_shared_memory(kv_bytes, pair_bytes),
        dq=config.dq.fit_shared_memory(kv_bytes, pair_bytes),
    )
    return _Layout(
        config,
        common.round_up(seq_q, config.q_multiple),
        common.round_up(seq_k, config.k_multiple),
        padded_dim,
    )


def _pad_q(x, layout: _Layout):
    return common.pad_tokens(x, layout.q_len, layout.head_dim)


def _pad_k(x, layout: _Layout):
    return common.pad_tokens(x, layout.k_len, layout.head_dim)


def _pad_axis(x, axis: int, length: int, mode: str = "constant", value=0, broadcast: bool = False):
    """Pads one axis to `length`; with `broadcast`, a size-1 axis stays (it broadcasts)."""
    if x.shape[axis] == length or (broadcast and x.shape[axis] == 1):
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, length - x.shape[axis])
    if mode == "edge":
        return jnp.pad(x, widths, mode="edge")
    return jnp.pad(x, widths, constant_values=value)


def _scorer(params: AttentionParams, seq_q: int, seq_k: int) -> Scorer:
    return Scorer(
        spec=params.mask_spec(seq_q, seq_k), scale=params.scale, softcap=params.softcap,
        dropout_rate=params.dropout_rate, broadcast_dropout=params.broadcast_dropout,
    )


def _tile_inputs(extras: Extras, q, k, layout: _Layout, block_q: int, block_k: int, *, by_key_block: bool) -> Extras:
    """Pads the optional inputs to the tiles and folds lengths and segments into per-tile ranges."""
    batch, seq_q, seq_k = q.shape[0], q.shape[1], k.shape[1]
    q_seg = kv_seg = None
    if extras.q_segment_ids is not None:
        # Repeating the last id keeps each padded tile's id extent tight.
        q_seg = _pad_axis(extras.q_segment_ids.astype(jnp.int32), 1, layout.q_len, mode="edge")
        kv_seg = _pad_axis(extras.kv_segment_ids.astype(jnp.int32), 1, layout.k_len, mode="edge")
    ranges = None
    if any(a is not None for a in (q_seg, extras.q_lengths, extras.kv_lengths, extras.mask)):
        ranges = masks.dynamic_ranges(
            batch=batch, seq_q=seq_q, seq_k=seq_k, block_q=block_q, block_k=block_k,
            padded_q=layout.q_len, padded_k=layout.k_len,
            q_lengths=extras.q_lengths, kv_lengths=extras.kv_lengths,
            q_segment_ids=q_seg, kv_segment_ids=kv_seg,
            dense_mask=extras.mask is not None, by_key_block=by_key_block,
        )

    def pad_pair(a, value):
        if a is None:
            return None
        a = _pad_axis(a, 2, layout.q_len, value=value, broadcast=True)
        return _pad_axis(a, 3, layout.k_len, value=value, broadcast=True)

    return Extras(
        ranges=ranges,
        q_segment_ids=q_seg,
        kv_segment_ids=kv_seg,
        # Triton has no boolean memory type worth loading: int8, 0 = masked.
        mask=pad_pair(None if extras.mask is None else extras.mask.astype(jnp.int8), 0),
        bias=pad_pair(extras.bias, 0),
        alibi_slopes=None if extras.alibi_slopes is None else extras.alibi_slopes.astype(jnp.float32),
        dropout_seed=extras.dropout_seed,
    )


def forward(q, k, v, extras: Extras, params: AttentionParams, config: TritonConfig):
    """Returns o [B, Tq, H, D] (float32 with `params.float32_residual`, else q's dtype) and the
    natural-log lse [B, H, Tq] (-inf for empty rows)."""
    seq_q, head_dim = q.shape[1], q.shape[3]
    layout = _layout(q, k, extras, config)
    fwd = layout.config.fwd
    o, lse2 = triton_fwd.forward(
        _pad_q(q, layout), _pad_k(k, layout), _pad_k(v, layout),
        _tile_inputs(extras, q, k, layout, fwd.block_q, fwd.block_k, by_key_block=False),
        scorer=_scorer(params, seq_q, k.shape[1]), config=fwd, interpret=params.interpret,
        out_dtype=jnp.float32 if params.float32_residual else None,
    )
    return o[:, :seq_q, :, :head_dim], lse2[:, :, :seq_q] * common.LN2


def backward(q, k, v, o, lse, do, dlse, extras: Extras, params: AttentionParams, config: TritonConfig):
    """Returns (dq, dk, dv, dbias) given the forward's o and lse and the cotangents of both.

    dbias is None without a bias; otherwise float32 in the bias's (broadcast) shape.
    """
    seq_q, seq_k, head_dim = q.shape[1], k.shape[1], q.shape[3]
    layout = _layout(q, k, extras, config)
    config = layout.config
    lse2, delta = common.backward_rows(o, do, lse, dlse, layout.q_len)
    padded = (
        _pad_q(q, layout), _pad_k(k, layout), _pad_k(v, layout), _pad_q(do, layout),
    )
    scorer = _scorer(params, seq_q, seq_k)
    x_dq = _tile_inputs(extras, q, k, layout, config.dq.block_q, config.dq.block_k, by_key_block=False)
    dq, dk, dv = triton_bwd.backward(
        *padded, lse2, delta,
        _tile_inputs(extras, q, k, layout, config.dkv.block_q, config.dkv.block_k, by_key_block=True), x_dq,
        scorer=scorer, dkv_config=config.dkv, dq_config=config.dq, interpret=params.interpret,
    )
    dbias = None
    if extras.bias is not None:
        dbias = triton_bwd.bias_grad(*padded, lse2, delta, x_dq, scorer=scorer, config=config.dq, interpret=params.interpret)
        dbias = dbias[:, :, : extras.bias.shape[2], : extras.bias.shape[3]]
    return dq[:, :seq_q, :, :head_dim], dk[:, :seq_k, :, :head_dim], dv[:, :seq_k, :, :head_dim], dbias


BACKEND = backends.Backend(
    name="triton",
    description="Pallas Triton kernels: any CUDA GPU, interpret mode without one",
    config_type=TritonConfig,
    supports=supports,
    declines=declines,
    default_config=default_config,
    forward=forward,
    backward=backward,
    decode=backends.Decoder(supports=triton_decode.supports, run=triton_decode.decode, declines=declines),
)

"""The Triton backend: pads inputs to whole tiles and runs the Pallas kernels.

The kernels want every length a multiple of their tiles and a power-of-two
head dimension. Rather than masking every load, inputs are zero-padded here
(a copy only when a length is not already aligned) and the structural mask,
which knows the true lengths, hides padded keys. Padded query rows are computed
and dropped; in the backward their logsumexp is +inf, so they contribute nothing.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax.numpy as jnp

from flashjax import backends, flex, masks
from flashjax.kernels import common, extras_grad
from flashjax.kernels.triton import bwd as triton_bwd, decode as triton_decode, fwd as triton_fwd
from flashjax.kernels.triton.config import MAX_HEAD_DIM, DecodeConfig, TritonConfig
from flashjax.kernels.triton.scoring import Scorer
from flashjax.params import AttentionParams, Call, Extras

# Without a GPU the kernels run in Pallas interpret mode: exact, but slow. `auto` uses
# them up to this many score entries (B * H * Tq * Tk) and the reference beyond.
INTERPRET_LIMIT = 1 << 22
DTYPES = ("bfloat16", "float16", "float32")

def supports(call: Call) -> list[str]:
    reasons = []
    if call.batch == 0:
        reasons.append("an empty batch (batch 0)")
    if jnp.dtype(call.dtype).name not in DTYPES:
        reasons.append(f"{jnp.dtype(call.dtype).name} inputs (the kernels take bfloat16, float16 or float32)")
    if max(call.head_dim, call.v_head_dim or 0) > MAX_HEAD_DIM:
        reasons.append(f"head_dim {max(call.head_dim, call.v_head_dim or 0)} > {MAX_HEAD_DIM}")
    for name, mod in flex.call_mods(call):
        if why := flex.unreadable_reason(name, mod):
            reasons.append(why)
    return reasons + _unlowered_mods(call, derivative=False) + interpreter_reasons(call)


def interpreter_reasons(call) -> list[str]:
    """Why interpret mode cannot run a call (a `Call` or a `DecodeCall`): inside
    jax.shard_map with check_vma=True, Pallas' interpreter (JAX 0.11.2) evaluates the kernels
    on values typed with mesh axes that their own programs do not carry, and fails in some
    of them (the bias gradient, block masks). The compiled GPU kernels type their outputs
    (`vma.out_types`)."""
    if call.platform == "gpu" or not call.varying_axes:
        return []
    return [f"no GPU, inside jax.shard_map with check_vma=True (inputs varying over {', '.join(call.varying_axes)}): "
            "Pallas' interpret mode does not carry those types; shard_map(..., check_vma=False) runs it"]


def supports_backward(call: Call) -> list[str]:
    """Why the backward kernels cannot take `call` where the forward ones can: a score_mod
    whose derivative they cannot trace or lower."""
    return flex.kernel_backward_reasons(call) or _unlowered_mods(call, derivative=True)


def _unlowered_mods(call: Call, derivative: bool) -> list[str]:
    """The mods' primitives Pallas' Triton lowering lacks, in the forward kernels' programs or
    (`derivative`) the backward kernels'; none in interpret mode, which evaluates any primitive."""
    if call.platform != "gpu":
        return []
    reasons = []
    for name, mod in flex.call_mods(call):
        if flex.unreadable_reason(name, mod):  # said by `supports`; its reads are no primitive to lower
            continue
        where = f"{name}'s derivative" if derivative else name
        if missing := sorted(mod.primitives(derivative) - _lowered_primitives()):
            reasons.append(f"{where} uses {', '.join(missing)}, which Pallas' Triton lowering does not have")
        if forms := mod.unlowered_forms(derivative, "triton"):
            reasons.append(f"{where} uses {', '.join(forms)}, which Pallas' Triton lowering does not take")
    return reasons


@functools.cache
def _lowered_primitives() -> frozenset:
    """The primitives Pallas' Triton lowering has a rule for; read once, when the first call
    with a mod asks."""
    from jax._src.pallas.triton import lowering

    return frozenset(primitive.name for primitive in lowering.triton_lowering_rules)


def declines(call: Call) -> list[str]:
    """Why auto passes the kernels by: interpret mode past INTERPRET_LIMIT score entries
    (for a `Call` and, through `scores`, a decode call's `DecodeCall` alike)."""
    if call.platform != "gpu" and call.scores > INTERPRET_LIMIT:
        return [f"no GPU: interpret mode is used up to {INTERPRET_LIMIT} score entries (B*H*Tq*Tk), "
                f"this call has {call.scores}"]
    return []


def default_config(call: Call) -> TritonConfig:
    return TritonConfig.default(max(call.head_dim, call.v_head_dim or 0), call.dtype)


class _Layout(NamedTuple):
    config: TritonConfig
    q_len: int  # padded lengths
    k_len: int
    head_dim: int  # padded head dims: of q and k, and of v
    v_head_dim: int


def _padded_dim(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())


def _layout(q, k, v, extras: Extras, params: AttentionParams, config: TritonConfig) -> _Layout:
    seq_q, seq_k = q.shape[1], k.shape[1]
    padded_dim, padded_v_dim = _padded_dim(q.shape[3]), _padded_dim(v.shape[3])
    config = config.fit(seq_q, seq_k)
    # The forward and dQ kernels stream K and V tiles (and bias/mask tiles) through
    # shared memory, one set per pipeline stage; keep them within the budget. A mod that
    # reads a closed-over array per (query, key) pair gathers a score tile of it, which
    # Triton stages the same way.
    pair_bytes = sum(jnp.dtype(a.dtype).itemsize for a in (extras.bias, extras.mask) if a is not None)
    mod_bytes = sum(mod.pair_read_bytes for mod in (params.score_mod, params.mask_mod) if mod is not None)
    pair_bytes += mod_bytes
    kv_bytes = (padded_dim + padded_v_dim) * jnp.dtype(k.dtype).itemsize
    config = dataclasses.replace(
        config,
        fwd=config.fwd.fit_shared_memory(kv_bytes, pair_bytes),
        dq=config.dq.fit_shared_memory(kv_bytes, pair_bytes),
        # The dK/dV kernel's gathered tiles too (the same estimate: Q/dO rows in place of
        # K/V rows, an upper bound there, as its key tile is not pipelined).
        dkv=config.dkv.fit_shared_memory(kv_bytes, pair_bytes) if mod_bytes else config.dkv,
    )
    return _Layout(
        config,
        common.round_up(seq_q, config.q_multiple),
        common.round_up(seq_k, config.k_multiple),
        padded_dim,
        padded_v_dim,
    )


def _pad_q(x, layout: _Layout):
    return common.pad_tokens(x, layout.q_len, layout.head_dim)


def _pad_k(x, layout: _Layout):
    return common.pad_tokens(x, layout.k_len, layout.head_dim)


def _pad_v(x, layout: _Layout):
    return common.pad_tokens(x, layout.k_len, layout.v_head_dim)


def _pad_o(x, layout: _Layout):
    return common.pad_tokens(x, layout.q_len, layout.v_head_dim)


def _pad_axis(x, axis: int, length: int, value=0, broadcast: bool = False):
    """Pads one axis to `length`; with `broadcast`, a size-1 axis stays (it broadcasts)."""
    if x.shape[axis] == length or (broadcast and x.shape[axis] == 1):
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def _scorer(params: AttentionParams, seq_q: int, seq_k: int) -> Scorer:
    return Scorer(
        spec=params.mask_spec(seq_q, seq_k), scale=params.scale, softcap=params.softcap,
        dropout_rate=params.dropout_rate, broadcast_dropout=params.broadcast_dropout,
        score_mod=params.score_mod, mask_mod=params.mask_mod,
    )


def prepare(q, k, v, extras: Extras, params: AttentionParams, config: TritonConfig) -> Extras:
    """The registry's hook before the custom_vjp: a mask_mod's block mask, built once for the
    forward and the backward (`_with_block_mask` at the call's tiling)."""
    return _with_block_mask(extras, params, q, k, _layout(q, k, v, extras, params, config).config)


def _with_block_mask(extras: Extras, params: AttentionParams, q, k, config: TritonConfig) -> Extras:
    """With a mask_mod but no block mask, builds one at the finest of the kernels' tiles (each
    kernel re-tiles it exactly): one evaluation of mask_mod per (query, key) pair. A call
    through `autodiff` has it from `prepare` already; a direct kernel call (the ring's
    blocks) builds it here."""
    kernels = (config.fwd, config.dkv, config.dq)
    return flex.with_block_mask(extras, params.mask_mod, q.shape, k.shape[1], min(c.block_q for c in kernels),
                                min(c.block_k for c in kernels))


def _tile_inputs(extras: Extras, q, k, layout: _Layout, block_q: int, block_k: int, *, by_key_block: bool) -> Extras:
    """Pads the optional inputs to the tiles and folds lengths, segments and the block mask into
    per-tile ranges."""
    batch, seq_q, seq_k = q.shape[0], q.shape[1], k.shape[1]
    q_seg = kv_seg = None
    if extras.q_segment_ids is not None:
        q_seg = common.pad_segment_ids(extras.q_segment_ids, layout.q_len)
        kv_seg = common.pad_segment_ids(extras.kv_segment_ids, layout.k_len)
    ranges = None
    blocks = None
    if extras.block_mask is not None:
        blocks = flex.tile_flags(extras.block_mask, block_q, block_k, layout.q_len // block_q, layout.k_len // block_k)
    if any(a is not None for a in (q_seg, extras.q_lengths, extras.kv_lengths, extras.mask, blocks)):
        ranges = masks.dynamic_ranges(
            batch=batch, seq_q=seq_q, seq_k=seq_k, block_q=block_q, block_k=block_k,
            padded_q=layout.q_len, padded_k=layout.k_len,
            q_lengths=extras.q_lengths, kv_lengths=extras.kv_lengths,
            q_segment_ids=q_seg, kv_segment_ids=kv_seg,
            dense_mask=extras.mask is not None, by_key_block=by_key_block, blocks=blocks,
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
        sinks=None if extras.sinks is None else extras.sinks.astype(jnp.float32),
        score_consts=None if extras.score_consts is None else flex.kernel_operands(extras.score_consts),
        mask_consts=None if extras.mask_consts is None else flex.kernel_operands(extras.mask_consts),
    )


def forward(q, k, v, extras: Extras, params: AttentionParams, config: TritonConfig):
    """Returns o [B, Tq, H, Dv] (float32 with `params.float32_residual`, else q's dtype) and the
    natural-log lse [B, H, Tq] (-inf for empty rows)."""
    seq_q, v_head_dim = q.shape[1], v.shape[3]
    layout = _layout(q, k, v, extras, params, config)
    fwd = layout.config.fwd
    extras = _with_block_mask(extras, params, q, k, layout.config)
    o, lse2 = triton_fwd.forward(
        _pad_q(q, layout), _pad_k(k, layout), _pad_v(v, layout),
        _tile_inputs(extras, q, k, layout, fwd.block_q, fwd.block_k, by_key_block=False),
        scorer=_scorer(params, seq_q, k.shape[1]), config=fwd, interpret=params.interpret,
        out_dtype=jnp.float32 if params.float32_residual else None,
    )
    return o[:, :seq_q, :, :v_head_dim], lse2[:, :, :seq_q] * common.LN2


def backward(q, k, v, o, lse, do, dlse, extras: Extras, params: AttentionParams, config: TritonConfig):
    """Returns (dq, dk, dv, dextras) given the forward's o and lse and the cotangents of both.

    dextras holds dbias (float32 in the bias's broadcast shape), dsinks (float32 [H]) and the
    gradients of the float arrays score_mod closes over (None for the others), each None
    when its input is absent.
    """
    seq_q, seq_k, head_dim, v_head_dim = q.shape[1], k.shape[1], q.shape[3], v.shape[3]
    layout = _layout(q, k, v, extras, params, config)
    config = layout.config
    extras = _with_block_mask(extras, params, q, k, config)
    lse2, delta = common.backward_rows(o, do, lse, dlse, layout.q_len)
    padded = (
        _pad_q(q, layout), _pad_k(k, layout), _pad_v(v, layout), _pad_o(do, layout),
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
        dbias = _bias_grad(padded, lse2, delta, x_dq, extras, scorer, config, params)
    delta = delta[:, :, :seq_q]
    dextras = Extras(
        bias=dbias,
        sinks=None if extras.sinks is None else extras_grad.sinks_grad(extras.sinks, lse, delta),
        score_consts=extras_grad.score_consts_grad(q, k, v, do, lse, delta, extras, params),
    )
    return dq[:, :seq_q, :, :head_dim], dk[:, :seq_k, :, :head_dim], dv[:, :seq_k, :, :v_head_dim], dextras


def _bias_grad(padded, lse2, delta, x_dq: Extras, extras: Extras, scorer: Scorer, config: TritonConfig,
               params: AttentionParams):
    dbias = triton_bwd.bias_grad(*padded, lse2, delta, x_dq, scorer=scorer, config=config.dq, interpret=params.interpret)
    return dbias[:, :, : extras.bias.shape[2], : extras.bias.shape[3]]


def bias_gradient(q, k, v, o, lse, do, dlse, extras: Extras, params: AttentionParams, config: TritonConfig | None = None):
    """dBias (float32, in the bias's broadcast shape) by the dbias kernel alone, for a backend
    whose own backward kernels give dq, dk and dv: the Hopper kernels. The arguments are the
    backward's (o and lse from the forward, do and dlse their cotangents)."""
    if config is None:
        config = TritonConfig.default(max(q.shape[3], v.shape[3]), q.dtype)
    layout = _layout(q, k, v, extras, params, config)
    config = layout.config
    lse2, delta = common.backward_rows(o, do, lse, dlse, layout.q_len)
    padded = (_pad_q(q, layout), _pad_k(k, layout), _pad_v(v, layout), _pad_o(do, layout))
    x_dq = _tile_inputs(extras, q, k, layout, config.dq.block_q, config.dq.block_k, by_key_block=False)
    return _bias_grad(padded, lse2, delta, x_dq, extras, _scorer(params, q.shape[1], k.shape[1]), config, params)


BACKEND = backends.Backend(
    name="triton",
    description="Pallas Triton kernels: any CUDA GPU, interpret mode without one",
    config_type=TritonConfig,
    supports=supports,
    supports_backward=supports_backward,
    declines=declines,
    default_config=default_config,
    forward=forward,
    backward=backward,
    decode=backends.Decoder(supports=lambda call: triton_decode.supports(call) + interpreter_reasons(call),
                            run=triton_decode.decode, declines=declines, config_type=DecodeConfig),
    prepare=prepare,
)

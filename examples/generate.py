"""Generate with a KV cache: a small decoder LM (Flax nnx) prefills a prompt, then decodes greedily.

The model is examples/train_lm.py's ``DecoderLM`` (randomly initialised: the tokens are
arbitrary, the work per token is real; parameters stored in ``--dtype``), with either attention:

* ``--attention flash``: `flashjax.flax.nnx.FlashMultiHeadAttention(causal=True)`. Its
  ``decode=True`` path is `flashjax.decode_attention` (split-KV over the cache, each K/V
  byte read once per kv group) and it takes the prompt in chunks of ``--prefill-chunk``
  tokens through the same cache;
* ``--attention flax``: `flax.nnx.MultiHeadAttention` with its own cache, which takes one
  position per call, so the prompt is fed token by token (inside one compiled loop).

Both build the same parameters from the same seed, so their greedy tokens agree (up to
near-ties of the logits in low precision).

Examples::

  python examples/generate.py --attention flash --context 8192 --new-tokens 256 --batch 8 --dtype bfloat16
  python examples/generate.py --attention flax  --context 8192 --new-tokens 256 --batch 8 --dtype bfloat16
  python examples/generate.py --context 64 --new-tokens 8 --check   # CPU-sized; tokens vs no cache

The cache holds ``--cache-len`` slots per sequence (default: the prompt and the new tokens).
flashjax reads only the filled slots of each sequence; Flax's cached attention reads and
masks all of them, so a cache sized for a longer sequence than the one generated (as a
server allocates it) costs Flax in proportion and flashjax nothing.

Prints the prefill time, the decode tokens/s (``batch * (new_tokens - 1)`` over the time
of the compiled decode loop, run once untimed first), and the device's peak memory where it
reports one. ``--check`` also generates without a cache (the whole sequence re-run per
token) and asserts that the tokens are the same. ``--out`` writes a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_lm import DecoderLM, _dtype, peak_memory_bytes  # noqa: E402  (the model of the training example)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--attention", choices=["flash", "flax"], default="flash")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens per sequence")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per sequence")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prefill-chunk", type=int, default=256, help="prompt tokens per cached call (flash)")
    p.add_argument("--cache-len", type=int, default=None,
                   help="KV cache slots per sequence (default: context + new tokens); a server allocates "
                        "its longest sequence, e.g. 32768")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA)")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="compare with generation without a cache")
    p.add_argument("--out", default=None, help="write a JSON summary here")
    args = p.parse_args(argv)
    if args.new_tokens < 1:
        p.error(f"--new-tokens must be >= 1, got {args.new_tokens}")
    args.seq_len = args.context + args.new_tokens  # the position table's size (DecoderLM)
    args.cache_len = args.cache_len or args.seq_len
    if args.cache_len < args.seq_len:
        p.error(f"--cache-len {args.cache_len} cannot hold context + new tokens ({args.seq_len})")
    return args


@nnx.jit(static_argnames="decode")
def _logits_last(model, tokens, start, decode: bool):
    return model(tokens, start, decode=decode)[:, -1]


@nnx.jit
def _prefill_token_by_token(model, prompt):
    """Flax's cache takes one position per call: the prompt one token at a time, in a loop."""

    def body(t, carry):
        model, _ = carry
        return model, model(jax.lax.dynamic_slice_in_dim(prompt, t, 1, axis=1), t, decode=True)[:, -1]

    first = jnp.zeros((prompt.shape[0], model.unembed.out_features), jnp.float32)
    return nnx.fori_loop(0, prompt.shape[1], body, (model, first))[1]


def prefill(model, prompt, args):
    """Fills the caches with the prompt; returns the logits of its last position [batch, vocab]."""
    if args.attention == "flax":
        return _prefill_token_by_token(model, prompt)
    logits = None
    for start in range(0, prompt.shape[1], args.prefill_chunk):
        logits = _logits_last(model, prompt[:, start:start + args.prefill_chunk], start, decode=True)
    return logits


@nnx.jit(static_argnames="steps")
def _decode_loop(model, token, position, steps: int):
    """`steps` greedy tokens [batch, steps] following `token` (at `position`), in one compiled loop."""

    def body(i, carry):
        model, token, tokens = carry
        logits = model(token[:, None], position + i, decode=True)[:, -1]
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return model, token, tokens.at[:, i].set(token)

    tokens = jnp.zeros((token.shape[0], steps), jnp.int32)
    if steps == 0:  # one new token in all: the prefill's
        return tokens
    return nnx.fori_loop(0, steps, body, (model, token, tokens))[2]


def generate(model, prompt, args):
    """Greedy tokens [batch, new_tokens] with the KV cache; also the prefill and decode times (s).

    The decode loop runs once untimed on a copy of the model (it compiles), then, timed,
    on the model: the time is the device's, with no per-token dispatch."""
    model.init_cache(prompt.shape[0], args.cache_len, _dtype(args.dtype))
    start = time.perf_counter()
    token = jnp.argmax(prefill(model, prompt, args), axis=-1).astype(jnp.int32)
    token.block_until_ready()
    prefill_s = time.perf_counter() - start
    position, steps = jnp.int32(prompt.shape[1]), args.new_tokens - 1
    _decode_loop(nnx.clone(model), token, position, steps).block_until_ready()  # same graph: compiled once
    start = time.perf_counter()
    tokens = _decode_loop(model, token, position, steps)
    tokens.block_until_ready()
    decode_s = time.perf_counter() - start
    return jnp.concatenate([token[:, None], tokens], axis=1), prefill_s, decode_s


def generate_without_cache(model, prompt, new_tokens: int):
    """Greedy tokens [batch, new_tokens], re-running the whole sequence for each one."""
    sequence = prompt
    for _ in range(new_tokens):
        token = jnp.argmax(_logits_last(model, sequence, 0, decode=False), axis=-1).astype(jnp.int32)
        sequence = jnp.concatenate([sequence, token[:, None]], axis=1)
    return sequence[:, prompt.shape[1]:]


def cast_params(model, dtype):
    """Stores the parameters in the compute dtype, as a server holds them (training keeps
    float32 masters and casts per step; here that cast would be re-done every token)."""
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p: p.astype(dtype), params))


def run(args) -> dict:
    model = DecoderLM(args, rngs=nnx.Rngs(args.seed))
    if args.dtype != "float32":
        cast_params(model, _dtype(args.dtype))
    prompt = jax.random.randint(jax.random.key(args.seed + 1), (args.batch, args.context), 0, args.vocab)
    tokens, prefill_s, decode_s = generate(model, prompt, args)
    timed = args.batch * max(0, args.new_tokens - 1)  # the first token comes from the prefill
    summary = {
        "attention": args.attention,
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "check")},
        "device": str(jax.devices()[0].device_kind),
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "decode_tokens_per_s": timed / decode_s if decode_s > 0 else None,
        "peak_memory_bytes": peak_memory_bytes(),
        "tokens": tokens[:2, :16].tolist(),
    }
    rate = f"{summary['decode_tokens_per_s']:,.0f}" if summary["decode_tokens_per_s"] else "-"
    print(f"{args.attention}: prompt {args.batch} x {args.context} in {prefill_s:.2f} s, "
          f"decode {rate} tokens/s ({args.batch} x {args.new_tokens} new)")
    if summary["peak_memory_bytes"] is not None:
        print(f"peak device memory: {summary['peak_memory_bytes'] / 2**30:.2f} GiB")
    if args.check:
        reference = generate_without_cache(model, prompt, args.new_tokens)
        summary["matches_no_cache"] = bool((reference == tokens).all())
        print(f"tokens without a cache: {'the same' if summary['matches_no_cache'] else 'DIFFERENT'}")
        if not summary["matches_no_cache"]:
            raise SystemExit("generation with the KV cache differs from generation without it")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
    return summary


def main(argv=None) -> dict:
    return run(parse_args(argv))


if __name__ == "__main__":
    main()

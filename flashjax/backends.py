"""The registry of attention backends, and the one place where a call's backend is chosen.

A backend is a module under `flashjax.kernels` that builds a `Backend`: its config
type and tuned defaults, what it cannot do (`supports`), and its forward and
backward. The registry orders them per platform; ``backend="auto"`` takes the first
that supports the call, a backend named by the caller is used or refused with its
reasons, and `Choice` says which ran and why the ones before it did not.

The backward may run on a different backend than the forward (the Hopper kernels'
backward refuses a score_mod whose derivative it cannot lower): it runs on the forward's
backend when that one supports it, else on the first backend of the platform's order
that does.

Adding a backend: a module with a ``BACKEND`` object, one line in `_MODULES`, and
its name in the platform orders.

Decoding (`flashjax.decode_attention`) goes through the same registry and the same
platform orders: a backend with a decode path sets `Backend.decode` to a `Decoder`
(what it cannot decode, and its run function); `choose_decode` takes the first
backend of the order whose decoder supports the call (and does not decline it). A
backend without one (``decode=None``) is passed by with that reason, so the choice for
`flash_attention` is untouched.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
from typing import Any, Callable

import jax

from flashjax.params import Call, DecodeCall

__all__ = ["Backend", "Decoder", "Choice", "choose", "choose_decode", "get", "names", "describe_device", "sm_count"]


@dataclasses.dataclass(frozen=True)
class Decoder:
    """A backend's decode path (`flashjax.decode_attention`; forward only).

    Attributes:
      supports: ``supports(call: DecodeCall) -> list[str]``: why it cannot run the call.
      run: ``run(q, cache: params.KVCache, params: params.DecodeParams) -> (o, lse)``:
        o [B, q_len, H, D] in q's dtype, lse [B, H, q_len] (natural log, float32).
      declines: like `Backend.declines`: why ``auto`` passes it by although it could.
      config_type: the type of `decode_attention`'s ``config=`` for it (None: it takes none).
    """

    supports: Callable[[DecodeCall], list[str]]
    run: Callable
    declines: Callable[[DecodeCall], list[str]] = lambda call: []
    config_type: type | None = None


@dataclasses.dataclass(frozen=True)
class Backend:
    """One implementation of attention.

    Attributes:
      name: what ``backend=`` calls it.
      description: one line for users.
      config_type: the type of its ``config=`` (None: it takes none).
      supports: ``supports(call) -> list[str]``: why it cannot run the call's forward
        (empty when it can).
      supports_backward: the same for the backward (in addition to `supports`).
      declines: ``declines(call) -> list[str]``: why ``auto`` passes it by although it
        could run the call (too slow there); a backend named by the caller ignores it.
      default_config: ``default_config(call)``: its tuned config for the call.
      forward: ``forward(q, k, v, extras, params, config) -> (o, lse)``.
      backward: ``backward(q, k, v, o, lse, do, dlse, extras, params, config) -> (dq, dk, dv, dextras)``,
        given the forward's o and lse (or, in ring attention, a merge of several calls');
        ``dextras`` is an `Extras` of the gradients of the bias, the sinks and the arrays
        score_mod closes over (None where zero or absent).
      differentiable: its forward is plain JAX, differentiated by JAX when it runs a
        whole call (exact float32 gradients, no recomputation from a rounded o).
      decode: its decode path (`Decoder`), or None when it has none.
      prepare: ``prepare(q, k, v, extras, params, config) -> extras``: inputs its kernels
        derive from the call's (a block mask from a mask_mod), computed once before the
        custom_vjp so that the forward and the backward share them; None: nothing to derive.
    """

    name: str
    description: str
    config_type: type | None
    supports: Callable[[Call], list[str]]
    forward: Callable
    backward: Callable
    default_config: Callable[[Call], Any] = lambda call: None
    supports_backward: Callable[[Call], list[str]] = lambda call: []
    declines: Callable[[Call], list[str]] = lambda call: []
    differentiable: bool = False
    decode: Decoder | None = None
    prepare: Callable | None = None


# name -> module that defines BACKEND.
_MODULES = {
    "mosaic": "flashjax.kernels.mosaic",
    "triton": "flashjax.kernels.triton",
    "xla": "flashjax.kernels.xla",
}
# The order `auto` tries them in, per JAX platform (others: "default").
_ORDER = {
    "gpu": ("mosaic", "triton", "xla"),
    "default": ("triton", "xla"),
}


def names() -> tuple[str, ...]:
    """Every registered backend's name."""
    return tuple(_MODULES)


def get(name: str) -> Backend:
    """The backend registered as `name`."""
    if name not in _MODULES:
        raise ValueError(f"backend must be 'auto' or one of {names()}, got {name!r}.")
    return importlib.import_module(_MODULES[name]).BACKEND


def order(platform: str) -> tuple[str, ...]:
    return _ORDER.get(platform, _ORDER["default"])


def describe_device() -> tuple[str, str]:
    """(platform, compute capability) of the default device: what backends are chosen for."""
    platform = jax.default_backend()
    if platform != "gpu":
        return platform, ""
    return platform, str(getattr(jax.devices()[0], "compute_capability", ""))


def sm_count() -> int:
    """Streaming multiprocessors of the default GPU (0 without one, or when JAX does not say)."""
    device = jax.devices()[0]
    return int(getattr(device, "core_count", 0) or 0) if device.platform == "gpu" else 0


@dataclasses.dataclass(frozen=True)
class Choice:
    """The backends a call runs on, and why the ones `auto` tried first were passed by.

    Attributes:
      backend: runs the forward.
      backward_backend: runs the backward.
      config: the forward backend's config; backward_config: the backward's.
      passed: ((backend, reasons), ...) for each backend ahead of `backend` in the order
        (or the named backend's own reasons its backward moved).
      backward_passed: the same for the backward.
    """

    backend: str
    backward_backend: str
    config: Any
    backward_config: Any
    passed: tuple[tuple[str, tuple[str, ...]], ...] = ()
    backward_passed: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def __str__(self) -> str:
        lines = [f"forward: {self.backend}"]
        lines += [f"  not {name}: {_joined(reasons)}" for name, reasons in self.passed]
        if not self.backward_backend:  # a decode call: forward only
            return "\n".join(lines)
        lines.append(f"backward: {self.backward_backend}")
        lines += [f"  not {name}: {_joined(reasons)}" for name, reasons in self.backward_passed]
        return "\n".join(lines)


def _joined(reasons, separator: str = "; ") -> str:
    """Reasons as one clause list, for a sentence that goes on after it."""
    return separator.join(reason.rstrip(".") for reason in reasons)


def choose(call: Call, backend: str = "auto", config: Any = None) -> Choice:
    """Picks the backends of a call.

    Args:
      call: the call's description.
      backend: "auto" or a registered name.
      config: None, or a backend's config; with "auto" it selects the backend it
        belongs to.

    Raises:
      ValueError: unknown backend name, or a config of another backend than the named one.
      NotImplementedError: the named backend (or the one `config` implies) cannot run
        the call; the message lists its reasons.
    """
    named = backend
    if config is not None:
        backend = _config_owner(config, backend, lambda b: b.config_type, "config")
    if backend != "auto":
        chosen = get(backend)
        reasons = chosen.supports(call)
        if reasons:
            raise NotImplementedError(
                f"backend={backend!r} ({chosen.description}) cannot run this call: {_joined(reasons)}. "
                + _instead(named, config)
            )
        passed = ()
    else:
        chosen, passed = _first(call, order(call.platform), lambda b: b.supports(call) + b.declines(call))
    config = config if config is not None else chosen.default_config(call)

    own = chosen.supports_backward(call)
    if not own:
        return Choice(chosen.name, chosen.name, config, config, passed, ())
    candidates = [n for n in order(call.platform) if n != chosen.name]
    backward, backward_passed = _first(
        call, candidates, lambda b: b.supports(call) + b.supports_backward(call) + b.declines(call)
    )
    return Choice(chosen.name, backward.name, config, backward.default_config(call), passed,
                  ((chosen.name, tuple(own)),) + backward_passed)


def choose_decode(call: DecodeCall, backend: str = "auto", config: Any = None) -> Choice:
    """Picks the backend of a decode call (forward only: the Choice's backward fields are empty).

    ``config``: None, or a backend's decode config, which selects that backend (as in `choose`).

    Raises:
      ValueError: unknown backend name, or a config of another backend than the named one.
      NotImplementedError: the named backend cannot decode the call (its reasons listed).
    """

    def reasons_of(b: Backend, auto: bool) -> list[str]:
        if b.decode is None:
            return ["no decode path"]
        return b.decode.supports(call) + (b.decode.declines(call) if auto else [])

    named = backend
    if config is not None:
        backend = _config_owner(config, backend, lambda b: b.decode and b.decode.config_type, "decode config")
    if backend != "auto":
        reasons = reasons_of(get(backend), auto=False)
        if reasons:
            raise NotImplementedError(
                f"backend={backend!r} ({get(backend).description}) cannot run this decode call: {_joined(reasons)}. "
                + _instead(named, config)
            )
        return Choice(backend, "", None, None)
    chosen, passed = _first(call, order(call.platform), lambda b: reasons_of(b, auto=True))
    return Choice(chosen.name, "", None, None, passed)


def _instead(named: str, config) -> str:
    """What to change when the named backend, or the one a config selected, cannot run a call."""
    if named == "auto" and config is not None:
        return (f"The config ({type(config).__name__}) selected that backend: pass config=None "
                "(with backend='auto') to take the first backend that can.")
    return "Use backend='auto' to take the first backend that can."


def _config_owner(config, backend: str, config_type_of, what: str) -> str:
    """The backend whose config type (`config_type_of(backend)`) `config` is; raises when none
    is, or when `backend` names another one."""
    typed = [n for n in names() if config_type_of(get(n))]
    owner = next((n for n in typed if isinstance(config, config_type_of(get(n)))), None)
    if owner is None:
        types = ", ".join(config_type_of(get(n)).__name__ for n in typed)
        raise ValueError(f"{what} must be one of {types} or None, got {type(config).__name__}.")
    if backend not in ("auto", owner):
        raise ValueError(f"config is a {type(config).__name__}, the {what} of backend {owner!r}, not of {backend!r}.")
    return owner


def _first(call, candidates, reasons_of):
    passed = []
    for name in candidates:
        backend = get(name)
        reasons = reasons_of(backend)
        if not reasons:
            return backend, tuple(passed)
        passed.append((name, tuple(reasons)))
    details = "; ".join(f"{name}: {_joined(r, ', ')}" for name, r in passed)
    raise NotImplementedError(f"no backend can run this call ({details}).")


def _preload_interpreters() -> None:
    """Imports Pallas' interpret-mode modules now where the kernels will run in interpret mode:
    JAX has no CUDA plugin, or `JAX_PLATFORMS` names no GPU platform. The first interpret-mode
    lowering would import them, and one registers a JAX config option, which changes every jit
    cache key: a user's jitted step traced before it would compile a second time."""
    platforms = os.environ.get("JAX_PLATFORMS", "").lower()
    gpu_platform = not platforms or any(name in platforms for name in ("cuda", "gpu"))
    has_plugin = any(importlib.util.find_spec(name) is not None for name in ("jax_plugins", "jax_cuda13_plugin",
                                                                              "jax_cuda12_plugin"))
    if gpu_platform and has_plugin:
        return
    for name in ("jax._src.pallas.mosaic.interpret.interpret_pallas_call", "jax._src.pallas.mosaic.interpret.params",
                 "jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call",
                 "jax._src.pallas.mosaic_gpu.interpret.params"):
        try:
            importlib.import_module(name)
        except ImportError:
            pass


_preload_interpreters()

"""pytest plugin: flashjax as the default attention of Flax's attention modules.

Load it with ``-p flax_default_attention`` (this folder on ``PYTHONPATH``) to run
Flax's own tests with `flashjax.flax.attention_fn` in place of Flax's
``dot_product_attention`` wherever a module is built without an explicit
``attention_fn``::

  PYTHONPATH=tests python -m pytest -p flax_default_attention \\
      flax-0.12.10/tests/linen/linen_attention_test.py flax-0.12.10/tests/nnx/nn/attention_test.py

What is swapped (Flax 0.12.10): the *default value* of the ``attention_fn``
argument, where Flax stores it --

* ``flax.nnx.MultiHeadAttention``: a keyword-only default of ``__init__``
  (``__init__.__kwdefaults__['attention_fn']``);
* ``flax.linen.MultiHeadDotProductAttention`` and its subclasses
  ``MultiHeadAttention`` and ``SelfAttention``: a dataclass field, whose default
  lives in the shared ``dataclasses.Field`` (read by subclasses defined later, e.g.
  in a test file), in the class attribute, and in each class's generated
  ``__init__`` (the function under linen's ``init_wrapper``, reached through
  ``__wrapped__``).

Patching the module-level ``flax.*.attention.dot_product_attention`` would not do
it: the default was bound when the classes were defined. A module built with an
explicit ``attention_fn`` (Flax's tests do that for RoPE and for custom einsums)
keeps it, and tests that call ``nn.dot_product_attention`` directly still test
Flax's function.

The plugin checks that the swap took (a usage error otherwise, e.g. on another
Flax version), counts the calls of flashjax's attention per test, and
deselects the tests in `DESELECTED`, which need what flashjax never computes.
With ``--flashjax-report=PATH`` it writes what it did as JSON: the patched
classes, the deselected node ids with their reasons, and the number of calls of
flashjax's attention per test, so a caller can check that flashjax really ran.
"""

from __future__ import annotations

import collections
import functools
import inspect
import json

import pytest

# Tests that need the attention weights, which flashjax never materialises: they
# call the modules with sow_weights=True, and flashjax's attention_fn raises
# NotImplementedError when Flax passes module= to sow them. Matched against the
# end of the node id (``Class::test``).
SOW_REASON = "sows the attention weights (sow_weights=True), which flashjax never materialises"
DESELECTED = {
    # tests/linen/linen_attention_test.py
    "AttentionTest::test_multihead_sow_attention_weights": SOW_REASON,
    "AttentionTest::test_mixed_precision_multihead_attention0": SOW_REASON,
    "AttentionTest::test_mixed_precision_multihead_attention1": SOW_REASON,
    # tests/nnx/nn/attention_test.py
    "TestMultiHeadAttention::test_multihead_sow_attention_weights": SOW_REASON,
}

_CALLS: collections.Counter = collections.Counter()
_CURRENT: list[str] = ["<collection>"]


def _counting(fn):
    """``fn`` that counts its calls per running test; same signature (linen inspects it)."""

    @functools.wraps(fn)
    def attention_fn(*args, **kwargs):
        _CALLS[_CURRENT[0]] += 1
        return fn(*args, **kwargs)

    return attention_fn


def _replace_default(func, name: str, old, new) -> bool:
    """Replaces the default ``old`` of parameter ``name`` of ``func`` (unwrapped) by ``new``."""
    func = inspect.unwrap(func)
    kwdefaults = func.__kwdefaults__ or {}
    if kwdefaults.get(name) is old:
        kwdefaults[name] = new
        return True
    code = func.__code__
    positional = code.co_varnames[: code.co_argcount]
    defaults = list(func.__defaults__ or ())
    if name in positional:
        index = positional.index(name) - (len(positional) - len(defaults))
        if 0 <= index < len(defaults) and defaults[index] is old:
            defaults[index] = new
            func.__defaults__ = tuple(defaults)
            return True
    return False


def _replace_signature_default(func, name: str, new):
    """linen's init_wrapper carries a copy of the dataclass __init__'s signature; keep it truthful."""
    sig = getattr(func, "__signature__", None)
    if sig is not None and name in sig.parameters:
        params = [p.replace(default=new) if p.name == name else p for p in sig.parameters.values()]
        func.__signature__ = sig.replace(parameters=params)


def install(attention_fn) -> list[str]:
    """Makes ``attention_fn`` the default of Flax's attention modules; returns what was patched."""
    from flax import linen, nnx
    from flax.linen import attention as linen_attention
    from flax.nnx.nn import attention as nnx_attention

    patched = []
    old = nnx_attention.dot_product_attention
    if not _replace_default(nnx.MultiHeadAttention.__init__, "attention_fn", old, attention_fn):
        raise pytest.UsageError("flax.nnx.MultiHeadAttention.__init__ has no attention_fn default to replace")
    patched.append("flax.nnx.MultiHeadAttention")

    old = linen_attention.dot_product_attention
    classes = (linen.MultiHeadDotProductAttention, linen.MultiHeadAttention, linen.SelfAttention)
    for cls in classes:
        field = cls.__dataclass_fields__["attention_fn"]
        if field.default is old:
            field.default = attention_fn  # one Field shared by the subclasses
        if cls.__dict__.get("attention_fn") is old:
            cls.attention_fn = attention_fn  # the dataclass's class attribute
        if not _replace_default(cls.__init__, "attention_fn", old, attention_fn):
            raise pytest.UsageError(f"flax.linen.{cls.__name__}.__init__ has no attention_fn default to replace")
        _replace_signature_default(cls.__init__, "attention_fn", attention_fn)
        patched.append(f"flax.linen.{cls.__name__}")

    # Check on real instances (construction only; nothing is run).
    layer = nnx.MultiHeadAttention(num_heads=1, in_features=2, decode=False, rngs=nnx.Rngs(0))
    built = [("flax.nnx.MultiHeadAttention", layer.attention_fn)]
    built += [(f"flax.linen.{cls.__name__}", cls(num_heads=1).attention_fn) for cls in classes]

    class Probe(linen.MultiHeadDotProductAttention):  # as a test file's subclass would be
        pass

    built.append(("a linen subclass defined later", Probe(num_heads=1).attention_fn))
    wrong = [name for name, fn in built if fn is not attention_fn]
    if wrong:
        raise pytest.UsageError(f"flashjax attention_fn did not become the default of: {', '.join(wrong)}")
    return patched


def pytest_addoption(parser):
    parser.addoption(
        "--flashjax-report", default=None, metavar="PATH",
        help="write {patched, deselected: {node id: reason}, calls: {node id: calls of flashjax's attention_fn}} "
        "as JSON to PATH",
    )


def pytest_configure(config):
    import flashjax.flax

    config._flashjax_patched = install(_counting(flashjax.flax.attention_fn))


def pytest_report_header(config):
    lines = ["flashjax.flax.attention_fn is the default attention_fn of: " + ", ".join(config._flashjax_patched)]
    lines += [f"deselected {name}: {reason}" for name, reason in DESELECTED.items()]
    return lines


def _deselected_key(item) -> str | None:
    for name in DESELECTED:
        if item.nodeid.endswith("::" + name):
            return name
    return None


def pytest_collection_modifyitems(config, items):
    keep, drop = [], []
    for item in items:
        (drop if _deselected_key(item) else keep).append(item)
    config._flashjax_deselected = {item.nodeid: DESELECTED[_deselected_key(item)] for item in drop}
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    _CURRENT[0] = item.nodeid
    try:
        return (yield)
    finally:
        _CURRENT[0] = "<between tests>"


def pytest_sessionfinish(session):
    config = session.config
    path = config.getoption("--flashjax-report")
    if path:
        report = {
            "patched": config._flashjax_patched,
            "deselected": getattr(config, "_flashjax_deselected", {}),
            "calls": dict(sorted(_CALLS.items())),
        }
        with open(path, "w") as f:
            json.dump(report, f, indent=1)

"""The `flashjax` command: the demo's smallest setting runs and passes its checks; the help texts."""

import sys

import jax

from flashjax import cli


def test_demo_quick(capsys):
    assert cli.main(["demo", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "ok " in out and "FAIL" not in out
    assert "backend: " in out  # flashjax.explain's choice for each problem
    if jax.default_backend() != "gpu":
        assert "timings: skipped" in out and "ms (TF/s)" not in out


def test_unknown_command_is_an_error(capsys):
    assert cli.main(["nope"]) == 2


def test_help_is_plain_text(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: flashjax")
    assert "demo" in out and "bench" in out
    assert "`" not in out  # no reST markup in a terminal
    assert cli.main([]) == 0
    assert "`" not in capsys.readouterr().out


def test_bench_help_is_the_benchmarks(capsys):
    assert cli.main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: flashjax bench")
    assert "--seqlens" in out and "--mosaic-config" in out and "--triton-config" in out
    assert "`" not in out


def test_demo_help(capsys):
    assert cli.main(["demo", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: flashjax demo") and "--timing" in out


def test_progress_bar_is_optional(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm raises ImportError
    bar = cli._bar(2, "checks")
    bar.update()
    bar.close()

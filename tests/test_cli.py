"""The `flashjax` command: the demo's smallest setting runs and passes its checks."""

from flashjax import cli


def test_demo_quick(capsys):
    assert cli.main(["demo", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "ok " in out and "FAIL" not in out


def test_unknown_command_is_an_error(capsys):
    assert cli.main(["nope"]) == 2

"""``python -m stallguard_sglang`` and the ``.pth`` activation: exit codes, one-line
errors, and an activation that never stops an unrelated interpreter (issue 10 point 12,
issue 11). Pure Python; the subprocesses start bare interpreters of this environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import stallguard_sglang.__main__ as cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stallguard_sglang import _activate
from stallguard_sglang.package import has_plugin_framework

GOOD = "[prefill.deadlines]\nTransferring = 20\n"


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STALLGUARD_SGLANG")}
    env.update(extra)
    return env


@pytest.fixture
def no_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("STALLGUARD_SGLANG"):
            monkeypatch.delenv(name)


def run_cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stallguard_sglang", *args],
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
    )


# --------------------------------------------------------------------------- the CLI


def test_bad_sglang_version_is_one_line_and_no_traceback():
    proc = run_cli("--sglang-version", "garbage", STALLGUARD_SGLANG="1")
    assert proc.returncode == cli.EXIT_USAGE == 2
    assert proc.stderr.strip().splitlines() == [
        "python -m stallguard_sglang: error: argument --sglang-version: 'garbage' is not a "
        "PEP 440 version number (e.g. 0.5.23)"
    ]
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_version_option():
    proc = run_cli("--version")
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip()
    assert line.startswith("stallguard-sglang 0.1.0 (stallguard 0.1.0; SGLang "), line
    assert line.endswith("supported >=0.5.17,<0.6)")


def test_config_option_validates_that_file(tmp_path, no_env, capsys):
    path = tmp_path / "sg.toml"
    path.write_text(GOOD)
    assert cli.main(["--config", str(path), "--sglang-version", "0.5.23"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert f"config: {path}" in out and "SGLang: 0.5.23 (supported;" in out
    path.write_text("[prefill.deadlines]\nTransfering = 20\n")
    assert cli.main(["--config", str(path)]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"stallguard-sglang: invalid configuration: {path}: ")
    assert "(did you mean 'Transferring'?)" in err
    assert cli.main(["--config", str(tmp_path / "absent.toml")]) == cli.EXIT_USAGE
    assert "no such file" in capsys.readouterr().err


def test_disabled_without_config(no_env, capsys):
    assert cli.main([]) == cli.EXIT_DISABLED == 1
    assert "disabled" in capsys.readouterr().out


def test_sglang_missing_and_unsupported_have_their_own_codes(monkeypatch, no_env, capsys):
    monkeypatch.setenv("STALLGUARD_SGLANG", "1")
    assert cli.main(["--sglang-version", "0.5.16"]) == cli.EXIT_UNSUPPORTED == 4
    captured = capsys.readouterr()
    assert "SGLang: 0.5.16 (NOT supported" in captured.out
    assert "outside the supported range >=0.5.17,<0.6" in captured.err
    assert cli.main(["--sglang-version", "0.5.17rc0"]) == cli.EXIT_UNSUPPORTED
    capsys.readouterr()
    monkeypatch.setattr(cli, "sglang_version", lambda: None)  # as if not installed
    assert cli.main([]) == cli.EXIT_SGLANG_MISSING == 3
    captured = capsys.readouterr()
    assert "SGLang: not installed" in captured.out
    assert "SGLang is not installed here" in captured.err
    # an explicit release is judged on its own, installed or not
    assert cli.main(["--sglang-version", "0.5.23"]) == cli.EXIT_OK
    assert len({cli.EXIT_OK, cli.EXIT_DISABLED, cli.EXIT_USAGE, 3, 4}) == 5


# --------------------------------------------------------------------------- the .pth


def test_bad_activation_value_warns_and_stands_aside(monkeypatch, capsys):
    monkeypatch.setenv(_activate.ENV_ACTIVATION, "always")
    with pytest.raises(ValueError, match="STALLGUARD_SGLANG_ACTIVATION='always'"):
        _activate.install_import_hook()
    before = list(sys.meta_path)
    assert _activate.from_pth() is False
    assert sys.meta_path == before  # no import hook armed
    err = capsys.readouterr().err
    assert err == (
        "stallguard-sglang: warning: environment variable STALLGUARD_SGLANG_ACTIVATION="
        "'always': expected one of auto, pth, plugin; not activated from the .pth file in "
        "this interpreter\n"
    )


def test_any_error_in_the_activation_warns_and_stands_aside(monkeypatch, capsys):
    def broken() -> bool:
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(_activate, "install_import_hook", broken)
    assert _activate.from_pth() is False
    assert "warning: RuntimeError: disk on fire; not activated" in capsys.readouterr().err


def pth_installed() -> bool:
    return any(Path(p, "stallguard_sglang_activate.pth").is_file() for p in sys.path if p)


@pytest.mark.skipif(not pth_installed(), reason="stallguard_sglang_activate.pth is not installed")
@pytest.mark.parametrize("activation", ["bogus", "PTH!", "plugin,pth"])
def test_an_unrelated_interpreter_still_runs_with_a_bad_activation_value(activation):
    # the old .pth raised SystemExit at site import here: every interpreter of the
    # environment (pip included) refused to start
    proc = subprocess.run(
        [sys.executable, "-c", "print('still alive')"],
        env=clean_env(STALLGUARD_SGLANG="1", STALLGUARD_SGLANG_ACTIVATION=activation),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "still alive\n"
    # (one line per run of the .pth: site.py runs a venv's .pth files twice on some
    # installs, e.g. this pyenv build)
    [warning] = set(proc.stderr.strip().splitlines())
    assert warning.startswith("stallguard-sglang: warning: environment variable ")
    assert warning.endswith("not activated from the .pth file in this interpreter")


# --------------------------------------------------------------------------- properties


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(value=st.text(max_size=12))
def test_the_pth_entry_point_never_raises(monkeypatch, capsys, no_env, value):
    """Whatever STALLGUARD_SGLANG_ACTIVATION holds, from_pth() returns: armed (pth),
    standing aside for the plugin (auto, plugin), or standing aside with one warning."""
    if "\x00" in value:
        return  # an environment variable cannot hold NUL
    monkeypatch.setenv(_activate.ENV_ACTIVATION, value)
    before = list(sys.meta_path)
    try:
        armed = _activate.from_pth()
    finally:
        sys.meta_path[:] = before
    err = capsys.readouterr().err
    choice = value.strip().lower() or "auto"
    if choice in _activate.ACTIVATIONS:
        assert err == ""
        assert armed is (choice == "pth" or (choice == "auto" and not has_plugin_framework()))
    else:
        assert armed is False
        assert err.count("\n") == 1 and err.startswith("stallguard-sglang: warning: ")


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(version=st.text(max_size=12))
def test_the_cli_answers_any_version_with_a_documented_status(tmp_path_factory, capsys, version):
    path = tmp_path_factory.mktemp("cli") / "sg.toml"
    path.write_text(GOOD)
    try:
        status = cli.main(["--config", str(path), "--sglang-version", version])
    except SystemExit as e:  # argparse refusing the value
        status = e.code
    captured = capsys.readouterr()
    assert status in (cli.EXIT_OK, cli.EXIT_USAGE, cli.EXIT_UNSUPPORTED)
    assert "Traceback" not in captured.err
    if status == cli.EXIT_USAGE:
        assert captured.err.count("\n") == 1 and "--sglang-version" in captured.err


def test_advise_is_a_listed_subcommand(capsys):
    """``--help`` lists ``advise``; its own ``--help`` documents every option."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "advise" in out and "``" not in out
    with pytest.raises(SystemExit):
        cli.main(["advise", "--help"])
    out = capsys.readouterr().out
    for option in (
        "--url",
        "--file",
        "--multiproc-dir",
        "--baseline",
        "--false-timeout-rate",
        "--margin",
        "--floor",
        "--min-samples",
        "--toml",
    ):
        assert option in out, option
    # every option has help text
    import argparse

    from stallguard_sglang import _advise

    parser = argparse.ArgumentParser()
    _advise.add_arguments(parser)
    assert all(a.help for a in parser._actions), [a.dest for a in parser._actions if not a.help]


def test_advise_through_the_main_parser(tmp_path, capsys):
    assert cli.main(["advise", "--file", str(tmp_path / "missing.txt")]) == 2
    assert "--file" in capsys.readouterr().err


def test_closed_pipe_is_quiet(tmp_path):
    """``python -m stallguard_sglang | head -1``: no BrokenPipeError traceback."""
    env = {**os.environ, "STALLGUARD_SGLANG": "1"}
    env.pop("STALLGUARD_SGLANG_CONFIG", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "stallguard_sglang"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err

"""Issue 20: a bad configuration never starts SGLang unguarded, and the adapter's reader
and commands turn every failure into one named error.

* the reader: a file that is not UTF-8, values nested thousands deep, an integer of
  5,000 digits, a 400-digit ``[bootstrap_queue] deadline``: a ``ConfigError`` naming the
  file (was: UnicodeDecodeError, RecursionError, ValueError, OverflowError);
* the plugin entry point and the ``.pth`` import hook: those, and any other exception
  while loading or installing a given configuration, are a ``SystemExit`` naming the
  file, which SGLang's ``load_plugins()`` does not swallow (it swallows every
  ``Exception``: the server came up unguarded);
* ``python -m stallguard_sglang`` and its ``advise`` command: exit status 2 and one line
  on stderr, never a traceback.

Pure Python: SGLang's loader is imitated by :func:`load_plugins_like_sglang` (the
real one, in a fresh process, is test_adapter_plugin.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import stallguard_sglang.__main__ as cli
from stallguard_sglang import _activate, load_config, plugin
from stallguard_sglang._config import Config

from stallguard import ConfigError

ENV = "STALLGUARD_SGLANG_CONFIG"

#: name -> (file bytes, what the message says)
BAD_FILES = {
    "latin1": (
        b"[prefill.deadlines]\nTransferring = 20 # 20 \xb5s\n",
        "not UTF-8 text (TOML files must be UTF-8): byte 0xb5 at offset 43",
    ),
    "deep": (b"x = " + b"[" * 3000 + b"]" * 3000 + b"\n", "values nested too deeply"),
    "digits": (
        b"[prefill.deadlines]\nTransferring = " + b"9" * 5000 + b"\n",
        "an integer of more than 4300 digits",
    ),
    "bootstrap400": (
        b"[bootstrap_queue]\ndeadline = " + b"9" * 400 + b"\n",
        "[bootstrap_queue] deadline = 99999999999999999999... (400 digits): must be a "
        "positive, finite number of seconds (this one is too large for a float)",
    ),
}


def write(tmp_path: Path, data: bytes, name: str = "sg.toml") -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


@pytest.fixture
def no_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("STALLGUARD_SGLANG"):
            monkeypatch.delenv(name)


@pytest.fixture
def installs(monkeypatch, no_env):
    """plugin.install() recorded instead of registering hooks with SGLang."""
    calls: list[tuple[Config, str]] = []
    monkeypatch.setattr(plugin, "install", lambda config, *, via: calls.append((config, via)))
    monkeypatch.setattr(plugin, "_installed", None)
    return calls


def load_plugins_like_sglang(func) -> None:
    """What SGLang 0.5.23's ``load_plugins()`` does with a general plugin: call it and
    log and swallow every ``Exception`` (a BaseException such as SystemExit escapes)."""
    try:
        func()
    except Exception:
        pass


# --------------------------------------------------------------------------- the reader


@pytest.mark.parametrize("name", list(BAD_FILES))
def test_a_bad_file_is_a_config_error_naming_it(tmp_path, name):
    data, expected = BAD_FILES[name]
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as info:
        load_config({ENV: path})
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    assert expected in message, message
    assert len(message) < 400  # never the 5,000 digits


def test_an_unusable_path_is_a_config_error():
    with pytest.raises(ConfigError, match="not a usable file path"):
        load_config({ENV: "sg\0.toml"})  # (a --config argument can hold a NUL)


def test_any_other_failure_interpreting_the_file_names_it(tmp_path, monkeypatch):
    from stallguard_sglang import _config

    path = write(tmp_path, b"[prefill]\nmode = 'report'\n")

    def broken(data, *, source):
        raise KeyError("surprise")

    monkeypatch.setattr(_config, "parse_config", broken)
    with pytest.raises(ConfigError) as info:
        load_config({ENV: path})
    assert str(info.value).startswith(f"{path}: cannot interpret it (KeyError: 'surprise')")


# --------------------------------------------------------------------------- the plugin


@pytest.mark.parametrize("name", list(BAD_FILES))
def test_the_plugin_refuses_to_start_on_a_bad_file(tmp_path, monkeypatch, installs, name):
    data, expected = BAD_FILES[name]
    path = write(tmp_path, data)
    monkeypatch.setenv(ENV, path)
    with pytest.raises(SystemExit) as info:
        load_plugins_like_sglang(plugin.register)
    message = str(info.value.code)
    assert message.startswith(
        f"stallguard-sglang: invalid configuration, refusing to start: {path}"
    )
    assert expected in message
    assert installs == []


def test_any_exception_loading_the_config_refuses_to_start(tmp_path, monkeypatch, installs):
    path = write(tmp_path, b"")
    monkeypatch.setenv(ENV, path)

    def broken(environ=None):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(plugin, "load_config", broken)
    with pytest.raises(SystemExit) as info:
        load_plugins_like_sglang(plugin.register)
    assert str(info.value.code) == (
        f"stallguard-sglang: cannot load the configuration ({ENV}={path!r}), refusing to "
        "start: RuntimeError: disk on fire"
    )
    assert installs == []


def test_a_config_that_loads_but_cannot_be_installed_refuses_to_start(
    tmp_path, monkeypatch, no_env
):
    path = write(tmp_path, b"[prefill.deadlines]\nTransferring = 20\n")
    monkeypatch.setenv(ENV, path)
    monkeypatch.setattr(plugin, "_installed", None)

    def broken(config, *, via):
        raise ImportError("no HookRegistry here")

    monkeypatch.setattr(plugin, "install", broken)
    with pytest.raises(SystemExit) as info:
        load_plugins_like_sglang(plugin.register)
    assert str(info.value.code) == (
        f"stallguard-sglang: cannot install the hooks for config {path}, refusing to start: "
        "ImportError: no HookRegistry here"
    )


def test_a_bad_enable_flag_refuses_to_start(monkeypatch, installs):
    monkeypatch.setenv("STALLGUARD_SGLANG", "yes please")
    with pytest.raises(SystemExit, match="STALLGUARD_SGLANG='yes please': expected 1"):
        load_plugins_like_sglang(plugin.register)


def test_a_good_file_is_installed(tmp_path, monkeypatch, installs):
    path = write(tmp_path, b"[prefill.deadlines]\nTransferring = 20\n")
    monkeypatch.setenv(ENV, path)
    load_plugins_like_sglang(plugin.register)
    [(config, via)] = installs
    assert config == load_config({ENV: path}) and via == "plugins"


@pytest.mark.parametrize("name", ["latin1", "bootstrap400"])
def test_the_pth_import_hook_refuses_to_start_on_a_bad_file(tmp_path, monkeypatch, installs, name):
    # the .pth fallback activates when SGLang's prefill module is imported
    path = write(tmp_path, BAD_FILES[name][0])
    monkeypatch.setenv(ENV, path)
    with pytest.raises(SystemExit, match="refusing to start: " + path):
        _activate._activate_now()
    assert installs == []


# --------------------------------------------------------------------------- the commands


@pytest.mark.parametrize("name", list(BAD_FILES))
def test_the_cli_exits_2_with_one_line(tmp_path, capsys, no_env, name):
    path = write(tmp_path, BAD_FILES[name][0])
    assert cli.main(["--config", path, "--sglang-version", "0.5.23"]) == cli.EXIT_USAGE
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"stallguard-sglang: invalid configuration: {path}: ")
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err


METRICS = (
    'sglang:stallguard_state_seconds_bucket{{backend="nixl",queue="inflight",'
    'state="Transferring",le="1.0"}} {low}\n'
    'sglang:stallguard_state_seconds_bucket{{backend="nixl",queue="inflight",'
    'state="Transferring",le="+Inf"}} {high}\n'
)


@pytest.mark.parametrize(
    ("low", "high", "message"),
    [
        ("1", "+Inf", "line 2: sglang:stallguard_state_seconds_bucket{"),  # was: OverflowError
        ("NaN", "2", "NaN: a count must be a finite number >= 0"),  # was: ValueError, no line
        ("-Inf", "2", "-Inf: a count must be a finite number >= 0"),
    ],
)
def test_advise_on_a_nonfinite_count_exits_2_with_one_line(tmp_path, capsys, low, high, message):
    path = tmp_path / "metrics.txt"
    path.write_text(METRICS.format(low=low, high=high))
    assert cli.main(["advise", "--file", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("stallguard-sglang advise: line ") and message in err
    assert err.count("\n") == 1


def test_advise_on_a_file_that_is_not_utf8_names_it(tmp_path, capsys):
    path = tmp_path / "metrics.txt"
    path.write_bytes(b"# caf\xe9\n")
    assert cli.main(["advise", "--file", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"stallguard-sglang advise: --file {str(path)!r}: not UTF-8 text: byte 0xe9 at "
        "offset 5 cannot be decoded (a Prometheus exposition is UTF-8)\n"
    )


def test_advise_arguments_are_refused_on_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["advise", "--margin", "lots"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--margin: invalid float value: 'lots'" in err

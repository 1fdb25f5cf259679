"""Fuzzing the config entry points (issue 10): random documents, random TOML text
(invalid bytes included) and random environments. Whatever comes in, the only exception
that escapes ``load_config``/``load_spec``/``parse_config_table``/``parse_deadlines`` is a
:class:`stallguard.ConfigError` (a documented one), and what loads is what the docs say:
the config builds a working watchdog, and every environment override it accepted is in
the result.

The strategies lean towards near-valid input (known keys, state names, numbers at the
edges of a float) so that the fuzzer reaches past the first check.
"""

from __future__ import annotations

import math
import os
import re
import tempfile

from _profiles import at_least
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import stallguard as sg
from stallguard.testing import FakeClock

FUZZ = settings(
    max_examples=at_least(300),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

# names that collide once upper-cased and punctuation-replaced, or extend each other
NAMES = ["kv", "kv_sender", "kv-sender", "Kv.Sender", "kv_deadline", "s", "é", "", " "]
STATES = ["A", "B", "Wait-Input", "Wait_Input", "wait input", "MODE", "Success", "", "1"]
KEYS = ["deadlines", "terminal", "lifetime", "mode", "unknown_state", "memory", "seconds"]


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


numbers = st.one_of(
    st.integers(min_value=-3, max_value=10**6),
    st.integers(min_value=10**300, max_value=10**420),  # beyond a float, or close to it
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1e-300, 5e-324, 1.7976931348623157e308, 9.3e9]),
    # beyond int-to-text (issue 20); built in a map: hypothesis cannot repr() the value
    st.sampled_from([1, -1]).map(lambda sign: sign * 10**5000),
)
# values nested thousands deep (issue 20: formatting the message recursed)
deep = st.integers(min_value=500, max_value=3000).map(nested)
scalars = st.one_of(
    numbers,
    deep,
    st.booleans(),
    st.none(),
    st.sampled_from(["none", "None", " none ", "enforce", "report", "raise", "ignore", "", "1"]),
    st.text(max_size=8),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.sampled_from(KEYS + STATES + ["stall"]), inner, max_size=4),
    ),
    max_leaves=6,
)
deadline_values = st.one_of(
    numbers,
    st.sampled_from(["none", "2m", None]),
    st.fixed_dictionaries(
        {}, optional={"seconds": numbers | st.just("none"), "stall": numbers, "x": numbers}
    ),
    values,
)
spec_tables = st.fixed_dictionaries(
    {},
    optional={
        "deadlines": st.dictionaries(st.sampled_from(STATES), deadline_values, max_size=4) | values,
        "terminal": st.lists(st.sampled_from(STATES), max_size=3) | values,
        "lifetime": deadline_values,
        "mode": st.sampled_from(["enforce", "report", "Report"]) | values,
        "unknown_state": st.sampled_from(["raise", "ignore"]) | values,
        "memory": numbers | values,
        "extra": values,
    },
)
# near-valid: a deadlines table of distinct states, then the optional keys, each valid
# or not
good_seconds = st.one_of(
    st.integers(min_value=1, max_value=10**6),
    st.floats(min_value=1e-6, max_value=1e9),
    st.just("none"),
)
good_tables = st.fixed_dictionaries(
    {
        "deadlines": st.dictionaries(
            st.sampled_from(["A", "B", "Wait-Input"]), good_seconds, min_size=1
        )
    },
    optional={
        "terminal": st.just(["Success"]),
        "lifetime": good_seconds | numbers,
        "mode": st.sampled_from(["enforce", "report", "Report"]),
        "memory": st.integers(min_value=0, max_value=10**20),
        "deadlines_extra": values,
    },
)
documents = st.one_of(
    st.fixed_dictionaries(
        {"spec": st.dictionaries(st.sampled_from(NAMES[:6]), good_tables, min_size=1, max_size=3)}
    ),
    st.fixed_dictionaries(
        {"spec": st.dictionaries(st.sampled_from(NAMES), good_tables | spec_tables, max_size=3)}
    ),
    st.dictionaries(st.sampled_from(["spec", "other"]), values, max_size=2),
)


def environments(names: list[str]) -> st.SearchStrategy[dict[str, str]]:
    def var(name: str, setting: str, state: str) -> str:
        text = f"STALLGUARD_{name}_{setting}_{state}" if state else f"STALLGUARD_{name}_{setting}"
        return re.sub(r"[^A-Za-z0-9]", "_", text).upper()

    variables = st.builds(
        var,
        st.sampled_from([*names, "kv", "x"]),
        st.sampled_from(["DEADLINE", "STALL", "MODE", "LIFETIME", "MEMORY", "UNKNOWN_STATE", "X"]),
        st.sampled_from(["A", "A", "Wait_Input", *STATES, "", "SENDER", "DEADLINE_A"]),
    )
    env_values = st.one_of(
        st.sampled_from(["5", "0.25", "none", "-1", "nan", "inf", "report", "ignore", "9" * 400]),
        st.sampled_from(["1_000", " 7 ", "1e999", "9" * 5000, "0x10", "٣"]),  # edges of int()
        st.text(max_size=6),
    )
    return st.dictionaries(variables | st.text(max_size=10), env_values, max_size=5)


def assert_works(config: sg.WatchdogConfig) -> None:
    """What loaded builds a watchdog that tracks and expires requests."""
    clock = FakeClock()
    watchdog = config.watchdog(clock=clock)
    assert watchdog.spec is config.spec and watchdog.mode == config.mode
    for state in config.spec.deadlines:
        watchdog.observe(object(), state)
    clock.advance(1e6)
    watchdog.check()


@FUZZ
@given(document=documents, data=st.data())
def test_random_documents(document: dict, data: st.DataObject) -> None:
    specs = document.get("spec")
    known = list(specs) if isinstance(specs, dict) else []
    name = data.draw(st.sampled_from([None, *NAMES]) | st.sampled_from(known or [None]))
    try:
        config = sg.load_config(document, name=name, env={})
    except sg.ConfigError as exc:
        assert len(str(exc)) < 1000  # values are shown shortened, however large
        event("refused")
        return
    event("loaded")
    assert_works(config)


@FUZZ
@given(table=values | spec_tables, name=st.sampled_from(NAMES))
def test_random_tables(table: object, name: str) -> None:
    try:
        config = sg.parse_config_table(table, name=name)  # type: ignore[arg-type]
    except sg.ConfigError:
        pass
    else:
        assert_works(config)
    try:
        deadlines = sg.parse_deadlines(table)  # type: ignore[arg-type]
    except sg.ConfigError:
        return
    for deadline in deadlines.values():
        for seconds in (deadline.seconds, deadline.stall):
            assert seconds is None or (math.isfinite(seconds) and seconds > 0)


TOML_LINES = [
    "[spec.kv_sender]",
    "[spec.kv_sender.deadlines]",
    "[spec.kv-sender.deadlines]",
    "[spec]",
    "[spec.s.deadlines]",
    'terminal = ["Success", "Failed"]',
    "terminal = []",
    'mode = "report"',
    "memory = 10",
    "lifetime = 1e400",
    f"Transferring = {'9' * 400}",
    "Transferring = { seconds = 120, stall = 30 }",
    'Queued = "none"',
    "A = nan",
    "A = -inf",
    "A = 0",
    "A = 1",
    "A = 1",  # a duplicate key
    "x = [[[[[[[[[[]]]]]]]]]]",
    "x = " + "[" * 3000 + "]" * 3000,
    "A = " + "9" * 5000,  # more digits than int() reads (issue 20)
    '"Wait-Input" = 5',
    "Wait_Input = 5",
    "= broken",
]


GOOD_TOML = ["[spec.kv_sender]", 'terminal = ["Success", "Failed"]', "[spec.kv_sender.deadlines]"]
GOOD_LINES = [
    "Transferring = { seconds = 120, stall = 30 }",
    'Queued = "none"',
    "A = 1",
    "B = 0.5",
    '"Wait-Input" = 5',
    "A = nan",  # one bad line among them
]


@FUZZ
@given(
    lines=st.one_of(
        st.lists(st.sampled_from(TOML_LINES) | st.text(max_size=20), max_size=8),
        st.lists(st.sampled_from(GOOD_LINES), min_size=1, max_size=3, unique=True).map(
            lambda tail: GOOD_TOML + tail
        ),
    ),
    noise=st.just(b"") | st.binary(max_size=12),
    where=st.integers(min_value=0, max_value=400),
)
def test_random_toml_files(lines: list[str], noise: bytes, where: int) -> None:
    data = "\n".join(lines).encode("utf-8", "surrogatepass")
    data = data[:where] + noise + data[where:]  # invalid UTF-8 often
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "fuzz.toml")
        with open(path, "wb") as f:
            f.write(data)
        try:
            config = sg.load_config(path, env={})
        except sg.ConfigError as exc:
            assert str(exc).startswith(path)  # every file error names the file
            event("refused")
            return
    event("loaded")
    assert_works(config)


@FUZZ
@given(data=st.data(), names=st.lists(st.sampled_from(NAMES[:6]), min_size=1, max_size=3))
def test_random_environments(data: st.DataObject, names: list[str]) -> None:
    tables = {
        n: {"deadlines": {"A": 10, "Wait-Input": 20, "B": None}, "terminal": ["Success"]}
        for n in names
    }
    if data.draw(st.booleans()):
        tables[names[0]]["deadlines"]["Wait_Input"] = 30  # two states, one variable name
    document = {"spec": tables}
    name = data.draw(st.sampled_from(names))
    env = data.draw(environments(names))
    try:
        config = sg.load_config(document, name=name, env=env)
    except sg.ConfigError as exc:
        event("refused: ambiguous" if "ambiguous" in str(exc) else "refused")
        return
    event("loaded with overrides" if env else "loaded")
    assert_works(config)
    assert_overrides_applied(config, name, names, env)


def env_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]", "_", text).upper()


def assert_overrides_applied(
    config: sg.WatchdogConfig, name: str, names: list[str], env: dict[str, str]
) -> None:
    """Every variable addressed to spec *name* that loading accepted is in *config*;
    a variable that another spec could claim as well must have been refused."""
    head = env_name(f"STALLGUARD_{name}_")
    heads = {env_name(f"STALLGUARD_{n}_") for n in names if n != name}
    spec = config.spec
    for var, value in env.items():
        if not var.startswith(head):
            continue
        rest = var[len(head) :]
        assert head not in heads, f"{var} could be for two specs, yet loading did not refuse it"
        if any(h != head and var.startswith(h) for h in heads):
            continue  # another spec's (a longer name); the ambiguous ones were refused
        field, _, state = rest.partition("_")
        text = value.strip()
        if field in ("DEADLINE", "STALL"):
            matching = [s for s in spec.deadlines if env_name(s) == state]
            assert len(matching) == 1, f"{var} was accepted for states {matching}"
            expected = None if text.lower() == "none" else float(text)
            attribute = "seconds" if field == "DEADLINE" else "stall"
            assert getattr(spec.deadlines[matching[0]], attribute) == expected
        elif rest == "MODE":
            assert config.mode == text
        elif rest == "LIFETIME":
            assert spec.lifetime == (None if text.lower() == "none" else float(text))

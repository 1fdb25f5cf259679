"""stallguard.adapters, the public adapter kit (docs/adapters.md): the readers' one error
format under adversarial input (hypothesis), VersionSupport against PEP 440, the lazy
face, the statistics exporter against a real prometheus_client registry."""

from __future__ import annotations

import math
import string
import sys
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import stallguard
from stallguard import ConfigError
from stallguard.adapters import (
    LADDER,
    EnvReader,
    StatisticsExporter,
    TableReader,
    VersionSupport,
    histogram_buckets,
    lazy_attribute,
    lazy_names,
    seconds_arg,
)
from stallguard.testing import FakeClock

#: what a parsed TOML document, a JSON command line or a Python caller can hold
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=10**300, max_value=10**400),
    st.builds(lambda: 10**5000),  # (st.just would repr it: str() refuses 5,000 digits)
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=10),
    st.binary(max_size=8).map(lambda b: b.decode("utf-8", "surrogateescape")),
    st.sampled_from(["none", "None", "enforce", "report", "A", "B"]),
)
keys = st.one_of(
    st.sampled_from(["mode", "wait", "deadlines", "A", "B", "Done"]), st.text(max_size=5)
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(keys, inner, max_size=3)),
    max_leaves=10,
)


def _read(data: object) -> object:
    top = TableReader(data, source="f.toml", where="", allowed=("mode", "wait", "deadlines"))
    return (
        top.choice("mode", ("enforce", "report"), "enforce"),
        top.seconds("wait", 5.0),
        top.deadlines("deadlines", ("A", "B"), terminal=("Done",)),
    )


@settings(max_examples=200, deadline=None)
@given(st.one_of(values, st.dictionaries(keys, values, max_size=4)))
def test_table_reader_gives_values_or_one_named_error(data: object) -> None:
    try:
        mode, wait, deadlines = _read(data)  # type: ignore[misc]
    except ConfigError as e:
        message = str(e)
        assert message.startswith("f.toml: "), message
        message.encode("utf-8")  # printable
        return
    assert mode in ("enforce", "report")
    assert wait is None or (wait > 0 and math.isfinite(wait))
    for d in deadlines.values():
        for s in (d.seconds, d.stall):
            assert s is None or (s > 0 and math.isfinite(s))


def test_table_reader_messages() -> None:
    cases = [
        ({"mode": "Report"}, "(did you mean 'report'?)"),
        ({"wat": 1}, "wat = 1: unknown key (did you mean 'wait'?); allowed keys: mode"),
        ({"deadlines": {"Done": 1}}, "Done is terminal and takes no deadline; states: A, B"),
        ({"deadlines": 3}, "deadlines = 3: must be a table ([deadlines])"),
        ({"wait": "\udcb5"}, 'wait = "\\udcb5": must be a positive'),
        (
            {"wait": 10**400},
            "wait = 10000000000000000000... (401 digits): must be a positive, finite number "
            "of seconds (this one is too large for a float)",
        ),
    ]
    for data, needle in cases:
        with pytest.raises(ConfigError) as info:
            _read(data)
        assert needle in str(info.value), info.value


VARS = ("P_MODE", "P_WAIT", "P_HOLD")


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.one_of(
            st.sampled_from(VARS),
            st.text(string.ascii_uppercase + "_", max_size=8).map("P_".__add__),
        ),
        st.one_of(
            st.sampled_from(
                ["nan", "inf", "1e999", "0", "none", "enforce", " report ", "9" * 5000]
            ),
            st.binary(max_size=8).map(lambda b: b.decode("utf-8", "surrogateescape")),
            st.text(max_size=8),
        ),
        max_size=4,
    )
)
def test_env_reader_gives_values_or_one_named_error(env: dict[str, str]) -> None:
    try:
        reader = EnvReader(env, "P_", known=VARS)
        got = [
            reader.choice("P_MODE", ("enforce", "report")) if "P_MODE" in reader else None,
            reader.seconds("P_WAIT") if "P_WAIT" in reader else None,
            reader.seconds("P_HOLD", none=False) if "P_HOLD" in reader else 1.0,
        ]
    except ConfigError as e:
        message = str(e)
        var = message.removeprefix("environment: ").split(" = ", 1)[0]
        assert var in env, message
        message.encode("utf-8")
        return
    assert got[0] in (None, "enforce", "report")
    assert got[1] is None or (got[1] > 0 and math.isfinite(got[1]))
    assert got[2] is not None and got[2] > 0 and math.isfinite(got[2])


def test_version_support_follows_pep_440() -> None:
    support = VersionSupport("vllm", ">=0.33,<0.34", label="vLLM")
    assert support.contains("0.33.0") and support.contains("0.33.2+cpu")
    assert support.contains("0.33.1rc1")  # pre-releases inside the range count
    assert not support.contains("0.34.0rc1") and not support.contains("0.33.0rc1")
    with pytest.raises(ValueError, match="not a PEP 440 version number: 'main'"):
        support.contains("main")
    assert not VersionSupport("no-such-engine-xyz", ">=1").is_supported()
    with pytest.raises(ValueError, match="not a PEP 440 specifier"):
        VersionSupport("x", "~~1").specifier_set()


def test_lazy_attribute_imports_at_first_use_and_caches() -> None:
    package = types.ModuleType("kitpkg")
    sys.modules["kitpkg"] = package
    sub = types.ModuleType("kitpkg._impl")
    sub.Thing = object()  # type: ignore[attr-defined]
    sys.modules["kitpkg._impl"] = sub
    exports = {"._impl": ("Thing",)}
    try:
        assert lazy_names(exports, "eager") == ["Thing", "eager"]
        assert lazy_attribute("kitpkg", exports, "Thing", distribution="kitpkg") is sub.Thing  # type: ignore[attr-defined]
        assert package.Thing is sub.Thing  # type: ignore[attr-defined]
        assert (
            lazy_attribute("kitpkg", exports, "__version__", distribution="x-none") == "0+unknown"
        )
        assert lazy_attribute("kitpkg", exports, "__version__", distribution="attrs") != "0+unknown"
        with pytest.raises(AttributeError, match="module 'kitpkg' has no attribute 'Other'"):
            lazy_attribute("kitpkg", exports, "Other", distribution="kitpkg")
    finally:
        del sys.modules["kitpkg"], sys.modules["kitpkg._impl"]


def test_seconds_arg() -> None:
    import argparse

    assert seconds_arg("2.5") == 2.5
    for bad in ("nan", "0", "-1", "x", "1e999"):
        with pytest.raises(argparse.ArgumentTypeError, match="not a positive, finite"):
            seconds_arg(bad)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.floats(0.0001, 10**6), min_size=1, max_size=6), min_size=1, max_size=4))
def test_exporter_adds_exactly_what_the_recorder_holds(batches: list[list[float]]) -> None:
    """However stays are batched between exports, the served histogram equals the
    watchdog's statistics at every ladder bound, and its sum is the stays' total."""
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    histogram = prometheus_client.Histogram(
        "kit_state_seconds",
        "t",
        labelnames=("lane", "state"),
        buckets=histogram_buckets(),
        registry=registry,
    )
    clock = FakeClock()
    spec = stallguard.Spec(name="kit", deadlines={"A": None}, terminal=["Done"])
    wd: stallguard.Watchdog[int] = stallguard.Watchdog(spec, clock=clock, statistics=True)
    exporter = StatisticsExporter(histogram, labels={"lane": "l0"})
    key = 0
    for batch in batches:
        for seconds in batch:
            key += 1
            wd.observe(key, "A")
            clock.advance(seconds)
            wd.observe(key, "Done")
        exporter.export(wd.statistics())
    dist = wd.statistics().states["A"].distribution
    get = registry.get_sample_value
    for bound in LADDER:
        served = get(
            "kit_state_seconds_bucket", {"lane": "l0", "state": "A", "le": str(float(bound))}
        )
        assert served == dist.count - dist.count_above(bound), bound
    assert get("kit_state_seconds_count", {"lane": "l0", "state": "A"}) == key
    assert math.isclose(
        get("kit_state_seconds_sum", {"lane": "l0", "state": "A"}), dist.total, rel_tol=1e-9
    )


def test_exporter_sets_deadlines_oldest_ages_and_completed_once_each() -> None:
    """The gauges and the counter the adapters serve beside the histogram: a state's
    deadline once (a state without one has no series at all, not 0), each state's oldest
    age from a snapshot (0 once it empties), and report mode's reported-then-completed
    requests added once however often the same statistics are exported."""
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    names = ("lane", "state")
    kw = {"labelnames": names, "registry": registry}
    histogram = prometheus_client.Histogram("k2_s", "t", buckets=histogram_buckets(), **kw)
    deadline = prometheus_client.Gauge("k2_deadline", "t", **kw)
    oldest = prometheus_client.Gauge("k2_oldest", "t", **kw)
    completed = prometheus_client.Counter("k2_completed", "t", **kw)
    clock = FakeClock()
    spec = stallguard.Spec(
        name="kit2", deadlines={"A": 2.5, "B": None}, terminal=["Done", "Failed"]
    )
    wd: stallguard.Watchdog[int] = stallguard.Watchdog(
        spec, clock=clock, statistics=True, mode="report"
    )
    exporter = StatisticsExporter(
        histogram, labels={"lane": "l1"}, deadline=deadline, completed=completed, oldest=oldest
    )
    wd.observe(1, "A")
    wd.observe(2, "B")
    clock.advance(1.25)
    wd.observe(3, "A")
    clock.advance(1.5)  # 1 is 2.75 s in A: past its 2.5 s deadline (reported)
    wd.check()
    wd.observe(2, "Done")  # B's first stay (2.75 s)
    exporter.export(wd.statistics(), wd.snapshot(requests=False))
    get = registry.get_sample_value
    assert get("k2_oldest", {"lane": "l1", "state": "A"}) == pytest.approx(2.75)
    assert get("k2_deadline", {"lane": "l1", "state": "B"}) is None  # no deadline: no series
    wd.observe(1, "Done")  # reported, then completed
    wd.observe(3, "Done")
    for _ in range(3):  # the same record exported again adds nothing
        exporter.export(wd.statistics(), wd.snapshot(requests=False))
    assert get("k2_deadline", {"lane": "l1", "state": "A"}) == 2.5
    assert get("k2_deadline", {"lane": "l1", "state": "B"}) is None
    assert get("k2_oldest", {"lane": "l1", "state": "A"}) == 0.0  # empty now
    assert get("k2_completed_total", {"lane": "l1", "state": "A"}) == 1
    assert get("k2_s_count", {"lane": "l1", "state": "A"}) == 2
    assert get("k2_s_sum", {"lane": "l1", "state": "A"}) == pytest.approx(2.75 + 1.5)


# ---------------------------------------------------------------- exposition readers


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=64))
def test_read_exposition_file_returns_the_text_or_names_the_file(tmp_path_factory, data):
    """Any bytes: the UTF-8 text, or one ValueError naming the option and the path (and,
    for bad UTF-8, the byte and its offset); never another exception."""
    from stallguard.adapters import read_exposition_file

    path = tmp_path_factory.mktemp("expo") / "metrics.txt"
    path.write_bytes(data)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        with pytest.raises(ValueError, match="--file '.*metrics.txt': not UTF-8 text") as info:
            read_exposition_file(str(path))
        assert f"offset {e.start}" in str(info.value)
        assert f"{data[e.start]:#04x}" in str(info.value)
    else:
        assert read_exposition_file(str(path)).replace("\r\n", "\n") == text.replace(
            "\r\n", "\n"
        ).replace("\r", "\n")


def test_read_exposition_file_missing_names_the_option_given(tmp_path):
    from stallguard.adapters import read_exposition_file

    with pytest.raises(ValueError, match=r"^--saved '.*nope': cannot read it: "):
        read_exposition_file(str(tmp_path / "nope"), what="--saved")
    with pytest.raises(ValueError, match="cannot read it"):
        read_exposition_file(str(tmp_path))  # a directory


def test_scrape_exposition_reads_a_metrics_page_and_names_the_url_when_it_cannot():
    import http.server
    import socket
    import threading

    from stallguard.adapters import scrape_exposition

    pages = {"/metrics": b"x_total 1\n", "/bad": b"x_total \xff\n"}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = pages.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write(body or b"no")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert scrape_exposition(base + "/metrics") == "x_total 1\n"
        with pytest.raises(ValueError, match=r"^--url '.*/bad': the response is not UTF-8"):
            scrape_exposition(base + "/bad")
        with pytest.raises(ValueError, match=r"^--url '.*/gone': cannot scrape it: .*404"):
            scrape_exposition(base + "/gone")
    finally:
        server.shutdown()
        server.server_close()
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    with pytest.raises(ValueError, match=r"^--scrape 'http://127.0.0.1:\d+/m': cannot scrape"):
        scrape_exposition(f"http://127.0.0.1:{closed}/m", what="--scrape", timeout=5)
    with pytest.raises(ValueError, match="cannot scrape it"):
        scrape_exposition("not a url")


def test_text_table_aligns_columns_under_a_rule() -> None:
    """The support and coverage tables' one layout: columns two spaces apart, as wide
    as their widest cell, trailing spaces trimmed, dashes under the header."""
    table = stallguard.adapters.text_table(
        [("phase", "mode", "stallguard"), ("Receiving", "pull", "10s"), ("Queued", "", "")]
    )
    assert table.splitlines() == [
        "phase      mode  stallguard",
        "---------  ----  ----------",
        "Receiving  pull  10s",
        "Queued",
    ]

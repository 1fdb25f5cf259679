"""Advice from a Prometheus server's HTTP API (stallguard._promapi), against adversarial
input: bad URLs, garbage and hostile responses, huge numbers, bad durations. Every
failure is a named error (PrometheusAPIError / ValueError naming the URL or the option
and the value), never a traceback; the advise commands exit 2 with one line.

The server here is a real HTTP server on loopback answering what each example asks
(tests/test_prometheus_rules.py runs the real Prometheus)."""

from __future__ import annotations

import itertools
import json
import math
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stallguard
from stallguard._promapi import (
    PrometheusAPIError,
    exposition_from_prometheus,
    growth,
    parse_window,
)

NAMES = ("sglang:stallguard_state_seconds", "sglang:stallguard_deadline_seconds")


class Server:
    def __init__(self) -> None:
        self.status = 200
        self.body = b""
        self.queries: list[str] = []

        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.queries.append(self.path)
                self.send_response(outer.status)
                self.send_header("Content-Length", str(len(outer.body)))
                self.end_headers()
                self.wfile.write(outer.body)

            def log_message(self, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server()
    yield s
    s.http.shutdown()


def _matrix(series: list[dict[str, Any]]) -> bytes:
    return json.dumps(
        {"status": "success", "data": {"resultType": "matrix", "result": series}}
    ).encode()


def _read(server: Server, **kw: Any) -> str:
    return exposition_from_prometheus(server.url, NAMES, window=600, end=1e9, step=15, **kw)


def test_growth_counts_resets_and_births(server: Server) -> None:
    """Two pods, both spellings, a restart: the exposition holds each series' growth."""
    t = 1e9 - 600
    server.status = 200
    server.body = _matrix(
        [
            {  # pod a, underscores (Prometheus 2.x), existed before the window, restarted
                "metric": {
                    "__name__": "sglang_stallguard_state_seconds_bucket",
                    "le": "+Inf",
                    "state": "A",
                    "pod": "a",
                },
                "values": [[t, "10"], [t + 15, "14"], [t + 30, "3"], [t + 45, "5"]],
            },
            {  # pod b, colons, born in the window
                "metric": {
                    "__name__": "sglang:stallguard_state_seconds_bucket",
                    "le": "+Inf",
                    "state": "A",
                    "pod": "b",
                },
                "values": [[t + 30, "7"], [t + 45, "8"]],
            },
            {  # a gauge: its last value
                "metric": {"__name__": "sglang_stallguard_deadline_seconds", "state": "A"},
                "values": [[t, "30"], [t + 45, "60"]],
            },
        ]
    )
    text = _read(server)
    stats = stallguard.statistics_from_prometheus(
        text,
        histogram="sglang:stallguard_state_seconds",
        deadline_gauge="sglang:stallguard_deadline_seconds",
    )
    # pod a: 14-10 + 3 (reset) + 5-3 = 9; pod b: 8 (born) -> 17
    assert stats.states["A"].count == 17
    assert stats.states["A"].deadline == 60.0
    assert "__name__%3D~" in server.queries[-1]  # one query_range for every name


@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=30), st.booleans())
def test_growth_is_the_sum_of_increases_and_resets(values: list[int], born: bool) -> None:
    points = [(float(i), float(v)) for i, v in enumerate(values)]
    expected = values[0] if born else 0
    for a, b in itertools.pairwise(values):
        expected += b - a if b >= a else b
    assert growth(points, born=born) == expected
    assert growth(points, born=born) >= 0


BAD_URLS = ["", "prometheus:9090", "ftp://x", "http://", "http://[::1", "http://127.0.0.1:1"]


@pytest.mark.parametrize("url", BAD_URLS)
def test_bad_urls_are_named(url: str) -> None:
    with pytest.raises(PrometheusAPIError, match="--prometheus"):
        exposition_from_prometheus(url, NAMES, window=60, end=1e9, timeout=2)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.one_of(
        st.binary(max_size=200),
        st.text(max_size=200).map(str.encode),
        st.recursive(
            st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=8),
            lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
            max_leaves=12,
        ).map(lambda v: json.dumps(v).encode()),
    ),
    st.sampled_from([200, 400, 404, 500, 503]),
)
def test_garbage_responses_are_named_errors(server: Server, body: bytes, status: int) -> None:
    server.status, server.body = status, body
    try:
        text = _read(server)
    except PrometheusAPIError as e:
        assert "--prometheus" in str(e) and server.url in str(e)
        return
    # a body that happens to be a valid empty/odd matrix: still an exposition
    assert isinstance(text, str)


@pytest.mark.parametrize(
    ("body", "said"),
    [
        (
            b'{"status": "error", "error": "parse error at char 3"}',
            "HTTP 400: parse error at char 3",
        ),
        (b"<html>bad request</html>", "HTTP 400"),
    ],
)
def test_http_errors_name_the_status_and_prometheus_error(
    server: Server, body: bytes, said: str
) -> None:
    """An HTTP error says its status, and the error of Prometheus's JSON body if any."""
    server.status, server.body = 400, body
    with pytest.raises(PrometheusAPIError) as raised:
        _read(server)
    assert str(raised.value) == f"--prometheus {server.url!r}: /api/v1/query_range answered {said}"


HUGE = st.one_of(
    st.sampled_from(["1e308", "1.7976931348623157e308", "+Inf", "-Inf", "NaN", "-1", "9" * 400]),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(HUGE, min_size=1, max_size=6))
def test_huge_numbers_never_escape_as_tracebacks(server: Server, values: list[str]) -> None:
    """Counts that overflow, NaN, infinite or negative: the reader names the series (a
    ValueError), or reads them; never another exception."""
    server.status = 200
    server.body = _matrix(
        [
            {
                "metric": {
                    "__name__": "sglang_stallguard_state_seconds_bucket",
                    "le": le,
                    "state": "A",
                },
                "values": [[1e9 - 600 + 15 * i, v] for i, v in enumerate(values)],
            }
            for le in ("1.0", "+Inf")
        ]
    )
    try:
        text = _read(server)
        stats = stallguard.statistics_from_prometheus(text, histogram=NAMES[0])
        stallguard.advise(stats)
    except ValueError as e:
        assert str(e)


@given(st.text(max_size=12))
def test_bad_windows_name_the_option(text: str) -> None:
    try:
        seconds = parse_window(text)
    except ValueError as e:
        assert "--window" in str(e) and repr(text) in str(e)
    else:
        assert math.isfinite(seconds) and seconds > 0


def test_windows() -> None:
    assert parse_window("7d") == 7 * 86400
    assert parse_window("90m") == 5400
    assert parse_window("2w") == 14 * 86400
    assert parse_window("30") == 30
    with pytest.raises(ValueError, match="more than 11000 points"):
        exposition_from_prometheus("http://x", NAMES, window=86400 * 7, end=1e9, step=1)


@pytest.mark.parametrize(
    "argv",
    [
        ["--prometheus", "http://127.0.0.1:1", "--window", "1h"],
        ["--prometheus", "not-a-url"],
        ["--prometheus", "http://127.0.0.1:1", "--window", "7x"],
        ["--prometheus", "http://127.0.0.1:1", "--step=-1s"],
    ],
)
def test_advise_commands_exit_2_with_one_line(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from stallguard_sglang._advise import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("stallguard-sglang advise: ")


def test_advise_garbage_server_exits_2(server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    from stallguard_sglang._advise import main

    server.status, server.body = 200, b"<html>not prometheus</html>"
    assert main(["--prometheus", server.url, "--window", "1h"]) == 2
    err = capsys.readouterr().err
    assert "did not answer JSON" in err and err.count("\n") == 1

"""Time-in-state history from a Prometheus server's HTTP API, for ``advise``.

:func:`exposition_from_prometheus` asks ``/api/v1/query_range`` for the raw series of
the named metrics over a window and turns them into one Prometheus text exposition in
which every counter (a histogram's ``_bucket`` and ``_sum``, a ``_total``) holds what
it **grew by in the window**, per series, and every gauge its last value: the input
:func:`stallguard.statistics_from_prometheus` reads. Growth is counted per series,
sample to sample, the way ``increase()`` counts it but without its extrapolation:

* a drop is a counter reset (a restarted pod): the value after it is all growth;
* a series that appears after the window's start (a pod started, or its first stay in a
  state) starts from 0: its first value is growth (``increase()`` would drop it);
* every pod is its own series (``instance``, ``pod`` labels), summed by the reader.

Resolution: the samples are read every *step* seconds (default: the window / 1,000, at
least 15 s). Growth between the last sample before a reset and the reset itself is
lost: at most one step of one pod's stays per restart. Use a step no longer than the
scrape interval to lose nothing.

Both metric spellings are read: ``sglang:stallguard_x`` and ``sglang_stallguard_x``
(what Prometheus 2.x stores when scraping prometheus_client 0.26's OpenMetrics output,
client_python #1177); the exposition uses the ``:`` one.
"""

from __future__ import annotations

import http.client
import json
import math
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ._adapters import describe_exception
from ._advice import exposed

__all__ = ["PrometheusAPIError", "exposition_from_prometheus", "parse_window"]

#: Points Prometheus returns per series at most (its query_range limit is 11,000).
MAX_POINTS = 11_000
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_WINDOW = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")


class PrometheusAPIError(ValueError):
    """The Prometheus HTTP API could not be read, or answered something unusable. The
    message names the URL and what went wrong."""


def parse_window(text: str, what: str = "--window") -> float:
    """``"7d"``, ``"12h"``, ``"90m"``, ``"30s"``, ``"2w"`` (or plain seconds) in seconds.

    Raises:
        ValueError: naming *what* and the value, for anything else (empty, negative,
            zero, not finite, an unknown unit).
    """
    m = _WINDOW.match(text) if isinstance(text, str) else None
    if m is not None:
        seconds = float(m.group(1)) * _UNITS[m.group(2)]
    else:
        try:
            seconds = float(text)
        except (TypeError, ValueError):
            raise ValueError(
                f"{what} {text!r}: not a duration; give a number and a unit s, m, h, d or w "
                "(e.g. 7d, 12h, 90m)"
            ) from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{what} {text!r}: must be a finite duration > 0")
    return seconds


def _spellings(name: str) -> str:
    """A ``__name__`` regex matching *name* (``prefix:rest``) under both spellings."""
    prefix, sep, rest = name.partition(":")
    if not sep:
        return re.escape(name)
    return f"{re.escape(prefix)}[:_]{re.escape(rest)}"


def _canonical(name: str, names: Sequence[str]) -> str:
    for wanted in names:
        prefix, sep, rest = wanted.partition(":")
        if sep and name.startswith(f"{prefix}_{rest}"):
            return f"{prefix}:{rest}{name[len(prefix) + 1 + len(rest) :]}"
    return name


def _get(base: str, path: str, params: Mapping[str, str], timeout: float) -> Any:
    url = f"{base.rstrip('/')}{path}?{urllib.parse.urlencode(params)}"
    shown = f"--prometheus {base!r}"
    body = _read(url, shown, path, timeout)
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise PrometheusAPIError(
            f"{shown}: {path} did not answer JSON (is this a Prometheus server's URL, "
            "without /api/v1?)"
        ) from None
    return _matrix(doc, shown, path)


def _read(url: str, shown: str, path: str, timeout: float) -> bytes:
    """The body of the answer to *url* (*shown* and *path* name it in messages)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            body: bytes = response.read()
    except urllib.error.HTTPError as e:
        detail = _error_detail(e)
        raise PrometheusAPIError(
            f"{shown}: {path} answered HTTP {e.code}{f': {detail}' if detail else ''}"
        ) from None
    except (OSError, ValueError, http.client.HTTPException) as e:
        raise PrometheusAPIError(f"{shown}: cannot query {path}: {e}") from None
    return body


def _error_detail(error: urllib.error.HTTPError) -> Any:
    """The ``error`` of Prometheus's JSON error body ("" if there is none)."""
    try:
        return json.loads(error.read()).get("error", "")
    except Exception:  # not Prometheus's JSON error body
        return ""


def _matrix(doc: Any, shown: str, path: str) -> list[Any]:
    """The result list of a successful ``query_range`` answer *doc*."""
    if not isinstance(doc, dict) or doc.get("status") != "success":
        error = doc.get("error") if isinstance(doc, dict) else None
        raise PrometheusAPIError(f"{shown}: {path} did not succeed: {error or _short(doc)}")
    data = doc.get("data")
    if not isinstance(data, dict) or data.get("resultType") != "matrix":
        raise PrometheusAPIError(f"{shown}: {path} answered no matrix: {_short(data)}")
    result = data.get("result")
    if not isinstance(result, list):
        raise PrometheusAPIError(f"{shown}: {path} answered no result list")
    return result


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else f"{text[:117]}..."


def _points(series: Any, base: str) -> tuple[dict[str, str], list[tuple[float, float]]]:
    """The labels and ``(time, value)`` points of one matrix entry, checked."""
    if not isinstance(series, dict):
        raise PrometheusAPIError(f"--prometheus {base!r}: a series is not an object")
    labels = series.get("metric")
    values = series.get("values")
    if not isinstance(labels, dict) or not isinstance(values, list):
        raise PrometheusAPIError(
            f"--prometheus {base!r}: a series without metric/values: {_short(series)}"
        )
    points = [_point(point, base) for point in values]
    return {str(k): str(v) for k, v in labels.items()}, points


def _point(point: Any, base: str) -> tuple[float, float]:
    """One ``[time, value]`` point of a matrix entry, as floats."""
    try:
        t, v = point
        return float(t), float(v)
    except (TypeError, ValueError):
        raise PrometheusAPIError(
            f"--prometheus {base!r}: a point is not [time, value]: {_short(point)}"
        ) from None


def growth(points: Sequence[tuple[float, float]], *, born: bool) -> float:
    """What a counter grew by over *points* (time order): resets count the value after
    them; *born* (the series appeared in the window) counts its first value too."""
    total = 0.0
    previous = 0.0 if born else None
    for _, value in points:
        if previous is not None:
            total += value - previous if value >= previous else value
        previous = value
    return total


def _is_counter(name: str) -> bool:
    return name.endswith(("_bucket", "_sum", "_count", "_total"))


def _label_text(labels: Mapping[str, str]) -> str:
    def esc(v: str) -> str:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return ",".join(f'{k}="{esc(v)}"' for k, v in sorted(labels.items()))


def exposition_from_prometheus(
    base: str,
    names: Iterable[str],
    *,
    window: float,
    end: float,
    step: float | None = None,
    timeout: float = 30.0,
) -> str:
    """A text exposition of *names* (metric family names, ``prefix:rest``; a
    histogram's name covers its ``_bucket``, ``_sum`` and ``_count``, a counter's its
    ``_total``) over ``[end - window, end]`` from the Prometheus server at *base*
    (``http://host:9090``): counters as their growth in the window, gauges as their
    last value (see the module docstring).

    Raises:
        PrometheusAPIError: the server cannot be reached or answers something else
            than a query_range matrix (the message names the URL).
        ValueError: a window, end or step that is not a finite positive number.
    """
    _check_positive(window=window, end=end, step=step)
    if not isinstance(base, str) or not base.startswith(("http://", "https://")):
        raise PrometheusAPIError(
            f"--prometheus {base!r}: give the server's http:// or https:// URL "
            "(e.g. http://prometheus:9090)"
        )
    names = list(names)
    start = end - window
    step = _step(window, step)
    pattern = "|".join(f"{_spellings(n)}(_bucket|_sum|_count|_total)?" for n in names)
    result = _get(
        base,
        "/api/v1/query_range",
        {
            "query": f'{{__name__=~"{pattern}"}}',
            "start": repr(start),
            "end": repr(end),
            "step": repr(step),
        },
        timeout,
    )
    lines = [_line(series, base, names, start + step / 2) for series in result]
    return "".join(f"{line}\n" for line in lines if line)


def _check_positive(**values: float | None) -> None:
    """Refuse a given value that is not a finite number > 0, naming it."""
    for what, value in values.items():
        if value is not None and (
            not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0
        ):
            raise ValueError(f"{what} {value!r}: must be a finite number > 0")


def _step(window: float, step: float | None) -> float:
    """The query's step: *step*, by default a thousandth of the window (at least 15 s),
    within Prometheus's limit of points per series."""
    if step is None:
        step = max(15.0, window / 1000)
    if window / step > MAX_POINTS:
        raise ValueError(
            f"step {step:g}s over a {window:g}s window asks for more than {MAX_POINTS} "
            "points per series (Prometheus's limit): give a longer step"
        )
    return step


def _line(series: Any, base: str, names: Sequence[str], born_after: float) -> str | None:
    """The exposition line of one matrix entry (None: no points, or no name): a counter's
    growth (counted from zero if its first point is after *born_after*), a gauge's last
    value."""
    labels, points = _points(series, base)
    if not points:
        return None
    name = _canonical(labels.pop("__name__", ""), names)
    if not name:
        return None
    value = points[-1][1]  # a gauge's last value
    if _is_counter(name):
        value = growth(points, born=points[0][0] > born_after)
    return f"{name}{{{_label_text(labels)}}} {exposed(value)}"


def scrape_exposition(url: str, *, what: str = "--url", timeout: float = 10.0) -> str:
    """The text exposition a ``/metrics`` *url* serves; a :class:`ValueError` naming
    *what* and the URL if it cannot be read or is not UTF-8."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return str(response.read().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {url!r}: the response is not UTF-8 text ({e})") from None
    except (OSError, ValueError, http.client.HTTPException) as e:
        raise ValueError(f"{what} {url!r}: cannot scrape it: {describe_exception(e)}") from None


def read_exposition_file(path: str, *, what: str = "--file") -> str:
    """A saved text exposition; a :class:`ValueError` naming *what* and the path if it
    cannot be read or is not UTF-8 (the byte and its offset named)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{what} {path!r}: not UTF-8 text: byte {e.object[e.start]:#04x} at offset "
            f"{e.start} cannot be decoded (a Prometheus exposition is UTF-8)"
        ) from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{what} {path!r}: cannot read it: {describe_exception(e)}") from None

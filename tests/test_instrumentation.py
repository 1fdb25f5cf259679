"""The instrumentation hook registry and the logging hook (stallguard.instrumentation).

OpenTelemetry spans: tests/test_otel_spans.py; metrics: tests/test_otel_metrics.py.
"""

from __future__ import annotations

import gc
import logging
import sys

import pytest

import stallguard as sg
from stallguard import instrumentation as si
from stallguard.testing import FakeClock, record_expiries

SPEC = sg.Spec(
    name="instr_kv",
    deadlines={"Bootstrapping": 300, "Transferring": sg.Deadline(120, stall=30)},
    terminal=["Success", "Failed"],
)


@pytest.fixture(autouse=True)
def _restore_hooks():
    yield
    si.set_on_expire_hooks(None)
    si.disable_metrics()


def expire_one(mode: str = "enforce", **watchdog_args) -> tuple[sg.Watchdog, sg.Expiry]:
    """A watchdog on a FakeClock with one request 1 s past its Bootstrapping deadline,
    checked once."""
    clock = FakeClock(1000.0)
    watchdog = sg.Watchdog(SPEC, clock=clock, mode=mode, **watchdog_args)
    watchdog.observe("req-1", "Bootstrapping")
    clock.advance(301)
    (expiry,) = watchdog.check()
    return watchdog, expiry


# ---------------------------------------------------------------------- defaults


def test_defaults_are_logging_then_opentelemetry():
    si.set_on_expire_hooks(None)
    hooks = si.get_on_expire_hooks()
    assert [hook.__qualname__ for hook in hooks] == [
        "_init_logging_hook.<locals>.log_expiry",
        "_init_otel_hook.<locals>.emit_span",
    ]


def test_defaults_without_opentelemetry_are_logging_only(monkeypatch, caplog):
    # A None entry in sys.modules makes `import opentelemetry.trace` raise ImportError,
    # as in an environment where the package is missing.
    monkeypatch.setitem(sys.modules, "opentelemetry.trace", None)
    si.set_on_expire_hooks(None)
    (hook,) = si.get_on_expire_hooks()
    _, expiry = expire_one()  # runs the defaults too: logging only, no error
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="stallguard"):
        hook(expiry)
    assert [r.stallguard_key for r in caplog.records] == ["'req-1'"]


def test_default_hooks_run_without_an_sdk(caplog):
    # The process has no global TracerProvider: the span hook talks to the API's no-op
    # tracer. Nothing may fail, and the logging hook still logs.
    si.set_on_expire_hooks(None)
    with caplog.at_level(logging.WARNING, logger="stallguard"):
        watchdog, _ = expire_one()
    assert watchdog.snapshot().hook_errors == 0
    assert len([r for r in caplog.records if r.msg.startswith("stallguard %s")]) == 1


# ---------------------------------------------------------------------- set / get


def test_set_replaces_empty_disables_none_restores():
    seen = []
    si.set_on_expire_hooks([seen.append])
    assert si.get_on_expire_hooks() == (seen.append,)
    _, expiry = expire_one()
    assert seen == [expiry]

    si.set_on_expire_hooks([])
    assert si.get_on_expire_hooks() == ()
    expire_one()
    assert seen == [expiry]  # nothing more

    si.set_on_expire_hooks(None)
    assert len(si.get_on_expire_hooks()) == 2


def test_hooks_run_in_order_after_on_expire_and_see_report_mode_too():
    calls = []
    si.set_on_expire_hooks(
        [lambda e: calls.append(("first", e.mode)), lambda e: calls.append(("second", e.mode))]
    )
    expire_one(on_expire=lambda e: calls.append(("enforce", e.mode)))
    assert calls == [("enforce", "enforce"), ("first", "enforce"), ("second", "enforce")]

    calls.clear()
    expire_one(mode="report", on_expire=lambda e: calls.append(("enforce", e.mode)))
    assert calls == [("first", "report"), ("second", "report")]


def test_factory_is_resolved_lazily_and_once():
    built = []
    seen = []

    def factory():
        built.append(True)
        return seen.append

    si.set_on_expire_hooks([si.ExpiryHookFactory(factory)])
    assert built == []
    clock = FakeClock()
    watchdog = sg.Watchdog(SPEC, clock=clock)
    watchdog.observe("a", "Bootstrapping")
    watchdog.observe("b", "Bootstrapping")
    assert watchdog.check() == []
    assert built == []  # no expiry yet: nothing imported, nothing built
    clock.advance(300)
    assert len(watchdog.check()) == 2
    assert built == [True]
    assert [e.key for e in seen] == ["a", "b"]
    expire_one()
    assert built == [True]


def test_failing_hook_is_logged_and_counted_and_others_still_run(caplog):
    seen = []

    def broken(expiry):
        raise RuntimeError("exporter down")

    si.set_on_expire_hooks([broken, seen.append])
    with caplog.at_level(logging.ERROR, logger="stallguard"):
        watchdog, expiry = expire_one()
    assert seen == [expiry]
    assert watchdog.snapshot().hook_errors == 1
    (record,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "exporter down" in record.exc_text


def test_failing_factory_never_reaches_check(caplog):
    seen = []

    def factory():
        raise ImportError("no module named statsd")

    si.set_on_expire_hooks([si.ExpiryHookFactory(factory), seen.append])
    with caplog.at_level(logging.ERROR, logger="stallguard"):
        watchdog, expiry = expire_one()
    assert seen == [expiry]  # the other hook still ran
    assert watchdog.snapshot().hook_errors == 1  # the expiry the broken hook missed
    assert any("hook factory" in r.getMessage() for r in caplog.records)
    # The public getter does not hide the failure.
    with pytest.raises(ImportError, match="statsd"):
        si.get_on_expire_hooks()


def test_get_raises_a_factory_error_before_any_expiry():
    def factory():
        raise ValueError("bad config")

    si.set_on_expire_hooks([si.ExpiryHookFactory(factory)])
    with pytest.raises(ValueError, match="bad config"):
        si.get_on_expire_hooks()


@pytest.mark.parametrize(
    ("hooks", "message"),
    [
        (print, r"wrap a single hook in a list.*<built-in function print>"),
        ("hook", r"iterable of hooks or None.*'hook'"),
        (42, r"iterable of hooks or None.*42"),
        ([print, 42], r"callables or ExpiryHookFactory instances, got 42"),
    ],
)
def test_set_rejects_bad_hooks(hooks, message):
    with pytest.raises(sg.ConfigError, match=message):
        si.set_on_expire_hooks(hooks)


def test_factory_rejects_a_non_callable():
    with pytest.raises(sg.ConfigError, match=r"hook_factory=.*got 'logging'"):
        si.ExpiryHookFactory("logging")


def test_record_expiries_keeps_working_with_the_registry():
    outer = []
    si.set_on_expire_hooks([outer.append])
    with record_expiries() as seen:
        _, expiry = expire_one()
    assert seen == [expiry]
    assert outer == []  # replaced inside the block
    _, after = expire_one()
    assert outer == [after]  # and restored after it


# ---------------------------------------------------------------------- logging hook


def test_logging_hook_writes_one_structured_warning(caplog):
    si.set_on_expire_hooks([si.LoggingOnExpireHook])
    clock = FakeClock(50.0)
    watchdog = sg.Watchdog(SPEC, clock=clock)
    watchdog.observe(7, "Transferring")
    watchdog.annotate(7, attributes={"sglang.room": 7, "engine": "nixl"})
    clock.advance(31.5)  # the 30 s progress window fires before the 120 s deadline
    with caplog.at_level(logging.WARNING, logger="stallguard"):
        (expiry,) = watchdog.check()
    (record,) = caplog.records
    assert record.name == "stallguard"
    assert record.levelno == logging.WARNING
    assert record.getMessage() == (
        "stallguard forced failure: spec=instr_kv key=7 state=Transferring reason=stall "
        "elapsed_s=31.500 deadline_s=30"
    )
    assert record.stallguard_spec == "instr_kv"
    assert record.stallguard_key == "7"
    assert record.stallguard_state == "Transferring"
    assert record.stallguard_reason == "stall"
    assert record.stallguard_elapsed_s == 31.5
    assert record.stallguard_deadline_s == 30
    assert record.stallguard_mode == "enforce"
    assert record.stallguard_attr_engine == "nixl"
    assert getattr(record, "stallguard_attr_sglang.room") == 7
    assert expiry.elapsed == 31.5


def test_logging_hook_report_mode_wording(caplog):
    si.set_on_expire_hooks([si.LoggingOnExpireHook])
    with caplog.at_level(logging.WARNING, logger="stallguard"):
        expire_one(mode="report")
    (record,) = caplog.records
    assert record.getMessage().startswith("stallguard stall reported (report mode): ")
    assert record.stallguard_mode == "report"


def test_logging_hook_respects_the_logger_level(caplog):
    si.set_on_expire_hooks([si.LoggingOnExpireHook])
    with caplog.at_level(logging.ERROR, logger="stallguard"):
        watchdog, _ = expire_one()
    assert caplog.records == []
    assert watchdog.snapshot().hook_errors == 0


# ---------------------------------------------------------------------- live watchdogs


def test_live_watchdogs_holds_watchdogs_weakly():
    spec = sg.Spec(name="instr_weak", deadlines={"Queued": 5}, terminal=["Done"])

    def mine():
        return [w for w in si.live_watchdogs() if w.spec is spec]

    watchdog = sg.Watchdog(spec, clock=FakeClock())
    assert mine() == [watchdog]
    del watchdog
    gc.collect()
    assert mine() == []

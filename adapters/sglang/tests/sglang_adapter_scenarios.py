"""Scenarios that must run in a process of their own (SGLang's `load_plugins()` patches
classes for the life of the process; the .pth fallback acts at interpreter start-up;
gloo ranks are processes), as module-level functions for `sglang_support.run_in_python`
and `run_ranks`. They return plain data for the tests to assert on.

Real: SGLang's plugin loader and HookRegistry, the prefill queue code, NIXL / Mooncake
senders over managers without transfer engines (sglang_support), prometheus_client's
multiprocess collector, the OpenTelemetry SDK.
"""

from __future__ import annotations

import io
import logging
import os
import sys
from typing import Any

T0 = 1000.0
WFI, TRANSFERRING, SUCCESS = 2, 3, 4


def _capture_logs() -> io.StringIO:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    for name in ("stallguard", "sglang.srt.plugins", "sglang.srt.disaggregation.prefill"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        logger.addHandler(handler)
    return stream


def _targets() -> dict[str, Any]:
    from sglang.srt.disaggregation.common.conn import CommonKVManager
    from sglang.srt.disaggregation.fake.conn import FakeKVSender
    from sglang.srt.disaggregation.prefill import (
        PrefillBootstrapQueue,
        SchedulerDisaggregationPrefillMixin,
    )

    return {
        "inflight": SchedulerDisaggregationPrefillMixin.process_disagg_prefill_inflight_queue,
        "bootstrap": PrefillBootstrapQueue.pop_bootstrapped,
        "update_status": CommonKVManager.update_status,
        "fake_send": FakeKVSender.send,
        "fake_abort": FakeKVSender.abort,
    }


_ORIGINALS: dict[str, Any] = {}


def _wrapped() -> dict[str, bool]:
    """Which targets are now a wrapper around the function first seen (a hook applied).
    (SGLang's own decorators already give some of them a ``__wrapped__``.)"""
    now = _targets()
    for name, fn in now.items():
        _ORIGINALS.setdefault(name, fn)
    return {
        name: fn is not _ORIGINALS[name] and getattr(fn, "__wrapped__", None) is _ORIGINALS[name]
        for name, fn in now.items()
    }


def _stuck(sgs: Any, sched: Any, backend: str, rid: str, state: int, mgr: Any = None) -> Any:
    mgr = mgr or sgs.make_manager(backend)
    sender = sgs.make_sender(mgr, sgs.next_room())
    for status in (WFI, TRANSFERRING):
        if status <= state:
            sgs.set_status(sender, status)
    return sgs.make_request(rid, sender, prefilled=False)


def _conclusions(sched: Any) -> dict[str, tuple[int, str, str | None]]:
    return {rid: (c.iteration, c.outcome, c.message) for rid, c in sched.conclusions.items()}


# --------------------------------------------------------------------------- plugin


def active_line(config_path: str, configure_first: str) -> dict[str, Any]:
    """The "stallguard-sglang active" line of a process whose logging SGLang configures
    *after* ``load_plugins()`` (``configure_first="no"``, what ``launch_server`` does in
    the launcher and each scheduler process) or before it (``"yes"``): SGLang's own
    ``load_plugins()`` with the installed entry point, then SGLang's ``configure_logger``
    (root handler at INFO, ``force=True``), then three inflight queue calls of a stuck
    NIXL sender through the hooks. Returns the log text at each point."""
    import sglang.srt.plugins as plugins
    import sglang_support as sgs
    from sglang.srt.utils.common import configure_logger

    class Args:  # the one field configure_logger reads
        log_level = "info"

    stream = io.StringIO()

    def configure() -> None:
        configure_logger(Args())
        root = logging.getLogger()
        # configure_logger's handler writes to stderr: capture it instead, same level
        for handler in root.handlers:
            if isinstance(handler, logging.StreamHandler):
                handler.setStream(stream)  # type: ignore[type-var]

    os.environ["STALLGUARD_SGLANG_CONFIG"] = config_path
    if configure_first == "yes":
        configure()
    plugins.load_plugins()
    after_plugins = stream.getvalue()
    if configure_first != "yes":
        configure()
    after_configure = stream.getvalue()
    sgs.setup_context(0, 1)
    sched = sgs.FakeScheduler()
    sched.prefill(_stuck(sgs, sched, "nixl", "nixl-stuck", TRANSFERRING))
    for _ in range(3):
        sched.step()
    return {
        "after_plugins": after_plugins,
        "after_configure": after_configure,
        "after_queue": stream.getvalue(),
    }


def plugin_roundtrip(config_path: str) -> dict[str, Any]:
    """SGLang's own `load_plugins()` with the installed entry point: first without
    STALLGUARD_SGLANG_CONFIG (nothing happens), then with it (the hooks apply and a stuck
    NIXL and a stuck Mooncake sender are failed, with span and Prometheus count).

    Expects PROMETHEUS_MULTIPROC_DIR in the environment, as an SGLang scheduler process
    has it when the server runs with metrics enabled."""
    logs = _capture_logs()
    import sglang.srt.plugins as plugins
    import sglang_support as sgs
    import stallguard_sglang
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from sglang.srt.plugins.hook_registry import HookRegistry
    from stallguard_sglang._runtime import runtime

    from stallguard.testing import FakeClock

    out: dict[str, Any] = {"eps": [], "before": {}, "after": {}}
    from importlib.metadata import entry_points

    out["eps"] = [(ep.name, ep.value) for ep in entry_points(group="sglang.srt.plugins")]

    # ---- without the environment variable: register() does nothing
    os.environ.pop("STALLGUARD_SGLANG_CONFIG", None)
    os.environ.pop("STALLGUARD_SGLANG", None)
    plugins.load_plugins()
    out["before"] = {
        "wrapped": _wrapped(),
        "runtime": runtime() is not None,
        "registered": sorted(t for t in HookRegistry._hooks if "disaggregation" in t),
    }

    # ---- with it, as a fresh server process would see it
    os.environ["STALLGUARD_SGLANG_CONFIG"] = config_path
    plugins._plugins_loaded = False  # load_plugins() is once per process; start over
    plugins.load_plugins()
    rt = runtime()
    out["after"] = {
        "wrapped": _wrapped(),
        "runtime": rt is not None,
        "source": rt.config.source if rt else None,
        "registered": sorted(t for t in HookRegistry._hooks if "disaggregation" in t),
    }

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    parent = provider.get_tracer("sglang-test").start_span("sglang request")
    clock = FakeClock(T0)
    stallguard_sglang.set_clock(clock)

    sgs.setup_context(0, 1)
    sched = sgs.FakeScheduler()
    # SGLang's own scheduler metrics, as run_scheduler_process creates them with metrics
    # on (SchedulerMetricsCollector.init_new builds these labels from the runtime context)
    from sglang.srt.observability.metrics_collector import SchedulerMetricsCollector

    sglang_labels = {
        "model_name": "test-model",
        "engine_type": "prefill",
        "tp_rank": 0,
        "pp_rank": 0,
        "moe_ep_rank": 0,
    }
    sched.metrics_collector = SchedulerMetricsCollector(labels=sglang_labels, server_args=None)
    sched.metrics_collector.num_running_reqs.labels(**sglang_labels).set(2)
    nixl = _stuck(sgs, sched, "nixl", "nixl-stuck", TRANSFERRING)
    # SGLang's per-request trace context, as TraceReqContext holds it when tracing is on
    nixl.time_stats.trace_ctx.tracing_enable = True
    nixl.time_stats.trace_ctx.root_span_context = trace.set_span_in_context(parent)
    mooncake = _stuck(sgs, sched, "mooncake", "mooncake-stuck", WFI)
    sched.prefill(nixl, mooncake)
    sched.step()
    steps = []
    for _ in range(8):
        clock.advance(5)
        sched.step()
        steps.append((clock() - T0, sched.inflight_rids()))
    parent.end()

    from prometheus_client import CollectorRegistry, generate_latest, multiprocess, values

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    metrics = [
        line
        for line in generate_latest(registry).decode().splitlines()
        if ("stallguard" in line or line.startswith("sglang:num_running_reqs{"))
        and not line.startswith("#")
    ]
    spans = [
        {
            "name": s.name,
            "attributes": dict(s.attributes),
            "parent": s.parent.span_id if s.parent else None,
            "trace_id": s.context.trace_id,
            "status": s.status.status_code.name,
            "description": s.status.description,
        }
        for s in exporter.get_finished_spans()
        if s.name.startswith("stallguard.")
    ]
    out.update(
        steps=steps,
        conclusions=_conclusions(sched),
        metrics=metrics,
        multiprocess_value=values.ValueClass.__name__,
        spans=spans,
        parent_span_id=parent.get_span_context().span_id,
        parent_trace_id=parent.get_span_context().trace_id,
        logs=logs.getvalue(),
    )
    return out


def pth_fallback() -> dict[str, Any]:
    """Run with STALLGUARD_SGLANG_ACTIVATION=pth and STALLGUARD_SGLANG_CONFIG set: the
    .pth installed in site-packages must have armed the import hook at interpreter
    start-up, and importing SGLang's prefill module must apply the hooks."""
    armed = [type(f).__name__ for f in sys.meta_path if type(f).__module__.startswith("stallguard")]
    before_import = "sglang.srt.disaggregation.prefill" in sys.modules
    import sglang.srt.plugins as plugins
    import sglang_support as sgs
    import stallguard_sglang

    from stallguard.testing import FakeClock

    patched = _targets()
    hooks = {
        name: getattr(fn, "_stallguard_hook", None) is not None for name, fn in patched.items()
    }
    plugins.load_plugins()  # the entry point must not install a second set of hooks
    hooks_after_plugins = {name: fn is patched[name] for name, fn in _targets().items()}
    clock = FakeClock(T0)
    stallguard_sglang.set_clock(clock)
    sgs.setup_context(0, 1)
    sched = sgs.FakeScheduler()
    sched.prefill(_stuck(sgs, sched, "nixl", "stuck", TRANSFERRING))
    sched.step()
    clock.advance(21)
    sched.step()
    return {
        "armed": armed,
        "prefill_imported_before": before_import,
        "hooks": hooks,
        "hooks_after_plugins": hooks_after_plugins,
        "conclusions": _conclusions(sched),
    }


# --------------------------------------------------------------------------- ranks


def ranks_clock_skew(info: Any, config_path: str) -> dict[str, Any]:
    """One rank of a real gloo group. Both ranks hold the same inflight requests; rank 0's
    clock runs 1 s per iteration, rank 1's 0.6 s (their clocks disagree), so rank 0's
    watchdog reaches the 10 s WaitingForInput deadline first."""
    import sglang_support as sgs
    import stallguard_sglang
    from sglang.srt.plugins import load_plugins

    from stallguard.testing import FakeClock, record_expiries

    os.environ["STALLGUARD_SGLANG_CONFIG"] = config_path
    load_plugins()  # what run_scheduler_process does first
    clock = FakeClock(T0 + 1000 * info.rank)
    stallguard_sglang.set_clock(clock)
    tick = 1.0 if info.rank == 0 else 0.6
    sched = sgs.FakeScheduler(info.group)
    mgr = sgs.make_manager("nixl")
    stuck = _stuck(sgs, sched, "nixl", "stuck", WFI, mgr)
    healthy = _stuck(sgs, sched, "nixl", "healthy", WFI, mgr)
    sched.prefill(stuck, healthy)
    with record_expiries() as expiries:
        for i in range(1, 26):
            clock.advance(tick)
            if i == 8:
                sgs.set_status(healthy.disagg_kv_sender, TRANSFERRING)
            if i == 20:
                sgs.set_status(healthy.disagg_kv_sender, SUCCESS)
            sched.step()
    return {
        "rank": info.rank,
        "conclusions": _conclusions(sched),
        "expiries": [(str(e.key), e.state_label, round(e.elapsed, 3)) for e in expiries],
        "inflight": sched.inflight_rids(),
        "iterations": sched.iteration,
    }


# --------------------------------------------------------------------------- 0.5.17


def legacy_bootstrap_wedge(config_path: str, iterations: int = 30) -> dict[str, Any]:
    """Under SGLang 0.5.17: a NIXL request whose decode never bootstraps, in the bootstrap
    queue (default config) and in the inflight queue (optimistic prefill), first without
    the adapter, then with it (loaded by SGLang's `load_plugins()`)."""
    logs = _capture_logs()
    import sglang
    import sglang_support as sgs
    import stallguard_sglang
    from sglang.srt.plugins import load_plugins

    from stallguard.testing import FakeClock

    sgs.setup_context(0, 1)
    out: dict[str, Any] = {"version": sglang.__version__}

    def new_request(rid: str, backend: str) -> Any:
        sender = sgs.make_sender(sgs.make_manager(backend), sgs.next_room())
        return sgs.make_request(rid, sender, prefilled=False)

    def scenario(clock: Any = None, deadline: float = 0.0) -> dict[str, Any]:
        # bootstrap queue, optimistic prefill off (SGLang's default)
        boot = sgs.FakeScheduler(optimistic_prefill_attempts=0)
        nixl = sgs.make_request(
            "nixl-boot", sgs.make_sender(sgs.make_manager("nixl"), sgs.next_room()), prefilled=False
        )
        moon = sgs.make_request(
            "mooncake-boot",
            sgs.make_sender(sgs.make_manager("mooncake"), sgs.next_room()),
            prefilled=False,
        )
        boot.admit(nixl, moon)
        # inflight queue, optimistic prefill on: parked with pending_bootstrap
        opt = sgs.FakeScheduler(optimistic_prefill_attempts=1)
        parked = sgs.make_request(
            "nixl-parked",
            sgs.make_sender(sgs.make_manager("nixl"), sgs.next_room()),
            prefilled=False,
        )
        opt.admit(parked)
        popped = opt.pop_bootstrapped()
        opt.prefill(*popped)
        # and a NIXL transfer that hangs (past bootstrap), in the same inflight queue
        hang_sender = sgs.make_sender(sgs.make_manager("nixl"), sgs.next_room())
        sgs.set_status(hang_sender, WFI)
        sgs.set_status(hang_sender, TRANSFERRING)
        opt.prefill(sgs.make_request("nixl-hang", hang_sender, prefilled=False))
        # and one that moves on to Transferring 5 s after it was queued: 0.5.17's
        # NixlKVManager overrides update_status (and calls the hooked base method)
        moving_sender = sgs.make_sender(sgs.make_manager("nixl"), sgs.next_room())
        sgs.set_status(moving_sender, WFI)
        opt.prefill(sgs.make_request("nixl-moving", moving_sender, prefilled=False))
        trace = []
        for i in range(iterations):
            if clock is not None:
                clock.advance(deadline / 10)
            if i == 5:
                sgs.set_status(moving_sender, TRANSFERRING)
            boot.pop_bootstrapped()
            opt.step()
            trace.append(
                (
                    round(clock() - T0, 3) if clock is not None else i,
                    [r.rid for r in boot.disagg_prefill_bootstrap_queue.queue],
                    opt.inflight_rids(),
                )
            )
        return {
            "popped": [r.rid for r in popped],
            "parked_pending": parked.pending_bootstrap if parked in popped else None,
            "nixl_init_time": nixl.disagg_kv_sender.init_time,
            "nixl_local_poll": int(nixl.disagg_kv_sender.poll()),
            "trace": trace,
            "boot_conclusions": _conclusions(boot),
            "opt_conclusions": _conclusions(opt),
            "boot_iteration": boot.iteration,
            "opt_iteration": opt.iteration,
        }

    out["without"] = scenario()
    out["wrapped_before"] = _wrapped()  # also records the originals
    os.environ["STALLGUARD_SGLANG_CONFIG"] = config_path
    load_plugins()
    out["wrapped"] = _wrapped()
    clock = FakeClock(T0)
    stallguard_sglang.set_clock(clock)
    out["with"] = scenario(clock, deadline=10.0)
    out["logs"] = logs.getvalue()
    return out

"""Backend profiles: which ``KVPoll`` states each transfer backend reports, what SGLang
bounds on its own (per release), and the deadlines stallguard enforces.

Sources: shared notes on SGLang 0.5.23 and 0.5.17 (sections on timeouts and backends);
every claim about SGLang below is about its code, cited in docs/sglang.md.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from stallguard import Deadline
from stallguard.adapters import text_table

from ._config import BACKENDS, DECODE_PHASES, LIVE_STATES, Config, DecodeConfig, PrefillConfig
from .package import nixl_has_bootstrap_timeout, parse_version, sglang_version

__all__ = [
    "PROFILES",
    "BackendProfile",
    "SupportRow",
    "bootstrap_queue_deadline",
    "bootstrap_queue_guarded",
    "decode_deadlines",
    "decode_support_table",
    "effective_deadlines",
    "format_support_table",
    "sglang_settings",
    "support_table",
]


@dataclass(frozen=True)
class BackendProfile:
    """What one transfer backend's KV sender looks like from the prefill inflight queue.

    Attributes:
        name: the backend (``--disaggregation-transfer-backend``), or ``"fake"`` for the
            ``FakeKVSender`` that warmup and health-check requests use on every backend.
        reports: the non-terminal states its sender can report in the inflight queue.
        merges_transfer: True if the backend never reports ``Transferring``, so that its
            ``WaitingForInput`` stands for "transfer pending" (queueing *and* transfer):
            by default its ``WaitingForInput`` deadline is the sum of the
            ``WaitingForInput`` and ``Transferring`` deadlines.
        common: True for ``CommonKVSender`` backends (state lives in the manager's
            ``request_status``; every change goes through ``update_status``).
    """

    name: str
    reports: tuple[str, ...]
    merges_transfer: bool
    common: bool


#: The profile of every backend stallguard-sglang knows.
PROFILES: Mapping[str, BackendProfile] = {
    "nixl": BackendProfile("nixl", LIVE_STATES, merges_transfer=False, common=True),
    "mooncake": BackendProfile(
        "mooncake", ("Bootstrapping", "WaitingForInput"), merges_transfer=True, common=True
    ),
    "ascend": BackendProfile(
        "ascend", ("Bootstrapping", "WaitingForInput"), merges_transfer=True, common=True
    ),
    "mori": BackendProfile("mori", LIVE_STATES, merges_transfer=False, common=True),
    "fake": BackendProfile("fake", ("WaitingForInput",), merges_transfer=False, common=False),
}
assert tuple(PROFILES) == BACKENDS


def _number(environ: Mapping[str, str], name: str, default: float) -> float:
    raw = environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return float(raw)
    except ValueError:
        return default  # SGLang itself would refuse to start; not ours to report


def sglang_settings(environ: Mapping[str, str] | None = None) -> dict[str, float]:
    """The SGLang (and Mooncake) settings the default deadlines derive from, read from
    the environment with SGLang's defaults:

    * ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` (300 s): SGLang's own bootstrap deadline;
    * ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` (300 s): how long decode waits for the KV
      before it gives up on the request (and the ``FakeKVSender`` deadline);
    * ``SGLANG_MORI_TRANSFER_TIMEOUT_MS`` (0 = off): Mori's per-transfer bound;
    * ``MC_TRANSFER_TIMEOUT`` (30 s, Mooncake's default): Mooncake's per-batch bound.
    """
    env = os.environ if environ is None else environ
    return {
        "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": _number(
            env, "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300.0
        ),
        "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": _number(
            env, "SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300.0
        ),
        "SGLANG_MORI_TRANSFER_TIMEOUT_MS": _number(env, "SGLANG_MORI_TRANSFER_TIMEOUT_MS", 0.0),
        "MC_TRANSFER_TIMEOUT": _number(env, "MC_TRANSFER_TIMEOUT", 30.0),
    }


def _positive(seconds: float) -> Deadline:
    """SGLang's setting as a default deadline: none for 0 (off), and for a value beyond
    a float (a 400-digit integer SGLang reads as "never"), which ``Deadline`` refuses."""
    return Deadline(seconds=seconds) if 0 < seconds < math.inf else Deadline()


def _add(a: Deadline, b: Deadline) -> Deadline:
    seconds = None if a.seconds is None or b.seconds is None else a.seconds + b.seconds
    if seconds is not None and not math.isfinite(seconds):  # two settings near 1e308
        seconds = None
    return Deadline(seconds=seconds, stall=a.stall)


def effective_deadlines(
    prefill: PrefillConfig | Config,
    backend: str,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Deadline]:
    """The deadline of each non-terminal state for requests of *backend* in the prefill
    inflight queue, counted from when the request entered the queue.

    Precedence: ``[prefill.backends.<backend>.deadlines]``, then ``[prefill.deadlines]``,
    then defaults derived from SGLang's settings (:func:`sglang_settings`):
    ``Bootstrapping`` = ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``; ``WaitingForInput``
    and ``Transferring`` = ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` (decode gives up on
    the request after that long anyway). For mooncake and ascend, which never report
    ``Transferring``, ``WaitingForInput`` defaults to the sum of the two (unless the
    backend's own table sets it).
    """
    if isinstance(prefill, Config):
        prefill = prefill.prefill
    if backend not in PROFILES:
        raise ValueError(f"unknown backend {backend!r}; known: {', '.join(PROFILES)}")
    settings = sglang_settings(environ)
    waiting = _positive(settings["SGLANG_DISAGGREGATION_WAITING_TIMEOUT"])
    out: dict[str, Deadline] = {
        "Bootstrapping": _positive(settings["SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"]),
        "WaitingForInput": waiting,
        "Transferring": waiting,
    }
    out.update(prefill.deadlines)
    override = prefill.backends.get(backend, {})
    if PROFILES[backend].merges_transfer and "WaitingForInput" not in override:
        out["WaitingForInput"] = _add(out["WaitingForInput"], out["Transferring"])
    out.update(override)
    return out


def bootstrap_queue_guarded(config: Config, backend: str, version: str | None = None) -> bool:
    """True if stallguard guards *backend*'s requests in SGLang's bootstrap queue:
    ``mode="auto"`` only where SGLang has no bootstrap deadline of its own (NIXL before
    0.5.18); ``"enforce"``/``"report"`` for every backend that bootstraps (not fake)."""
    mode = config.bootstrap_queue.mode
    if mode == "off" or backend == "fake":
        return False
    if mode == "auto":
        return backend == "nixl" and not nixl_has_bootstrap_timeout(version)
    return True


def bootstrap_queue_deadline(config: Config, environ: Mapping[str, str] | None = None) -> float:
    """The bootstrap-queue ``Bootstrapping`` deadline in seconds: the file's, else
    ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` (what SGLang applies on other backends)."""
    if config.bootstrap_queue.deadline is not None:
        return config.bootstrap_queue.deadline
    return sglang_settings(environ)["SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"] or 300.0


def _fake_has_waiting_timeout(version: str | None) -> bool | None:
    import sys

    module = sys.modules.get("sglang.srt.disaggregation.fake.conn")
    if module is not None and (version is None or version == sglang_version()):
        return hasattr(module.FakeKVSender, "_check_waiting_timeout")
    return None if version is None else _fake_release_has_waiting_timeout(version)


def _fake_release_has_waiting_timeout(version: str) -> bool | None:
    """Whether SGLang *version*'s fake backend has its waiting timeout, as far as the
    release number tells (None: a release between, where it cannot)."""
    release = parse_version(version)
    if release >= (0, 5, 23):
        return True
    if release <= (0, 5, 17):
        return False
    return None  # upstream PR #28652 landed in between; unknown without importing SGLang


def _native(backend: str, state: str, version: str | None, settings: dict[str, float]) -> str:
    """What SGLang itself does about a request stuck in *state* in the inflight queue."""
    if state not in PROFILES[backend].reports:
        return "never reported"
    if state == "Bootstrapping":
        return _native_bootstrapping(backend, version, settings)
    if backend == "fake":
        return _native_fake(version, settings)
    return _native_transfer(backend, state, settings)


def _native_transfer(backend: str, state: str, settings: dict[str, float]) -> str:
    """What SGLang does about a request of a transferring backend (not fake) stuck in
    *state* after ``Bootstrapping``."""
    if backend in ("mooncake", "ascend"):
        return (
            f"partly: MC_TRANSFER_TIMEOUT={settings['MC_TRANSFER_TIMEOUT']:g}s per write "
            "batch; queueing unbounded"
        )
    ms = settings["SGLANG_MORI_TRANSFER_TIMEOUT_MS"]
    if backend == "mori" and state == "Transferring" and ms > 0:
        return f"yes: SGLANG_MORI_TRANSFER_TIMEOUT_MS={ms:g} per transfer"
    return "no: only a transport error or a decode ABORT ends it"


def _native_bootstrapping(backend: str, version: str | None, settings: dict[str, float]) -> str:
    """What SGLang does about a request stuck in ``Bootstrapping`` on *backend*."""
    if backend == "nixl" and not nixl_has_bootstrap_timeout(version):
        return "no: waits forever"
    boot = f"{settings['SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT']:g}s"
    return f"yes: SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT={boot} since sender creation"


def _native_fake(version: str | None, settings: dict[str, float]) -> str:
    """What SGLang does about a request of the fake backend stuck after
    ``Bootstrapping``."""
    has = _fake_has_waiting_timeout(version)
    if has is None:
        return "unknown for this release"
    if has:
        waiting = f"{settings['SGLANG_DISAGGREGATION_WAITING_TIMEOUT']:g}s"
        return f"yes: SGLANG_DISAGGREGATION_WAITING_TIMEOUT={waiting} after first poll"
    return "no: waits forever"


def _render(deadline: Deadline | None) -> str:
    if deadline is None:
        return "not guarded"
    parts = [
        f"{label}{seconds:g}s"
        for label, seconds in (("", deadline.seconds), ("stall ", deadline.stall))
        if seconds is not None
    ]
    return ", ".join(parts) or "none (explicitly)"


@dataclass(frozen=True)
class SupportRow:
    """One line of the support table logged at startup.

    Attributes:
        queue: ``"inflight"`` (``disagg_prefill_inflight_queue``) or ``"bootstrap"``
            (``PrefillBootstrapQueue``).
        backend: the backend profile.
        state: the ``KVPoll`` state.
        sglang: whether and how SGLang bounds the state on its own on this release.
        stallguard: the deadline stallguard enforces (or reports), or why none.
    """

    queue: str
    backend: str
    state: str
    sglang: str
    stallguard: str


def support_table(
    config: Config,
    backends: tuple[str, ...] | list[str] = BACKENDS,
    *,
    version: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> list[SupportRow]:
    """Per backend and state: what SGLang *version* (default: the installed one) bounds
    on its own, and the deadline stallguard enforces with *config*."""
    version = version if version is not None else sglang_version()
    settings = sglang_settings(environ)
    rows: list[SupportRow] = []
    for backend in backends:
        deadlines = effective_deadlines(config, backend, environ)
        if backend != "fake":
            rows.append(_bootstrap_row(config, backend, version, settings, environ))
        for state in LIVE_STATES:
            native = _native(backend, state, version, settings)
            ours = _inflight_ours(config, PROFILES[backend], state, deadlines)
            rows.append(SupportRow("inflight", backend, state, native, ours))
    return rows


def _bootstrap_row(
    config: Config,
    backend: str,
    version: str | None,
    settings: dict[str, float],
    environ: Mapping[str, str] | None,
) -> SupportRow:
    """The bootstrap queue's ``Bootstrapping`` row of *backend*."""
    native = _native(backend, "Bootstrapping", version, settings)
    mode = config.bootstrap_queue.mode
    if not bootstrap_queue_guarded(config, backend, version):
        ours = f"not guarded (bootstrap_queue.mode={mode})"
    else:
        ours = f"{bootstrap_queue_deadline(config, environ):g}s"
        ours += " (report)" if mode == "report" else ""
    return SupportRow("bootstrap", backend, "Bootstrapping", native, ours)


def _inflight_ours(
    config: Config, profile: BackendProfile, state: str, deadlines: Mapping[str, Deadline]
) -> str:
    """The deadline stallguard gives *state* in the inflight queue, or why none."""
    mode = config.prefill.mode
    if mode == "off":
        return "not guarded (prefill.mode=off)"
    if state not in profile.reports:
        return "n/a"
    ours = _render(deadlines[state])
    if state == "Bootstrapping":
        ours += " (optimistic prefill only)"
    return ours + (" (report)" if mode == "report" else "")


def format_support_table(
    rows: list[SupportRow], *, version: str | None = None, second: str = "backend"
) -> str:
    """The table as aligned text lines, as logged at startup (*second* names the second
    column: ``"policy"`` for :func:`decode_support_table`'s rows)."""
    header = ("queue", second, "state", f"SGLang {version or '?'} bounds it", "stallguard")
    return text_table(
        [header, *((r.queue, r.backend, r.state, r.sglang, r.stallguard) for r in rows)]
    )


# --------------------------------------------------------------------------- decode


def decode_deadlines(
    decode: DecodeConfig | Config,
    queue: str,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Deadline]:
    """The deadline of each phase of a request in decode queue *queue* (``"prealloc"``
    or ``"transfer"``), counted from when the request entered the queue, or the phase.

    Precedence: ``[decode.<queue>]``, then defaults derived from SGLang's settings
    (:func:`sglang_settings`):

    * prealloc ``Bootstrapping`` and ``WaitingForInput``:
      ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``: the prefill's own sender for the
      room gives up after that long in ``Bootstrapping`` (its clock starts when the
      request reaches prefill, about when it reaches decode), and it stays there until
      decode sends its metadata (``early``), so a decode request still waiting by then
      waits for nothing;
    * prealloc ``WaitingForPrefill``, transfer ``WaitingForInput`` and ``Transferring``:
      ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``, SGLang's own bound on the first two.

    Raises:
        ValueError: for an unknown *queue*.
    """
    if isinstance(decode, Config):
        decode = decode.decode
    if queue not in DECODE_PHASES:
        raise ValueError(f"unknown decode queue {queue!r}; known: {', '.join(DECODE_PHASES)}")
    settings = sglang_settings(environ)
    boot = _positive(settings["SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"])
    waiting = _positive(settings["SGLANG_DISAGGREGATION_WAITING_TIMEOUT"])
    if queue == "prealloc":
        out = {"Bootstrapping": boot, "WaitingForPrefill": waiting, "WaitingForInput": boot}
        out.update(decode.prealloc)
    else:
        out = {"WaitingForInput": waiting, "Transferring": waiting}
        out.update(decode.transfer)
    return out


def _decode_native(queue: str, phase: str, settings: dict[str, float]) -> list[tuple[str, str]]:
    """(allocation policy, what SGLang 0.5.23 does about a decode request stuck in
    *phase*) pairs; docs/sglang.md cites the code."""
    seconds = settings["SGLANG_DISAGGREGATION_WAITING_TIMEOUT"]
    waiting = f"SGLANG_DISAGGREGATION_WAITING_TIMEOUT={seconds:g}s"
    policy, native = _DECODE_NATIVE.get((queue, phase)) or _DECODE_NATIVE[queue, ""]
    return [(policy, native.format(waiting=waiting))]


_BOTH = "early, prefill_complete"
#: (decode queue, phase; "": any other phase) -> (allocation policy, what SGLang 0.5.23
#: does about a request stuck there; ``{waiting}``: its waiting timeout)
_DECODE_NATIVE = {
    ("prealloc", "Bootstrapping"): (
        _BOTH,
        "no: a room the bootstrap server never learns stays pending",
    ),
    ("prealloc", "WaitingForPrefill"): ("prefill_complete", "yes: {waiting} since init()"),
    ("prealloc", ""): (_BOTH, "no: waits for decode memory with no clock"),
    ("transfer", "WaitingForInput"): (
        _BOTH,
        "yes: {waiting} since send_metadata, then pages held up to 30s more",
    ),
    ("transfer", ""): (
        _BOTH,
        "no: Success held back by the metadata gate or HiCache has no clock",
    ),
}


def decode_support_table(
    config: Config, environ: Mapping[str, str] | None = None
) -> list[SupportRow]:
    """Per decode queue, phase and allocation policy: what SGLang 0.5.23 bounds on its
    own, and the deadline stallguard enforces with *config*. The ``backend`` column
    holds the allocation policy (the decode phases are the same on every backend)."""
    settings = sglang_settings(environ)
    mode = config.decode.mode
    rows: list[SupportRow] = []
    for queue, phases in DECODE_PHASES.items():
        deadlines = decode_deadlines(config, queue, environ)
        for phase in phases:
            ours = _decode_ours(mode, deadlines, phase)
            for policy, native in _decode_native(queue, phase, settings):
                rows.append(SupportRow(queue, policy, phase, native, ours))
    return rows


def _decode_ours(mode: str, deadlines: Mapping[str, Deadline], phase: str) -> str:
    """The deadline stallguard gives decode *phase* in *mode*, or why none."""
    if mode == "off":
        return "not guarded (decode.mode=off)"
    return _render(deadlines[phase]) + (" (report)" if mode == "report" else "")

"""Real SGLang PD servers: prefill + decode (``python -m sglang.launch_server``) and the
Rust ``sglang-router`` in front, each in its own process group, on loopback.

The servers run in ``.venv-realsrv`` (``python3 tools/dev.py env``), whose CPU stand-ins
(standins/README.md) are the only thing that is not what a GPU deployment runs, plus the
two flags in :data:`CPU_STANDIN_FLAGS`. stallguard-sglang is enabled exactly as
docs/sglang.md tells users: the installed package's ``sglang.srt.plugins`` entry point,
and ``STALLGUARD_SGLANG_CONFIG`` in the servers' environment.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from stallguard.testing import free_ports

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-realsrv"
PYTHON = VENV / "bin" / "python"
MODEL = Path(__file__).resolve().parent / "models" / "tiny-llama-bigkv"
HOST = "127.0.0.1"

#: Flags that stand in for a GPU (standins/README.md): both servers / decode only.
CPU_STANDIN_FLAGS = ["--disable-overlap-schedule"]
CPU_STANDIN_DECODE_FLAGS = ["--disaggregation-decode-retraction-backup", "none"]

#: What both servers run with: the tiny model with dummy weights, CPU, metrics on.
COMMON_FLAGS = [
    "--model-path", str(MODEL), "--load-format", "dummy", "--device", "cpu",
    "--skip-tokenizer-init", "--attention-backend", "torch_native", "--disable-cuda-graph",
    "--host", HOST, "--enable-metrics",
]  # fmt: skip

#: The KV transfer backends the rig runs: NIXL over UCX/TCP, or Mooncake's transfer
#: engine over TCP (``MC_FORCE_TCP=1``: no RDMA device here).
BACKENDS = ("nixl", "mooncake")
#: Environment each backend adds to the servers'.
BACKEND_ENV = {"nixl": {}, "mooncake": {"MC_FORCE_TCP": "1"}}

#: Environment of every server: loopback only, NIXL over UCX's TCP transport.
SERVER_ENV = {
    "SGLANG_HOST_IP": HOST,
    "UCX_TLS": "tcp,self",
    "UCX_NET_DEVICES": "lo",
    "PYTHONUNBUFFERED": "1",
}

#: How long a process group may live at most (a leftover after a crash of the driver).
LIFETIME_S = 1800


def http(
    method: str, url: str, body: Mapping[str, object] | None = None, timeout: float = 5.0
) -> tuple[int, str]:
    """(status, body text); status 0 for a connection error or a timeout."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (OSError, TimeoutError) as e:
        return 0, f"{type(e).__name__}: {e}"


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_series(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text -> [(name, labels, value)], one per sample line."""
    out: list[tuple[str, dict[str, str], float]] = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and not line.startswith("#"):
            with suppress(ValueError):
                labels = dict(_LABEL.findall(m.group(2) or ""))
                out.append((m.group(1), labels, float(m.group(3))))
    return out


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name: value summed over label sets}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and not line.startswith("#"):
            with suppress(ValueError):
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


@dataclass
class Proc:
    """One process group started by :func:`spawn` (``setsid``: pgid == pid)."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    frozen: bool = False

    @property
    def pgid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, sig)

    def freeze(self) -> None:
        self.signal(signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        self.signal(signal.SIGCONT)
        self.frozen = False

    def stop(self) -> None:
        """SIGCONT (a stopped group ignores SIGTERM until then), SIGTERM, then SIGKILL."""
        if self.popen.poll() is not None and not self._group_exists():
            return
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline and self._group_exists():
            time.sleep(0.2)
        self.signal(signal.SIGKILL)
        with suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=5)

    def _group_exists(self) -> bool:
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""


def spawn(name: str, argv: list[str], env: Mapping[str, str], log: Path) -> Proc:
    """Start *argv* in a new session (its own process group), output to *log*, under
    ``timeout`` so that nothing outlives :data:`LIFETIME_S`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        popen = subprocess.Popen(
            ["timeout", "--kill-after=10", str(LIFETIME_S), *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=dict(env),
            cwd=ROOT,
            start_new_session=True,
        )
    return Proc(name, popen, log)


def server_env(stallguard_config: Path | None, extra: Mapping[str, str] = {}) -> dict[str, str]:
    """The servers' environment: this one minus any STALLGUARD_SGLANG* (the "without"
    arm must not inherit one), the checkout first on PYTHONPATH (so the code under test
    is this checkout's, in every spawned scheduler process too), and
    ``STALLGUARD_SGLANG_CONFIG`` for the "with" arm: the one thing that differs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STALLGUARD_SGLANG")}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)  # SGLang makes its own per server
    # this checkout's CPU stand-ins too: the venv's .pth imports `_stallguard_realsrv`
    # by name, and PYTHONPATH comes before the path the .pth appends
    paths = [
        str(ROOT),
        str(ROOT / "adapters" / "sglang" / "src"),
        str(ROOT / "examples" / "real_servers" / "standins"),
    ]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*paths, env.get("PYTHONPATH")]))
    env.update(SERVER_ENV)
    if stallguard_config is not None:
        env["STALLGUARD_SGLANG_CONFIG"] = str(stallguard_config)
    env.update(extra)
    return env


def tp_env(tp: int, dp: int = 1) -> dict[str, str]:
    """What a CPU server with *tp* x *dp* scheduler ranks needs: SGLang binds each rank's
    OpenMP threads to a NUMA node unless ``SGLANG_CPU_OMP_THREADS_BIND`` names cores per
    rank, and refuses more ranks than nodes (``numa_utils.init_threads_binding``: "the
    total number of ranks (dp_size * tp_size * pp_size ...) should be smaller than or
    equal to number of numa node"); with the variable set it picks entry ``gpu_id``,
    and a DP replica's ranks have ``gpu_id`` ``dp_rank * tp + tp_rank``, so the list
    has ``tp * dp`` entries. This machine has one node and 2 cores: rank i gets core
    ``i % cores``."""
    ranks = tp * dp
    if ranks <= 1:
        return {}
    cores = os.cpu_count() or 1
    return {"SGLANG_CPU_OMP_THREADS_BIND": "|".join(str(i % cores) for i in range(ranks))}


#: SGLang's plugin loader's lines in every process (standins/_stallguard_realsrv.py)
PLUGIN_TRACE_ENV = "STALLGUARD_REALSRV_PLUGIN_TRACE"
#: SGLang's plain-DP prefill rank fixed (standins/_stallguard_realsrv.py)
DP_RANK_FIX_ENV = "STALLGUARD_REALSRV_DP_RANK_FIX"
#: how the plugin trace tags its lines: ``[realsrv plugin trace pid=<pid>] ...``
PLUGIN_TRACE = re.compile(r"\[realsrv plugin trace pid=(\d+)\] (\S+): (.*)")


def dp_env(dp: int, fix: bool = True) -> dict[str, str]:
    """What the rig adds to a server at ``--dp`` > 1: the plugin trace (SGLang's plugin
    loader's lines, dropped otherwise, show which processes, the DP controller
    included, loaded the adapter) and, unless *fix* is False, the fix of SGLang
    0.5.23's prefill DP rank under DP replicas (without it every request the prefill's
    DP controller sends to a replica other than 0 fails at bootstrap:
    sgl-project/sglang#29725)."""
    if dp <= 1:
        return {}
    env = {PLUGIN_TRACE_ENV: "1"}
    if fix:
        env[DP_RANK_FIX_ENV] = "1"
    return env


def plugin_trace(log_text: str) -> dict[int, list[str]]:
    """The plugin trace's lines of a server's log, by process id (the message only)."""
    out: dict[int, list[str]] = {}
    for line in log_text.splitlines():
        m = PLUGIN_TRACE.search(line)
        if m:
            out.setdefault(int(m.group(1)), []).append(m.group(3))
    return out


def group_processes(pgid: int) -> dict[int, str]:
    """pid -> the process's title (``/proc/<pid>/cmdline``, which SGLang's
    ``setproctitle`` rewrites: ``sglang::data_parallel_controller``,
    ``sglang::scheduler_DP1``, ...) for every process of the group *pgid*."""
    out: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            raw = Path(f"/proc/{entry}/cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        out[int(entry)] = raw.replace(b"\0", b" ").decode(errors="replace").strip()[:120]
    return out


@dataclass
class ServerSet:
    """Prefill + decode + router for one arm ("without" or "with" stallguard).

    With *decode_from*, the set starts no decode of its own: its router sends the decode
    half of each request to *decode_from*'s decode (one decode serving two prefills, as
    a decode serves any prefill the router pairs it with). Both arms of a run then share
    one decode, and one SIGSTOP of it is the fault of both; the arms differ only in their
    prefill's environment. *decode_stallguard* False starts the decode without
    ``STALLGUARD_SGLANG_CONFIG`` (the shared decode: the control must not run it).
    """

    arm: str
    logs: Path
    stallguard_config: Path | None
    max_total_tokens: int = 8192
    chunked_prefill_size: int = 512
    decode_from: ServerSet | None = None
    decode_stallguard: bool = True
    #: the decode's process/log name (default "<arm>-decode"; "decode" for a shared one)
    decode_name: str | None = None
    #: the KV transfer backend of both servers (:data:`BACKENDS`)
    backend: str = "nixl"
    #: tensor parallelism of both servers (``--tp``; on a CPU each rank is a scheduler
    #: process on gloo, bound to a core of its own: :func:`tp_env`)
    tp: int = 1
    #: data parallelism of both servers (``--dp-size``: *dp* scheduler replicas behind
    #: SGLang's DP controller process, each with *tp* ranks; one core per rank too)
    dp: int = 1
    #: at dp > 1, SGLang's plain-DP prefill rank fixed in the servers
    #: (:func:`dp_env`; standins/_stallguard_realsrv.py)
    dp_rank_fix: bool = True
    ports: dict[str, int] = field(default_factory=dict)
    procs: dict[str, Proc] = field(default_factory=dict)
    started_at: float = 0.0
    healthy_after: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.ports:
            p = free_ports(5)
            names = ("prefill", "bootstrap", "decode", "router", "router_metrics")
            self.ports = dict(zip(names, p, strict=True))
        if self.decode_from is not None:
            self.ports["decode"] = self.decode_from.ports["decode"]
        if self.backend not in BACKENDS:
            raise ValueError(f"backend {self.backend!r}: must be one of {', '.join(BACKENDS)}")

    def url(self, name: str) -> str:
        return f"http://{HOST}:{self.ports[name]}"

    def server_argv(self, mode: str) -> list[str]:
        argv = [str(PYTHON), "-m", "sglang.launch_server", *COMMON_FLAGS, *CPU_STANDIN_FLAGS]
        argv += ["--disaggregation-transfer-backend", self.backend]
        argv += ["--max-total-tokens", str(self.max_total_tokens)]
        argv += ["--chunked-prefill-size", str(self.chunked_prefill_size)]
        argv += ["--port", str(self.ports[mode]), "--disaggregation-mode", mode]
        argv += ["--tp", str(self.tp)]
        if self.dp > 1:
            # SGLang's DP controller in front of dp scheduler replicas; the prefill's
            # default dispatch in PD mode is follow_bootstrap_room (the replica is the
            # router's bootstrap room modulo dp, which the decode computes the same
            # way), the decode's round_robin
            argv += ["--dp-size", str(self.dp)]
        if mode == "prefill":
            argv += ["--disaggregation-bootstrap-port", str(self.ports["bootstrap"])]
        else:
            argv += CPU_STANDIN_DECODE_FLAGS
        return argv

    def router_argv(self) -> list[str]:
        # Health checks, the circuit breaker and retries off: with them, a SIGSTOPped
        # decode makes the router refuse every request ("all circuits open"), which is
        # the router's own protection, not the server's, and not what is measured here.
        return [
            str(PYTHON), "-m", "sglang_router.launch_router", "--pd-disaggregation",
            "--prefill", self.url("prefill"), str(self.ports["bootstrap"]),
            "--decode", self.url("decode"), "--host", HOST, "--port", str(self.ports["router"]),
            "--disable-health-check", "--disable-circuit-breaker", "--disable-retries",
            # it checks that its workers are up every 30 s by default: every second here
            # (the servers are healthy already when it starts; a 30 s wait is only cost)
            "--worker-startup-check-interval", "1",
            # its own Prometheus exporter (default :29000, which two routers cannot share)
            "--prometheus-host", HOST, "--prometheus-port", str(self.ports["router_metrics"]),
        ]  # fmt: skip

    def start_servers(self) -> None:
        self.started_at = time.monotonic()
        for mode in ("prefill", "decode"):
            if mode == "decode" and self.decode_from is not None:
                self.procs["decode"] = self.decode_from.procs["decode"]
                continue
            config = self.stallguard_config
            if mode == "decode" and not self.decode_stallguard:
                config = None
            name = (
                "decode"
                if mode == "decode" and not self.decode_stallguard
                else f"{self.arm}-{mode}"
            )
            self.procs[mode] = spawn(
                name,
                self.server_argv(mode),
                server_env(
                    config,
                    {
                        **BACKEND_ENV[self.backend],
                        **tp_env(self.tp, self.dp),
                        **dp_env(self.dp, self.dp_rank_fix),
                    },
                ),
                self.logs / f"{name}.log",
            )

    def owns(self, mode: str) -> bool:
        """Whether this set started the *mode* server (False for a borrowed decode)."""
        return not (mode == "decode" and self.decode_from is not None)

    def start_router(self) -> None:
        # the router's ports are chosen now, not when the set was made: minutes of
        # server start-up later, another process may have taken them (a router died
        # of "Address already in use" for its Prometheus port at load 60-90)
        self.ports["router"], self.ports["router_metrics"] = free_ports(2)
        env = server_env(None)
        self.procs["router"] = spawn(
            f"{self.arm}-router", self.router_argv(), env, self.logs / f"{self.arm}-router.log"
        )

    def poll_health(self) -> dict[str, int]:
        """One /health probe of each server that is not healthy yet; records when each
        first answered 200. Raises if a server process (or a router started with the
        servers) died."""
        router = self.procs.get("router")
        if router is not None and not router.alive():
            raise ServerDied(router)
        for mode in ("prefill", "decode"):
            if mode in self.healthy_after:
                continue
            if not self.owns(mode) and self.decode_from is not None:
                if mode in self.decode_from.healthy_after:
                    self.healthy_after[mode] = self.decode_from.healthy_after[mode]
                continue
            proc = self.procs[mode]
            if not proc.alive():
                raise ServerDied(proc)
            status, _ = http("GET", self.url(mode) + "/health", timeout=3)
            if status == 200:
                self.healthy_after[mode] = time.monotonic() - self.started_at
        return {m: int(m in self.healthy_after) for m in ("prefill", "decode")}

    @property
    def healthy(self) -> bool:
        return len(self.healthy_after) == 2

    def metrics(self, name: str = "prefill") -> dict[str, float]:
        status, text = http("GET", self.url(name) + "/metrics", timeout=3)
        return parse_metrics(text) if status == 200 else {}

    def metrics_text(self, name: str = "prefill") -> str:
        status, text = http("GET", self.url(name) + "/metrics", timeout=3)
        return text if status == 200 else ""

    def stop(self) -> None:
        for mode, proc in reversed(list(self.procs.items())):
            if self.owns(mode):
                proc.stop()

    def __iter__(self) -> Iterator[Proc]:
        return iter(self.procs.values())


def stop_all(procs: list[Proc]) -> None:
    """Stop *procs* at once (each waits up to ~13 s for its group; not one after the
    other)."""
    threads = [threading.Thread(target=p.stop, daemon=True) for p in procs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)


class ServerDied(RuntimeError):
    def __init__(self, proc: Proc) -> None:
        tail = "\n".join(proc.log_text().splitlines()[-25:])
        super().__init__(
            f"{proc.name} exited with {proc.popen.returncode} (log {proc.log}):\n{tail}"
        )
        self.proc = proc


def wait_healthy(sets: list[ServerSet], timeout: float = 900.0, every: float = 3.0) -> None:
    """Poll every set's servers' /health until all answer 200 (starts take ~90-110 s
    here on quiet cores, 3-7 minutes when the sets start together at load 30-90)."""
    deadline = time.monotonic() + timeout
    while not all(s.healthy for s in sets):
        if time.monotonic() > deadline:
            states = {s.arm: s.healthy_after for s in sets}
            raise TimeoutError(f"servers not healthy after {timeout:.0f} s: {states}")
        for s in sets:
            s.poll_health()
        time.sleep(every)

"""The shipped Prometheus rules and Grafana dashboard (deploy/), on a real Prometheus.

A real ``prometheus`` (Debian's package; tools/dev.py installs it) scrapes a small HTTP
server that exposes REAL adapter expositions: stallguard-sglang's after real forced
failures through the real SGLang inflight queue (adapters/sglang/tests/
sglang_metrics_scenarios.py), stallguard-vllm's after real forced failures through its
phase tracker and vLLM's own Prometheus classes (adapters/vllm/tests/
vllm_metrics_scenario.py, in .venv-vllm). Per engine, two "pods":

* pod ``a`` is served as SGLang's and vLLM's ``/metrics`` serve it: prometheus_client's
  content negotiation, OpenMetrics for Prometheus, which (client_python #1177) makes
  Prometheus 2.x store ``sglang_stallguard_*`` / ``vllm_stallguard_*``;
* pod ``b`` as a plain text exposition (version 0.0.4), stored as ``sglang:`` /
  ``vllm:`` names (what Prometheus 3.x stores from either).

Timeline: both pods serve the exposition after round 1, then after round 2; then pod
``a`` restarts (serves round 1's exposition again: every counter drops). Each change
waits until Prometheus scraped every target twice (polled, no fixed sleeps).

Then: ``promtool check rules``; every recording rule, every alert's expression and
every dashboard query returns series from both pods (both spellings) and both
engines; values checked against the expositions; the alerts the traffic must raise are
raised; ``advise --prometheus`` gives a deadline per guarded phase of both engines from
this history (two pods, a restart), with exactly the stays the expositions hold.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from stallguard.testing import free_port

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "prometheus" / "stallguard-rules.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "stallguard-dashboard.json"
SGLANG_TESTS = ROOT / "adapters" / "sglang" / "tests"
VLLM_TESTS = ROOT / "adapters" / "vllm" / "tests"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
SCRAPE_S = 1.0
SCRAPE_MS = int(SCRAPE_S * 1000)  # Prometheus durations are integers of a unit

pytestmark = [pytest.mark.slow, pytest.mark.sglang, pytest.mark.vllm, pytest.mark.timeout(1800)]


def _skip_reason() -> str | None:
    if shutil.which("prometheus") is None or shutil.which("promtool") is None:
        return (
            "prometheus/promtool not installed: `python3 tools/dev.py env` installs Debian's "
            "prometheus package with apt-get (as root); without apt the rules are untested"
        )
    if not VLLM_PYTHON.exists():
        return f"{VLLM_PYTHON} missing: run python3 tools/dev.py env"
    try:
        import prometheus_client  # noqa: F401
        import sglang  # noqa: F401
    except ImportError as e:
        return f"needs SGLang and prometheus_client in this interpreter ({e})"
    return None


SKIP = _skip_reason()
if SKIP is not None:
    pytestmark.append(pytest.mark.skip(reason=SKIP))


# --------------------------------------------------------------------- expositions


#: requests per round of the SGLang prefill and decode pods
SGLANG_N = 120
DECODE_N = 100


def _sglang_expositions(tmp: Path, role: str = "prefill") -> dict[str, Any]:
    """A prefill pod's expositions (the inflight queue), or a decode pod's (*role*
    ``"decode"``: the prealloc and transfer queues), from a fresh process."""
    sys.path.insert(0, str(SGLANG_TESTS))
    import sglang_support as sgs

    metrics_dir = tmp / f"sglang-{role}-multiproc"
    metrics_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("STALLGUARD_SGLANG")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SGLANG_TESTS), env.get("PYTHONPATH")]))
    env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    target, n = ("expositions", SGLANG_N) if role == "prefill" else ("decode_expositions", DECODE_N)
    out: dict[str, Any] = sgs.run_in_python(
        sys.executable,
        f"sglang_metrics_scenarios:{target}",
        args=(str(metrics_dir), n),
        timeout=1200,
        env=env,
    )
    return out


def _vllm_expositions(tmp: Path) -> dict[str, Any]:
    out_path = tmp / "vllm.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STALLGUARD_VLLM")}
    env.update(VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="WARNING")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(ROOT / "adapters" / "vllm" / "src"), str(VLLM_TESTS)]
    )
    proc = subprocess.run(
        [str(VLLM_PYTHON), str(VLLM_TESTS / "vllm_metrics_scenario.py"), str(out_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(out_path.read_text())
    return result


# --------------------------------------------------------------------- the targets


class Targets:
    """What each target serves now, and how often Prometheus scraped it."""

    def __init__(self) -> None:
        self.text: dict[str, str] = {}
        self.scrapes: dict[str, int] = {}
        self.accept: dict[str, str] = {}
        self.cache: dict[tuple[str, str], tuple[bytes, str]] = {}
        self.lock = threading.Lock()

    def serve(self, path: str, accept: str) -> tuple[bytes, str] | None:
        name = path.strip("/").split("/")[0]
        with self.lock:
            text = self.text.get(name)
            if text is None:
                return None
            self.scrapes[name] = self.scrapes.get(name, 0) + 1
            self.accept[name] = accept
        return self._encode(name, text, accept)

    def _encode(self, name: str, text: str, accept: str) -> tuple[bytes, str]:
        """Pod a as SGLang's and vLLM's /metrics serve it: prometheus_client's registry,
        the encoder chosen by the scraper's Accept header (OpenMetrics for Prometheus);
        pod b as the text format. Encoded once per text and Accept header (a scrape
        must answer within the scrape interval, on a loaded machine too)."""
        if not name.endswith("-a"):
            return text.encode(), "text/plain; version=0.0.4; charset=utf-8"
        key = (text, accept)
        with self.lock:
            cached = self.cache.get(key)
        if cached is not None:
            return cached
        from prometheus_client import CollectorRegistry
        from prometheus_client.exposition import choose_encoder
        from prometheus_client.parser import text_string_to_metric_families

        families = list(text_string_to_metric_families(text))

        class Replay:
            def collect(self) -> Any:
                return iter(families)

        registry = CollectorRegistry()
        registry.register(Replay())  # type: ignore[arg-type]
        encoder, content_type = choose_encoder(accept)
        out = (encoder(registry), content_type)
        with self.lock:
            self.cache[key] = out
        return out

    def set(self, **texts: str) -> None:
        for name, text in texts.items():  # encoded before Prometheus asks for it
            for accept in {a for a in self.accept.values()}:
                self._encode(name, text, accept)
        with self.lock:
            self.text.update(texts)
            for name in texts:
                self.scrapes[name] = 0

    def wait_scraped(self, times: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if all(n >= times for n in self.scrapes.values()):
                    return
            time.sleep(0.1)
        raise AssertionError(f"Prometheus did not scrape every target {times}x: {self.scrapes}")


def _serve(targets: Targets) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            served = targets.serve(self.path, self.headers.get("Accept", ""))
            if served is None:
                self.send_error(404)
                return
            body, content_type = served
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


#: the targets of each job: (path prefix, role label) per pod
JOBS = {"sglang": (("sglang", "prefill"), ("sglang-decode", "decode")), "vllm": (("vllm", ""),)}


def _config(port: int) -> str:
    jobs = []
    for job, kinds in JOBS.items():
        targets = "\n".join(
            f"      - targets: ['127.0.0.1:{port}']\n"
            f"        labels: {{__metrics_path__: '/{name}-{pod}/metrics', pod: '{pod}'"
            + (f", role: '{role}'" if role else "")
            + "}"
            for name, role in kinds
            for pod in ("a", "b")
        )
        jobs.append(f"  - job_name: {job}\n    static_configs:\n{targets}")
    return (
        f"global:\n  scrape_interval: {SCRAPE_MS}ms\n  evaluation_interval: {SCRAPE_MS}ms\n"
        f"rule_files: ['{RULES}']\nscrape_configs:\n" + "\n".join(jobs) + "\n"
    )


class Prom:
    def __init__(self, url: str) -> None:
        self.url = url

    def get(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=30) as r:
            doc = json.loads(r.read())
        assert doc["status"] == "success", doc
        return doc["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.get("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        result: list[dict[str, Any]] = data["result"]
        return result

    def poll(self, what: str, check: Callable[[], Any], timeout: float = 90.0) -> Any:
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            last = check()
            if last:
                return last
            time.sleep(0.2)
        raise AssertionError(f"{what}: not true after {timeout:g}s (last: {last!r})")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("prom")
    with ThreadPoolExecutor(3) as pool:
        sglang_future = pool.submit(_sglang_expositions, tmp)
        decode_future = pool.submit(_sglang_expositions, tmp, "decode")
        vllm_future = pool.submit(_vllm_expositions, tmp)
        sglang, decode = sglang_future.result(), decode_future.result()
        vllm = vllm_future.result()
    targets = Targets()
    server = _serve(targets)
    port = free_port()
    (tmp / "prometheus.yml").write_text(_config(server.server_address[1]))
    proc = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp / "prometheus.log", "w"),  # noqa: SIM115 - closed with the process
    )
    prom = Prom(f"http://127.0.0.1:{port}")
    log = tmp / "prometheus.log"

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"prometheus exited {proc.returncode}: {log.read_text()}")
        return _ready(prom.url)

    try:
        prom.poll("Prometheus ready", ready, timeout=120)
        version = prom.get("/api/v1/status/buildinfo")["version"]
        start = time.time()
        rounds = {
            "sglang": sglang["texts"],
            "sglang-decode": decode["texts"],
            "vllm": vllm["texts"],
        }
        # round 1 on both pods, then round 2, then pod a restarts (round 1 again)
        for step in (
            {f"{e}-{p}": rounds[e][0] for e in rounds for p in "ab"},
            {f"{e}-{p}": rounds[e][1] for e in rounds for p in "ab"},
            {f"{e}-a": rounds[e][0] for e in rounds},
        ):
            targets.set(**step)
            targets.wait_scraped(3)
        yield {
            "prom": prom,
            "version": version,
            "start": start,
            "sglang": sglang,
            "sglang-decode": decode,
            "vllm": vllm,
            "targets": targets,
            "log": tmp / "prometheus.log",
        }
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        server.shutdown()


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


# --------------------------------------------------------------------- rules


def _rules() -> list[dict[str, Any]]:
    import yaml  # type: ignore[import-untyped]

    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def _panel_queries() -> list[tuple[str, str]]:
    doc = json.loads(DASHBOARD.read_text())
    out = [
        (panel["title"], target["expr"]) for panel in doc["panels"] for target in panel["targets"]
    ]
    for var in doc["templating"]["list"]:
        if var["type"] == "query":
            # label_values(SELECTOR, label): the selector must match series
            m = re.fullmatch(r"label_values\((.*), (\w+)\)", var["query"]["query"])
            assert m is not None, var
            label = m.group(2)
            out.append((f"variable {label}", f"count by (job, {label}) ({m.group(1)})"))
    return out


def _grafana(expr: str) -> str:
    """A panel query with Grafana's variables as "All" and a short rate interval."""
    return (
        expr.replace("$__rate_interval", "1m")
        .replace('"$job"', '".+"')
        .replace('"$model_name"', '".*"')
    )


def _operand(expr: str) -> str:
    """An alert's expression without its final threshold comparison."""
    return re.sub(r"\s*>\s*[0-9.]+\s*$", "", expr.strip())


def _per_pod(expr: str, pod: str) -> str:
    """*expr* restricted to one pod: a ``pod`` matcher in every raw selector, and the
    recorded series evaluated from their definition (they aggregate pods away)."""
    recorded = {r["record"]: r["expr"] for r in _rules() if "record" in r}
    for _ in range(3):  # recorded series in recorded series' expressions
        for name, definition in recorded.items():
            expr = re.sub(
                rf"{re.escape(name)}(\{{[^}}]*\}})?(?![\w:])",
                lambda m, d=definition: f"({d})",
                expr,
            )
    return re.sub(r'\{__name__=~("[^"]+")', rf'{{__name__=~\1, pod="{pod}"', expr)


def test_promtool_check_rules() -> None:
    proc = subprocess.run(
        ["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in proc.stdout


def test_prometheus_stores_both_spellings(world: dict[str, Any]) -> None:
    """Pod a (OpenMetrics, as SGLang's and vLLM's /metrics serve Prometheus) is stored
    with underscores by this Prometheus 2.x; pod b (text format) with colons."""
    prom = world["prom"]
    assert world["version"].startswith("2."), world["version"]
    names = {
        pod: {
            r["metric"]["__name__"]
            for r in prom.query(
                f'count by (__name__) ({{pod="{pod}", __name__=~".*stallguard.*"}})'
            )
        }
        for pod in "ab"
    }
    assert "openmetrics" in world["targets"].accept["sglang-a"]
    assert "sglang_stallguard_forced_failures_total" in names["a"]
    assert "vllm_stallguard_state_seconds_bucket" in names["a"]
    assert not any(":" in n for n in names["a"]), names["a"]
    assert "sglang:stallguard_forced_failures_total" in names["b"]
    assert "vllm:stallguard_quarantine_overdue" in names["b"]
    assert all(":" in n for n in names["b"]), names["b"]


def _jobs_and_pods(prom: Prom, expr: str) -> None:
    """*expr* returns series of both engines, and does so for each pod alone (reported
    stalls: vLLM only, whose Queued phase is always report-only; the SGLang traffic
    runs in enforce mode)."""
    engines = {"vllm"} if "stalls_reported" in expr else {"sglang", "vllm"}
    for pod in "ab":
        per_pod = _per_pod(expr, pod)

        def both(e: str = per_pod) -> list[dict[str, Any]] | None:
            # polled: a scrape that timed out on a loaded machine marks that target's
            # series stale until its next scrape
            result = prom.query(e)
            return result if {r["metric"].get("job") for r in result} >= engines else None

        prom.poll(f"{expr!r} for pod {pod}: series of {sorted(engines)}", both, timeout=60)


@pytest.mark.parametrize("rule", [r.get("record") or r["alert"] for r in _rules()])
def test_every_rule_returns_series_for_both_spellings_and_engines(
    world: dict[str, Any], rule: str
) -> None:
    prom = world["prom"]
    [definition] = [r for r in _rules() if r.get("record", r.get("alert")) == rule]
    expr = definition["expr"] if "record" in definition else _operand(definition["expr"])
    _jobs_and_pods(prom, expr)
    if "record" in definition:  # and the recorded series itself, both engines
        engines = {"vllm"} if "stalls_reported" in rule else {"sglang", "vllm"}

        def recorded() -> bool:
            return {r["metric"]["job"] for r in prom.query(rule)} == engines

        prom.poll(f"{rule} for {sorted(engines)}", recorded, timeout=60)


@pytest.mark.parametrize(("title", "expr"), _panel_queries())
def test_every_dashboard_query_returns_series(world: dict[str, Any], title: str, expr: str) -> None:
    _jobs_and_pods(world["prom"], _grafana(expr))


def test_values_agree_with_the_expositions(world: dict[str, Any]) -> None:
    """Deadlines as configured (absent for a state without one), forced failures by
    state and reason as the pods' last expositions count them, quarantined memory."""
    prom = world["prom"]
    _eventually(lambda: _check_values(prom))


def _eventually(check: Callable[[], None], timeout: float = 60.0) -> None:
    """*check* until it passes (a scrape that timed out on a loaded machine leaves that
    target's series stale until its next scrape); its last failure after *timeout*."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            check()
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _check_values(prom: Prom) -> None:

    def value(expr: str) -> dict[tuple[str, ...], float]:
        out = {}
        for r in prom.query(expr):
            m = r["metric"]
            key = (m.get("job", ""), m.get("queue", ""), m.get("state", m.get("peer", "")))
            out[key] = float(r["value"][1])
        return out

    deadlines = value("stallguard:deadline_seconds:max")
    assert deadlines[("sglang", "inflight", "WaitingForInput")] == 10.0
    assert deadlines[("sglang", "inflight", "Transferring")] == 60.0
    assert ("sglang", "inflight", "Bootstrapping") not in deadlines  # "none": no series
    # the decode pod's queues, as configured there
    for (queue, state), seconds in {
        ("prealloc", "Bootstrapping"): 20.0,
        ("prealloc", "WaitingForPrefill"): 8.0,
        ("prealloc", "WaitingForInput"): 30.0,
        ("transfer", "WaitingForInput"): 10.0,
        ("transfer", "Transferring"): 5.0,
    }.items():
        assert deadlines[("sglang", queue, state)] == seconds, (queue, state, deadlines)
    assert deadlines[("vllm", "", "Receiving")] == 10.0
    assert deadlines[("vllm", "", "HeldForRead")] == 20.0
    # forced failures now: pod a restarted (round 1: one per kind), pod b round 2 (two)
    forced = prom.query(
        "sum by (job, queue, state, reason) "
        '({__name__=~"(sglang|vllm)[:_]stallguard_forced_failures_total"})'
    )
    got = {
        (
            r["metric"]["job"],
            r["metric"].get("queue", ""),
            r["metric"]["state"],
            r["metric"]["reason"],
        ): float(r["value"][1])
        for r in forced
    }
    assert got == {
        ("sglang", "inflight", "WaitingForInput", "state"): 3.0,
        ("sglang", "inflight", "Transferring", "stall"): 3.0,
        ("sglang", "prealloc", "WaitingForPrefill", "state"): 3.0,  # the decode pod's
        ("vllm", "", "Receiving", "state"): 3.0,
        ("vllm", "", "HeldForRead", "state"): 3.0,
    }
    overdue = value("stallguard:quarantine_overdue:sum")
    # SGLang: 0 holds overdue in round 1 (pod a now), 1 in round 2 (pod b); vLLM: 1, 2
    assert overdue == {("sglang", "", "decode-peer-0"): 1.0, ("vllm", "", "P"): 3.0}


def test_alerts_fire(world: dict[str, Any]) -> None:
    prom = world["prom"]

    def alerts() -> set[tuple[str, str]]:
        return {
            (a["labels"]["alertname"], a["labels"].get("job", ""))
            for a in prom.get("/api/v1/alerts")["alerts"]
            if a["state"] in ("pending", "firing")
        }

    want = {
        ("StallguardForcedFailures", "sglang"),
        ("StallguardForcedFailures", "vllm"),
        ("StallguardQuarantineOverdue", "sglang"),
        ("StallguardQuarantineOverdue", "vllm"),
        ("StallguardOldestNearDeadline", "vllm"),  # the request stuck Queued
    }
    prom.poll("alerts", lambda: want <= alerts() or None, timeout=60)


# --------------------------------------------------------------------- advise


def _expected_stays(texts: list[str], histogram: str, where: dict[str, str]) -> dict[str, int]:
    """Stays per state over the timeline: pod b's last exposition, plus pod a's last
    before its restart and its exposition after it."""
    import stallguard

    def counts(text: str) -> dict[str, int]:
        stats = stallguard.statistics_from_prometheus(text, histogram=histogram, where=where)
        return {s: st.count for s, st in stats.states.items()}

    last, first = counts(texts[1]), counts(texts[0])
    return {s: 2 * last[s] + first.get(s, 0) for s in last}


def test_advise_from_prometheus_history_covers_every_guarded_phase(world: dict[str, Any]) -> None:
    """Two pods, one restart, both spellings: every stay is counted once (the counts
    equal the expositions'), and every phase with traffic gets a deadline."""
    from stallguard_sglang._advise import PROMETHEUS_NAMES, advise_text, read_source, toml_block
    from stallguard_sglang._config import DECODE_PHASES
    from stallguard_vllm import advise as vllm_advise

    from stallguard._promapi import exposition_from_prometheus

    prom = world["prom"]
    window = time.time() - world["start"] + 30
    text = read_source(prometheus=prom.url, window=window, step=SCRAPE_S)
    advice = advise_text(text, min_samples=50)
    inflight = advice[("inflight", "nixl")]
    expected = _expected_stays(
        world["sglang"]["texts"],
        "sglang:stallguard_state_seconds",
        {"queue": "inflight", "backend": "nixl"},
    )
    assert {s: a.count for s, a in inflight.states.items() if a.count} == {
        s: n for s, n in expected.items() if n
    }
    for state in ("WaitingForInput", "Transferring"):
        assert inflight.states[state].suggested is not None, inflight.table()
    # forced failures grew by 2 on pod b; on pod a by 2, then 1 after its restart
    assert inflight.states["WaitingForInput"].fired == 5

    # the decode pods: every phase of both decode queues
    for queue in ("prealloc", "transfer"):
        decode = advice[(queue, "nixl")]
        expected = _expected_stays(
            world["sglang-decode"]["texts"],
            "sglang:stallguard_state_seconds",
            {"queue": queue, "backend": "nixl"},
        )
        assert {s: a.count for s, a in decode.states.items() if a.count} == expected
        for state in DECODE_PHASES[queue]:
            assert decode.states[state].suggested is not None, (queue, decode.table())
    assert advice[("prealloc", "nixl")].states["WaitingForPrefill"].fired == 5
    # ... and the TOML block sets them, as the adapter's own reader loads it
    block = toml_block(advice)
    import tomllib
    from stallguard_sglang._config import parse_config

    config = parse_config(tomllib.loads(block), source="advise's TOML block")
    for queue in ("prealloc", "transfer"):
        got = getattr(config.decode, queue)
        for state in DECODE_PHASES[queue]:
            suggested = advice[(queue, "nixl")].states[state].suggested
            assert got[state].seconds == suggested, (queue, state, block)

    vtext = exposition_from_prometheus(
        prom.url, vllm_advise.PROMETHEUS_NAMES, window=window, step=SCRAPE_S, end=time.time()
    )
    vadvice = vllm_advise.advise_text(vtext, min_samples=50)["tiny"]
    vexpected = _expected_stays(
        world["vllm"]["texts"], "vllm:stallguard_state_seconds", {"model_name": "tiny"}
    )
    assert {s: a.count for s, a in vadvice.states.items()} == vexpected
    for phase in ("Queued", "Receiving", "AbortedHeld", "HeldForRead"):
        assert vadvice.states[phase].suggested is not None, vadvice.table()
    assert PROMETHEUS_NAMES  # (the names advise asks the server for)


def test_decode_pod_exports_every_stay(world: dict[str, Any]) -> None:
    """The decode pod's expositions hold every stay of every request, each round's
    last ones included (exported by the idle passes after the traffic), and SGLang's
    queues concluded every request: the healthy ones committed, the one whose prefill
    never answered failed by its WaitingForPrefill deadline (aborted to its client)."""
    import stallguard

    decode = world["sglang-decode"]
    n = DECODE_N
    for i, (text, outcome) in enumerate(zip(decode["texts"], decode["rounds"], strict=True)):
        assert outcome["done"] == sorted(f"round{i}-d{k}" for k in range(n)), outcome
        assert outcome["aborted"] == [f"round{i}-stuck-prefill"] and not outcome["left"]
        rounds = i + 1  # the expositions are cumulative
        want = {
            "prealloc": {
                "Bootstrapping": (n + 1) * rounds,
                "WaitingForPrefill": (n + 1) * rounds,
                "WaitingForInput": n * rounds,
            },
            "transfer": {"WaitingForInput": n * rounds, "Transferring": n * rounds},
        }
        for queue, counts in want.items():
            stats = stallguard.statistics_from_prometheus(
                text,
                histogram="sglang:stallguard_state_seconds",
                where={"queue": queue, "backend": "nixl"},
            )
            assert {s: st.count for s, st in stats.states.items()} == counts, (i, queue)


def test_advise_cli_from_prometheus(
    world: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    from stallguard_sglang.__main__ import main

    window = f"{int(time.time() - world['start'] + 30)}s"
    status = main(
        [
            "advise",
            "--prometheus",
            world["prom"].url,
            "--window",
            window,
            "--step",
            "0.5s",
            "--min-samples",
            "50",
        ]
    )
    out = capsys.readouterr()
    assert status == 0, out.err
    assert "mode: Prometheus history, pods summed" in out.out
    assert re.search(r"^WaitingForInput = \d", out.out, re.M), out.out
    assert math.isfinite(float(re.search(r"^Transferring = ([\d.]+)", out.out, re.M).group(1)))

"""Command line of the demo."""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from pathlib import Path

from . import _config, _env

EPILOG = """\
exit status: 0 if, in every "with stallguard" run, nothing was left pinned, no healthy
request failed (each that did is a false positive, listed with its timing) and every
forced failure was released by the first scheduler loop pass after its deadline (so at
most one loop interval late), and in the thaw (prefill-freeze-write) the resumed
prefill's late WRITE changed 0 bytes of the new owner with stallguard (and some without:
the control), the quarantined pages were freed after the thaw and none leaked; 1
otherwise; 2 if the demo could not run. The deadlines are
the profile's, scaled per rig by what a warm-up measurement of healthy requests took.
"""


def _split(value: str, allowed, what: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise argparse.ArgumentTypeError(
            f"--{what}={value!r}: expected a comma-separated subset of {', '.join(allowed)}"
        )
    return items


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m examples.pd_wedge",
        description="Reproduce the prefill inflight-queue wedge on real SGLang KV managers "
        "over real NIXL and Mooncake transfer engines, without and with stallguard-sglang.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--engines",
        default=",".join(_config.ENGINES),
        type=lambda v: _split(v, _config.ENGINES, "engines"),
        help="transfer engines to run (default: nixl,mooncake)",
    )
    ap.add_argument(
        "--scenarios",
        default=",".join(_config.ALL_SCENARIOS),
        type=lambda v: _split(v, _config.ALL_SCENARIOS, "scenarios"),
        help="faults to inject: on a decode (the prefill side is guarded): "
        + ", ".join(_config.SCENARIOS)
        + "; on a prefill (the decode side is guarded): "
        + ", ".join(_config.DECODE_SCENARIOS)
        + " (default: all)",
    )
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="shorter runs (the test suite's)")
    size.add_argument("--full", action="store_true", help="longer, heavier runs")
    ap.add_argument("--out", type=Path, default=Path("pd_wedge_out"), help="output directory")
    ap.add_argument("--seed", type=int, default=0, help="seed of the request stream")
    ap.add_argument(
        "--no-advice",
        dest="advice",
        action="store_false",
        help="skip the advice section (shadow in report mode, `stallguard_sglang advise`, "
        "enforce the advice)",
    )
    return ap.parse_args(argv)


def check_environment() -> str | None:
    """Why the demo cannot run here, or None."""
    missing = [
        name
        for name in ("sglang", "nixl", "mooncake", "stallguard_sglang", "matplotlib")
        if importlib.util.find_spec(name) is None
    ]
    if missing:
        return (
            f"missing packages: {', '.join(missing)}. Build the project environment with "
            "`python3 tools/dev.py env` and run the demo with `.venv/bin/python -m "
            "examples.pd_wedge` from the repository root."
        )
    return None


def main(argv=None) -> int:
    args = parse_args(argv)
    problem = check_environment()
    if problem:
        print(f"pd_wedge: {problem}")
        return 2
    profile = _config.QUICK if args.quick else _config.FULL if args.full else _config.DEFAULT
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    # Before the fork server exists: every worker inherits this environment.
    _env.apply(_env.ENGINE_ENV)
    _env.apply(_env.mooncake_transport_env(profile.mooncake_timeout))
    os.environ["SGLANG_DISAGGREGATION_QUEUE_SIZE"] = "4"

    from . import _ddriver, _driver, _report

    print(
        f"pd_wedge: profile {profile.name}, engines {','.join(args.engines)}, scenarios "
        f"{','.join(args.scenarios)}; base deadlines {profile.deadlines} (mooncake "
        f"WaitingForInput {profile.mooncake_waiting}s), scaled per rig by its warm-up "
        f"measurement; loop {profile.loop_interval * 1000:.0f} ms; logs in {out / 'logs'}",
        flush=True,
    )
    t = time.monotonic()
    try:
        log = lambda msg: print(msg, flush=True)  # noqa: E731
        prefill_side = [s for s in args.scenarios if s in _config.SCENARIOS]
        decode_side = [s for s in args.scenarios if s in _config.DECODE_SCENARIOS]
        results, advice, thaw = [], {}, []
        if prefill_side or args.advice:
            results, advice = _driver.run_all(
                args.engines,
                prefill_side,
                profile,
                out,
                seed=args.seed,
                log=log,
                advice=args.advice,
            )
        if decode_side:
            results += _ddriver.run_all(
                args.engines, decode_side, profile, out, seed=args.seed, log=log, thaw=thaw
            )
    except (_driver.HarnessError, _driver.WorkerError) as exc:
        print(f"pd_wedge: the demo could not run: {exc}")
        return 2
    elapsed = time.monotonic() - t
    table = _report.text_table(results)
    print()
    print(table)
    print()
    print(_report.summary(results))
    derived_text = _report.calibration_section(results)
    fp_text = _report.false_positive_section(results)
    print()
    print(derived_text)
    print()
    print(fp_text)
    advice_text = _report.advice_section(results, advice, profile)
    if advice_text:
        print()
        print(advice_text)
    thaw_text = _report.thaw_section(thaw)
    if thaw_text:
        print()
        print(thaw_text)
    _report.save_json(results, profile, out / "results.json", thaw=thaw)
    (out / "results.md").write_text(
        _report.markdown_table(results)
        + "\n\n"
        + _report.summary(results)
        + "\n\n"
        + derived_text
        + "\n\n"
        + fp_text
        + "\n"
        + (f"\n{advice_text}\n" if advice_text else "")
        + (f"\n{thaw_text}\n" if thaw_text else "")
    )
    # (no picture when only the thaw ran: it has no queue lengths over time)
    png = _report.plot(results, profile, out / "pd_wedge.png") if results else "-"
    print(f"\npicture: {png}\nresults: {out / 'results.json'} ({elapsed:.0f}s)")
    bad = [r for r in results if not r.ok()]
    for r in bad:
        print(
            f"FAIL {r.engine}/{r.scenario} ({r.side} side) with stallguard: "
            f"pinned={r.pinned} left={r.left} "
            f"healthy_failed={r.healthy_failed} (false positives, listed above) "
            f"late_releases={r.late_releases} "
            f"problems={r.problems[:3]}"
        )
    for t in thaw:
        if not t.ok():
            print(
                f"FAIL {t.engine} thaw ({t.arm} stallguard): "
                + (
                    f"the late WRITE did not land in the new owner's pages (the control "
                    f"shows no fault): {t.overwritten} B, problems={t.problems[:3]}"
                    if t.arm == "without"
                    else f"{t.overwritten} of the new owner's bytes overwritten, "
                    f"freed after thaw: {t.freed_after_thaw_ms} ms, leaked pages "
                    f"{t.leaked_pages}, problems={t.problems[:3]}"
                )
            )
    return 1 if bad or not all(t.ok() for t in thaw) else 0

"""The advice section: shadow, advise, enforce (docs/advice.md), on the same rig.

1. **Shadow.** A third prefill, identical to the others but started with stallguard-sglang
   in *report* mode, takes the request stream for ``shadow`` seconds, during which decode
   A freezes for ``shadow_fault`` seconds. Nothing is failed; the adapter records how long
   every request stayed in every state and exports it, as it would to SGLang's
   ``/metrics``. The driver saves that exposition (``<engine>-shadow-metrics.txt``).
2. **Advise.** The operator's command, as is: ``python -m stallguard_sglang advise --file
   <that file> --false-timeout-rate R --floor F`` (its output in ``<engine>-advice.txt``).
3. **Enforce.** A fourth prefill starts with the suggested deadlines (merged over the
   shadow's configuration: a state without a suggestion keeps its configured deadline,
   as the advice says) in enforce mode, and the ``freeze`` scenario runs on it, measured
   against those deadlines.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import tomllib

from ._config import STATES, Profile, prefill_lines
from ._driver import HarnessError, Rig, Run, RunResult

SHADOW, ADVISED = "report", "advised"


def advised_config(
    profile: Profile, engine: str, suggested: dict, path: Path
) -> tuple[Path, Profile]:
    """The enforce-mode configuration: the shadow's deadlines with the suggestions over
    them; and the profile to measure the advised run against. (A prefill of the demo
    has senders of one engine only, so ``[prefill.deadlines]`` holds that engine's
    suggestions; the demo's Mooncake ``WaitingForInput`` lives in its backend table.)"""
    mine = dict(suggested.get("prefill", {}).get("deadlines", {}))
    waiting = profile.mooncake_waiting
    if engine == "mooncake" and "WaitingForInput" in mine:
        waiting = mine.pop("WaitingForInput")
    deadlines = {**profile.deadlines, **mine}
    advised = replace(profile, deadlines=deadlines, mooncake_waiting=waiting)
    lines = prefill_lines(advised, "enforce", "advised arm (the shadow's deadlines, advised)")
    path.write_text("\n".join(lines))
    return path, advised


def run(rig: Rig, seed: int, log=print) -> tuple[list[RunResult], str]:
    """Shadow, advise, enforce on *rig* (started with the extra arm ``"report"``);
    returns the shadow and advised runs and the advice as printed."""
    p, out, engine = rig.profile, rig.out, rig.engine
    shadow_profile = replace(p, pre=p.shadow, window=p.shadow_fault, post=1.0)
    t = time.monotonic()
    shadow = Run(rig, "freeze", SHADOW, seed, profile=shadow_profile).execute()
    time.sleep(1.2)  # the adapter exports what it recorded about once a second
    metrics = out / f"{engine}-shadow-metrics.txt"
    metrics.write_text(rig.prefill[SHADOW].rpc.call("metrics"))
    command = [
        sys.executable,
        "-m",
        "stallguard_sglang",
        "advise",
        "--file",
        str(metrics),
        "--false-timeout-rate",
        str(p.advice_rate),
        "--floor",
        str(p.advice_floor),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise HarnessError(f"{' '.join(command[1:])} failed:\n{done.stdout}{done.stderr}")
    advice = done.stdout
    (out / f"{engine}-advice.txt").write_text(advice)
    block = advice.split("# paste into the file STALLGUARD_SGLANG_CONFIG names:", 1)[-1]
    try:
        suggested = tomllib.loads(block)
    except tomllib.TOMLDecodeError as exc:
        raise HarnessError(f"advise printed no TOML block: {exc}\n{advice}") from None
    config, advised_profile = advised_config(p, engine, suggested, out / f"{engine}-advised.toml")
    log(
        f"[{engine}] shadow run and advice in {time.monotonic() - t:.1f}s; advised "
        f"deadlines {advised_profile.deadlines} (mooncake WaitingForInput "
        f"{advised_profile.mooncake_waiting}s)"
    )
    rig.add_prefill(ADVISED, config)
    advised = Run(rig, "freeze", ADVISED, seed, profile=advised_profile).execute()
    # the deadlines in force for this engine's senders
    advised.deadlines = {state: advised_profile.deadline(engine, state) for state in STATES}
    shadow.deadlines = {state: p.deadline(engine, state) for state in STATES}
    return [shadow, advised], advice

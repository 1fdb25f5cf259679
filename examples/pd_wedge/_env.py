"""Process environment of the demo: loopback only, engines over TCP.

SGLang and both transfer engines read these variables when they are imported or
initialised, so the driver sets them before it starts the fork server that imports
SGLang once for every worker (see ``_procs``).
"""

from __future__ import annotations

import os

#: Set in the driver before any worker exists; inherited by every worker.
ENGINE_ENV = {
    # CommonKVManager advertises get_local_ip_auto(), i.e. the NIC address, without it.
    "SGLANG_HOST_IP": "127.0.0.1",
    # NIXL: UCX over TCP loopback (UCX would otherwise pick shared memory).
    "UCX_TLS": "tcp,self",
    "UCX_NET_DEVICES": "lo",
    "UCX_LOG_LEVEL": "error",
    # Mooncake: TCP transport only (no RDMA on this machine), peer-to-peer handshake.
    "MC_FORCE_TCP": "1",
    # Import-time chatter of SGLang's quantization modules on a CPU-only host.
    "PYTHONWARNINGS": "ignore",
    # Tokenizers' thread pool must not exist before the fork server forks.
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
}


def mooncake_transport_env(stall_timeout_s: float) -> dict[str, str]:
    """Mooncake's own bound on a stalled TCP write.

    It is set above the watchdog deadlines on purpose: when a decode freezes, the
    demo must show which component ends the wedge, and with these values Mooncake
    only gives up after stallguard's deadline has passed.
    """
    s = str(round(stall_timeout_s))
    return {"MC_TRANSFER_TIMEOUT": s, "MC_TCP_PROGRESS_TIMEOUT_SEC": s}


def apply(env: dict[str, str]) -> None:
    os.environ.update(env)

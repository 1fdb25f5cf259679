"""The default logging hook: one structured warning line per expiry."""

from __future__ import annotations

import logging
from typing import Any

from ._hooks import ExpiryHook, ExpiryHookFactory

__all__ = ["LoggingOnExpireHook"]

logger = logging.getLogger("stallguard")


def _init_logging_hook() -> ExpiryHook:
    def log_expiry(expiry: Any) -> None:
        verb = "forced failure" if expiry.enforced else "stall reported (report mode)"
        logger.warning(
            "stallguard %s: spec=%s key=%r state=%s reason=%s elapsed_s=%.3f deadline_s=%g",
            verb,
            expiry.spec,
            expiry.key,
            expiry.state_label,
            expiry.reason,
            expiry.elapsed,
            expiry.deadline,
            extra={
                "stallguard_spec": expiry.spec,
                "stallguard_key": repr(expiry.key),
                "stallguard_state": expiry.state_label,
                "stallguard_reason": expiry.reason,
                "stallguard_elapsed_s": expiry.elapsed,
                "stallguard_deadline_s": expiry.deadline,
                "stallguard_mode": expiry.mode,
                **{f"stallguard_attr_{k}": v for k, v in expiry.attributes.items()},
            },
        )

    return log_expiry


#: Logs one warning line per expiry to the ``stallguard`` logger, with the details as
#: ``extra`` fields (``stallguard_state``, ``stallguard_elapsed_s``...) for structured
#: log handlers.
LoggingOnExpireHook = ExpiryHookFactory(_init_logging_hook)

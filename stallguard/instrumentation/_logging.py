"""The default logging hook: one structured warning line per expiry."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ._hooks import ExpiryHook, ExpiryHookFactory

if TYPE_CHECKING:
    from .._details import Expiry

__all__ = ["LoggingOnExpireHook"]

logger = logging.getLogger("stallguard")


def _init_logging_hook() -> ExpiryHook:
    def log_expiry(expiry: Expiry[Any]) -> None:
        if not logger.isEnabledFor(logging.WARNING):
            return
        extra = {
            "stallguard_spec": expiry.spec,
            "stallguard_key": repr(expiry.key),
            "stallguard_state": expiry.state_label,
            "stallguard_reason": expiry.reason,
            "stallguard_elapsed_s": expiry.elapsed,
            "stallguard_deadline_s": expiry.deadline,
            "stallguard_mode": expiry.mode,
        }
        for name, value in expiry.attributes.items():
            extra[f"stallguard_attr_{name}"] = value
        logger.warning(
            "stallguard %s: spec=%s key=%r state=%s reason=%s elapsed_s=%.3f deadline_s=%g",
            "forced failure" if expiry.enforced else "stall reported (report mode)",
            expiry.spec,
            expiry.key,
            expiry.state_label,
            expiry.reason,
            expiry.elapsed,
            expiry.deadline,
            extra=extra,
        )

    return log_expiry


#: The logging hook (a default): one ``WARNING`` line per expiry on the ``stallguard``
#: logger, e.g. ``stallguard forced failure: spec=kv_sender key=7 state=Transferring
#: reason=state elapsed_s=121.000 deadline_s=120``. For structured log handlers the same
#: details are on the record as ``extra`` fields: ``stallguard_spec``,
#: ``stallguard_key`` (its ``repr``), ``stallguard_state``, ``stallguard_reason``,
#: ``stallguard_elapsed_s``, ``stallguard_deadline_s``, ``stallguard_mode``, and
#: ``stallguard_attr_<name>`` for each attribute attached with
#: :meth:`~stallguard.Watchdog.annotate`.
LoggingOnExpireHook = ExpiryHookFactory(_init_logging_hook)

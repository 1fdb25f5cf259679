"""Real SGLang PD servers (``sglang.launch_server`` prefill + decode, the Rust
``sglang-router``) with a decode frozen mid-transfer, without and with stallguard-sglang
enabled as docs/sglang.md tells users. See ``_main.py`` and docs/demo.md."""

"""STAND-IN for the ``vllm`` package (real-server rig only: .venv-realsrv's stand-ins).

SGLang 0.5.23's ``RotaryEmbedding.__init__`` (``layers/rotary_embedding/base.py``), on a
device that is neither CUDA nor one of SGLang's other platforms (a plain CPU without
``SGLANG_USE_CPU_ENGINE``, which needs SGLang's CPU kernels, not on PyPI), imports
``vllm._custom_ops.rotary_embedding`` as its "fallback kernel". Only ``forward_cuda``
calls it; on CPU ``forward_native`` runs. So an import that succeeds is all it needs.
"""

__version__ = "0.0.0+stallguard.standin"

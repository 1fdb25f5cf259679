"""tools/dev.py's modules (stdlib only, Python 3.11): run by ``python3 tools/dev.py``.

* :mod:`devlib.common` - paths, logging, running a command (with pip's progress), stamps,
  venv creation;
* :mod:`devlib.envs` - :class:`~devlib.envs.VenvSpec`, the one description of every
  environment (.venv, .venv-sglang0517, .venv-realsrv, .venv-vllm, .venv-docs), and the
  one builder that installs any of them;
* :mod:`devlib.locking` - the hashed locks in tools/lock/, resolved by ``uv pip compile``;
* :mod:`devlib.runners` - ``test``, ``demo``, ``docs``, ``lint``;
* :mod:`devlib.compiled` - ``test``'s last phase: the core tests against the compiled core;
* :mod:`devlib.cli` - the command line (``main``).
"""

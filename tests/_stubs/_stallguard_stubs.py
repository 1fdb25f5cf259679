# Activates the test-only stand-ins in tests/_stubs (see each stub's header for why the real
# package cannot be used here). Imported by `_stallguard_dev.pth`, which tools/dev.py writes
# into the site-packages of .venv and .venv-sglang0517, so every interpreter of those venvs,
# including multiprocessing `spawn` children and subprocesses, gets them before any test code.
# Must stay cheap: it runs at every interpreter start-up. Idempotent.
#   * triton:      meta-path finder (_triton_stub.py), installed here.
#   * torchvision: plain package tests/_stubs/torchvision, found because tests/_stubs is on
#                  sys.path (put there by the same .pth file); no dist-info on purpose.
import _triton_stub

_triton_stub.install()

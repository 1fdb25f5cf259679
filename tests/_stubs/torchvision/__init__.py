# Test-only stand-in for `torchvision` (PyTorch's vision library); no image is ever processed.
# Why not the real package: SGLang imports torchvision at module level (0.5.23:
# configs/nano_nemotron_vl.py -> multimodal/internvl_utils.py; 0.5.17:
# sglang/srt/utils/common.py imports `decode_jpeg` from torchvision.io), but no working
# torchvision exists for torch 2.13.0+cpu on PyPI: torchvision==0.28.0 installs, yet its
# _C.so links libtorch_cuda and import fails ("operator torchvision::nms does not exist"),
# and an unpinned torchvision pulls torch 2.14 plus ~4.5 GB of CUDA wheels.
# See shared/notes/sglang.md section 11.
#
# Deliberately has NO dist-info, so `importlib.metadata` reports torchvision as absent (note:
# transformers 5.19's `is_torchvision_available()` only uses `importlib.util.find_spec`, so it
# does see this stub; any torchvision op it would then call raises instead of computing).
# Found because tools/dev.py's `_stallguard_dev.pth` puts tests/_stubs on sys.path.
# Every public name not defined here is a class that raises when instantiated or called.
from torchvision._stub import InterpolationMode, module_getattr

__version__ = "0.0.0+stub"
__stallguard_stub__ = True
__getattr__ = module_getattr(__name__)

from torchvision import io, transforms

__all__ = ["InterpolationMode", "io", "transforms"]

# Part of the test-only torchvision stand-in (see tests/_stubs/torchvision/__init__.py).
from torchvision._stub import InterpolationMode, module_getattr

__stallguard_stub__ = True
__getattr__ = module_getattr(__name__)

from torchvision.transforms import functional, v2

__all__ = ["InterpolationMode", "functional", "v2"]

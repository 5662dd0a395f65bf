"""Let PyPI's CUDA-built torchvision import beside a CPU-only torch.

vLLM's qwen3_5 model module imports transformers' Qwen-VL image code, which imports
torchvision. PyPI ships torchvision for x86_64 linked against CUDA; next to CPU torch its
C++ extension fails to load, so the `torchvision::nms`/`qnms` operator schemas are never
defined and torchvision's own fake-kernel registration raises at import time. Defining
those two schemas first lets torchvision import (its image ops stay unavailable, which a
text-only model never calls).

The install script activates this through a `.pth` file on CPU machines only, so every
Python process in the environment (vLLM, Ray workers, tests) gets it. Torch is imported
lazily: the hook fires on the first `import torchvision`, not at interpreter start.
"""

from __future__ import annotations

import importlib.abc
import sys

_SIGNATURE = "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
_OPS = ("nms", "qnms")


def define_missing_torchvision_schemas() -> None:
    import torch

    if torch.version.cuda is not None:  # a CUDA torch loads torchvision's real ops
        return
    for name in _OPS:
        if not hasattr(torch.ops.torchvision, name):
            torch.library.define(f"torchvision::{name}", _SIGNATURE)


class _BeforeTorchvisionImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001
        if fullname == "torchvision":
            sys.meta_path.remove(self)
            define_missing_torchvision_schemas()
        return None  # let the normal finders import it


def install() -> None:
    if "torchvision" not in sys.modules and not any(isinstance(f, _BeforeTorchvisionImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _BeforeTorchvisionImport())

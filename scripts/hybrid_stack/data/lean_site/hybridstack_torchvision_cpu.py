# SPDX-License-Identifier: Apache-2.0
"""Lean profile startup hook: let torchvision import on the CPU-only torch.

Installed by ``hybrid-stack build --profile lean`` into the venv's
site-packages with a ``.pth`` line that imports it at interpreter start.

The lean profile's torch is the CPU build, but the only torchvision wheels the
index carries are CUDA builds: their ops library (``torchvision/_C.so``) cannot
load, torchvision notices (``extension._has_ops() is False``) and carries on,
except that ``torchvision/_meta_registrations.py`` registers fake kernels for
``torchvision::nms`` and ``torchvision::qnms`` without that check and so fails
with "operator torchvision::nms does not exist". vLLM's Qwen-VL family imports
transformers' Qwen2-VL image processing, which imports torchvision, so every
hybrid Qwen3.5 test would fail at model inspection.

This hook waits (a meta-path finder; nothing is imported at startup) until
``torchvision._meta_registrations`` is about to be imported and, only if the
ops library did not load, defines the schemas of those two ops. torchvision's
Python transforms then work; its compiled ops stay unavailable, as before.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
from typing import Any

_TARGET = "torchvision._meta_registrations"
_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_libs: list[Any] = []


def _define_missing_ops() -> None:
    import torch
    import torchvision.extension

    if torchvision.extension._has_ops():
        return
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _SCHEMAS:
        name = schema.split("(", 1)[0]
        if not torch._C._dispatch_has_kernel(f"torchvision::{name}"):
            with contextlib.suppress(RuntimeError):  # already defined
                lib.define(schema)
    _libs.append(lib)  # a Library's definitions live as long as the object


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> None:
        if name == _TARGET:
            sys.meta_path.remove(self)
            _define_missing_ops()
        return None


if not any(isinstance(f, _Hook) for f in sys.meta_path):
    sys.meta_path.insert(0, _Hook())

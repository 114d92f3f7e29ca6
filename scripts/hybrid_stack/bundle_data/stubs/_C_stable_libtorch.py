# SPDX-License-Identifier: Apache-2.0
"""Stub of vLLM's compiled ``_C_stable_libtorch`` extension (hybrid-stack bundle).

The GPU bundle carries vLLM's Python sources only. ``vllm.platforms.cuda``
imports this extension unconditionally to register the ``torch.ops._C`` kernels;
this stub lets that import succeed and registers NO compute kernels, so any
caller of a compiled op (``torch.ops._C.<op>``, ``vllm._custom_ops.<op>``) raises
when it is called: a test that needs compiled code fails, it never passes.

Only capability queries are answered, with "not supported" (which is true: the
compiled kernels are absent), because vLLM asks them at import time.
"""

from __future__ import annotations

from typing import Any

import torch

HYBRID_STACK_STUB = True
_CAPABILITY_QUERIES = (
    "cutlass_scaled_mm_supports_fp8",
    "cutlass_scaled_mm_supports_block_fp8",
    "cutlass_scaled_mm_supports_fp4",
    "cutlass_group_gemm_supported",
)


def _not_supported(cuda_device_capability: int) -> bool:
    return False


def _register() -> Any:
    lib = torch.library.Library("_C", "FRAGMENT")
    for name in _CAPABILITY_QUERIES:
        try:
            lib.define(f"{name}(int cuda_device_capability) -> bool")
            lib.impl(name, _not_supported, "CompositeExplicitAutograd")
        except RuntimeError:
            pass  # already defined by a real extension loaded earlier
    return lib


_LIB = _register()


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(
        f"vllm._C_stable_libtorch.{name}: compiled vLLM extensions are not in the "
        "hybrid-stack GPU bundle (this module is a stub)"
    )

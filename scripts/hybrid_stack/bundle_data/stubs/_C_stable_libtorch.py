# SPDX-License-Identifier: Apache-2.0
"""Stub of vLLM's compiled ``_C_stable_libtorch`` extension (hybrid-stack bundle).

The GPU bundle carries vLLM's Python sources only. ``vllm.platforms.cuda``
imports this extension unconditionally to register the ``torch.ops._C`` kernels;
this stub lets that import succeed and registers NO compute kernels, so any
caller of a compiled op (``torch.ops._C.<op>``, ``vllm._custom_ops.<op>``) raises
when it is called: a test that needs compiled code fails, it never passes.

Two kinds of ops are registered, neither of which computes anything:
- capability queries, answered "not supported" (which is true: the compiled
  kernels are absent), because vLLM asks them at import time;
- ``get_cuda_view_from_cpu_tensor`` (Model Runner V2's ``UvaBuffer``), which only
  builds a CUDA tensor over pinned host memory. With unified virtual addressing
  a pinned host buffer has the same address on the device, so a Python version
  (``__cuda_array_interface__`` over that address) does what csrc/cuda_view.cu
  does. A non-pinned input is first copied into a new pinned buffer, as there.
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


class _PinnedBytes:
    """A CUDA array interface over the bytes of a pinned host storage; it keeps
    the host tensor alive for as long as the CUDA view built from it lives."""

    def __init__(self, host: torch.Tensor) -> None:
        storage = host.untyped_storage()
        self.host = host
        self.__cuda_array_interface__ = {
            "shape": (storage.nbytes(),),
            "typestr": "|u1",
            "data": (storage.data_ptr(), False),
            "version": 3,
        }


def get_cuda_view_from_cpu_tensor(cpu_tensor: torch.Tensor) -> torch.Tensor:
    """CUDA tensor aliasing ``cpu_tensor``'s pinned memory (UVA); same shape,
    strides and dtype. Writes through either tensor are seen by the other."""
    if cpu_tensor.device.type != "cpu":
        raise RuntimeError("get_cuda_view_from_cpu_tensor: input tensor must be on CPU")
    if cpu_tensor.numel() == 0:
        return torch.empty(cpu_tensor.shape, dtype=cpu_tensor.dtype, device="cuda")
    host = cpu_tensor
    if not host.is_pinned():
        host = torch.empty(cpu_tensor.shape, dtype=cpu_tensor.dtype, pin_memory=True)
        host.copy_(cpu_tensor)
    raw = torch.as_tensor(_PinnedBytes(host), device="cuda")
    return raw.view(host.dtype).as_strided(host.shape, host.stride(), host.storage_offset())


def _register() -> Any:
    lib = torch.library.Library("_C", "FRAGMENT")
    ops = [
        (f"{name}(int cuda_device_capability) -> bool", name, _not_supported)
        for name in _CAPABILITY_QUERIES
    ]
    ops.append(
        (
            "get_cuda_view_from_cpu_tensor(Tensor cpu_tensor) -> Tensor",
            "get_cuda_view_from_cpu_tensor",
            get_cuda_view_from_cpu_tensor,
        )
    )
    for schema, name, fn in ops:
        try:
            lib.define(schema)
            lib.impl(name, fn, "CompositeExplicitAutograd")
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

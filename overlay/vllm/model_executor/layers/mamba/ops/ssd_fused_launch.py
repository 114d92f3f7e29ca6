# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Launches of the fused SSD prefill kernels without Triton's per-call binding.

``kernel[grid](*args, **meta)`` binds and specializes every argument on every
call (``JITFunction.run``: the type, 16-byte alignment and value class of each
of the kernels' 65-71 arguments, then a string cache key). ``launch`` builds
a cheaper key from the same facts, looks the compiled kernel up under it and
launches that (``CompiledKernel[grid]``); on a miss it takes the kernel from
``JITFunction.warmup`` with the same arguments, which compiles it if needed.
Measured on the H200's host (the stack's results/ssd_fused_launch-h200), host
time per fused prefill call at 1k-4k tokens: the Triton kernel 63-98 -> 52-87
us, the sm_90 kernel 117-189 -> 85-122 us (their GPU time: 29-230 us).

The key determines Triton's specialization: a tensor's dtype and whether its
address is a multiple of 16; for an int, whether it is 1, a multiple of 16 and
in int32 range (the three facts Triton specializes an int on); floats and
None by position; constexpr parameters and any other argument (a TMA
descriptor's dtype, block shape and layout) by value.
``test_launch_key_determines_the_specialization`` (tests/kernels/mamba/
test_ssd_fused.py, CPU) checks this against Triton's own argument binding.
What the JIT reads at each launch besides the arguments (its debug and
instrumentation knobs, pre-run hooks) is read at a key's first launch only;
launch hooks (``knobs.runtime.launch_enter_hook``) run on every launch.
"""

from collections.abc import Hashable
from typing import Any

import torch

from vllm.triton_utils import triton

_KERNELS: dict[Hashable, tuple[Any, tuple]] = {}
# per kernel: which of its parameters are constexprs (keyed by value)
_CONSTEXPR: dict[Any, tuple[bool, ...]] = {}

# TMA descriptors (the sm_90 form's x / B / C / out views)
_DESCRIPTOR_TYPES: tuple[type, ...] = ()
try:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    _DESCRIPTOR_TYPES = (TensorDescriptor,)
except ImportError:
    pass


_I32 = 2**31


def _other_key(a: Any) -> Hashable:
    if isinstance(a, _DESCRIPTOR_TYPES):  # (its base is 16-byte aligned)
        return a.base.dtype, tuple(a.block_shape), a.layout
    return a


def args_key(fn: Any, args: tuple) -> Hashable:
    """What decides Triton's specialization of ``fn`` for ``args`` (the
    arguments before its meta ones): calls with equal keys are specialized
    alike."""
    constexpr = _CONSTEXPR.get(fn)
    if constexpr is None:
        constexpr = _CONSTEXPR[fn] = tuple(p.is_constexpr for p in fn.params)
    # one expression per argument, no call per argument: this is host time on
    # every launch
    return tuple(
        [
            a
            if c
            else (a == 1, a % 16 == 0, -_I32 <= a < _I32)
            if type(a) is int
            else (a.dtype, a.data_ptr() % 16 == 0)
            if isinstance(a, torch.Tensor)
            else None
            if a is None or type(a) is float
            else _other_key(a)
            for a, c in zip(args, constexpr)
        ]
    )


def launch_key(fn: Any, args: tuple, meta: dict[str, Any]) -> Hashable:
    """The compiled kernel of ``fn[grid](*args, **meta)`` on the current
    device is the same for every call with this key."""
    return (
        fn,
        triton.runtime.driver.active.get_current_device(),
        args_key(fn, args),
        tuple(meta.items()),
    )


def launch(fn: Any, grid: int, args: tuple, meta: dict[str, Any]) -> None:
    """``fn[(grid,)](*args, **meta)``: the kernel's constexpr arguments in
    ``meta`` by name (with launch options such as num_warps), the others in
    ``args``, in the order of its signature."""
    if not isinstance(fn, triton.runtime.JITFunction):
        # the Triton interpreter, or a stand-in recording the launch
        fn[(grid,)](*args, **meta)
        return
    key = launch_key(fn, args, meta)
    hit = _KERNELS.get(key)
    if hit is None:
        kernel = fn.warmup(*args, grid=(grid,), **meta)
        if hasattr(kernel, "result"):  # compiled asynchronously
            kernel = kernel.result()
        # the constexpr arguments, positionally after args
        constexprs = tuple(meta[name] for name in fn.arg_names[len(args) :])
        hit = _KERNELS[key] = (kernel, constexprs)
    kernel, constexprs = hit
    kernel[(grid, 1, 1)](*args, *constexprs)

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Launches of the fused SSD prefill kernels without Triton's per-call binding.

A fused prefill is one kernel launch, so at small prefills (about 1k tokens)
its cost is host time. ``kernel[grid](*args, **meta)`` binds and specializes
every argument on every call (``JITFunction.run``: the type, 16-byte
alignment and value class of each of the kernels' 65-71 arguments, then a
string cache key). ``launch`` builds a cheaper key from the same facts, looks
the compiled kernel up under it and launches that; on a miss it takes the
kernel from ``JITFunction.warmup`` with the same arguments, which compiles it
if needed, and launches it through ``CompiledKernel[grid]``. The callers'
meta arguments are ``Meta`` objects made once per configuration (their items
are not hashed again per launch). The flag buffer and the workspace are kept
per stream (``scratch``).

The key determines Triton's specialization: a tensor's dtype and whether its
address is a multiple of 16; for an int, whether it is 1, a multiple of 16 and
in int32 range (the three facts Triton specializes an int on); floats and
None by position; constexpr parameters and any other argument by value.
``test_launch_key_determines_the_specialization`` (tests/kernels/mamba/
test_ssd_fused.py, CPU) checks this against Triton's own argument binding.
What the JIT reads at each launch besides the arguments (its debug and
instrumentation knobs, pre-run hooks) is read at a key's first launch only;
launch hooks (``knobs.runtime.launch_enter_hook``) run on every launch.

Private path: where no launch hook is registered, a cached kernel is
launched by calling ``CompiledKernel.run`` (the driver's launcher) with the
arguments ``CompiledKernel[grid]`` would pass it, less the launch metadata
and the two hook chains it would call on every launch. That argument list is
Triton's internal calling convention, so this path is taken only under the
releases in ``DIRECT_RUN_TRITON`` (``test_direct_run_matches_triton_runner``
checks it against each one's ``CompiledKernel.__getitem__``); under any
other release every launch goes through ``CompiledKernel[grid]``.
"""

from collections.abc import Callable, Hashable
from operator import attrgetter, itemgetter
from typing import Any

import torch

from vllm.triton_utils import triton

_KERNELS: dict[Hashable, tuple[Any, tuple]] = {}
# the same kernels under fast_key (at most FAST_KEYS, then cleared)
_FAST: dict[Hashable, tuple[Any, tuple]] = {}
FAST_KEYS = 4096
# per kernel (by id: the entry keeps it alive) and argument types: the
# kernel and the getters of its arguments keyed by value (constexprs, ints),
# of its tensors and of the others (fast_key); never cleared, so that a
# split's id stands for its kernel and types
_SPLITS: dict[Hashable, tuple[Any, Callable, Callable, Callable]] = {}
_dtype = attrgetter("dtype")
# per kernel: which of its parameters are constexprs (keyed by value)
_CONSTEXPR: dict[Any, tuple[bool, ...]] = {}

_I32 = 2**31

# Triton releases whose CompiledKernel[grid] runner calls
# ``self.run(gx, gy, gz, stream, function, packed_metadata, launch_metadata,
# enter_hook, exit_hook, *args)``, so that launch() may call run() itself.
DIRECT_RUN_TRITON = ("3.6", "3.8")
_DIRECT_RUN = getattr(triton, "__version__", "").startswith(
    tuple(v + "." for v in DIRECT_RUN_TRITON)
)


def _other_key(a: Any) -> Hashable:
    """The key of an argument that is neither a tensor, an int, a float nor
    None: the argument itself (by value)."""
    return a


# The flag constexprs both fused kernels take, in the order of meta_flags.
FLAG_NAMES = (
    "HAS_D",
    "D_HAS_HDIM",
    "HAS_Z",
    "HAS_DT_BIAS",
    "DT_SOFTPLUS",
    "HAS_INITSTATES",
    "WRITE_INTER",
    "WRITE_FINAL",
    "FINAL_HAS_INDICES",
)


def meta_flags(
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    initial_states: torch.Tensor | None,
    write_inter: bool,
    write_final: bool,
    final_has_indices: bool,
) -> tuple:
    """The values of FLAG_NAMES for a call of a fused kernel."""
    return (
        D is not None,
        D is not None and D.dim() == 2,
        z is not None,
        dt_bias is not None,
        dt_softplus,
        initial_states is not None,
        write_inter,
        write_final,
        final_has_indices,
    )


class Meta(dict):
    """A kernel's meta arguments (constexprs by name, launch options) for
    ``launch``, made once per configuration and not changed after: its hash
    is computed once (a plain dict's items are hashed on every launch)."""

    __slots__ = ("_hash",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._hash = hash(tuple(self.items()))

    def __hash__(self) -> int:  # type: ignore[override]
        return self._hash

    def _frozen(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("a launch Meta is not changed after it is made")

    __setitem__ = __delitem__ = update = pop = popitem = clear = _frozen  # type: ignore[assignment]
    setdefault = __ior__ = _frozen  # type: ignore[assignment]


def _constexpr(fn: Any) -> tuple[bool, ...]:
    """Which of fn's parameters are constexprs (cached per kernel)."""
    constexpr = _CONSTEXPR.get(fn)
    if constexpr is None:
        constexpr = _CONSTEXPR[fn] = tuple(p.is_constexpr for p in fn.params)
    return constexpr


def args_key(fn: Any, args: tuple) -> Hashable:
    """What decides Triton's specialization of ``fn`` for ``args`` (the
    arguments before its meta ones): calls with equal keys are specialized
    alike."""
    constexpr = _constexpr(fn)
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


def _getter(positions: list[int]) -> Callable[[tuple], tuple]:
    """The arguments at these positions, as a tuple (an itemgetter)."""
    if len(positions) > 1:
        return itemgetter(*positions)
    return lambda args: tuple(args[i] for i in positions)


def fast_key(fn: Any, args: tuple) -> Hashable:
    """A key that determines ``args_key(fn, args)``, built without a Python
    step per argument: the arguments' types, the ints by value, and the
    dtype and 16-byte alignment of each tensor; constexprs and any other
    argument by value (as in args_key); floats and None by type. Where
    args_key has one key for every value class of an int, this has one per
    value, so launch() keeps at most FAST_KEYS of them."""
    types = tuple(map(type, args))
    split = _SPLITS.get((id(fn), types))
    if split is None:
        values, tensors, others = [], [], []
        for i, (t, c) in enumerate(zip(types, _constexpr(fn))):
            if c or t is int:
                values.append(i)
            elif issubclass(t, torch.Tensor):
                tensors.append(i)
            elif t is not float and t is not type(None):
                others.append(i)
        split = _SPLITS[(id(fn), types)] = (
            fn,
            _getter(values),
            _getter(tensors),
            _getter(others),
        )
    _, get_values, get_tensors, get_others = split
    tensors = get_tensors(args)
    return (
        id(split),
        get_values(args),
        tuple(map(_dtype, tensors)),
        tuple([t.data_ptr() % 16 == 0 for t in tensors]),
        tuple([_other_key(a) for a in get_others(args)]),
    )


def launch_key(fn: Any, args: tuple, meta: Meta) -> Hashable:
    """The compiled kernel of ``fn[grid](*args, **meta)`` on the current
    device is the same for every call with this key."""
    return (
        fn,
        triton.runtime.driver.active.get_current_device(),
        args_key(fn, args),
        meta,
    )


# Per (device, stream): the fused kernels' flag buffer, which every launch
# leaves zeroed (ssd_fused, "Flag buffer"), and their fp32 state workspace,
# which a launch writes before it reads it; kept across calls (no memset
# kernel and no allocation per call). One per stream, so that launches on
# two streams never share one. Under CUDA graph capture each launch gets its
# own (the graph's memory: a kept buffer would be shared by graph replays
# and eager calls on other streams).
_SYNC: dict[tuple[int, int], torch.Tensor] = {}
_WORKSPACE: dict[tuple[int, int], torch.Tensor] = {}
# fp32 elements; a larger workspace (the Triton form's, one state per chunk
# and head: 32 KB each at 64 x 128) is allocated per call
WORKSPACE_CACHE_MAX = 1 << 23


def _stream_key(device: torch.device) -> tuple[int, int] | None:
    """(device, current stream) where buffers may be kept; None where not (a
    CPU device: the Triton interpreter; CUDA graph capture)."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return None
    index = device.index
    if index is None:
        index = torch.accelerator.current_device_index()
    return index, triton.runtime.driver.active.get_current_stream(index)


def _kept(
    kept: dict[tuple[int, int], torch.Tensor],
    key: tuple[int, int] | None,
    device: torch.device,
    numel: int,
    dtype: torch.dtype,
    zeroed: bool,
    floor: int,
) -> torch.Tensor:
    """A flat buffer of at least numel elements: the one kept under key
    (replaced by one of at least floor elements where too small), or a new
    one where key is None."""
    new = torch.zeros if zeroed else torch.empty
    if key is None:
        return new(numel, device=device, dtype=dtype)
    buf = kept.get(key)
    if buf is None or buf.shape[0] < numel:
        # (a buffer it replaces is freed in stream order, after the launches
        # that use it)
        buf = kept[key] = new(max(numel, floor), device=device, dtype=dtype)
    return buf


def scratch(
    device: torch.device, ws_numel: int, n_programs: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """What a launch of n_programs programs hands states over through: an
    fp32 workspace of at least ws_numel elements (flat, uninitialized) and
    the zeroed int32 flag buffer (the ticket counter, the count of finished
    programs and a flag per program: at least 2 + n_programs entries), which
    the launch leaves zeroed."""
    key = _stream_key(device)
    ws_key = key if ws_numel <= WORKSPACE_CACHE_MAX else None
    return (
        _kept(_WORKSPACE, ws_key, device, ws_numel, torch.float32, False, 1 << 20),
        _kept(_SYNC, key, device, 2 + n_programs, torch.int32, True, 4096),
    )


def _direct_run_ok() -> bool:
    """Whether launch() may call a cached kernel's run() itself: a release
    in DIRECT_RUN_TRITON and no launch hook registered (Triton's hook chains
    empty or unset)."""
    if not _DIRECT_RUN:
        return False
    rt = triton.knobs.runtime
    enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
    return (enter is None or getattr(enter, "calls", True) == []) and (
        leave is None or getattr(leave, "calls", True) == []
    )


def launch(fn: Any, grid: int, args: tuple, meta: Meta) -> None:
    """``fn[(grid,)](*args, **meta)``: the kernel's constexpr arguments in
    ``meta`` by name (with launch options such as num_warps; made once per
    configuration), the others in ``args``, in the order of its signature."""
    if not isinstance(fn, triton.runtime.JITFunction):
        # the Triton interpreter, or a stand-in recording the launch
        fn[(grid,)](*args, **meta)
        return
    driver = triton.runtime.driver.active
    device = driver.get_current_device()
    fast = (device, fast_key(fn, args), meta)
    hit = _FAST.get(fast)
    if hit is None:
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
        # through Triton, which loads the kernel's handles on its first launch
        kernel[(grid, 1, 1)](*args, *constexprs)
        if len(_FAST) >= FAST_KEYS:
            _FAST.clear()
        _FAST[fast] = hit
        return
    kernel, constexprs = hit
    if _direct_run_ok():
        # what CompiledKernel[grid](*args) does with no hooks registered
        # (its launch metadata is only read by hooks)
        kernel.run(
            grid, 1, 1, driver.get_current_stream(device), kernel.function,
            kernel.packed_metadata, None, None, None, *args, *constexprs,
        )  # fmt: skip
    else:
        kernel[(grid, 1, 1)](*args, *constexprs)

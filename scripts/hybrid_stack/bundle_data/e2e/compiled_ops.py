# SPDX-License-Identifier: Apache-2.0
"""The compiled vLLM ops the end-to-end harness provides, and why (GPU bundle only).

The bundle carries vLLM's Python sources without its compiled extensions (the
pinned wheel's ``_C`` needs torch 2.14; the GPU machine has another torch). The
engine, run as users run it (V1 engine, Model Runner V2, ``torch.compile`` with
full CUDA graphs, vLLM's Triton attention and the models' Triton/PyTorch
paths), reaches the compiled ``torch.ops._C`` library in two ways only, and this
module answers both under the ops' own names and schemas (taken from the tree's
``csrc/torch_bindings.cpp`` when the bundle is built, ``op_schemas.json``):

``IMPLEMENTED``
    ops the engine calls; each has a Python implementation with the compiled
    op's semantics and a CPU test against them (tests/venv_e2e/).

``LOOKUP_ONLY``
    ops that layers look up while they are built (``self.op =
    torch.ops._C.silu_and_mul`` in ``SiluAndMul.__init__``) but that the default
    settings never call: with ``torch.compile`` the custom ops are off and the
    layers run their PyTorch forms. Their schema is defined so the lookup
    answers; a call raises, naming the op, so a path that needs compiled code
    fails loudly instead of computing something else. ``COUNTS`` records every
    call of both kinds, and the harness reports it.

With e2e/ on the import path, the dist-info beside this file makes ``plugin``
a vLLM general plugin, so every engine process (the in-process engine core and
tensor-parallel workers alike) registers the shims before it builds a model.

An op vLLM probes with ``hasattr(torch.ops._C, name)`` to choose between its
compiled form and a fallback must never be defined here: that would switch the
engine onto a path that then raises. The bundle builder refuses such a name.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SCHEMAS = Path(__file__).with_name("op_schemas.json")
NAMESPACE = "_C"

COUNTS: Counter[str] = Counter()
# The library of this process's registration (dropping it unregisters the ops).
_REGISTERED: list[torch.library.Library] = []


def weak_ref_tensor(input: torch.Tensor) -> torch.Tensor:
    """A tensor over ``input``'s memory (same dtype, shape, strides, offset) that
    does not own it, as csrc's weak_ref_tensor (``from_blob`` without a deleter):
    the CUDA graph wrapper keeps such views of graph outputs so the graph pool
    can be reused; the caller keeps the memory alive."""
    storage = input.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(
        storage.data_ptr(), input.device, storage.nbytes()
    )
    out = torch.empty(0, dtype=input.dtype, device=input.device)
    return out.set_(alias, input.storage_offset(), input.shape, input.stride())


# name -> (implementation, why the engine needs it)
IMPLEMENTED: dict[str, tuple[Callable[..., Any], str]] = {
    "weak_ref_tensor": (
        weak_ref_tensor,
        "CUDA graph wrapper (vllm/compilation/cuda_graph.py) keeps non-owning "
        "views of captured outputs",
    ),
}

# name -> who looks it up (never called with the harness's settings)
LOOKUP_ONLY: dict[str, str] = {
    "silu_and_mul": "SiluAndMul.__init__ (MLP of every model)",
    "mul_and_silu": "MulAndSilu.__init__",
    "relu_squared": "ReLUSquaredActivation.__init__ (Nemotron-H MLP)",
    "gelu_and_mul": "GeluAndMul.__init__",
    "gelu_tanh_and_mul": "GeluAndMul.__init__ (tanh)",
    "rms_norm": "vLLM IR rms_norm 'vllm_c' provider",
    "fused_add_rms_norm": "vLLM IR fused_add_rms_norm 'vllm_c' provider",
    "rotary_embedding": "RotaryEmbedding custom op",
    "static_scaled_fp8_quant": "fp8 quant custom op registration",
    "dynamic_scaled_fp8_quant": "fp8 quant custom op registration",
    "dynamic_per_token_scaled_fp8_quant": "fp8 quant custom op registration",
    "silu_and_mul_quant": "compile fusion pass pattern tables",
    "rms_norm_static_fp8_quant": "compile fusion pass pattern tables",
    "fused_add_rms_norm_static_fp8_quant": "compile fusion pass pattern tables",
    "rms_norm_dynamic_per_token_quant": "compile fusion pass pattern tables",
    "silu_and_mul_per_block_quant": "compile fusion pass pattern tables",
    "fused_qk_norm_rope": "compile fusion pass pattern tables",
}


def load_schemas(path: Path = SCHEMAS) -> dict[str, str]:
    """``name -> schema`` of the ``_C`` ops, as the tree's csrc defines them."""
    return json.loads(path.read_text())[NAMESPACE]


def _counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def impl(*args: Any, **kwargs: Any) -> Any:
        COUNTS[name] += 1
        return fn(*args, **kwargs)

    return impl


def _raising(name: str) -> Callable[..., Any]:
    def impl(*args: Any, **kwargs: Any) -> Any:
        COUNTS[name] += 1
        raise RuntimeError(
            f"torch.ops.{NAMESPACE}.{name} was called, but the hybrid-stack bundle "
            "has no compiled vLLM kernels (only lookups of it are provided): run "
            "with the harness's settings, or add a tested implementation to "
            "e2e/compiled_ops.py IMPLEMENTED"
        )

    return impl


def register(schemas: dict[str, str] | None = None) -> torch.library.Library:
    """Define and implement the ops above in ``torch.ops._C``; ops a loaded
    compiled extension already defines are left to it. Returns the library
    (keep it alive: dropping it unregisters the ops)."""
    schemas = load_schemas() if schemas is None else schemas
    missing = sorted(n for n in (*IMPLEMENTED, *LOOKUP_ONLY) if n not in schemas)
    if missing:
        raise RuntimeError(
            f"op_schemas.json defines no {NAMESPACE} op named {', '.join(missing)}: "
            "rebuild the bundle from a tree that has them, or drop them from "
            "e2e/compiled_ops.py"
        )
    lib = torch.library.Library(NAMESPACE, "FRAGMENT")
    table = {n: _counted(n, fn) for n, (fn, _) in IMPLEMENTED.items()}
    table.update({n: _raising(n) for n in LOOKUP_ONLY})
    for name, impl in table.items():
        if hasattr(getattr(torch.ops, NAMESPACE), name):
            continue
        lib.define(schemas[name])
        lib.impl(name, impl, "CompositeExplicitAutograd")
    return lib


def plugin() -> None:
    """vLLM general plugin (``vllm.general_plugins``): register once per process."""
    if not _REGISTERED:
        _REGISTERED.append(register())

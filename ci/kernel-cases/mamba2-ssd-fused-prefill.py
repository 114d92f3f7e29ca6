# SPDX-License-Identifier: Apache-2.0
"""Kernel cases of the entry mamba2-ssd-fused-prefill for `hybrid-stack kernel-stats`.

Named by the entry's ``kernel_cases`` in patches/series.toml; loaded by the
probe (scripts/hybrid_stack/kstats_probe.py) inside the build venv, in the
applied tree. Each group calls the fused kernel's real launcher on ``meta``
tensors at model-sized inputs; the probe compiles the captured launch.
"""

from __future__ import annotations

import math
from typing import Any

import kstats_probe  # the probe running this file (see kstats_probe.load_cases)


def _ssd_fused_cases(arch: int) -> Any:
    """The fused kernel's portable Triton form, through its real launcher."""
    import torch
    from vllm.model_executor.layers.mamba.ops import ssd_fused

    meta = "meta"

    def launch(name: str, *, heads: int, groups: int, chunk: int, dtype: torch.dtype,
               seqs: int = 2, tokens: int = 4096, z: bool = False, d_dim: bool = False,
               init: bool = False, inter: bool = False) -> Any:  # fmt: skip
        hd, ds = 64, 128
        nchunks = seqs * math.ceil(tokens / seqs / chunk)

        def t(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
            return torch.empty(*shape, device=meta, dtype=dt)

        i32 = torch.int32

        def call() -> None:
            ssd_fused._mamba_chunk_scan_fused_fwd(
                t(tokens, heads, hd), t(tokens, heads), t(heads, dt=torch.float32),
                t(tokens, groups, ds), t(tokens, groups, ds), chunk,
                t(seqs + 1, dt=i32), t(nchunks + 1, dt=i32), t(seqs, dt=i32),
                t(nchunks, dt=i32), t(tokens, heads, hd),
                D=t(heads, hd, dt=torch.float32) if d_dim else t(heads, dt=torch.float32),
                z=t(tokens, heads, hd) if z else None,
                dt_bias=t(heads, dt=torch.float32),
                initial_states=t(seqs, heads, hd, ds, dt=torch.float32) if init else None,
                dt_softplus=True,
                return_intermediate_states=inter,
                state_dtype=torch.float32,
                final_states_out=None if inter else t(8, heads, hd, ds, dt=torch.float32),
                final_state_indices=None if inter else t(seqs, dt=i32),
            )  # fmt: skip

        real, args, kwargs = kstats_probe.capture(ssd_fused, "_ssd_fused_varlen_kernel", call)
        return name, real, args, kwargs

    bf16 = torch.bfloat16
    yield launch("granite-small bf16 c256", heads=128, groups=1, chunk=256, dtype=bf16)  # fmt: skip
    yield launch("granite-small bf16 c256 init+inter", heads=128, groups=1, chunk=256,
                 dtype=bf16, init=True, inter=True)  # fmt: skip
    yield launch("nemotron-h bf16 c128 g8", heads=128, groups=8, chunk=128, dtype=bf16)  # fmt: skip
    yield launch("fp32 c256 g2 z D(dim) init", heads=8, groups=2, chunk=256,
                 dtype=torch.float32, z=True, d_dim=True, init=True)  # fmt: skip


# case name -> why ptxas serializing its wgmma is accepted there
WGMMA_SERIAL_OK = {
    "fp32 c256 g2 z D(dim) init": "fp32 inputs (tf32 dots at 255 registers): "
    "the fp32 path is for exactness, its speed is not a target",
}

GROUPS = (_ssd_fused_cases,)

# SPDX-License-Identifier: Apache-2.0
"""Kernel cases of the entry mamba2-ssd-fused-prefill-sm90 for `hybrid-stack kernel-stats`.

Named by the entry's ``kernel_cases`` in patches/series.toml; loaded by the
probe (scripts/hybrid_stack/kstats_probe.py) inside the build venv, in the
applied tree. The group calls the sm_90 form's real launcher on ``meta``
tensors at model-sized inputs; the probe compiles the captured launch.
"""

from __future__ import annotations

import math
from typing import Any

import kstats_probe  # the probe running this file (see kstats_probe.load_cases)


def _ssd_fused_sm90_cases(arch: int) -> Any:
    """The fused kernel's sm_90 form (Gluon), launched through its real
    launcher on meta tensors: granite / Nemotron-H dims, bf16, headdim 64."""
    import torch
    import triton
    from vllm.model_executor.layers.mamba.ops import ssd_fused_sm90 as sm90

    if arch != 90:
        raise kstats_probe.CasesSkipped("the sm_90 form (Gluon, wgmma + TMA) is for sm_90 only")
    if not sm90.HAS_GLUON:
        versions = "/".join(sm90.GLUON_TRITON_VERSIONS)
        raise kstats_probe.CasesSkipped(
            f"the sm_90 form needs Triton {versions} (this is {triton.__version__}); "
            "compile it with --triton 3.6.0"
        )
    meta = "meta"

    def launch(name: str, *, heads: int, groups: int, chunk: int, seqs: int = 2,
               tokens: int = 4096, inter: bool = False, run: int,
               ws: bool = False) -> Any:  # fmt: skip
        hd, ds = 64, 128
        nchunks = seqs * math.ceil(tokens / seqs / chunk)

        def t(*shape: int, dt: torch.dtype = torch.bfloat16) -> torch.Tensor:
            return torch.empty(*shape, device=meta, dtype=dt)

        f32, i32 = torch.float32, torch.int32

        def call() -> None:
            sm90.launch(
                t(tokens, heads, hd), t(tokens, heads), t(heads, dt=f32),
                t(tokens, groups, ds), t(tokens, groups, ds), chunk,
                t(nchunks + 1, dt=i32), t(seqs, dt=i32), t(nchunks, dt=i32),
                t(tokens, heads, hd), t(heads, dt=f32), None, t(heads, dt=f32), None,
                True, (0.0, float("inf")),
                t(nchunks, heads, hd, ds, dt=f32) if inter else None,
                None if inter else t(8, heads, hd, ds, dt=f32),
                None if inter else t(seqs, dt=i32),
                not inter,
                sm90.LaunchConfig(run_chunks=run, warp_specialize=ws),
            )  # fmt: skip

        # runs of `run` chunks, on one warpgroup or (ws) warp-specialized
        real, args, kwargs = kstats_probe.capture(sm90, "_ssd_fused_sm90_kernel", call)
        return name, real, args, kwargs

    yield launch("sm90 runs: granite-small bf16 c256", heads=128, groups=1, chunk=256,
                 seqs=8, run=8)  # fmt: skip
    yield launch("sm90 runs: nemotron-h bf16 c128 g8 inter", heads=128, groups=8,
                 chunk=128, seqs=8, inter=True, run=16)  # fmt: skip
    # warp-specialized: one head per program (16 chunks), and ranges of part
    # of a head (16 of its 32 chunks: the form with hand-overs and the 4-deep
    # ring, which runs where ranges cross heads)
    yield launch("sm90 ws: granite-small bf16 c256 heads", heads=128, groups=1,
                 chunk=256, seqs=8, run=16, ws=True)  # fmt: skip
    yield launch("sm90 ws: nemotron-h bf16 c128 g8 inter ranges", heads=128,
                 groups=8, chunk=128, seqs=8, inter=True, run=16, ws=True)  # fmt: skip


GROUPS = (_ssd_fused_sm90_cases,)

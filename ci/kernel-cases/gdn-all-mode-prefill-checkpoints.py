# SPDX-License-Identifier: Apache-2.0
"""Kernel cases of the entry gdn-all-mode-prefill-checkpoints for `hybrid-stack kernel-stats`.

Named by the entry's ``kernel_cases`` in patches/series.toml; loaded by the
probe (scripts/hybrid_stack/kstats_probe.py) inside the build venv, in the
applied tree. The group calls ``chunk_gated_delta_rule_fwd_h`` (the FLA GDN
chunk prefill's state pass) on ``meta`` tensors at Qwen3.5-9B-like /
Qwen3-Next dims (16 q/k heads, 32 v heads, head dim 128, bf16, one 32k-token
sequence), once without checkpoints (the kernel's 0.33.0 form) and with
checkpoints at block size 576 into an fp32 state cache (stored after each
chunk's update) and into a bf16 one (h's dtype: stored beside the per-chunk
h store), and compiles each autotune config of 4 warps for all three, side
by side: a checkpoint variant must not cost registers or spills in the loop
that the plain one does not (the 2-warp configs spill without checkpoints
already and are left out).

The kernel is autotuned and has heuristics: the launcher's captured launch
lacks them, so the case fills in the heuristics' constexprs and each
config's BV / warps / stages itself. Unlike a GPU launch, the probe types
integer arguments equal to 1 (the block table's column stride) as i32
rather than specialising them to constants; register counts may differ
from the GPU build by a few.
"""

from __future__ import annotations

from typing import Any

import kstats_probe  # the probe running this file (see kstats_probe.load_cases)

QK_HEADS, V_HEADS, HEAD_DIM, TOKENS, BLOCK_SIZE = 16, 32, 128, 32768, 576


def _chunk_h_checkpoint_cases(arch: int) -> Any:
    """chunk_gated_delta_rule_fwd_h with and without block checkpoints"""
    import torch
    from vllm.third_party.flash_linear_attention.ops import chunk_delta_h

    meta, bf16, f32, i32 = "meta", torch.bfloat16, torch.float32, torch.int32
    H, Hg, K, V, T = V_HEADS, QK_HEADS, HEAD_DIM, HEAD_DIM, TOKENS
    chunk = chunk_delta_h.FLA_CHUNK_SIZE
    blocks = -(-T // BLOCK_SIZE)

    def t(*shape: int, dt: torch.dtype = bf16) -> torch.Tensor:
        return torch.empty(*shape, device=meta, dtype=dt)

    def capture(checkpoints: Any) -> tuple[Any, dict]:
        def call() -> None:
            chunk_delta_h.chunk_gated_delta_rule_fwd_h(
                k=t(1, T, Hg, K), w=t(1, T, H, K), u=t(1, T, H, V), g=t(1, T, H, dt=f32),
                initial_state=t(1, H, V, K, dt=f32), output_final_state=True,
                cu_seqlens=t(2, dt=i32), chunk_indices=t(T // chunk, 2, dt=i32),
                chunk_offsets=t(2, dt=torch.int64), checkpoints=checkpoints,
            )  # fmt: skip

        heuristics, args, kwargs = kstats_probe.capture(
            chunk_delta_h, "chunk_gated_delta_rule_fwd_kernel_h_blockdim64", call
        )
        assert not args
        kwargs = dict(kwargs)
        # heuristics (USE_G, ..., STORE_CHECKPOINTS) from the launch's arguments
        for name, rule in heuristics.values.items():
            kwargs[name] = rule(kwargs)
        return heuristics.fn, kwargs

    def checkpoints(dt: torch.dtype) -> Any:
        return chunk_delta_h.ChunkStateCheckpoints(
            states=t(1 + blocks, H, V, K, dt=dt),
            block_table=t(1, blocks, dt=i32),
            num_computed_tokens=t(1, dt=i32),
            block_size=BLOCK_SIZE,
        )

    variants = [
        ("off", *capture(None)),
        ("fp32", *capture(checkpoints(f32))),
        ("bf16", *capture(checkpoints(bf16))),
    ]
    tuner = variants[0][1]
    for cfg in tuner.configs:
        if cfg.num_warps != 4:
            continue
        label = f"BV{cfg.kwargs['BV']} w{cfg.num_warps} s{cfg.num_stages}"
        for variant, tuned, kwargs in variants:
            launch = {**kwargs, **cfg.kwargs}
            launch.update(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            yield f"{label} ckpt {variant}", tuned.fn, (), launch


GROUPS = (_chunk_h_checkpoint_cases,)

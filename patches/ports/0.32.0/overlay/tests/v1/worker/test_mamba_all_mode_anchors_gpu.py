# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`MambaAllModeAnchors` on the GPU: the tracker Model Runner V2 runs every
step in mamba_cache_mode="all" gives the CPU tracker's anchors over random
steps (reordered and partial batches, -1 rows, padding, preemption,
acceptance), and its `consume_with_conv` / `stage` / `reset` never
synchronize with the host."""

import random

import pytest
import torch

from vllm.v1.attention.backends.utils import NULL_BLOCK_ID
from vllm.v1.worker.gpu.model_states.mamba_hybrid import MambaAllModeAnchors

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MAX_NUM_REQS = 64


def _random_steps(seed: int, num_spec: int, num_steps: int = 200):
    rng = random.Random(seed)
    for _ in range(num_steps):
        n = rng.randint(1, MAX_NUM_REQS)
        rows = rng.sample(range(MAX_NUM_REQS), n)
        # Filtered rows under pipeline parallelism.
        rows = [r if rng.random() > 0.05 else -1 for r in rows]
        slots = [[rng.randint(1, 10**6) for _ in range(num_spec + 1)] for _ in range(n)]
        for s in slots:
            if rng.random() < 0.1:  # a padded row: null write slot
                s[0] = NULL_BLOCK_ID
        accepted = [rng.randint(1, num_spec + 1) for _ in range(MAX_NUM_REQS)]
        resets = rng.sample(range(MAX_NUM_REQS), rng.randint(0, 3))
        yield rows, slots, accepted, resets


@pytest.mark.parametrize("num_spec", [0, 1, 3])
def test_gpu_tracker_matches_cpu(num_spec: int) -> None:
    cpu = MambaAllModeAnchors(MAX_NUM_REQS, num_spec, torch.device("cpu"))
    gpu = MambaAllModeAnchors(MAX_NUM_REQS, num_spec, torch.device("cuda"))
    for rows, slots, accepted, resets in _random_steps(num_spec, num_spec):
        idx = torch.tensor(rows, dtype=torch.int32)
        acc = torch.tensor(accepted, dtype=torch.int32)
        want = cpu.consume_with_conv(idx, acc)
        got = gpu.consume_with_conv(idx.cuda(), acc.cuda())
        assert torch.equal(got.cpu(), want)
        spec = torch.tensor(slots, dtype=torch.int32)
        cpu.stage(idx, spec)
        gpu.stage(idx.cuda(), spec.cuda())
        for r in resets:
            cpu.reset(r)
            gpu.reset(r)
        # The sink row (last) takes every -1 row's stage in any order.
        assert torch.equal(gpu.staged[:-1].cpu(), cpu.staged[:-1])


def test_tracker_step_does_not_sync() -> None:
    num_spec = 2
    anchors = MambaAllModeAnchors(MAX_NUM_REQS, num_spec, torch.device("cuda"))
    idx = torch.randperm(MAX_NUM_REQS, device="cuda")[:17]
    acc = torch.randint(1, num_spec + 2, (MAX_NUM_REQS,), device="cuda")
    spec = torch.randint(1, 1000, (17, num_spec + 1), device="cuda")
    torch.accelerator.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            anchors.consume_with_conv(idx, acc)
            anchors.stage(idx, spec)
            anchors.reset(5)
    finally:
        torch.cuda.set_sync_debug_mode("default")

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Empty sequences in a varlen Mamba2 SSD prefill batch.

A sequence with no tokens (a repeated ``cu_seqlens`` entry; its
``last_chunk_indices`` entry is -1) has no chunks. Contract: its final state
is its initial state, or zeros without initial states, and the sequences
around it are computed as if it were not there. Checked against a float64
token-by-token recurrence, with the final states returned (vLLM 0.32.0's
chain has no in-kernel write into cache slots).

Runs on a GPU, or on the CPU under the Triton interpreter in fp32:

    TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES="" \\
        pytest tests/kernels/mamba/test_ssd_varlen_empty_seq.py
"""

import os

import pytest
import torch

from vllm.model_executor.layers.mamba.ops.ssd_combined import (
    mamba_chunk_scan_combined_varlen,
)
from vllm.platforms import current_platform
from vllm.v1.attention.backends.mamba2_attn import compute_varlen_chunk_metadata

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(
    not (current_platform.is_cuda_alike() or INTERPRETER),
    reason="needs a CUDA-alike GPU or the Triton interpreter (TRITON_INTERPRET=1)",
)


def reference(x, dt, A, B, C, D, lens, init):
    """float64 recurrence, one token at a time: h = exp(dt A) h + dt x B^T,
    y = h C + D x. Returns (y, final state of every sequence)."""
    x, dt, A, B, C, D = (t.double().cpu() for t in (x, dt, A, B, C, D))
    T, H, P = x.shape
    G, N = B.shape[1:]
    Bh = B.repeat_interleave(H // G, dim=1)
    Ch = C.repeat_interleave(H // G, dim=1)
    y = torch.zeros(T, H, P, dtype=torch.float64)
    finals, start = [], 0
    for s, n in enumerate(lens):
        h = init[s].double().cpu() if init is not None else torch.zeros(H, P, N)
        h = h.double()
        for t in range(start, start + n):
            h = torch.exp(dt[t] * A)[:, None, None] * h + (
                dt[t][:, None, None] * x[t][:, :, None] * Bh[t][:, None]
            )
            y[t] = (h * Ch[t][:, None]).sum(-1) + D[:, None] * x[t]
        start += n
        finals.append(h)
    return y, torch.stack(finals)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize(
    "lens",
    [
        [37, 0, 50, 0, 0, 20],  # empty sequences between non-empty ones
        [0, 0, 40, 9],  # empty first sequences
        [25, 0],  # an empty last sequence
    ],
)
@pytest.mark.parametrize("use_init", [True, False])
def test_empty_sequences(lens, use_init):
    device = "cpu" if INTERPRETER else current_platform.device_type
    g = torch.Generator(device=device).manual_seed(sum(lens) + use_init)
    T, H, P, G, N, chunk = sum(lens), 4, 16, 2, 16, 16

    def r(*s):
        return torch.randn(*s, device=device, generator=g)

    x, B, C = r(T, H, P), r(T, G, N), r(T, G, N)
    dt = torch.nn.functional.softplus(r(T, H) - 1.0)
    A = -torch.rand(H, device=device, generator=g) - 0.5
    D = r(H)
    init = r(len(lens), H, P, N) if use_init else None
    cu = torch.tensor([0, *lens], device=device).cumsum(0).to(torch.int32)
    cu_chunk, last, seq_idx = compute_varlen_chunk_metadata(cu, chunk)
    assert (last == -1).sum() == lens.count(0)
    out = torch.full_like(x, float("nan"))
    finals = mamba_chunk_scan_combined_varlen(
        x, dt, A, B, C, chunk, cu, cu_chunk, last, seq_idx, out, D=D,
        initial_states=init, state_dtype=torch.float32,
    )  # fmt: skip
    ref_y, ref_finals = reference(x, dt, A, B, C, D, lens, init)
    assert not out.isnan().any()
    # fp32 on the CPU; tf32 dots on a GPU
    tol = 1e-5 if INTERPRETER else 5e-3
    assert rel_err(out, ref_y) < tol
    for s, n in enumerate(lens):
        err = rel_err(finals[s], ref_finals[s]) if ref_finals[s].norm() else 0.0
        if n == 0 and not use_init:
            assert (finals[s] == 0).all(), f"empty sequence {s}: not zeros"
        else:
            assert err < tol, f"sequence {s} (length {n}): final state error {err}"

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Block-boundary state checkpoints out of the chunked GDN prefill.

``ChunkStateCheckpoints`` makes ``chunk_gated_delta_rule_fwd_h`` store the
state at every block boundary inside a prefill into that block's state slot,
in the same pass. These tests check, against a plain fp32 recurrence and
against the kernel's own per-chunk states:

- parity: outputs, final states and chunk states are bit-identical with
  checkpoints on and off; every checkpoint equals the reference state at its
  position (varlen: shorter than a chunk, exactly one chunk, many chunks,
  lengths not a multiple of 64, random initial states);
- confinement: every slot the step does not own as a checkpoint slot keeps
  its poison, including the null slot and the rows of misaligned sequences;
- resume: prefilling the rest of each sequence from each checkpoint gives the
  outputs and final state of the full prefill.

The slots expected are ``get_mamba_all_mode_state_slots``'s checkpoint slots,
so the kernel and the KV cache manager agree on which block holds which state.

The ``interpreter`` cases run on the CPU under ``TRITON_INTERPRET=1`` in fp32
(the interpreter's bf16 ``tl.dot`` is not usable); the ``gpu`` cases run bf16
at model-like sizes on CUDA.
"""

import os

import pytest
import torch
import torch.nn.functional as F

from vllm.third_party.flash_linear_attention.ops import (
    ChunkStateCheckpoints,
    chunk_delta_h,
    chunk_gated_delta_rule,
    chunk_o,
    chunk_scaled_dot_kkt,
)
from vllm.third_party.flash_linear_attention.ops.chunk import (
    chunk_gated_delta_rule_fwd,
)
from vllm.third_party.flash_linear_attention.ops.chunk_delta_h import (
    CHECKPOINT_NULL_SLOT,
    chunk_gated_delta_rule_fwd_h,
    chunk_gated_delta_rule_fwd_kernel_h_blockdim64,
)
from vllm.third_party.flash_linear_attention.ops.cumsum import chunk_local_cumsum
from vllm.third_party.flash_linear_attention.ops.index import (
    prepare_chunk_offsets,
)
from vllm.third_party.flash_linear_attention.ops.utils import FLA_CHUNK_SIZE
from vllm.triton_utils import tl
from vllm.v1.kv_cache_interface import get_mamba_all_mode_state_slots

BT = FLA_CHUNK_SIZE
POISON = 7.0

interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton interpreter test: set TRITON_INTERPRET=1 "
    '(and CUDA_VISIBLE_DEVICES="") to run it on the CPU.',
)
gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="bf16 model-size case: needs CUDA (the CPU runs the interpreter cases).",
)


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def interpreted_fla_ops(monkeypatch):
    """The FLA kernels call ``exp`` / ``exp2`` through module-level aliases of
    ``tl.exp`` / ``tl.exp2``, which the Triton interpreter does not patch (it
    patches the ``tl`` module it finds in a kernel's globals). Route the
    aliases through ``tl`` for the interpreter cases; compiled kernels are
    unaffected (these cases never compile)."""
    for mod in (chunk_delta_h, chunk_o, chunk_scaled_dot_kkt):
        monkeypatch.setattr(mod, "exp", lambda x: tl.exp(x))
        if hasattr(mod, "exp2"):
            monkeypatch.setattr(mod, "exp2", lambda x: tl.exp2(x))


# ----------------------------------------------------------------------------
# Reference and fixtures
# ----------------------------------------------------------------------------


def reference_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    h0: torch.Tensor,
    cu_seqlens: list[int],
    positions: list[list[int]],
) -> tuple[torch.Tensor, torch.Tensor, list[dict[int, torch.Tensor]]]:
    """Token-by-token fp32 recurrence, state ``S[h]`` of shape ``[V, K]``:

    ``S = exp(g_t) S;  S += beta_t (v_t - S k_t) k_t^T;  o_t = scale S q_t``.

    q, k: ``[T, Hg, K]``; v: ``[T, H, V]``; g, beta: ``[T, H]``; h0:
    ``[N, H, V, K]``. Returns the outputs ``[T, H, V]``, the final states and,
    per sequence, the state after ``p`` of its tokens for each ``p`` in
    ``positions[n]``.
    """
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    H, Hg = v.shape[1], k.shape[1]
    q = q.repeat_interleave(H // Hg, dim=1)
    k = k.repeat_interleave(H // Hg, dim=1)
    o = torch.empty_like(v)
    finals, states = [], []
    for n in range(len(cu_seqlens) - 1):
        bos, eos = cu_seqlens[n], cu_seqlens[n + 1]
        S = h0[n].float().clone()
        taken = {0: S.clone()} if 0 in positions[n] else {}
        for t in range(bos, eos):
            S = S * g[t].exp()[:, None, None]
            v_new = v[t] - torch.einsum("hvk,hk->hv", S, k[t])
            S = S + beta[t][:, None, None] * v_new[:, :, None] * k[t][:, None, :]
            o[t] = scale * torch.einsum("hvk,hk->hv", S, q[t])
            if t + 1 - bos in positions[n]:
                taken[t + 1 - bos] = S.clone()
        finals.append(S)
        states.append(taken)
    return o, torch.stack(finals), states


def make_inputs(
    lens: list[int],
    Hg: int,
    H: int,
    K: int,
    V: int,
    dtype: torch.dtype,
    seed: int,
):
    device = _device()
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    T = sum(lens)
    q = F.normalize(rand(1, T, Hg, K), p=2, dim=-1).to(dtype)
    k = F.normalize(rand(1, T, Hg, K), p=2, dim=-1).to(dtype)
    v = rand(1, T, H, V).to(dtype)
    # Gates close to 1 keep the states far from 0 over a few chunks.
    g = F.logsigmoid(rand(1, T, H) + 4.0)
    beta = rand(1, T, H).sigmoid()
    h0 = 0.5 * rand(len(lens), H, V, K)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=device)
    return q, k, v, g, beta, h0, cu, cu_seqlens


def make_slots(
    lens: list[int],
    starts: list[int],
    block_size: int,
    pool_dtype: torch.dtype,
    H: int,
    V: int,
    K: int,
    seed: int,
    extra_slots: int = 5,
):
    """A poisoned state pool and a strided block table: each sequence owns a
    row of distinct slots (slot 0 is the null slot, a few slots belong to no
    row)."""
    device = _device()
    width = max(-(-(s + n) // block_size) for s, n in zip(starts, lens)) + 1
    num_slots = 1 + len(lens) * width + extra_slots
    gen = torch.Generator(device="cpu").manual_seed(seed)
    owned = 1 + torch.randperm(num_slots - 1, generator=gen)[: len(lens) * width]
    # Every other column of a wider table: the kernel must honour strides.
    table = torch.zeros(len(lens), 2 * width, dtype=torch.int32)
    table[:, ::2] = owned.view(len(lens), width).to(torch.int32)
    table = table.to(device)[:, ::2]
    # A strided view, as the cache's per-layer state is: slot stride 4*H*V*K,
    # head stride 2*V*K; the gaps must stay poisoned too (see check_pool).
    storage = torch.full(
        (num_slots, 2, H, 2, V, K), POISON, dtype=pool_dtype, device=device
    )
    pool = storage[:, 0, :, 0]
    num_computed = torch.tensor(starts, dtype=torch.int32, device=device)
    return pool, table, num_computed


def expected_checkpoints(
    lens: list[int], starts: list[int], block_size: int, table: torch.Tensor
) -> list[list[tuple[int, int]]]:
    """Per sequence, ``(query offset, slot)`` of each checkpoint the kernel
    must write: the KV cache manager's checkpoint slots, none for a start off
    the chunk grid."""
    out = []
    for n, (start, length) in enumerate(zip(starts, lens)):
        slots = get_mamba_all_mode_state_slots(start, length, 0, block_size, 0)
        row = []
        if start % BT == 0:
            for col, off in zip(
                slots.checkpoint_block_idxs, slots.checkpoint_token_offsets
            ):
                assert off % BT == 0
                row.append((off, int(table[n, col])))
        out.append(row)
    return out


def run_prefill(q, k, v, g, beta, h0, cu_seqlens, checkpoints):
    """The whole chunked prefill; fp32 through the internal entry point (the
    public one refuses fp32), other dtypes through ``chunk_gated_delta_rule``."""
    scale = k.shape[-1] ** -0.5
    if q.dtype == torch.float32:
        _, o, _, final, *_ = chunk_gated_delta_rule_fwd(
            q=q,
            k=k,
            v=v,
            g=g,
            beta=beta,
            scale=scale,
            initial_state=h0,
            output_final_state=True,
            cu_seqlens=cu_seqlens,
            checkpoints=checkpoints,
        )
        return o, final
    return chunk_gated_delta_rule(
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        scale=scale,
        initial_state=h0,
        output_final_state=True,
        cu_seqlens=cu_seqlens,
        checkpoints=checkpoints,
    )


def check_pool(pool, expected, values, tol):
    """Slots in ``expected`` hold ``values[(n, off)]``; every other slot is
    bit-for-bit the poison."""
    written = set()
    for n, row in enumerate(expected):
        for off, slot in row:
            if slot == CHECKPOINT_NULL_SLOT:
                continue
            written.add(slot)
            want = values[(n, off)]
            if tol is None:
                assert torch.equal(pool[slot], want.to(pool.dtype)), (n, off, slot)
            else:
                torch.testing.assert_close(
                    pool[slot].float(), want.float(), **tol, msg=f"{n=} {off=}"
                )
    untouched = [s for s in range(pool.shape[0]) if s not in written]
    assert torch.equal(pool[untouched], torch.full_like(pool[untouched], POISON)), (
        "a slot that is not the step's checkpoint slot was written"
    )
    storage = pool._base
    assert storage is not None and storage.shape[1] == storage.shape[3] == 2
    for gap in (storage[:, 1], storage[:, 0, :, 1]):
        assert torch.equal(gap, torch.full_like(gap, POISON)), (
            "written between the pool's slots or heads"
        )
    return written


# ----------------------------------------------------------------------------
# Test bodies (shared by the interpreter and the GPU cases)
# ----------------------------------------------------------------------------


def run_fwd_h(**kwargs) -> tuple[torch.Tensor, ...]:
    """``chunk_gated_delta_rule_fwd_h``'s ``(h, v_new, final_state)`` (its
    return annotation names only two of the three)."""
    return chunk_gated_delta_rule_fwd_h(**kwargs)


def _check_kernel_h(lens, starts, block_size, Hg, H, K, V, dtype, seed):
    """``chunk_gated_delta_rule_fwd_h`` alone: with checkpoints on, h, v_new
    and the final state are bit-identical to checkpoints off, and each
    checkpoint is bit-for-bit the kernel's own chunk state at that position
    (the pool has h's dtype)."""
    q, k, v, g, beta, h0, cu, cu_seqlens = make_inputs(lens, Hg, H, K, V, dtype, seed)
    # Small w keeps the (non-WY) recurrence contracting over many chunks.
    w = (0.02 * torch.randn(1, sum(lens), H, K, device=k.device)).to(dtype)
    g = chunk_local_cumsum(g, chunk_size=BT, cu_seqlens=cu_seqlens)
    args = dict(
        k=k,
        w=w,
        u=v,
        g=g,
        initial_state=h0,
        output_final_state=True,
        cu_seqlens=cu_seqlens,
    )
    h_off, v_off, final_off = run_fwd_h(**args)
    pool, table, num_computed = make_slots(
        lens, starts, block_size, dtype, H, V, K, seed
    )
    ckpt = ChunkStateCheckpoints(pool, table, num_computed, block_size)
    h_on, v_on, final_on = run_fwd_h(**args, checkpoints=ckpt)
    assert torch.isfinite(h_on).all() and torch.isfinite(final_on).all()
    assert torch.equal(h_on, h_off)
    assert torch.equal(v_on, v_off)
    assert torch.equal(final_on, final_off)

    chunk_offsets = prepare_chunk_offsets(cu_seqlens, BT).tolist()
    expected = expected_checkpoints(lens, starts, block_size, table)
    values = {
        (n, off): h_on[0, chunk_offsets[n] + off // BT]
        for n, row in enumerate(expected)
        for off, _ in row
    }
    written = check_pool(pool, expected, values, tol=None)
    return expected, written


def _check_parity(lens, starts, block_size, Hg, H, K, V, dtype, pool_dtype, tol, seed):
    """The whole prefill: outputs and final states unchanged by checkpoints,
    checkpoints equal to the fp32 reference states, nothing else written."""
    q, k, v, g, beta, h0, cu, cu_seqlens = make_inputs(lens, Hg, H, K, V, dtype, seed)
    o_off, final_off = run_prefill(q, k, v, g, beta, h0, cu_seqlens, None)
    pool, table, num_computed = make_slots(
        lens, starts, block_size, pool_dtype, H, V, K, seed
    )
    ckpt = ChunkStateCheckpoints(pool, table, num_computed, block_size)
    o_on, final_on = run_prefill(q, k, v, g, beta, h0, cu_seqlens, ckpt)
    assert torch.equal(o_on, o_off)
    assert torch.equal(final_on, final_off)

    expected = expected_checkpoints(lens, starts, block_size, table)
    o_ref, final_ref, states = reference_gated_delta_rule(
        q[0],
        k[0],
        v[0],
        g[0],
        beta[0],
        K**-0.5,
        h0,
        cu,
        [[off for off, _ in row] for row in expected],
    )
    torch.testing.assert_close(o_on[0].float(), o_ref, **tol)
    torch.testing.assert_close(final_on.float(), final_ref, **tol)
    values = {(n, off): s for n, taken in enumerate(states) for off, s in taken.items()}
    written = check_pool(pool, expected, values, tol)
    assert len(written) == sum(len(row) for row in expected)
    return expected


def _check_resume(lens, starts, block_size, Hg, H, K, V, dtype, pool_dtype, tol, seed):
    """Prefill with checkpoints, then resume every sequence from its j-th
    checkpoint (j = 0, 1, ...) and prefill the rest: outputs and final states
    match the full prefill."""
    q, k, v, g, beta, h0, cu, cu_seqlens = make_inputs(lens, Hg, H, K, V, dtype, seed)
    pool, table, num_computed = make_slots(
        lens, starts, block_size, pool_dtype, H, V, K, seed
    )
    o_full, final_full = run_prefill(
        q,
        k,
        v,
        g,
        beta,
        h0,
        cu_seqlens,
        ChunkStateCheckpoints(pool, table, num_computed, block_size),
    )
    expected = expected_checkpoints(lens, starts, block_size, table)
    num_resumes = max(len(row) for row in expected)
    assert num_resumes > 0
    for j in range(num_resumes):
        # Sequences with fewer checkpoints resume from their start.
        offs = [row[j][0] if j < len(row) else 0 for row in expected]
        h0_j = torch.stack(
            [
                pool[row[j][1]].float() if j < len(row) else h0[n]
                for n, row in enumerate(expected)
            ]
        )
        idx = torch.cat(
            [
                torch.arange(cu[n] + off, cu[n + 1], device=q.device)
                for n, off in enumerate(offs)
            ]
        )
        lens_j = [n - off for n, off in zip(lens, offs)]
        cu_j = torch.tensor(
            [0] + torch.tensor(lens_j).cumsum(0).tolist(),
            dtype=torch.int32,
            device=q.device,
        )
        o_j, final_j = run_prefill(
            q[:, idx],
            k[:, idx],
            v[:, idx],
            g[:, idx],
            beta[:, idx],
            h0_j,
            cu_j,
            None,
        )
        if tol is None:
            assert torch.equal(o_j, o_full[:, idx]), j
            assert torch.equal(final_j, final_full), j
        else:
            torch.testing.assert_close(o_j.float(), o_full[:, idx].float(), **tol)
            torch.testing.assert_close(final_j, final_full, **tol)


# ----------------------------------------------------------------------------
# CPU: Triton interpreter, fp32, small shapes
# ----------------------------------------------------------------------------

# Shorter than a chunk, exactly one chunk, several chunks (not a multiple of
# 64), many chunks; starts on the chunk grid, on and off the block grid.
SMALL_LENS = [37, 64, 200, 320]
SMALL_STARTS = [128, 64, 64, 0]
FP32_TOL = dict(atol=2e-4, rtol=2e-4)


@interpreter
@pytest.mark.usefixtures("interpreted_fla_ops")
@pytest.mark.parametrize("block_size", [64, 128])
def test_checkpoints_small_kernel_h(block_size):
    expected, written = _check_kernel_h(
        SMALL_LENS, SMALL_STARTS, block_size, 1, 2, 64, 64, torch.float32, seed=0
    )
    assert len(written) >= 3


@interpreter
@pytest.mark.usefixtures("interpreted_fla_ops")
@pytest.mark.parametrize("block_size", [64, 128])
# A pool of h's dtype is written at the top of the chunk loop, any other
# after the chunk's update: fp64 takes the second path here.
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float64])
def test_checkpoints_small_parity(block_size, pool_dtype):
    expected = _check_parity(
        SMALL_LENS,
        SMALL_STARTS,
        block_size,
        1,
        2,
        64,
        64,
        torch.float32,
        pool_dtype,
        FP32_TOL,
        seed=1,
    )
    assert sum(map(len, expected)) >= 3


@interpreter
@pytest.mark.usefixtures("interpreted_fla_ops")
def test_checkpoints_small_confinement_misaligned():
    """Starts off the chunk grid write nothing; a null slot in the table is
    skipped; the aligned sequence still writes its own slots only."""
    lens, starts = [300, 200, 150], [100, 32, 0]
    q, k, v, g, beta, h0, cu, cu_seqlens = make_inputs(
        lens, 1, 2, 64, 64, torch.float32, seed=2
    )
    pool, table, num_computed = make_slots(
        lens, starts, 64, torch.float32, 2, 64, 64, seed=2
    )
    expected = expected_checkpoints(lens, starts, 64, table)
    assert expected[0] == [] and expected[1] == [] and len(expected[2]) == 2
    # Null out the aligned sequence's first checkpoint slot.
    table[2, 0] = CHECKPOINT_NULL_SLOT
    expected = expected_checkpoints(lens, starts, 64, table)
    run_prefill(
        q,
        k,
        v,
        g,
        beta,
        h0,
        cu_seqlens,
        ChunkStateCheckpoints(pool, table, num_computed, 64),
    )
    _, _, states = reference_gated_delta_rule(
        q[0], k[0], v[0], g[0], beta[0], 64**-0.5, h0, cu, [[], [], [128]]
    )
    written = check_pool(pool, expected, {(2, 128): states[2][128]}, FP32_TOL)
    assert len(written) == 1


@interpreter
@pytest.mark.usefixtures("interpreted_fla_ops")
def test_checkpoints_small_resume():
    _check_resume(
        [200, 320, 64],
        [0, 64, 128],
        64,
        1,
        2,
        64,
        64,
        torch.float32,
        torch.float32,
        None,
        seed=3,
    )


# ----------------------------------------------------------------------------
# GPU: bf16 inputs at model-like head sizes
# ----------------------------------------------------------------------------

GPU_LENS = [1, 63, 64, 65, 1170, 2304, 4000]
GPU_STARTS = [576, 0, 1152, 64, 0, 576, 1728]
# bf16 inputs against the fp32 recurrence over thousands of tokens.
BF16_TOL = dict(atol=5e-2, rtol=5e-2)


# 320 and 576: the all-mode block sizes of the e2e harness's tiny and 9B-like
# Qwen3.5 models (5 and 9 chunks a block); 2304: a checkpoint every 36 chunks.
GPU_BLOCK_SIZES = [320, 576, 2304]


@gpu
@pytest.mark.parametrize("block_size", GPU_BLOCK_SIZES)
def test_checkpoints_gpu_kernel_h(block_size):
    _check_kernel_h(
        GPU_LENS, GPU_STARTS, block_size, 4, 8, 128, 128, torch.bfloat16, seed=10
    )


@gpu
@pytest.mark.parametrize("block_size", GPU_BLOCK_SIZES)
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_checkpoints_gpu_parity(block_size, pool_dtype):
    _check_parity(
        GPU_LENS,
        GPU_STARTS,
        block_size,
        4,
        8,
        128,
        128,
        torch.bfloat16,
        pool_dtype,
        BF16_TOL,
        seed=11,
    )


# The kernel's autotune configs (heuristics wrap autotune wraps the kernel).
KERNEL_H_TUNER = chunk_gated_delta_rule_fwd_kernel_h_blockdim64.fn


@gpu
@pytest.mark.parametrize(
    "config",
    KERNEL_H_TUNER.configs,
    ids=lambda c: f"BV{c.kwargs['BV']}-w{c.num_warps}-s{c.num_stages}",
)
def test_checkpoints_gpu_kernel_h_every_config(config, monkeypatch):
    # Autotuning picks a config by timing, so an engine may run any of them:
    # each one alone, at the tiny e2e model's shape (8 heads of 128 x 128,
    # block 320) and a 1272-token prefill step with three boundaries inside.
    monkeypatch.setattr(KERNEL_H_TUNER, "configs", [config])
    monkeypatch.setattr(KERNEL_H_TUNER, "cache", {})
    _check_kernel_h(
        [1272, 700, 65], [0, 320, 640], 320, 4, 8, 128, 128, torch.bfloat16, seed=14
    )


@gpu
def test_checkpoints_gpu_confinement_misaligned():
    lens, starts = [3000, 2000, 1500], [100, 32, 0]
    q, k, v, g, beta, h0, cu, cu_seqlens = make_inputs(
        lens, 4, 8, 128, 128, torch.bfloat16, seed=12
    )
    pool, table, num_computed = make_slots(
        lens, starts, 576, torch.float32, 8, 128, 128, seed=12
    )
    run_prefill(
        q,
        k,
        v,
        g,
        beta,
        h0,
        cu_seqlens,
        ChunkStateCheckpoints(pool, table, num_computed, 576),
    )
    owned = table[:2].flatten().tolist()
    assert torch.equal(pool[owned], torch.full_like(pool[owned], POISON))
    expected = expected_checkpoints(lens, starts, 576, table)
    assert expected[0] == [] and expected[1] == []
    written = {slot for _, slot in expected[2]}
    others = [s for s in range(pool.shape[0]) if s not in written]
    assert torch.equal(pool[others], torch.full_like(pool[others], POISON))


@gpu
@pytest.mark.parametrize("pool_dtype", [torch.float32])
def test_checkpoints_gpu_resume(pool_dtype):
    # With an fp32 pool the resumed prefill starts from the very state the
    # full prefill held at that boundary and runs the same chunks; only
    # autotuning could pick other kernel configs, hence the tight tolerance
    # instead of bit equality.
    _check_resume(
        [2304, 1170, 4000],
        [0, 576, 1152],
        576,
        4,
        8,
        128,
        128,
        torch.bfloat16,
        pool_dtype,
        dict(atol=1e-3, rtol=1e-3),
        seed=13,
    )

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Dual read/write anchors in the GDN decode kernels.

In ``mamba_cache_mode="all"`` a decode or speculative step reads the running
state from one slot (the read anchor, possibly a shared cached block) and
writes the states it produces to others. With ``ssm_state_read_indices`` /
``conv_state_read_indices`` the recurrent kernels (``fused_recurrent``, the
packed decode, ``fused_sigmoid_gating``) and ``causal_conv1d_update`` do that
in one launch. Each case is checked bit for bit against the single-anchor
kernel run on a pool where the read slot was first copied into the write slot
(the obvious way to get the same result), over the whole pool: outputs, the
written slots, and every other slot (the read slot included when it differs
from the write slot) untouched. The slots come from
``get_mamba_all_mode_state_slots`` for steps of 1 + k tokens (k = 0..3) starting
at every offset of a block, so the steps cross block boundaries at every
position; index tensors are strided views.

Interpreter cases (CPU, ``TRITON_INTERPRET=1``) run in fp32; GPU cases in bf16
with fp32 and bf16 state pools.
"""

import os

import pytest
import torch
import torch.nn.functional as F

from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update
from vllm.third_party.flash_linear_attention.ops import (
    fused_recurrent,
    fused_recurrent_gated_delta_rule,
    fused_recurrent_gated_delta_rule_packed_decode,
    fused_sigmoid_gating_delta_rule_update,
)
from vllm.triton_utils import tl
from vllm.v1.kv_cache_interface import get_mamba_all_mode_state_slots

BLOCK = 4  # tokens per block: a k = 3 step crosses a boundary at every offset
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

if INTERPRET:
    DEVICE, DTYPES = "cpu", [(torch.float32, torch.float32)]
elif torch.cuda.is_available():
    DEVICE = "cuda"
    DTYPES = [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)]
else:
    DEVICE, DTYPES = "cpu", []

pytestmark = pytest.mark.skipif(
    not DTYPES, reason="needs CUDA or the Triton interpreter (TRITON_INTERPRET=1)"
)


@pytest.fixture(autouse=True)
def interpreted_fla_ops(monkeypatch):
    """``fused_recurrent`` calls ``exp`` through a module-level alias of
    ``tl.exp``, which the Triton interpreter does not patch; route it through
    ``tl`` under the interpreter (compiled kernels are unaffected)."""
    if INTERPRET:
        monkeypatch.setattr(fused_recurrent, "exp", lambda x: tl.exp(x))


def strided(idx: torch.Tensor) -> torch.Tensor:
    """The same indices as a view with non-unit strides."""
    if idx.dim() == 1:
        wide = torch.zeros(idx.shape[0], 3, dtype=idx.dtype)
        wide[:, 1] = idx
        return wide.to(DEVICE)[:, 1]
    wide = torch.zeros(idx.shape[0], 2 * idx.shape[1] + 1, dtype=idx.dtype)
    wide[:, 1::2][:, : idx.shape[1]] = idx
    return wide.to(DEVICE)[:, 1::2][:, : idx.shape[1]]


def all_mode_steps(k: int, seed: int):
    """One step of 1 + k tokens (k drafts) per block offset: per sequence the
    read slot and the slot of each token's state (`state_block_idxs`: the
    write block and the scratch blocks for the drafts), from
    ``get_mamba_all_mode_state_slots`` over a block table of distinct slots.
    Slot 0 stays the null block."""
    gen = torch.Generator().manual_seed(seed)
    n = BLOCK
    width = 8
    table = (1 + torch.randperm(n * width, generator=gen)).view(n, width)
    read, write = [], []
    for i in range(n):
        computed = BLOCK + i  # one full block already, then offset i
        slots = get_mamba_all_mode_state_slots(computed, 1 + k, k, BLOCK, k)
        read.append(int(table[i, slots.read_block_idx]))
        write.append([int(table[i, c]) for c in slots.state_block_idxs])
    crossings = sum(r != w[0] for r, w in zip(read, write))
    assert crossings >= 1  # the step starting on a boundary
    return (
        torch.tensor(read, dtype=torch.int32),
        torch.tensor(write, dtype=torch.int32),
        1 + n * width,
    )


def qkv(n, T, H, HV, K, V, dtype, gen):
    def r(*s):
        return torch.randn(*s, generator=gen).to(DEVICE)

    q = r(1, n * T, H, K).to(dtype)
    k = F.normalize(r(1, n * T, H, K), dim=-1).to(dtype)
    v = r(1, n * T, HV, V).to(dtype)
    return q, k, v


def copy_first(pool: torch.Tensor, read: torch.Tensor, dst: torch.Tensor) -> None:
    pool[dst.long()] = pool[read.long()]


# ----------------------------------------------------------------------------
# Recurrent kernels
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("k_draft", [0, 1, 2, 3])
@pytest.mark.parametrize("kernel", ["fused_recurrent", "fused_sigmoid_gating"])
@pytest.mark.parametrize("dtypes", DTYPES, ids=str)
def test_recurrent_dual_anchor_matches_copy_first(kernel, k_draft, dtypes):
    dtype, state_dtype = dtypes
    H, HV, K, V = 1, 2, 32, 32
    T = 1 + k_draft
    read, write, num_slots = all_mode_steps(k_draft, seed=k_draft)
    n = read.shape[0]
    gen = torch.Generator().manual_seed(100 + k_draft)
    q, k, v = qkv(n, T, H, HV, K, V, dtype, gen)
    a = torch.randn(n * T, HV, generator=gen).to(DEVICE)
    b = torch.randn(n * T, HV, generator=gen).to(DEVICE)
    A_log = torch.rand(HV, generator=gen).to(DEVICE)
    dt_bias = torch.rand(HV, generator=gen).to(DEVICE)
    pool0 = torch.randn(num_slots, HV, V, K, generator=gen).to(DEVICE, state_dtype)
    cu = torch.arange(0, n * T + 1, T, dtype=torch.int32, device=DEVICE)
    spec = k_draft > 0
    # Random acceptance of the previous step: ignored when the read anchor is
    # given (it already names the accepted state's slot).
    accepted = torch.randint(1, T + 1, (n,), generator=gen).to(DEVICE, torch.int32)

    def run(pool, indices, read_indices, num_accepted):
        kw = dict(
            q=q,
            k=k,
            v=v,
            initial_state=pool,
            inplace_final_state=True,
            cu_seqlens=cu,
            ssm_state_indices=indices if spec else indices[:, 0],
            num_accepted_tokens=num_accepted if spec else None,
            use_qk_l2norm_in_kernel=True,
            ssm_state_read_indices=read_indices,
        )
        if kernel == "fused_recurrent":
            g = -A_log.exp() * F.softplus(a + dt_bias)
            o, _ = fused_recurrent_gated_delta_rule(
                g=g[None], beta=b.sigmoid()[None], **kw
            )
        else:
            o, _ = fused_sigmoid_gating_delta_rule_update(
                A_log=A_log, a=a, b=b, dt_bias=dt_bias, **kw
            )
        return o

    # Reference: copy the read slot into the first write slot, single anchor.
    pool_ref = pool0.clone()
    write_d = write.to(DEVICE)
    copy_first(pool_ref, read.to(DEVICE), write_d[:, 0])
    ones = torch.ones(n, dtype=torch.int32, device=DEVICE)
    o_ref = run(pool_ref, write_d, None, ones)

    pool_dual = pool0.clone()
    o_dual = run(pool_dual, strided(write), strided(read), accepted)
    assert torch.equal(o_dual, o_ref)
    assert torch.equal(pool_dual, pool_ref)
    # Read isolation: a read slot that is not written keeps its state.
    written = set(write.flatten().tolist())
    for r in read.tolist():
        if r not in written:
            assert torch.equal(pool_dual[r], pool0[r])


@pytest.mark.parametrize("kernel", ["fused_recurrent", "fused_sigmoid_gating"])
@pytest.mark.parametrize("dtypes", DTYPES, ids=str)
def test_strided_spec_indices_match_contiguous(kernel, dtypes):
    """Single anchor, speculative: a strided 2D index view gives the results
    of its contiguous copy (the kernels honour the token stride)."""
    dtype, state_dtype = dtypes
    H, HV, K, V, T = 1, 2, 32, 32, 3
    _, write, num_slots = all_mode_steps(T - 1, seed=7)
    n = write.shape[0]
    gen = torch.Generator().manual_seed(7)
    q, k, v = qkv(n, T, H, HV, K, V, dtype, gen)
    g = F.logsigmoid(torch.randn(1, n * T, HV, generator=gen)).to(DEVICE)
    beta = torch.rand(1, n * T, HV, generator=gen).to(DEVICE)
    a = torch.randn(n * T, HV, generator=gen).to(DEVICE)
    b = torch.randn(n * T, HV, generator=gen).to(DEVICE)
    A_log = torch.rand(HV, generator=gen).to(DEVICE)
    dt_bias = torch.rand(HV, generator=gen).to(DEVICE)
    pool0 = torch.randn(num_slots, HV, V, K, generator=gen).to(DEVICE, state_dtype)
    cu = torch.arange(0, n * T + 1, T, dtype=torch.int32, device=DEVICE)
    accepted = torch.randint(1, T + 1, (n,), generator=gen).to(DEVICE, torch.int32)

    def run(indices):
        pool = pool0.clone()
        kw = dict(
            q=q,
            k=k,
            v=v,
            initial_state=pool,
            inplace_final_state=True,
            cu_seqlens=cu,
            ssm_state_indices=indices,
            num_accepted_tokens=accepted,
            use_qk_l2norm_in_kernel=True,
        )
        if kernel == "fused_recurrent":
            o, _ = fused_recurrent_gated_delta_rule(g=g, beta=beta, **kw)
        else:
            o, _ = fused_sigmoid_gating_delta_rule_update(
                A_log=A_log, a=a, b=b, dt_bias=dt_bias, **kw
            )
        return o, pool

    o_c, pool_c = run(write.to(DEVICE))
    o_s, pool_s = run(strided(write))
    assert torch.equal(o_s, o_c)
    assert torch.equal(pool_s, pool_c)


@pytest.mark.parametrize("dtypes", DTYPES, ids=str)
def test_packed_decode_dual_anchor_matches_copy_first(dtypes):
    dtype, state_dtype = dtypes
    H, HV, K, V = 1, 2, 32, 32
    read, write, num_slots = all_mode_steps(0, seed=3)
    write = write[:, 0]
    n = read.shape[0]
    gen = torch.Generator().manual_seed(3)
    mixed = torch.randn(n, 2 * H * K + HV * V, generator=gen).to(DEVICE, dtype)
    a = torch.randn(n, HV, generator=gen).to(DEVICE, dtype)
    b = torch.randn(n, HV, generator=gen).to(DEVICE, dtype)
    A_log = torch.rand(HV, generator=gen).to(DEVICE)
    dt_bias = torch.rand(HV, generator=gen).to(DEVICE)
    pool0 = torch.randn(num_slots, HV, V, K, generator=gen).to(DEVICE, state_dtype)

    def run(pool, indices, read_indices):
        out = torch.empty(n, 1, HV, V, dtype=dtype, device=DEVICE)
        fused_recurrent_gated_delta_rule_packed_decode(
            mixed_qkv=mixed,
            a=a,
            b=b,
            A_log=A_log,
            dt_bias=dt_bias,
            scale=K**-0.5,
            initial_state=pool,
            out=out,
            ssm_state_indices=indices,
            use_qk_l2norm_in_kernel=True,
            ssm_state_read_indices=read_indices,
        )
        return out

    pool_ref = pool0.clone()
    copy_first(pool_ref, read.to(DEVICE), write.to(DEVICE))
    o_ref = run(pool_ref, write.to(DEVICE), None)
    pool_dual = pool0.clone()
    o_dual = run(pool_dual, strided(write), strided(read))
    assert torch.equal(o_dual, o_ref)
    assert torch.equal(pool_dual, pool_ref)


# ----------------------------------------------------------------------------
# Conv state update
# ----------------------------------------------------------------------------


def conv_step_inputs(gen, n, dim, width, k_draft, num_slots, dtypes):
    """``causal_conv1d_update`` inputs for ``n`` sequences of ``1 + k_draft``
    tokens: x, weight, bias, a pool of ``num_slots`` states with room for the
    drafts in the conv state's usual layout (dim stride 1), and each sequence's
    previous acceptance (None without drafts)."""
    dtype, state_dtype = dtypes
    T = 1 + k_draft
    x = torch.randn(n, dim, T, generator=gen).to(DEVICE, dtype)
    weight = torch.randn(dim, width, generator=gen).to(DEVICE, dtype)
    bias = torch.randn(dim, generator=gen).to(DEVICE, dtype)
    pool = (
        torch.randn(num_slots, width - 1 + k_draft, dim, generator=gen)
        .to(DEVICE, state_dtype)
        .transpose(1, 2)
    )
    accepted = (
        torch.randint(1, T + 1, (n,), generator=gen).to(DEVICE, torch.int32)
        if k_draft
        else None
    )
    return x, weight, bias, pool, accepted


def conv_update(inputs, pool, **indices):
    """``causal_conv1d_update`` of ``conv_step_inputs`` on ``pool`` (a copy of
    their pool) with the given index arguments; returns the output."""
    x, weight, bias, _, accepted = inputs
    return causal_conv1d_update(
        x.clone(),
        pool,
        weight,
        bias,
        activation="silu",
        num_accepted_tokens=accepted,
        **indices,
    )


@pytest.mark.parametrize("k_draft", [0, 1, 2, 3])
@pytest.mark.parametrize("dtypes", DTYPES, ids=str)
def test_conv_update_dual_anchor_matches_copy_first(k_draft, dtypes):
    dim, width = 64, 4
    read, write, num_slots = all_mode_steps(k_draft, seed=20 + k_draft)
    write = write[:, 0]  # the conv window of a step lives in one slot
    gen = torch.Generator().manual_seed(20 + k_draft)
    inputs = conv_step_inputs(
        gen, read.shape[0], dim, width, k_draft, num_slots, dtypes
    )
    pool0 = inputs[3]

    def run(pool, indices, read_indices):
        return conv_update(
            inputs,
            pool,
            conv_state_indices=indices,
            conv_state_read_indices=read_indices,
        )

    pool_ref = pool0.clone()
    copy_first(pool_ref, read.to(DEVICE), write.to(DEVICE))
    o_ref = run(pool_ref, write.to(DEVICE), None)
    pool_dual = pool0.clone()
    o_dual = run(pool_dual, strided(write), strided(read))
    assert torch.equal(o_dual, o_ref)
    assert torch.equal(pool_dual, pool_ref)
    written = set(write.tolist())
    for r in read.tolist():
        if r not in written:
            assert torch.equal(pool_dual[r], pool0[r])


@pytest.mark.parametrize("k_draft", [1, 2, 3])
@pytest.mark.parametrize("dtypes", DTYPES, ids=str)
def test_conv_update_stores_the_window_at_the_boundary_draft(k_draft, dtypes):
    """With ``conv_state_checkpoint_indices`` / ``_offsets`` the kernel also
    stores the window ending at the boundary draft (all mode's state at a
    block's end, reached by a draft) into the write block: exactly the last
    ``width - 1`` inputs up to that token, at the slot's first columns; the
    rest of that slot, the outputs and every other slot are what the launch
    without it leaves. Rows whose step reaches no block end (a null slot)
    store nothing."""
    _, state_dtype = dtypes
    dim, width = 64, 4
    T = 1 + k_draft
    gen = torch.Generator().manual_seed(40 + k_draft)
    n = BLOCK
    table = (1 + torch.randperm(n * 8, generator=gen)).view(n, 8)
    read, write, ckpt, offset = [], [], [], []
    for i in range(n):
        slots = get_mamba_all_mode_state_slots(BLOCK + i, T, k_draft, BLOCK, k_draft)
        read.append(int(table[i, slots.read_block_idx]))
        write.append(int(table[i, slots.state_block_idxs[0]]))
        d = slots.boundary_draft
        ckpt.append(int(table[i, slots.write_block_idx]) if d else 0)
        offset.append(d)
    assert any(offset) and not all(offset)
    num_slots = 1 + n * 8
    inputs = conv_step_inputs(gen, n, dim, width, k_draft, num_slots, dtypes)
    x, _, _, pool0, accepted = inputs

    def run(pool, checkpoint):
        return conv_update(
            inputs,
            pool,
            conv_state_indices=strided(torch.tensor(write, dtype=torch.int32)),
            conv_state_read_indices=strided(torch.tensor(read, dtype=torch.int32)),
            conv_state_checkpoint_indices=None
            if not checkpoint
            else strided(torch.tensor(ckpt, dtype=torch.int32)),
            conv_state_checkpoint_offsets=None
            if not checkpoint
            else strided(torch.tensor(offset, dtype=torch.int32)),
        )

    pool_ref = pool0.clone()
    o_ref = run(pool_ref, checkpoint=False)
    pool = pool0.clone()
    o = run(pool, checkpoint=True)
    assert torch.equal(o, o_ref)
    for i in range(n):
        if not offset[i]:
            continue
        # The inputs the step sees: the window it reads, then its tokens.
        a = int(accepted[i]) - 1
        seen = torch.cat(
            [pool0[read[i]][:, a : a + width - 1], x[i].to(state_dtype)], dim=1
        )
        d = offset[i]
        assert torch.equal(pool[ckpt[i]][:, : width - 1], seen[:, d + 1 : d + width])
        assert torch.equal(
            pool[ckpt[i]][:, width - 1 :], pool_ref[ckpt[i]][:, width - 1 :]
        )
    others = [s for s in range(num_slots) if s not in set(ckpt) - {0}]
    assert torch.equal(pool[others], pool_ref[others])

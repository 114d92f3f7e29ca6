# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fused single-launch Mamba2 SSD prefill (varlen).

``mamba_chunk_scan_fused_varlen`` is a drop-in replacement for
``ssd_combined.mamba_chunk_scan_combined_varlen`` (same arguments, same
return value, same in-place writes).  The upstream chain launches five Triton
kernels (chunk cumsum, chunk state, state passing, bmm, chunk scan) and moves
``dt``, ``dA_cumsum``, per-chunk states and the ``C^T B`` blocks through HBM.
Here one launch does everything; only the chunk-boundary states go through
memory (an fp32 workspace that stays mostly in L2), handed from the CTA of
chunk ``c - 1`` to the CTA of chunk ``c`` of the same head block with an
acquire/release flag.

Selected with ``MambaConfig.ssd_prefill`` (CLI ``--mamba-ssd-prefill``):
``"chain"`` (default, upstream) or ``"fused"`` (this kernel).  See
``select_mamba_chunk_scan_varlen``.
"""

from collections.abc import Callable, Mapping
from typing import Any

import torch

from vllm import platforms
from vllm.model_executor.layers.mamba.ops import ssd_fused_launch
from vllm.model_executor.layers.mamba.ops.mamba_ssm import softplus
from vllm.model_executor.layers.mamba.ops.ssd_combined import (
    is_int_pow_2,
    mamba_chunk_scan_combined_varlen,
)
from vllm.model_executor.layers.mamba.ops.triton_helpers import fast_exp
from vllm.triton_utils import tl, triton

# ---------------------------------------------------------------------------
# Kernel
#
# Work decomposition.  A work item is (chunk c, head h, head-dim block pb);
# there are nchunks * NHB of them with NHB = nheads * cdiv(headdim, BLOCK_P).
# The grid has exactly one program per work item, but a program does NOT use
# its program_id: it takes a ticket t from a global atomic counter and works
# on item (c, hb) = divmod(t, NHB).  Tickets are therefore handed out in
# chunk-major order, in the order programs actually start running.
#
# One program, for its (c, h, pb):
#   A. dt -> softplus(dt + dt_bias) clamped to dt_limit, dA = dt * A[h]; the
#      chunk's total decay dA_tot = sum(dA) (all in registers, fp32).
#   B. the chunk-local state  S_loc[p, n] = sum_t x[t, p] * B[t, n] * dt[t]
#      * exp(dA_tot - cumsum(dA)[t])  (tensor-core dots over BLOCK_KB rows;
#      one step together with A when BLOCK_KB == CHUNK_SIZE).
#   C. the state entering the chunk, S_prev: the initial state of the
#      sequence (or zero) if c starts a sequence, else the state published by
#      the program of (c - 1, hb).  S_end = exp(dA_tot) * S_prev + S_loc is
#      published for (c + 1, hb) unless c is the sequence's last chunk, in
#      which case it goes to the final state (slot scatter or return tensor);
#      with return_intermediate_states it is also written for every chunk.
#   D. the output of the chunk, BLOCK_M rows at a time, carrying the running
#      state through the sub-blocks in registers:
#        y = exp(cs_i - base) * C_i . S_run                  (inter part)
#          + sum_{j <= i in block} C_i.B_j exp(cs_i - cs_j) dt_j x_j
#          + D * x_i,  then  y *= silu(z)  (if z),
#      followed by S_run <- exp(cs_end - base) S_run + x^T (B dt exp(..)).
#      All decay exponents are <= 0, so nothing can overflow.
#
# Deadlock freedom (proof).  Let item t wait only on item t - NHB (same hb,
# previous chunk, and only when both chunks belong to the same sequence).
# A ticket is taken by a program that is already running, and the counter
# hands out tickets in increasing order, so when some program holds ticket t
# every ticket u < t is held by a program that is running (resident) or has
# finished.  Induction on t: ticket 0 waits on nothing and finishes.  If all
# tickets < t eventually publish (they wait only on smaller tickets, which by
# the hypothesis publish), then the holder of t - NHB is resident, gets its
# turn (resident CTAs make progress independent of each other), publishes,
# and t's spin loop ends.  No assumption about the order in which the
# hardware starts programs or how many are resident is needed; with one
# resident program at a time (or the sequential Triton interpreter) it still
# terminates because a program never waits on a ticket that is handed out
# after its own.
#
# Operands and pipelining.  Only the output pass (D) is software-pipelined
# (tl.range with num_stages=OUT_STAGES=2): its x, B and C tiles arrive by
# asynchronous copies into shared memory one row block ahead.  Both state
# dots (B: S_loc, D: the S_run update) scale x rather than B by the dt/decay
# weights (half the elements) and take B straight from shared memory, so
# their A operand (x^T scaled) comes from registers; the other dots take
# their A operand from the copies (C, B, x^T) and the computed factor as the
# B operand.  The update written as x^T (B scaled), all operands in shared
# memory, gives wrong outputs on sm_90 once the loop is pipelined, as does
# num_stages=2 for the whole kernel (see _launch_config); compare
# ssd_chunk_scan._drop_racy_wgmma_configs.  The interpreter test runs
# both stage counts; the GPU tests run the default.
#
# dt latency.  dt is a strided 2-byte gather (one element per token and
# head), which the pipeliner's asynchronous copies do not cover; loaded where
# it is used, its global-memory latency is the largest single stall of the
# kernel.  A and B are therefore one step when BLOCK_KB == CHUNK_SIZE (dt, x
# and B requested together, dt loaded once), and the output pass requests
# the next row block's dt one iteration ahead.
#
# Order of the output pass.  Per row block the intra-block dots (C B^T, then
# x^T times the masked block) come first and the C . S_run dot, the only one
# that needs the state updated at the end of the previous row block, comes
# after them.  Triton waits for every wgmma right after issuing it, so the
# order only changes what the compiler can schedule around the dots (the
# outputs are bit-identical either way); this order is the faster one.
#
# Memory ordering.  Publisher: every thread stores its part of S_end (st to
# global), then a CTA barrier (bar.sync orders the stores of all threads
# before it at CTA scope), then one release atomic at GPU scope on the flag
# (release is cumulative, so all those stores are visible at GPU scope before
# the flag).  Consumer: acquire atomic loads of the flag at GPU scope until it
# is set, a CTA barrier, then the state loads, which use ".cg" (L2, never a
# possibly stale L1 line).
#
# Flag buffer.  sync_ptr[0] is the ticket counter, sync_ptr[1] a count of
# finished programs, sync_ptr[2 + t] the flag of item t.  The buffer is zero
# when a launch starts and zero again when it ends: after its last flag
# access (and a CTA barrier) a program counts itself finished with an
# acq_rel atomic; the program that finds it is the last one has every other
# program's flag accesses ordered before it, and zeroes the counters and
# flags (_sync_done).  So the host keeps one zeroed buffer per device and
# stream and does not clear it per call (ssd_fused_launch.scratch), which
# saves a memset kernel per call.
# ---------------------------------------------------------------------------


@triton.jit
def _dt_load(dt_ptr, offs_t, clength, stride_dt_seqlen):
    """Raw dt (fp32) of rows offs_t of the chunk; 0 beyond clength."""
    return tl.load(
        dt_ptr + offs_t * stride_dt_seqlen, mask=offs_t < clength, other=0.0
    ).to(tl.float32)


@triton.jit
def _sync_done(sync_ptr):
    """Count this program finished with the flag buffer (after its last flag
    access); the last one zeroes the buffer for the next launch ("Flag
    buffer" above)."""
    tl.debug_barrier()
    n = tl.num_programs(0)
    done = tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if done == n - 1:
        for i in range(0, n + 2, 1024):
            offs = i + tl.arange(0, 1024)
            tl.store(sync_ptr + offs, tl.zeros([1024], tl.int32), mask=offs < n + 2)


@triton.jit
def _load_rows(base, rows, mask_rows, cols, mask_cols, stride_row, stride_col):
    """Tile base[rows, cols] with the given row / column strides; 0 outside
    mask_rows x mask_cols."""
    return tl.load(
        base + rows[:, None] * stride_row + cols[None, :] * stride_col,
        mask=mask_rows[:, None] & mask_cols[None, :],
        other=0.0,
    )


@triton.jit
def _store_final_state(
    v,
    seq,
    h,
    offs_p,
    offs_n,
    state_mask,
    final_ptr,
    final_idx_ptr,
    stride_final_s,
    stride_final_h,
    stride_final_p,
    stride_final_n,
    stride_final_idx,
    FINAL_HAS_INDICES: tl.constexpr,
):
    """Store v (head h, this program's slice) as sequence seq's final state:
    into the slot final_idx[seq] names, or slot seq without indices."""
    if FINAL_HAS_INDICES:
        slot = tl.load(final_idx_ptr + seq * stride_final_idx).to(tl.int64)
    else:
        slot = seq.to(tl.int64)
    tl.store(
        final_ptr
        + slot * stride_final_s
        + h * stride_final_h
        + offs_p[:, None] * stride_final_p
        + offs_n[None, :] * stride_final_n,
        v.to(final_ptr.dtype.element_ty),
        mask=state_mask,
    )


@triton.jit
def _write_empty_finals(
    s_lo,
    s_hi,
    h,
    offs_p,
    offs_n,
    state_mask,
    init_ptr,
    final_ptr,
    final_idx_ptr,
    stride_init_b,
    stride_init_h,
    stride_init_p,
    stride_init_n,
    stride_final_s,
    stride_final_h,
    stride_final_p,
    stride_final_n,
    stride_final_idx,
    HAS_INITSTATES: tl.constexpr,
    FINAL_HAS_INDICES: tl.constexpr,
):
    """Final states of the empty sequences s_lo .. s_hi - 1 (head h, this
    program's slice): their initial states, or zeros."""
    for s in range(s_lo, s_hi):
        s64 = s + tl.zeros([], tl.int64)
        if HAS_INITSTATES:
            v = tl.load(
                init_ptr
                + s64 * stride_init_b
                + h * stride_init_h
                + offs_p[:, None] * stride_init_p
                + offs_n[None, :] * stride_init_n,
                mask=state_mask,
                other=0.0,
            )
        else:
            v = tl.where(state_mask, 0.0, 0.0)
        _store_final_state(
            v, s64, h, offs_p, offs_n, state_mask, final_ptr, final_idx_ptr,
            stride_final_s, stride_final_h, stride_final_p, stride_final_n,
            stride_final_idx, FINAL_HAS_INDICES,
        )  # fmt: skip


@triton.jit
def _dt_process(
    dt,
    valid,
    dt_bias,
    dt_min,
    dt_max,
    HAS_DT_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr,
):
    """Processed dt: clamp(softplus?(dt + dt_bias), dt_min, dt_max), 0 where
    not valid."""
    if HAS_DT_BIAS:
        dt += dt_bias
    if DT_SOFTPLUS:
        dt = tl.where(dt <= 20.0, softplus(dt), dt)
    dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    return tl.where(valid, dt, 0.0)


@triton.jit
def _ssd_fused_varlen_kernel(
    # tensors
    x_ptr,
    dt_ptr,
    A_ptr,
    B_ptr,
    C_ptr,
    D_ptr,
    z_ptr,
    dt_bias_ptr,
    out_ptr,
    init_ptr,
    ws_ptr,
    sync_ptr,
    inter_ptr,
    final_ptr,
    final_idx_ptr,
    cu_chunk_ptr,
    seq_idx_ptr,
    last_chunk_ptr,
    # runtime scalars
    dt_min,
    dt_max,
    nchunks,
    batch,
    # sizes
    nheads: tl.constexpr,
    hdim: tl.constexpr,
    dstate: tl.constexpr,
    heads_per_group: tl.constexpr,
    # strides
    stride_x_t: tl.int64,
    stride_x_h: tl.int64,
    stride_x_p: tl.constexpr,
    stride_dt_t: tl.int64,
    stride_dt_h: tl.constexpr,
    stride_B_t: tl.int64,
    stride_B_g: tl.int64,
    stride_B_n: tl.constexpr,
    stride_C_t: tl.int64,
    stride_C_g: tl.int64,
    stride_C_n: tl.constexpr,
    stride_D_h: tl.constexpr,
    stride_z_t: tl.int64,
    stride_z_h: tl.int64,
    stride_z_p: tl.constexpr,
    stride_out_t: tl.int64,
    stride_out_h: tl.int64,
    stride_out_p: tl.constexpr,
    stride_init_b: tl.int64,
    stride_init_h: tl.int64,
    stride_init_p: tl.int64,
    stride_init_n: tl.constexpr,
    stride_inter_c: tl.int64,
    stride_inter_h: tl.int64,
    stride_inter_p: tl.int64,
    stride_inter_n: tl.constexpr,
    stride_final_s: tl.int64,
    stride_final_h: tl.int64,
    stride_final_p: tl.int64,
    stride_final_n: tl.constexpr,
    stride_final_idx: tl.constexpr,
    # meta
    CHUNK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_KB: tl.constexpr,
    OUT_STAGES: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_P_BLOCKS: tl.constexpr,
    HAS_D: tl.constexpr,
    D_HAS_HDIM: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr,
    HAS_INITSTATES: tl.constexpr,
    WRITE_INTER: tl.constexpr,
    WRITE_FINAL: tl.constexpr,
    FINAL_HAS_INDICES: tl.constexpr,
):
    NHB: tl.constexpr = nheads * NUM_P_BLOCKS
    # sync_ptr[0] is the ticket counter, sync_ptr[2 + c * NHB + hb] the flag
    # of item (c, hb) ("Flag buffer" above).
    ticket = tl.atomic_add(sync_ptr, 1, sem="relaxed").to(tl.int64)
    c = ticket // NHB
    hb = ticket % NHB
    h = hb // NUM_P_BLOCKS
    pb = hb % NUM_P_BLOCKS
    g = h // heads_per_group

    chunk_start = tl.load(cu_chunk_ptr + c).to(tl.int64)
    clength = (tl.load(cu_chunk_ptr + c + 1) - chunk_start).to(tl.int32)
    seq = tl.load(seq_idx_ptr + c)
    seq_prev = tl.load(seq_idx_ptr + c - 1, mask=c > 0, other=-1)
    is_first = seq != seq_prev
    is_last = c == tl.load(last_chunk_ptr + seq)

    offs_m = tl.arange(0, BLOCK_M)
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < hdim
    mask_n = offs_n < dstate

    x_base = x_ptr + chunk_start * stride_x_t + h * stride_x_h
    dt_base = dt_ptr + chunk_start * stride_dt_t + h * stride_dt_h
    B_base = B_ptr + chunk_start * stride_B_t + g * stride_B_g
    C_base = C_ptr + chunk_start * stride_C_t + g * stride_C_g

    A = tl.load(A_ptr + h).to(tl.float32)
    if HAS_DT_BIAS:  # noqa: SIM108
        dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    else:
        dt_bias = 0.0

    # ---- A + B: total decay and chunk-local state -------------------------
    offs_c = tl.arange(0, CHUNK_SIZE)
    if BLOCK_KB == CHUNK_SIZE:
        # One step (the tuned configuration): the x and B tiles and dt are
        # requested together and dt is loaded once for both A and B.
        mask_c = offs_c < clength
        b_c = _load_rows(B_base, offs_c, mask_c, offs_n, mask_n, stride_B_t, stride_B_n)
        x_c = _load_rows(x_base, offs_c, mask_c, offs_p, mask_p, stride_x_t, stride_x_p)
        dt_all = _dt_process(
            _dt_load(dt_base, offs_c, clength, stride_dt_t), mask_c, dt_bias,
            dt_min, dt_max, HAS_DT_BIAS, DT_SOFTPLUS,
        )  # fmt: skip
        dA_all = dt_all * A
        dA_tot = tl.sum(dA_all, axis=0)
        w_c = dt_all * fast_exp(tl.minimum(dA_tot - tl.cumsum(dA_all, axis=0), 0.0))
        # Scale x, not B (see "Operands and pipelining" above).
        xw_c = (x_c.to(tl.float32) * w_c[:, None]).to(x_c.dtype)
        s_loc = tl.dot(tl.trans(xw_c), b_c)
    else:
        dt_all = _dt_process(
            _dt_load(dt_base, offs_c, clength, stride_dt_t), offs_c < clength, dt_bias,
            dt_min, dt_max, HAS_DT_BIAS, DT_SOFTPLUS,
        )  # fmt: skip
        dA_tot = tl.sum(dt_all * A, axis=0)
        s_loc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
        base = 0.0
        offs_kb = tl.arange(0, BLOCK_KB)
        for k0 in range(0, clength, BLOCK_KB):
            rows = k0 + offs_kb
            mask_t = rows < clength
            dt_m = _dt_process(
                _dt_load(dt_base, rows, clength, stride_dt_t), mask_t, dt_bias,
                dt_min, dt_max, HAS_DT_BIAS, DT_SOFTPLUS,
            )  # fmt: skip
            dA_m = dt_m * A
            cs_m = base + tl.cumsum(dA_m, axis=0)
            w = dt_m * fast_exp(tl.minimum(dA_tot - cs_m, 0.0))
            b = _load_rows(B_base, rows, mask_t, offs_n, mask_n, stride_B_t, stride_B_n)
            x = _load_rows(x_base, rows, mask_t, offs_p, mask_p, stride_x_t, stride_x_p)
            xw = (x.to(tl.float32) * w[:, None]).to(x.dtype)
            s_loc += tl.dot(tl.trans(xw), b)
            base = base + tl.sum(dA_m, axis=0)

    # ---- C: state passing ---------------------------------------------------
    state_offs = offs_p[:, None] * dstate + offs_n[None, :]
    state_mask = mask_p[:, None] & mask_n[None, :]
    hdim_x_dstate = hdim * dstate
    if is_first:
        if HAS_INITSTATES:
            s_prev = tl.load(
                init_ptr
                + seq.to(tl.int64) * stride_init_b
                + h * stride_init_h
                + offs_p[:, None] * stride_init_p
                + offs_n[None, :] * stride_init_n,
                mask=state_mask,
                other=0.0,
            ).to(tl.float32)
        else:
            s_prev = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    else:
        flag_prev = sync_ptr + 2 + (c - 1) * NHB + hb
        ready = tl.atomic_add(flag_prev, 0, sem="acquire", scope="gpu")
        while ready == 0:
            ready = tl.atomic_add(flag_prev, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()
        s_prev = tl.load(
            ws_ptr + ((c - 1) * nheads + h) * hdim_x_dstate + state_offs,
            mask=state_mask,
            other=0.0,
            cache_modifier=".cg",
        )

    s_end = fast_exp(dA_tot) * s_prev + s_loc
    if is_last:
        if WRITE_FINAL:
            _store_final_state(
                s_end, seq, h, offs_p, offs_n, state_mask, final_ptr,
                final_idx_ptr, stride_final_s, stride_final_h, stride_final_p,
                stride_final_n, stride_final_idx, FINAL_HAS_INDICES,
            )  # fmt: skip
            # Empty sequences have no chunks (last_chunk_indices == -1): the
            # last chunk of sequence seq writes the final states of those
            # between seq and the next chunk's sequence (the batch's end
            # after the last chunk), chunk 0 those before its sequence.
            seq_next = tl.load(seq_idx_ptr + c + 1, mask=c + 1 < nchunks, other=batch)
            _write_empty_finals(
                seq + 1, seq_next, h, offs_p, offs_n, state_mask, init_ptr,
                final_ptr, final_idx_ptr, stride_init_b, stride_init_h,
                stride_init_p, stride_init_n, stride_final_s, stride_final_h,
                stride_final_p, stride_final_n, stride_final_idx,
                HAS_INITSTATES, FINAL_HAS_INDICES,
            )  # fmt: skip
    else:
        tl.store(
            ws_ptr + (c * nheads + h) * hdim_x_dstate + state_offs,
            s_end,
            mask=state_mask,
            cache_modifier=".cg",
        )
        tl.debug_barrier()
        tl.atomic_xchg(sync_ptr + 2 + c * NHB + hb, 1, sem="release", scope="gpu")
    if WRITE_FINAL:  # noqa: SIM102
        if c == 0:
            _write_empty_finals(
                0, seq, h, offs_p, offs_n, state_mask, init_ptr, final_ptr,
                final_idx_ptr, stride_init_b, stride_init_h, stride_init_p,
                stride_init_n, stride_final_s, stride_final_h, stride_final_p,
                stride_final_n, stride_final_idx, HAS_INITSTATES,
                FINAL_HAS_INDICES,
            )  # fmt: skip
    if WRITE_INTER:
        tl.store(
            inter_ptr
            + c * stride_inter_c
            + h * stride_inter_h
            + offs_p[:, None] * stride_inter_p
            + offs_n[None, :] * stride_inter_n,
            s_end.to(inter_ptr.dtype.element_ty),
            mask=state_mask,
        )

    # (this program's last flag access is behind it)
    _sync_done(sync_ptr)

    # ---- D: outputs -----------------------------------------------------------
    if HAS_D:
        if D_HAS_HDIM:
            Dv = tl.load(D_ptr + h * stride_D_h + offs_p, mask=mask_p, other=0.0).to(
                tl.float32
            )
        else:
            Dv = tl.load(D_ptr + h * stride_D_h).to(tl.float32)
    s_run = s_prev
    # dt of the next row block is requested one iteration ahead (a strided
    # 2-byte gather, which the pipeliner's asynchronous copies do not cover).
    dt_next = _dt_load(dt_base, offs_m, clength, stride_dt_t)
    for m0 in tl.range(0, clength, BLOCK_M, num_stages=OUT_STAGES):
        rows = m0 + offs_m
        mask_t = rows < clength
        dt_raw = dt_next
        dt_next = _dt_load(dt_base, rows + BLOCK_M, clength, stride_dt_t)
        dt_m = _dt_process(
            dt_raw, mask_t, dt_bias, dt_min, dt_max, HAS_DT_BIAS, DT_SOFTPLUS
        )
        dA_m = dt_m * A
        cs_rel = tl.cumsum(dA_m, axis=0)  # cumsum(dA)[t] - base
        b = _load_rows(B_base, rows, mask_t, offs_n, mask_n, stride_B_t, stride_B_n)
        cm = _load_rows(C_base, rows, mask_t, offs_n, mask_n, stride_C_t, stride_C_n)
        x = _load_rows(x_base, rows, mask_t, offs_p, mask_p, stride_x_t, stride_x_p)
        # intra-block part first (it does not depend on S_run; see "Order of
        # the output pass" above), transposed: y_intra^T = x^T (L o C B^T)^T
        # with cbt[j, i] = B_j . C_i, kept for j <= i and scaled by
        # exp(cs_i - cs_j) dt_j.
        cbt = tl.dot(b, tl.trans(cm))
        decay_t = fast_exp(tl.minimum(cs_rel[None, :] - cs_rel[:, None], 0.0))
        causal_t = offs_m[:, None] <= offs_m[None, :]
        cbt = tl.where(causal_t, cbt * decay_t * dt_m[:, None], 0.0)
        intra = tl.trans(tl.dot(tl.trans(x), cbt.to(x.dtype)))
        # inter-block part: C_i . S_run, decayed from the block start
        acc = tl.dot(cm, tl.trans(s_run).to(cm.dtype))
        acc = acc * fast_exp(cs_rel)[:, None] + intra
        if HAS_D:
            if D_HAS_HDIM:
                acc += x.to(tl.float32) * Dv[None, :]
            else:
                acc += x.to(tl.float32) * Dv
        if HAS_Z:
            z_base = z_ptr + chunk_start * stride_z_t + h * stride_z_h
            zv = _load_rows(
                z_base, rows, mask_t, offs_p, mask_p, stride_z_t, stride_z_p
            ).to(tl.float32)
            acc *= zv * tl.sigmoid(zv)
        tl.store(
            out_ptr
            + (chunk_start + rows[:, None]) * stride_out_t
            + h * stride_out_h
            + offs_p[None, :] * stride_out_p,
            acc.to(out_ptr.dtype.element_ty),
            mask=mask_t[:, None] & mask_p[None, :],
        )
        if m0 + BLOCK_M < clength:
            blk = tl.sum(dA_m, axis=0)
            w = dt_m * fast_exp(tl.minimum(blk - cs_rel, 0.0))
            xw = (x.to(tl.float32) * w[:, None]).to(x.dtype)
            s_run = s_run * fast_exp(blk) + tl.dot(tl.trans(xw), b)


# Launch parameters per shape (and override), derived once: this is host
# time on every prefill.
_LAUNCH_METAS: dict[tuple, ssd_fused_launch.Meta] = {}


def _launch_config(chunk_size: int, headdim: int) -> dict[str, int]:
    """Block sizes and compile options of the Triton kernel."""
    return {
        # Rows per step of the output pass (D) and of the state pass (B); 64
        # head-dim columns per program. Every choice needs about 255
        # registers per thread at 4 warps, so 2 programs share an SM.
        "BLOCK_M": min(64, max(16, chunk_size)),
        "BLOCK_KB": min(256, max(16, chunk_size)),
        "BLOCK_P": min(64, max(16, triton.next_power_of_2(headdim))),
        "num_warps": 4,
        # Kernel-wide num_stages=2 gives wrong outputs on sm_90 with BLOCK_M
        # 64, like ssd_chunk_scan._drop_racy_wgmma_configs; only the output
        # loop is pipelined (OUT_STAGES, see "Operands and pipelining").
        "num_stages": 1,
        "OUT_STAGES": 2,
    }


def _launch_meta(
    chunk_size: int,
    headdim: int,
    dstate: int,
    flags: tuple,
    config: Mapping[str, int] | None,
) -> ssd_fused_launch.Meta:
    """The kernel's meta arguments: the shape's launch parameters (with the
    entries of ``config`` in place of _launch_config's) and the flags
    (ssd_fused_launch.meta_flags), made once per shape, flags and config."""
    override = tuple(sorted(config.items())) if config else ()
    key = (chunk_size, headdim, dstate, flags, override)
    meta = _LAUNCH_METAS.get(key)
    if meta is None:
        cfg = _launch_config(chunk_size, headdim)
        unknown = set(dict(override)) - set(cfg)
        if unknown:
            raise ValueError(f"unknown launch parameters {sorted(unknown)}")
        cfg.update(override)
        meta = _LAUNCH_METAS[key] = ssd_fused_launch.Meta(
            CHUNK_SIZE=chunk_size,
            BLOCK_M=cfg["BLOCK_M"],
            BLOCK_KB=cfg["BLOCK_KB"],
            OUT_STAGES=cfg["OUT_STAGES"],
            BLOCK_P=cfg["BLOCK_P"],
            BLOCK_N=max(16, triton.next_power_of_2(dstate)),
            NUM_P_BLOCKS=triton.cdiv(headdim, cfg["BLOCK_P"]),
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
            **dict(zip(ssd_fused_launch.FLAG_NAMES, flags)),
        )
    return meta


def _strides(t: torch.Tensor | None, n: int) -> tuple[int, ...]:
    return t.stride() if t is not None else (0,) * n


def mamba_chunk_scan_fused_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    cu_seqlens: torch.Tensor,
    cu_chunk_seqlens: torch.Tensor,
    last_chunk_indices: torch.Tensor,
    seq_idx: torch.Tensor,
    out: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    return_intermediate_states: bool = False,
    state_dtype: torch.dtype | None = None,
    final_states_out: torch.Tensor | None = None,
    final_state_indices: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Mamba2 SSD prefill over packed variable-length sequences, one launch.

    Same contract as ``mamba_chunk_scan_combined_varlen``.

    Shapes (T tokens, H heads, P headdim, G groups, N dstate, K chunks,
    S sequences):
        x: (T, H, P); dt: (T, H); A: (H,); B, C: (T, G, N), H % G == 0
        chunk_size: power of two (128 and 256 are the tuned sizes)
        cu_seqlens: (S + 1,) int; cu_chunk_seqlens: (K + 1,) int token
            offsets of the (pseudo) chunks, each chunk inside one sequence
            and at most chunk_size long; seq_idx: (K,) sequence of each
            chunk, non-decreasing; last_chunk_indices: (S,) last chunk of
            each sequence
        out: (T, H, P), written in place for every token
        D: (H,) or (H, P); z: (T, H, P) gate, out *= silu(z);
        dt_bias: (H,); dt = clamp(softplus?(dt + dt_bias), *dt_limit)
        initial_states: (S, H, P, N) state entering each sequence
        state_dtype: dtype of returned / written states (default C.dtype)
        final_states_out: (num_slots, H, P, N) state cache; the final state
            of sequence s is written to final_states_out[final_state_indices[s]]
            (slots may be in any order and non-contiguous).
    Dtypes: x, B, C, z, out fp32 / fp16 / bf16 (one dtype for x, B, C);
    dt, A, D, dt_bias any float; all math is accumulated in fp32, dots take
    the input dtype (tf32 for fp32 inputs).
    Returns: (K, H, P, N) states at every chunk end in state_dtype if
    return_intermediate_states; None if final_states_out is given; else the
    (S, H, P, N) final states in state_dtype.

    Empty sequences (repeated cu_seqlens entries, last_chunk_indices == -1)
    have no chunks; the final state of one is its initial state, or zeros
    without initial states.

    Launch: one Triton kernel with grid (K * H * cdiv(P, BLOCK_P),); each
    program takes a ticket from an atomic counter and computes the output of
    one chunk for one head and one BLOCK_P slice of the head dim, plus that
    slice's chunk-end state, which it hands to the next chunk's program via
    an fp32 workspace (K, H, P, N) and a release/acquire flag.  Besides
    ``out``, ``final_states_out`` and the returned tensor, it writes only
    that workspace and a small int32 flag buffer kept per device and
    stream (ssd_fused_launch.scratch).
    """
    if platforms.current_platform.is_cpu():
        # The CPU backend has its own reference implementation. It returns
        # the final states (no write into cache slots): scattered here.
        assert final_states_out is None or not return_intermediate_states
        states = mamba_chunk_scan_combined_varlen(
            x, dt, A, B, C, chunk_size, cu_seqlens, cu_chunk_seqlens,
            last_chunk_indices, seq_idx, out, D=D, z=z, dt_bias=dt_bias,
            initial_states=initial_states, dt_softplus=dt_softplus,
            dt_limit=dt_limit,
            return_intermediate_states=return_intermediate_states,
            state_dtype=state_dtype,
        )  # fmt: skip
        if final_states_out is None:
            return states
        assert final_state_indices is not None
        final_states_out[final_state_indices.long()] = states.to(
            final_states_out.dtype
        )
        return None

    return _mamba_chunk_scan_fused_fwd(
        x, dt, A, B, C, chunk_size, cu_seqlens, cu_chunk_seqlens,
        last_chunk_indices, seq_idx, out, D=D, z=z, dt_bias=dt_bias,
        initial_states=initial_states, dt_softplus=dt_softplus,
        dt_limit=dt_limit,
        return_intermediate_states=return_intermediate_states,
        state_dtype=state_dtype, final_states_out=final_states_out,
        final_state_indices=final_state_indices,
    )  # fmt: skip


def _mamba_chunk_scan_fused_fwd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    cu_seqlens: torch.Tensor,
    cu_chunk_seqlens: torch.Tensor,
    last_chunk_indices: torch.Tensor,
    seq_idx: torch.Tensor,
    out: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    return_intermediate_states: bool = False,
    state_dtype: torch.dtype | None = None,
    final_states_out: torch.Tensor | None = None,
    final_state_indices: torch.Tensor | None = None,
    *,
    triton_config: Mapping[str, int] | None = None,
) -> torch.Tensor | None:
    """``mamba_chunk_scan_fused_varlen`` without its platform check (the
    Triton interpreter test calls it with CPU tensors). ``triton_config``
    overrides entries of ``_launch_config`` (BLOCK_M, BLOCK_KB, BLOCK_P,
    OUT_STAGES, num_warps, num_stages) for tests."""
    assert cu_seqlens is not None, "cu_seqlens must be provided assuming varlen input"
    assert seq_idx is not None
    assert final_states_out is None or not return_intermediate_states
    assert is_int_pow_2(chunk_size), "chunk_size must be integer power of 2"
    seqlen, nheads, headdim = x.shape
    _, ngroups, dstate = B.shape
    assert nheads % ngroups == 0
    assert B.shape == (seqlen, ngroups, dstate)
    assert C.shape == B.shape
    assert dt.shape == (seqlen, nheads)
    assert A.shape == (nheads,)
    if z is not None:
        assert z.shape == x.shape
    if D is not None:
        assert D.shape == (nheads, headdim) or D.shape == (nheads,)
        if D.stride(-1) != 1:
            D = D.contiguous()
    if dt_bias is not None:
        assert dt_bias.shape == (nheads,)
        dt_bias = dt_bias.contiguous()
    A = A.contiguous()
    nchunks = cu_chunk_seqlens.shape[0] - 1
    batch = cu_seqlens.shape[0] - 1
    assert seq_idx.shape == (nchunks,)
    assert last_chunk_indices.shape == (batch,)
    if initial_states is not None:
        assert initial_states.shape == (batch, nheads, headdim, dstate)
    out_state_dtype = state_dtype if state_dtype is not None else C.dtype
    if final_states_out is not None:
        assert final_states_out.shape[1:] == (nheads, headdim, dstate)
        assert final_state_indices is not None
        assert final_state_indices.shape == (batch,)

    device = x.device
    if nchunks == 0:  # every sequence empty: nothing to launch
        if return_intermediate_states:
            return torch.empty(
                (0, nheads, headdim, dstate), device=device, dtype=out_state_dtype
            )
        if initial_states is not None:
            finals = initial_states.to(out_state_dtype)
        else:
            finals = torch.zeros(
                (batch, nheads, headdim, dstate), device=device, dtype=out_state_dtype
            )
        if final_states_out is None:
            return finals
        assert final_state_indices is not None
        final_states_out[final_state_indices.long()] = finals.to(final_states_out.dtype)
        return None

    inter = None
    if return_intermediate_states:
        inter = torch.empty(
            (nchunks, nheads, headdim, dstate), device=device, dtype=out_state_dtype
        )
    write_final = final_states_out is not None or not return_intermediate_states
    if final_states_out is not None:
        final = final_states_out
    elif write_final:
        final = torch.empty(
            (batch, nheads, headdim, dstate), device=device, dtype=out_state_dtype
        )
    else:
        final = None

    _launch_triton(
        x, dt, A, B, C, chunk_size, cu_chunk_seqlens, last_chunk_indices,
        seq_idx, out, D, z, dt_bias, initial_states, dt_softplus, dt_limit,
        inter, final, final_state_indices, write_final,
        final_states_out is not None, triton_config,
    )  # fmt: skip

    if return_intermediate_states:
        return inter
    if final_states_out is not None:
        return None
    return final


def _launch_triton(
    x, dt, A, B, C, chunk_size, cu_chunk_seqlens, last_chunk_indices, seq_idx,
    out, D, z, dt_bias, initial_states, dt_softplus, dt_limit, inter, final,
    final_state_indices, write_final, has_final_indices, triton_config,
) -> None:  # fmt: skip
    """Launch the Triton form (arguments checked by the caller)."""
    seqlen, nheads, headdim = x.shape
    _, ngroups, dstate = B.shape
    nchunks = cu_chunk_seqlens.shape[0] - 1
    flags = ssd_fused_launch.meta_flags(
        D, z, dt_bias, dt_softplus, initial_states,
        inter is not None, write_final, has_final_indices,
    )  # fmt: skip
    meta = _launch_meta(chunk_size, headdim, dstate, flags, triton_config)
    n_items = nchunks * nheads * meta["NUM_P_BLOCKS"]
    # a chunk-end state per chunk and head (each BLOCK_P slice its own part)
    # and the flag buffer ("Flag buffer" above)
    ws, sync = ssd_fused_launch.scratch(
        x.device, nchunks * nheads * headdim * dstate, n_items
    )
    args = (
        x, dt, A, B, C, D, z, dt_bias, out, initial_states, ws, sync, inter,
        final, final_state_indices, cu_chunk_seqlens, seq_idx,
        last_chunk_indices,
        float(dt_limit[0]), float(dt_limit[1]), nchunks,
        last_chunk_indices.shape[0],
        nheads, headdim, dstate, nheads // ngroups,
        *x.stride(), *dt.stride(), *B.stride(), *C.stride(),
        D.stride(0) if D is not None else 0,
        *_strides(z, 3), *out.stride(),
        *_strides(initial_states, 4), *_strides(inter, 4), *_strides(final, 4),
        final_state_indices.stride(0) if final_state_indices is not None else 0,
    )  # fmt: skip
    ssd_fused_launch.launch(_ssd_fused_varlen_kernel, n_items, args, meta)


# (Any: the chain's entry point is untyped, and callers index the result)
SSD_PREFILL_IMPLS: dict[str, Callable[..., Any]] = {
    "chain": mamba_chunk_scan_combined_varlen,
    "fused": mamba_chunk_scan_fused_varlen,
}


def select_mamba_chunk_scan_varlen(
    impl: str = "chain",
) -> Callable[..., Any]:
    """Return the SSD prefill entry point for ``MambaConfig.ssd_prefill``:
    ``"chain"`` (upstream five-kernel chain) or ``"fused"`` (this module's
    single launch)."""
    try:
        return SSD_PREFILL_IMPLS[impl]
    except KeyError:
        raise ValueError(
            f"Unknown Mamba2 SSD prefill implementation {impl!r}; "
            f"valid: {', '.join(SSD_PREFILL_IMPLS)}"
        ) from None

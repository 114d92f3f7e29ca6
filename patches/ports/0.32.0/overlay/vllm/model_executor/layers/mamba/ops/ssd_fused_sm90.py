# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Hopper (sm_90) form of the fused Mamba2 SSD prefill kernel, in Gluon.

Same algorithm, ticket scheme (and deadlock-freedom argument) and memory
ordering as the portable Triton kernel in ``ssd_fused``; what changes is how
one program uses the SM, which Triton's ``tl.dot`` does not let us control
(it waits for every wgmma right after issuing it):

* x, B and C row tiles arrive by TMA into a ring of shared-memory buffers
  (mbarrier-tracked), requested ahead of their use across passes;
* the tensor-core dots are asynchronous wgmma: C.B^T and C.S_run are issued
  together and the decay factors, the masked block and the operand of the
  state update are computed while they run; the state update runs while the
  output block's epilogue does;
* dt of a chunk is gathered from global memory once per pass (a strided
  2-byte gather per token is the slowest load of the kernel), and every
  per-row factor the passes derive from it (cumsums, decay weights,
  exponentials) is computed there once and kept in shared memory;
* full output row blocks are written by TMA stores from shared memory.

Work decomposition (``_ssd_fused_sm90_kernel``): one program per (run,
head), a run being ``run_chunks`` consecutive chunks of any sequences. The
output pass carries the running state S_run from chunk to chunk in
registers, so a chunk needs no state pass and no hand-over, and its x / B
tiles are read once. Only where the next run continues a sequence is a state
pass needed, over that sequence's chunks in the run (the run's tail); it is
split between the two programs (``_split``), so that with one sequence over
all runs of a head every program does the same share of state-pass work and
none waits for a whole tail's pass. The kernel has two forms (WS constexpr,
``warp_specialized``):

* one warpgroup, RUN_SLOTS_PER_SM programs per SM, ``slots // heads`` runs
  per head (``run_length``: one wave);
* warp-specialized (``_ws_output`` / ``_ws_state`` / ``_ws_loader``): one
  program per SM on three warpgroups joined by mbarrier rings in shared
  memory. A program's work item is a range of the heads x chunks in
  head-major order (``_ws_plan``, ``ws_programs``): one head where the heads
  fill the SMs, else the part of one head and the first chunks of the next,
  so that every SM has a program. Such a range runs the next head's chunks
  first: their entry state is known (their sequence starts in the range),
  and its running pass hands the state over at the chunk where the next
  program takes it, as it reaches that chunk. The next program, after its
  own next-head part, runs a state pass over the chunks between that chunk
  and its range's start, takes the state and runs its part of the first
  head (``_ws_entry_plan`` places the hand-over chunk so that the two meet,
  from the cost of a state-pass chunk relative to a run chunk,
  ``LaunchConfig.help_cost``). The loader issues every row tile by TMA into
  a ring (three deep; four where ranges cross heads, as the state pass
  reads through it), in the order they are consumed; the state warpgroup
  carries S_run through the range, publishing each 64-row block's S_run
  (bf16, two-slot ring) while the block's update is in flight and each
  chunk's dt factors (two-slot ring), and runs the state pass on per-chunk
  weights the output warpgroup computes meanwhile (two-slot ring); the
  output warpgroup computes C.B^T, C.S_run and y. The launcher takes it
  where whole heads per program fill the GPU (``ws_fills``) or there are at
  least WS_MIN_HEADS heads per SM.

Deadlock freedom. Within a program: each ring slot is released by all its
consumers before its producer refills it, and the state warpgroup runs at
most two row blocks and one chunk ahead of the output warpgroup (the depth
of the rings between them), so every wait is on a step that an earlier step
of another warpgroup of the same program releases: no wait closes a cycle.
Across programs: a program takes its work item from the ticket counter, in
increasing order, and waits only for a hand-over from the item before it
(a smaller ticket, held by a program that is running or has finished), so
the argument of ``ssd_fused`` applies unchanged.

Gluon is Triton's experimental lower-level language and its API changes
between releases: this module is used with the releases in
``GLUON_TRITON_VERSIONS`` (the ones it is compiled and tested with) and
otherwise reports itself unavailable (``HAS_GLUON``), so that
``ssd_fused`` runs its Triton form.

Used by ``mamba_chunk_scan_fused_varlen`` where ``supports`` holds (sm_90,
bf16 x / B / C / out with unit-stride, TMA-compatible rows, headdim 64,
dstate 32, 64 or 128, chunk 128 or 256); everything else runs the Triton
kernel.
"""

import dataclasses
from functools import cache

import torch

from vllm.model_executor.layers.mamba.ops import ssd_fused_launch
from vllm.triton_utils import triton

# The Triton releases this Gluon code is written and tested for.
GLUON_TRITON_VERSIONS = ("3.6", "3.8")
_TRITON_VERSION = getattr(triton, "__version__", "")
HAS_GLUON = False
if _TRITON_VERSION.startswith(tuple(v + "." for v in GLUON_TRITON_VERSIONS)):
    try:
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.hopper import (
            fence_async_shared,
            mbarrier,
            tma,
            warpgroup_mma,
            warpgroup_mma_wait,
        )
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        HAS_GLUON = True
    except ImportError:  # a build without Gluon's Hopper support
        pass

BLOCK_M = 64  # rows per output / state step: one wgmma M tile per warpgroup
NUM_BUFFERS = 2  # depth of the TMA ring
# Programs resident per SM (255 registers x 4 warps, about 110 KB of shared
# memory each): the one-warpgroup run kernel's programs per SM.
RUN_SLOTS_PER_SM = 2
# The warp-specialized run kernel is taken where its one wave of whole heads
# fills at least WS_MIN_FILL of the SMs (ws_fills) or the heads are at least
# WS_MIN_HEADS of the SMs (its ranges then cross heads).
WS_MIN_FILL = 0.9
WS_MIN_HEADS = 0.55
# Depth of its TMA ring: one head per program, and where ranges cross heads
# (the state passes then read their tiles through the ring at its depth).
WS_NUM_BUFFERS = (3, 4)
WS_REGS = (216, 40)  # registers of its state and loader warpgroups


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """How ``launch`` decomposes the work. The defaults are the launcher's
    heuristics; tests and benchmarks pass others to reach each form.

    run_chunks: chunks per program (run or range); None: ``run_length`` for
        the one-warpgroup kernel, ``ws_programs``' plan (one head per program
        or one program per SM) for the warp-specialized one.
    warp_specialize: the warp-specialized kernel (True), the one-warpgroup
        one (False), or ``warp_specialized``'s choice (None).
    help_cost: the time of the warp-specialized kernel's state pass over a
        chunk in units of its output pass over a chunk, by which
        ``_ws_entry_plan`` places a hand-over (tuned on an H200 at 80
        heads).
    """

    run_chunks: int | None = None
    warp_specialize: bool | None = None
    help_cost: float = 0.28

    def __post_init__(self) -> None:
        if self.run_chunks is not None and self.run_chunks < 1:
            raise ValueError(f"run_chunks must be at least 1, not {self.run_chunks}")


DEFAULT_CONFIG = LaunchConfig()


@cache
def _is_sm90(device_index: int | None) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def supports(
    x: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    out: torch.Tensor,
    chunk_size: int,
) -> bool:
    """Whether this kernel handles the call (else the Triton kernel does)."""
    if not HAS_GLUON or not x.is_cuda or not _is_sm90(x.device.index):
        return False
    _, _, headdim = x.shape
    dstate = B.shape[-1]
    # headdim is the M of the state dots (one warpgroup: 64); the tested
    # dstates and chunk sizes
    if headdim != 64 or dstate not in (32, 64, 128) or chunk_size not in (128, 256):
        return False
    for t, inner in ((x, headdim), (B, dstate), (C, dstate), (out, headdim)):
        # TMA views (tokens, heads * headdim) / (tokens, groups * dstate):
        # bf16, unit inner strides, 16-byte aligned base and row stride (8
        # elements).
        st = t.stride()
        if t.dtype != torch.bfloat16 or st[2] != 1 or st[1] != inner or st[0] % 8:
            return False
        if t.data_ptr() % 16:
            return False
    return True


if HAS_GLUON:

    class _TmaView(TensorDescriptor):
        """A TensorDescriptor without the argument checks it runs when built
        (host time on every launch): launch() builds them only for views
        supports() has checked (bf16, unit inner stride, 16-byte aligned base
        and rows)."""

        def __post_init__(self) -> None:
            pass

    _BLOCK_M = gl.constexpr(BLOCK_M)
    # CTA-wide barrier: thread_barrier in 3.6, barrier from 3.8 on
    _cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
    _NUM_BUFFERS = gl.constexpr(NUM_BUFFERS)
    WS_STATE_REGS = gl.constexpr(WS_REGS[0])
    WS_LOADER_REGS = gl.constexpr(WS_REGS[1])
    # the per-row factors of a chunk: row block k in row k
    _BLK_C = gl.constexpr(gl.BlockedLayout([1, 2], [1, 32], [4, 1], [1, 0]))
    _VEC = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))

    _LOG2E = gl.constexpr(1.4426950408889634)

    @gluon.jit
    def _exp(x):
        return gl.exp2(x * _LOG2E)

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _store_state(base, s, offs_p, offs_n, stride_p, stride_n):
        """Store the (P, N) state s at base with row / column strides, in the
        tensor's dtype."""
        gl.store(
            base + offs_p[:, None] * stride_p + offs_n[None, :] * stride_n,
            s.to(base.dtype.element_ty),
        )

    @gluon.jit
    def _store_final_state(
        final_ptr, final_idx_ptr, seq, h, s, offs_p, offs_n, stride_final_s,
        stride_final_h, stride_final_p, stride_final_n, stride_final_idx,
        FINAL_HAS_INDICES: gl.constexpr,
    ):  # fmt: skip
        """Store sequence seq's final state s of head h in its state cache
        slot (final_idx_ptr[seq], or seq without indices)."""
        if FINAL_HAS_INDICES:
            slot = gl.load(final_idx_ptr + seq * stride_final_idx).to(gl.int64)
        else:
            slot = seq.to(gl.int64)
        _store_state(
            final_ptr + slot * stride_final_s + h * stride_final_h,
            s, offs_p, offs_n, stride_final_p, stride_final_n,
        )  # fmt: skip

    @gluon.jit
    def _seq_init_state(
        init_ptr, seq, h, stride_init_b, stride_init_h, stride_init_p,
        stride_init_n, offs_p, offs_n, layout: gl.constexpr,
        HAS_INITSTATES: gl.constexpr,
    ):  # fmt: skip
        """The fp32 state entering sequence seq (zeros without initial
        states), in the layout of offs_p x offs_n."""
        if HAS_INITSTATES:
            s = gl.load(
                init_ptr
                + seq.to(gl.int64) * stride_init_b
                + h * stride_init_h
                + offs_p[:, None] * stride_init_p
                + offs_n[None, :] * stride_init_n
            ).to(gl.float32)
        else:
            s = gl.zeros([offs_p.shape[0], offs_n.shape[0]], gl.float32, layout=layout)
        return s

    @gluon.jit
    def _chunk_bounds(cu_chunk_ptr, c):
        """First row and length of chunk c."""
        start = gl.load(cu_chunk_ptr + c)
        return start, gl.load(cu_chunk_ptr + c + 1) - start

    @gluon.jit
    def _issue(
        s, ij, istart, ikind, x_desc, b_desc, c_desc, x_s, b_s, c_s, bars, xcol,
        bcol,
    ):  # fmt: skip
        """Request into ring slot s row block ij of the chunk starting at row
        istart, for the state pass (ikind 0: x, B) or the output pass (1: x, B,
        C); nothing for ikind >= 2."""
        if ikind < 2:
            bar = bars.index(s)
            r = istart + ij * _BLOCK_M
            if ikind == 0:
                mbarrier.expect(
                    bar, x_desc.block_type.nbytes + b_desc.block_type.nbytes
                )
            else:
                mbarrier.expect(
                    bar,
                    x_desc.block_type.nbytes
                    + b_desc.block_type.nbytes
                    + c_desc.block_type.nbytes,
                )
                tma.async_copy_global_to_shared(c_desc, [r, bcol], bar, c_s.index(s))
            tma.async_copy_global_to_shared(x_desc, [r, xcol], bar, x_s.index(s))
            tma.async_copy_global_to_shared(b_desc, [r, bcol], bar, b_s.index(s))

    @gluon.jit
    def _dt_raw(dt_ptr, cstart, clength, h, stride_dt_t, stride_dt_h, NB: gl.constexpr):
        """The chunk's dt (rows [cstart, cstart + clength), 0 past clength) as
        stored, row block k in row k; issued early, used by _chunk_factors."""
        offs = (
            gl.arange(0, NB, layout=gl.SliceLayout(1, _BLK_C))[:, None] * _BLOCK_M
            + gl.arange(0, _BLOCK_M, layout=gl.SliceLayout(0, _BLK_C))[None, :]
        )
        base = dt_ptr + cstart.to(gl.int64) * stride_dt_t + h * stride_dt_h
        return gl.load(base + offs * stride_dt_t, mask=offs < clength, other=0.0)

    @gluon.jit
    def _chunk_factors(
        dt_raw, clength, A, dt_bias, dt_min, dt_max, dt_s, cs_s, ecs_s, wst_s,
        wout_s, NB: gl.constexpr, HAS_DT_BIAS: gl.constexpr,
        DT_SOFTPLUS: gl.constexpr, STATE_W: gl.constexpr, OUT_W: gl.constexpr,
    ):  # fmt: skip
        """The per-row factors the passes derive from dt, into shared memory,
        row block k in row k: dt = clamp(softplus?(dt + dt_bias)), and
        with STATE_W the state pass's weights dt * exp(dA_tot - chunk
        cumsum) (the chunk cumsum is the block's cumsum cs of dt * A plus
        the totals of the blocks before), with OUT_W the output pass's dt,
        cs * log2(e) (the decay exponents in exp2's unit), exp(cs) and
        dt * exp(block total - cs). The passes load them in
        the layouts they need, with no scans, reductions or layout changes
        per row block. A warp holds a row block, so only STATE_W exchanges
        data across warps (once). Returns dA_tot, the chunk's total
        (with STATE_W, else 0)."""
        offs = (
            gl.arange(0, NB, layout=gl.SliceLayout(1, _BLK_C))[:, None] * _BLOCK_M
            + gl.arange(0, _BLOCK_M, layout=gl.SliceLayout(0, _BLK_C))[None, :]
        )
        dt = dt_raw.to(gl.float32)
        if HAS_DT_BIAS:
            dt += dt_bias
        if DT_SOFTPLUS:
            dt = gl.where(dt <= 20.0, gl.log(gl.exp(dt) + 1.0), dt)
        dt = gl.where(offs < clength, gl.minimum(gl.maximum(dt, dt_min), dt_max), 0.0)
        dA = dt * A
        cs = gl.associative_scan(dA, 1, _add)
        blk_tot = gl.sum(dA, axis=1)
        dA_tot = 0.0
        if STATE_W:
            # every block total in every warp (the one exchange across warps),
            # then the totals of the blocks before each block, warp-locally
            tot_j = gl.convert_layout(blk_tot, gl.SliceLayout(0, _BLK_C))
            rows = gl.arange(0, NB, layout=gl.SliceLayout(1, _BLK_C))
            cols = gl.arange(0, NB, layout=gl.SliceLayout(0, _BLK_C))
            before = cols[None, :] < rows[:, None]
            start = gl.sum(gl.where(before, tot_j[None, :], 0.0), axis=1)
            dA_tot = gl.sum(tot_j, axis=0)
            wst_s.store(dt * _exp(gl.minimum(dA_tot - (start[:, None] + cs), 0.0)))
        if OUT_W:
            dt_s.store(dt)
            cs_s.store(cs * _LOG2E)
            ecs_s.store(_exp(cs))
            wout_s.store(dt * _exp(gl.minimum(blk_tot[:, None] - cs, 0.0)))
        _cta_barrier()
        return dA_tot

    @gluon.jit
    def _state_block(s_acc, w_rows, xs, bs):
        """s_acc + (x scaled by the row weights w_rows)^T . B of one row
        block (x and B from ring slot views xs / bs)."""
        s_acc = _state_issue(s_acc, w_rows, xs, bs)
        return warpgroup_mma_wait(0, deps=(s_acc,))

    @gluon.jit
    def _state_issue(s_acc, w_rows, xs, bs):
        """_state_block's dot, issued (asynchronous, not waited for). x . w
        is taken in packed bf16 (w rounded to bf16 first): the dot's operand
        is bf16 either way, and the fp32 round trip was half of the state
        pass's instructions."""
        N: gl.constexpr = bs.shape[1]
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16]
        )
        opa_s: gl.constexpr = gl.DotOperandLayout(
            operand_index=0, parent=mma_s, k_width=2
        )
        w = w_rows.load(gl.SliceLayout(0, opa_s))
        xt = xs.permute((1, 0)).load(opa_s)
        xw = xt * w.to(xs.dtype)[None, :]
        return warpgroup_mma(xw, bs, s_acc, is_async=True)

    @gluon.jit
    def _block_decay(ecs_rows, k):
        """exp(total dA of row block k): its last exp(cs) (dt is 0 past the
        chunk's end)."""
        return gl.sum(ecs_rows.index(k).slice(_BLOCK_M - 1, 1).load(_VEC), axis=0)

    @gluon.jit
    def _exp_cap(P: gl.constexpr):
        """The causal mask of a row block's C.B^T as the upper bound of its
        decay exponents: 0 on and below the diagonal, -inf above (in the
        layout of the output dots, N = P)."""
        mma_o: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, P, 16]
        )
        offs_i = gl.arange(0, _BLOCK_M, layout=gl.SliceLayout(1, mma_o))
        offs_j = gl.arange(0, _BLOCK_M, layout=gl.SliceLayout(0, mma_o))
        return gl.where(offs_i[:, None] >= offs_j[None, :], 0.0, float("-inf"))

    @gluon.jit
    def _store_run_state(st_s, s_run):
        """S_run, bf16, into shared memory for the next block's C.S_run, once
        every warp's C.S_run has read the old one."""
        _cta_barrier()
        st_s.store(s_run.to(st_s.dtype))
        fence_async_shared()

    @gluon.jit
    def _output_block(
        s_run, k, cstart, clength, h, xcol, xs, bs, cs, st_s, y_s, out_desc, out_ptr,
        z_ptr, Dv, dt_rows, cs_rows, ecs_rows, wout_rows, stride_out_t,
        stride_out_h, stride_out_p, stride_z_t, stride_z_h, stride_z_p,
        HAS_D: gl.constexpr, D_HAS_HDIM: gl.constexpr, HAS_Z: gl.constexpr,
        UPDATE: gl.constexpr = True, exp_cap=0.0, HAS_EXP_CAP: gl.constexpr = False,
    ):  # fmt: skip
        """Output rows [k * BLOCK_M, (k + 1) * BLOCK_M) of the chunk at rows
        [cstart, cstart + clength) for head h, with x / B / C from ring slot
        views xs / bs / cs and the running state S_run in st_s (bf16) and
        s_run (fp32):

            y = exp(cs_i) C_i . S_run + (L o C_i B_i^T) x_i  (+ D x, * silu z)

        then S_run is advanced over the block (s_run returned, st_s
        rewritten). C_i . B_i^T, C_i . S_run and the state update are in
        flight while the decay factors are computed; y's dot while the new
        state goes to shared memory. Without UPDATE (the warp-specialized
        kernel's output partition) S_run is only read from st_s. With
        HAS_EXP_CAP, exp_cap (_exp_cap) is the causal mask, applied as the
        decay exponents' upper bound (exp2 of -inf is 0): it is hoisted out
        of the loop by the caller, so no compare or select per element is
        left here; without, exp_cap is 0.0 (the bound for j <= i) and the
        mask is a select."""
        P: gl.constexpr = xs.shape[1]
        N: gl.constexpr = bs.shape[1]
        io_dtype: gl.constexpr = xs.dtype
        mma_o: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, P, 16]
        )
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16]
        )
        opa_o: gl.constexpr = gl.DotOperandLayout(
            operand_index=0, parent=mma_o, k_width=2
        )
        opa_s: gl.constexpr = gl.DotOperandLayout(
            operand_index=0, parent=mma_s, k_width=2
        )
        row_o: gl.constexpr = gl.SliceLayout(1, mma_o)
        col_o: gl.constexpr = gl.SliceLayout(0, mma_o)
        offs_i = gl.arange(0, _BLOCK_M, layout=row_o)
        offs_j = gl.arange(0, _BLOCK_M, layout=col_o)
        offs_po = gl.arange(0, P, layout=col_o)
        m0 = k * _BLOCK_M
        rows = m0 + offs_i
        cb = warpgroup_mma(
            cs,
            bs.permute((1, 0)),
            gl.zeros([_BLOCK_M, _BLOCK_M], gl.float32, layout=mma_o),
            use_acc=False,
            is_async=True,
        )
        inter = warpgroup_mma(
            cs,
            st_s.permute((1, 0)),
            gl.zeros([_BLOCK_M, P], gl.float32, layout=mma_o),
            use_acc=False,
            is_async=True,
        )
        if UPDATE:
            w_a = wout_rows.index(k).load(gl.SliceLayout(0, opa_s))
            xt = xs.permute((1, 0)).load(opa_s)
            xw = xt * w_a.to(io_dtype)[None, :]
            # the state update for the next row block (on a chunk's last
            # block: the state at the chunk's end), in flight behind the two
            # dots; exp(block total) is the block's last exp(cs) (dt is 0
            # past clength)
            e_blk = _block_decay(ecs_rows, k)
            s_run = warpgroup_mma(xw, bs, s_run * e_blk, is_async=True)
        # decay exponents in exp2's unit (_chunk_factors)
        cs_i = cs_rows.index(k).load(row_o)
        dt_j = dt_rows.index(k).load(col_o)
        cs_j = cs_rows.index(k).load(col_o)
        fac = gl.exp2(gl.minimum(cs_i[:, None] - cs_j[None, :], exp_cap))
        fac = fac * dt_j[None, :]
        if UPDATE:
            cb = warpgroup_mma_wait(2, deps=(cb,))
        else:
            cb = warpgroup_mma_wait(1, deps=(cb,))
        if HAS_EXP_CAP:
            lmat = (cb * fac).to(io_dtype)
        else:
            causal = offs_i[:, None] >= offs_j[None, :]
            lmat = gl.where(causal, cb * fac, 0.0).to(io_dtype)
        lmat = gl.convert_layout(lmat, opa_o)
        if UPDATE:
            inter = warpgroup_mma_wait(1, deps=(inter,))
            s_run = warpgroup_mma_wait(0, deps=(s_run,))
        else:
            inter = warpgroup_mma_wait(0, deps=(inter,))
        acc = inter * ecs_rows.index(k).load(row_o)[:, None]
        if not UPDATE:
            y = warpgroup_mma(lmat, xs, acc, is_async=True)
            if HAS_D:
                xo = xs.load(mma_o).to(gl.float32)
        elif HAS_D:
            # the new S_run into shared memory (the next block's C.S_run)
            # while y's dot runs
            y = warpgroup_mma(lmat, xs, acc, is_async=True)
            _store_run_state(st_s, s_run)
            xo = xs.load(mma_o).to(gl.float32)
        else:
            # the same order crashes ptxas (Triton 3.6's and 3.8's) without
            # the D load between the store and the wait
            _store_run_state(st_s, s_run)
            y = warpgroup_mma(lmat, xs, acc, is_async=True)
        y = warpgroup_mma_wait(0, deps=(y,))
        if HAS_D:
            if D_HAS_HDIM:
                y += xo * Dv[None, :]
            else:
                y += xo * Dv
        mask_i = rows < clength
        if HAS_Z:
            z_base = z_ptr + cstart.to(gl.int64) * stride_z_t + h * stride_z_h
            zv = gl.load(
                z_base + rows[:, None] * stride_z_t + offs_po[None, :] * stride_z_p,
                mask=mask_i[:, None],
                other=0.0,
            ).to(gl.float32)
            y *= zv / (1.0 + gl.exp(-zv))
        # Both branches end in a barrier: st_s is complete, and every warp is
        # done with the ring slot.
        if m0 + _BLOCK_M <= clength:
            tma.store_wait(0)  # the previous block's store left y_s
            y_s.store(y.to(io_dtype))
            fence_async_shared()
            _cta_barrier()
            tma.async_copy_shared_to_global(out_desc, [cstart + m0, xcol], y_s)
        else:
            # the chunk's last, partial block: rows past clength belong to the
            # next chunk, so no TMA box here
            out_base = out_ptr + cstart.to(gl.int64) * stride_out_t + h * stride_out_h
            gl.store(
                out_base
                + rows[:, None] * stride_out_t
                + offs_po[None, :] * stride_out_p,
                y.to(out_ptr.dtype.element_ty),
                mask=mask_i[:, None],
            )
            _cta_barrier()
        return s_run

    @gluon.jit
    def _ws_ptrs(ws_ptr, item, P: gl.constexpr, N: gl.constexpr, layout: gl.constexpr):
        """Pointers to the fp32 (P, N) state of workspace item ``item``, in
        layout."""
        offs_p = gl.arange(0, P, layout=gl.SliceLayout(1, layout))
        offs_n = gl.arange(0, N, layout=gl.SliceLayout(0, layout))
        return (
            ws_ptr + item.to(gl.int64) * (P * N) + offs_p[:, None] * N + offs_n[None, :]
        )

    @gluon.jit
    def _take_state(
        ws_ptr, sync_ptr, item, P: gl.constexpr, N: gl.constexpr, layout: gl.constexpr
    ):
        """The fp32 state work item ``item`` handed over in the workspace
        (after its flag is set; see ssd_fused for the memory ordering)."""
        flag = sync_ptr + 2 + item
        ready = gl.atomic_add(flag, 0, sem="acquire", scope="gpu")
        while ready == 0:
            ready = gl.atomic_add(flag, 0, sem="acquire", scope="gpu")
        _cta_barrier()
        return gl.load(_ws_ptrs(ws_ptr, item, P, N, layout), cache_modifier=".cg")

    @gluon.jit
    def _hand_over(ws_ptr, sync_ptr, item, s, layout: gl.constexpr):
        """Publish work item ``item``'s fp32 state s (in layout): workspace,
        then flag."""
        P: gl.constexpr = s.shape[0]
        N: gl.constexpr = s.shape[1]
        gl.store(_ws_ptrs(ws_ptr, item, P, N, layout), s, cache_modifier=".cg")
        _cta_barrier()
        gl.atomic_xchg(sync_ptr + 2 + item, 1, sem="release", scope="gpu")

    @gluon.jit
    def _sync_done(sync_ptr):
        """Count this program finished with the flag buffer (after its last
        flag access, on the warps that made them); the last one zeroes the
        buffer for the next launch (ssd_fused, "Flag buffer")."""
        _cta_barrier()
        n = gl.num_programs(0)
        done = gl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu")
        if done == n - 1:
            offs0 = gl.arange(0, 512, layout=_VEC)
            for i in range(0, n + 2, 512):
                offs = i + offs0
                gl.store(
                    sync_ptr + offs,
                    gl.zeros([512], gl.int32, _VEC),
                    mask=offs < n + 2,
                )

    @gluon.jit
    def _load_D(
        D_ptr, h, stride_D_h, P: gl.constexpr, layout: gl.constexpr,
        HAS_D: gl.constexpr, D_HAS_HDIM: gl.constexpr,
    ):  # fmt: skip
        """Head h's D (per head dim, in layout, or a scalar; 0.0 without)."""
        if HAS_D:
            if D_HAS_HDIM:
                offs = gl.arange(0, P, layout=layout)
                Dv = gl.load(D_ptr + h * stride_D_h + offs).to(gl.float32)
            else:
                Dv = gl.load(D_ptr + h * stride_D_h).to(gl.float32)
        else:
            Dv = 0.0
        return Dv

    @gluon.jit
    def _settle(ic, ikind, own_hi, help_lo, c0, c1):
        """Move the run kernel's load cursor (chunk ic of pass ikind) past
        the passes it has finished. Its passes, in order: 0, the state pass
        over the run's own tail chunks (up to own_hi); 1, the state pass over
        the previous run's tail chunks [help_lo, c0); 2, the output pass over
        the run [c0, c1); 3, done."""
        if (ikind == 0) & (ic >= own_hi):
            ikind = 1
            ic = help_lo
        if (ikind == 1) & (ic >= c0):
            ikind = 2
            ic = c0
        if (ikind == 2) & (ic >= c1):
            ikind = 3
        return ic, ikind

    @gluon.jit
    def _advance(ic, ij, inb, istart, ikind, own_hi, help_lo, c0, c1, cu_chunk_ptr):
        """Move the run kernel's load cursor (row block ij of chunk ic, which
        has inb blocks from row istart, in pass ikind; see _settle) one row
        block on."""
        ij += 1
        if ij >= inb:
            ij = 0
            ic, ikind = _settle(ic + 1, ikind, own_hi, help_lo, c0, c1)
            if ikind < 3:
                istart, ilen = _chunk_bounds(cu_chunk_ptr, ic)
                inb = gl.cdiv(ilen, _BLOCK_M)
        return ic, ij, inb, istart, ikind

    @gluon.jit
    def _issue_run(
        s, ij, istart, ikind, x_desc, b_desc, c_desc, x_s, b_s, c_s, bars, xcol,
        bcol,
    ):  # fmt: skip
        """_issue for the run kernel's cursor: its passes 0 and 1 are state
        passes, 2 the output pass."""
        _issue(
            s, ij, istart, ikind - (ikind > 0).to(gl.int32), x_desc, b_desc, c_desc,
            x_s, b_s, c_s, bars, xcol, bcol,
        )  # fmt: skip

    @gluon.jit
    def _first_of(seq_idx_ptr, lo, hi, seq):
        """The first of chunks [lo, hi) in sequence seq or a later one (hi if
        none; seq_idx is non-decreasing)."""
        first = lo
        offs = gl.arange(0, 128, layout=_VEC)
        for base in range(lo, hi, 128):
            sq = gl.load(seq_idx_ptr + base + offs, mask=base + offs < hi, other=seq)
            first += gl.sum((sq < seq).to(gl.int32), axis=0)
        return first

    @gluon.jit
    def _split(lo, hi, r, n_runs):
        """Where the state pass over run r's tail [lo, hi) is split: run r's
        program takes [lo, split), run r + 1's [split, hi). Run r keeps
        (n_runs - 1 - r) / n_runs of it: where one sequence spans all
        n_runs runs of a head (in one wave), every program then has the same
        state-pass work, (n_runs - 1) / n_runs of a run, and none waits for
        its predecessor's hand-over."""
        return lo + ((hi - lo) * (n_runs - 1 - r) + n_runs // 2) // n_runs

    @gluon.jit
    def _run_plan(sync_ptr, seq_idx_ptr, n_chunks, run_chunks, nheads, heads_per_group):
        """The run kernel's work item: run r (chunks [c0, c1)) of head h
        (group g), the sequences it starts and ends in and whether they
        continue across its ends, and the split of the state passes
        (see below)."""
        # Ticket -> (run, head); run r is chunks [c0, c1), of any sequences.
        # No deadlock, whatever order the hardware starts programs in: the
        # program holding ticket r * nheads + h waits only for the flag of
        # (r - 1, h), ticket r * nheads + h - nheads, which is smaller. Tickets
        # are taken by running programs in increasing order, so that ticket's
        # program is already running, and the running program with the
        # smallest ticket waits for nothing (it is run 0 or its predecessor
        # has finished); by induction every program gets its flag.
        ticket = gl.atomic_add(sync_ptr, 1, sem="relaxed")
        r = ticket // nheads
        h = ticket % nheads
        g = h // heads_per_group
        c0 = r * run_chunks
        c1 = gl.minimum(c0 + run_chunks, n_chunks)
        seq_first = gl.load(seq_idx_ptr + c0)
        cont_in = seq_first == gl.load(seq_idx_ptr + c0 - 1, mask=c0 > 0, other=-1)
        seq_last = gl.load(seq_idx_ptr + c1 - 1)
        cont_out = seq_last == gl.load(seq_idx_ptr + c1, mask=c1 < n_chunks, other=-1)
        # the tail: the run's chunks of seq_last
        tail = _first_of(seq_idx_ptr, c0, c1, seq_last)
        # Where the next run continues seq_last it needs the state at the
        # run's end. The state pass over the tail is split between the two
        # programs (_split), so the next one does not wait for a whole
        # tail's pass: this program takes the tail's first part [tail,
        # own_hi) and hands over the state at own_hi, the next run's
        # program the rest. Where this run continues the previous run's
        # seq_first, it takes the rest of that run's tail, [help_lo, c0).
        # Own part first: a program's hand-over then waits only for its
        # predecessor's, not for the state passes of all runs before.
        n_runs = gl.cdiv(n_chunks, run_chunks)
        if cont_out:  # noqa: SIM108
            own_hi = _split(tail, c1, r, n_runs)
        else:
            own_hi = tail
        if cont_in:
            prev_tail = _first_of(seq_idx_ptr, c0 - run_chunks, c0, seq_first)
            help_lo = _split(prev_tail, c0, r - 1, n_runs)
        else:
            help_lo = c0

        return (
            r, h, g, c0, c1, seq_first, cont_in, seq_last, cont_out, tail, own_hi,
            help_lo,
        )  # fmt: skip

    @gluon.jit
    def _next_chunk(
        c, hi, nstart, nlen, dt_next, cu_chunk_ptr, dt_ptr, h, stride_dt_t,
        stride_dt_h, NB: gl.constexpr,
    ):  # fmt: skip
        """Chunk c's first row, length and dt (requested a chunk earlier), and
        chunk c + 1's, requested now if c + 1 < hi."""
        cstart = nstart
        clength = nlen
        dt_raw = dt_next
        if c + 1 < hi:
            nstart, nlen = _chunk_bounds(cu_chunk_ptr, c + 1)
            dt_next = _dt_raw(dt_ptr, nstart, nlen, h, stride_dt_t, stride_dt_h, NB)
        return cstart, clength, dt_raw, nstart, nlen, dt_next

    @gluon.jit
    def _state_pass(
        lo, hi, t, ic, ij, inb, istart, ikind, own_hi, help_lo, c0, c1,
        cu_chunk_ptr, dt_ptr, h, stride_dt_t, stride_dt_h, A, dt_bias, dt_min,
        dt_max, dt_s, cs_s, ecs_s, wst_s, wout_s, x_s, b_s, c_s, bars, x_desc,
        b_desc, c_desc, xcol, bcol, NB: gl.constexpr, HAS_DT_BIAS: gl.constexpr,
        DT_SOFTPLUS: gl.constexpr,
    ):  # fmt: skip
        """The run kernel's state pass over chunks [lo, hi) of one sequence,
        from a zero state: returns the state it adds at hi, the chunks' dA
        total, and the load count and cursor moved on."""
        NBUF: gl.constexpr = x_s.shape[0]
        P: gl.constexpr = x_s.shape[2]
        N: gl.constexpr = b_s.shape[2]
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16]
        )
        s_acc = gl.zeros([P, N], gl.float32, layout=mma_s)
        dA = 0.0
        nstart, nlen = _chunk_bounds(cu_chunk_ptr, lo)
        dt_next = _dt_raw(dt_ptr, nstart, nlen, h, stride_dt_t, stride_dt_h, NB)
        for c in range(lo, hi):
            cstart, clength, dt_raw, nstart, nlen, dt_next = _next_chunk(
                c, hi, nstart, nlen, dt_next, cu_chunk_ptr, dt_ptr, h, stride_dt_t,
                stride_dt_h, NB,
            )  # fmt: skip
            dA_tot = _chunk_factors(
                dt_raw, clength, A, dt_bias, dt_min, dt_max, dt_s, cs_s, ecs_s, wst_s,
                wout_s, NB, HAS_DT_BIAS, DT_SOFTPLUS, True, False,
            )  # fmt: skip
            s_acc = s_acc * _exp(dA_tot)
            wst_rows = _rows(wst_s)
            for k in range(gl.cdiv(clength, _BLOCK_M)):
                s = t % NBUF
                mbarrier.wait(bars.index(s), (t // NBUF) & 1)
                s_acc = _state_block(
                    s_acc, wst_rows.index(k), x_s.index(s), b_s.index(s)
                )
                _cta_barrier()  # every warp is done with slot s
                _issue_run(
                    s, ij, istart, ikind, x_desc, b_desc, c_desc, x_s, b_s, c_s, bars,
                    xcol, bcol,
                )  # fmt: skip
                ic, ij, inb, istart, ikind = _advance(
                    ic, ij, inb, istart, ikind, own_hi, help_lo, c0, c1, cu_chunk_ptr
                )
                t += 1
            dA += dA_tot
        return s_acc, dA, t, ic, ij, inb, istart, ikind

    @gluon.jit
    def _head_params(A_ptr, dt_bias_ptr, h, HAS_DT_BIAS: gl.constexpr):
        """Head h's A and dt bias (0.0 without), fp32."""
        A = gl.load(A_ptr + h).to(gl.float32)
        if HAS_DT_BIAS:  # noqa: SIM108
            dt_bias = gl.load(dt_bias_ptr + h).to(gl.float32)
        else:
            dt_bias = 0.0
        return A, dt_bias

    @gluon.jit
    def _entry_state(
        item, prev, h, c0, c1, seq_first, cont_in, seq_last, cont_out, tail,
        own_hi, help_lo, t, ic, ij, inb, istart, ikind, cu_chunk_ptr, dt_ptr,
        stride_dt_t, stride_dt_h, A, dt_bias, dt_min, dt_max, dt_s, cs_s, ecs_s,
        wst_s, wout_s, x_s, b_s, c_s, bars, x_desc, b_desc, c_desc, xcol, bcol,
        init_ptr, stride_init_b, stride_init_h, stride_init_p, stride_init_n,
        ws_ptr, sync_ptr, NB: gl.constexpr, HAS_DT_BIAS: gl.constexpr,
        DT_SOFTPLUS: gl.constexpr, HAS_INITSTATES: gl.constexpr,
    ):  # fmt: skip
        """The state entering chunk c0 of head h for work item ``item`` (run r
        of head h, _run_plan): the state passes over its own tail part and
        the previous item's rest (item ``prev``), the hand-over from the
        previous item and to the next one. Returns the entry state (fp32, in
        the state dots' layout), the load count and the cursor moved on."""
        P: gl.constexpr = x_s.shape[2]
        N: gl.constexpr = b_s.shape[2]
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16]
        )
        # ---- state passes: own tail part, then the previous item's rest --
        s_own, dA_own, t, ic, ij, inb, istart, ikind = _state_pass(
            tail, own_hi, t, ic, ij, inb, istart, ikind, own_hi, help_lo, c0, c1,
            cu_chunk_ptr, dt_ptr, h, stride_dt_t, stride_dt_h, A, dt_bias,
            dt_min, dt_max, dt_s, cs_s, ecs_s, wst_s, wout_s, x_s, b_s, c_s,
            bars, x_desc, b_desc, c_desc, xcol, bcol, NB, HAS_DT_BIAS,
            DT_SOFTPLUS,
        )  # fmt: skip
        if cont_out:
            # parked in this program's own workspace item (its flag is still
            # 0), read back by the same threads below
            own_ptrs = _ws_ptrs(ws_ptr, item, P, N, mma_s)
            gl.store(own_ptrs, s_own, cache_modifier=".cg")
        s_acc, dA_help, t, ic, ij, inb, istart, ikind = _state_pass(
            help_lo, c0, t, ic, ij, inb, istart, ikind, own_hi, help_lo, c0, c1,
            cu_chunk_ptr, dt_ptr, h, stride_dt_t, stride_dt_h, A, dt_bias,
            dt_min, dt_max, dt_s, cs_s, ecs_s, wst_s, wout_s, x_s, b_s, c_s,
            bars, x_desc, b_desc, c_desc, xcol, bcol, NB, HAS_DT_BIAS,
            DT_SOFTPLUS,
        )  # fmt: skip

        # ---- state passing between items (memory ordering as in ssd_fused)
        offs_p = gl.arange(0, P, layout=gl.SliceLayout(1, mma_s))
        offs_n = gl.arange(0, N, layout=gl.SliceLayout(0, mma_s))
        if cont_in:
            # the previous item hands over the state at help_lo
            s_prev = (
                _exp(dA_help) * _take_state(ws_ptr, sync_ptr, prev, P, N, mma_s) + s_acc
            )
        else:
            s_prev = _seq_init_state(
                init_ptr, seq_first, h, stride_init_b, stride_init_h,
                stride_init_p, stride_init_n, offs_p, offs_n, mma_s,
                HAS_INITSTATES,
            )  # fmt: skip
        if cont_out:
            # the state entering the tail: s_prev, or seq_last's initial one
            # where seq_last starts inside the item
            if tail > c0:
                s_in = _seq_init_state(
                    init_ptr, seq_last, h, stride_init_b, stride_init_h,
                    stride_init_p, stride_init_n, offs_p, offs_n, mma_s,
                    HAS_INITSTATES,
                )  # fmt: skip
            else:
                s_in = s_prev
            own_ptrs = _ws_ptrs(ws_ptr, item, P, N, mma_s)
            s_mid = _exp(dA_own) * s_in + gl.load(own_ptrs, cache_modifier=".cg")
            _hand_over(ws_ptr, sync_ptr, item, s_mid, mma_s)
        return s_prev, t, ic, ij, inb, istart, ikind

    @gluon.jit
    def _empty_finals(
        s_lo, s_hi, h, offs_p, offs_n, init_ptr, stride_init_b, stride_init_h,
        stride_init_p, stride_init_n, final_ptr, final_idx_ptr, stride_final_s,
        stride_final_h, stride_final_p, stride_final_n, stride_final_idx,
        layout: gl.constexpr, HAS_INITSTATES: gl.constexpr,
        FINAL_HAS_INDICES: gl.constexpr,
    ):  # fmt: skip
        """Final states of the empty sequences s_lo .. s_hi - 1 (head h):
        their initial states, or zeros."""
        for s in range(s_lo, s_hi):
            v = _seq_init_state(
                init_ptr, s, h, stride_init_b, stride_init_h, stride_init_p,
                stride_init_n, offs_p, offs_n, layout, HAS_INITSTATES,
            )  # fmt: skip
            _store_final_state(
                final_ptr, final_idx_ptr, s, h, v, offs_p, offs_n,
                stride_final_s, stride_final_h, stride_final_p, stride_final_n,
                stride_final_idx, FINAL_HAS_INDICES,
            )  # fmt: skip

    @gluon.jit
    def _chunk_end_states(
        s_run, c, seq_c, h, offs_p, offs_n, inter_ptr, stride_inter_c,
        stride_inter_h, stride_inter_p, stride_inter_n, final_ptr, final_idx_ptr,
        last_chunk_ptr, stride_final_s, stride_final_h, stride_final_p,
        stride_final_n, stride_final_idx, seq_idx_ptr, n_chunks, batch,
        init_ptr, stride_init_b, stride_init_h, stride_init_p, stride_init_n,
        layout: gl.constexpr, WRITE_INTER: gl.constexpr,
        WRITE_FINAL: gl.constexpr, FINAL_HAS_INDICES: gl.constexpr,
        HAS_INITSTATES: gl.constexpr,
    ):  # fmt: skip
        """The state s_run at the end of chunk c (of sequence seq_c) where
        it is asked for: the chunk's intermediate state, and the sequence's
        final state if c is its last chunk. Empty sequences have no chunks
        (last_chunk_indices == -1): the last chunk of seq_c also writes the
        final states of those between seq_c and the next chunk's sequence
        (the batch's end after the last chunk), chunk 0 those before its
        sequence."""
        if WRITE_INTER:
            _store_state(
                inter_ptr + c.to(gl.int64) * stride_inter_c + h * stride_inter_h,
                s_run, offs_p, offs_n, stride_inter_p, stride_inter_n,
            )  # fmt: skip
        if WRITE_FINAL:
            if c == gl.load(last_chunk_ptr + seq_c):
                _store_final_state(
                    final_ptr, final_idx_ptr, seq_c, h, s_run, offs_p, offs_n,
                    stride_final_s, stride_final_h, stride_final_p, stride_final_n,
                    stride_final_idx, FINAL_HAS_INDICES,
                )  # fmt: skip
                seq_next = gl.load(
                    seq_idx_ptr + c + 1, mask=c + 1 < n_chunks, other=batch
                )
                _empty_finals(
                    seq_c + 1, seq_next, h, offs_p, offs_n, init_ptr,
                    stride_init_b, stride_init_h, stride_init_p, stride_init_n,
                    final_ptr, final_idx_ptr, stride_final_s, stride_final_h,
                    stride_final_p, stride_final_n, stride_final_idx, layout,
                    HAS_INITSTATES, FINAL_HAS_INDICES,
                )  # fmt: skip
            if c == 0:
                _empty_finals(
                    0, seq_c, h, offs_p, offs_n, init_ptr, stride_init_b,
                    stride_init_h, stride_init_p, stride_init_n, final_ptr,
                    final_idx_ptr, stride_final_s, stride_final_h,
                    stride_final_p, stride_final_n, stride_final_idx, layout,
                    HAS_INITSTATES, FINAL_HAS_INDICES,
                )  # fmt: skip

    @gluon.jit
    def _allocate(
        x_desc, b_desc, c_desc, out_desc, STATE_SMEM_LAYOUT: gl.constexpr,
        NB: gl.constexpr,
    ):  # fmt: skip
        """Shared memory of a program: the TMA ring of x / B / C row tiles
        and its barriers, the running state as the B operand of C.S_run, an
        output staging tile and the per-row factors of one chunk."""
        io_dtype: gl.constexpr = x_desc.dtype
        P: gl.constexpr = x_desc.block_type.shape[1]
        N: gl.constexpr = b_desc.block_type.shape[1]
        x_s = gl.allocate_shared_memory(
            io_dtype, [_NUM_BUFFERS, _BLOCK_M, P], x_desc.layout
        )
        b_s = gl.allocate_shared_memory(
            io_dtype, [_NUM_BUFFERS, _BLOCK_M, N], b_desc.layout
        )
        c_s = gl.allocate_shared_memory(
            io_dtype, [_NUM_BUFFERS, _BLOCK_M, N], c_desc.layout
        )
        st_s = gl.allocate_shared_memory(io_dtype, [P, N], STATE_SMEM_LAYOUT)
        y_s = gl.allocate_shared_memory(io_dtype, [_BLOCK_M, P], out_desc.layout)
        bars = gl.allocate_shared_memory(
            gl.int64, [_NUM_BUFFERS, 1], mbarrier.MBarrierLayout()
        )
        for i in gl.static_range(_NUM_BUFFERS):
            mbarrier.init(bars.index(i), count=1)
        vec_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        dt_s = gl.allocate_shared_memory(gl.float32, [NB, _BLOCK_M], vec_l)
        cs_s = gl.allocate_shared_memory(gl.float32, [NB, _BLOCK_M], vec_l)
        ecs_s = gl.allocate_shared_memory(gl.float32, [NB, _BLOCK_M], vec_l)
        wst_s = gl.allocate_shared_memory(gl.float32, [NB, _BLOCK_M], vec_l)
        wout_s = gl.allocate_shared_memory(gl.float32, [NB, _BLOCK_M], vec_l)
        return x_s, b_s, c_s, st_s, y_s, bars, dt_s, cs_s, ecs_s, wst_s, wout_s

    @gluon.jit
    def _rows(buf):
        """A [NB, BLOCK_M] factor buffer as rows (row block k: .index(k))."""
        return buf._reinterpret(
            gl.float32, [buf.shape[0], _BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [0])
        )

    @gluon.jit
    def _allocate_ws(
        x_desc, b_desc, c_desc, out_desc, STATE_SMEM_LAYOUT: gl.constexpr,
        NB: gl.constexpr, NBUF: gl.constexpr,
    ):  # fmt: skip
        """Shared memory of a warp-specialized program: the TMA ring of x /
        B / C row tiles (ready: loaded, free: released by both consumers),
        the ring of running states S_run at row block starts (bf16, the B
        operand of C.S_run), the ring of a chunk's per-row factors for the
        output pass, the ring of a chunk's state-pass weights and dA total
        (wst_r, dA_r: hf_ready / hf_free), an output staging tile and the
        state pass's tile count (cnt_s)."""
        io_dtype: gl.constexpr = x_desc.dtype
        P: gl.constexpr = x_desc.block_type.shape[1]
        N: gl.constexpr = b_desc.block_type.shape[1]
        x_s = gl.allocate_shared_memory(io_dtype, [NBUF, _BLOCK_M, P], x_desc.layout)
        b_s = gl.allocate_shared_memory(io_dtype, [NBUF, _BLOCK_M, N], b_desc.layout)
        c_s = gl.allocate_shared_memory(io_dtype, [NBUF, _BLOCK_M, N], c_desc.layout)
        st_ring = gl.allocate_shared_memory(io_dtype, [2, P, N], STATE_SMEM_LAYOUT)
        y_s = gl.allocate_shared_memory(io_dtype, [_BLOCK_M, P], out_desc.layout)
        ring_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        dt_r = gl.allocate_shared_memory(gl.float32, [2, NB, _BLOCK_M], ring_l)
        cs_r = gl.allocate_shared_memory(gl.float32, [2, NB, _BLOCK_M], ring_l)
        ecs_r = gl.allocate_shared_memory(gl.float32, [2, NB, _BLOCK_M], ring_l)
        wout_r = gl.allocate_shared_memory(gl.float32, [2, NB, _BLOCK_M], ring_l)
        wst_r = gl.allocate_shared_memory(gl.float32, [2, NB, _BLOCK_M], ring_l)
        dA_r = gl.allocate_shared_memory(
            gl.float32, [2, 32], gl.SwizzledSharedLayout(1, 1, 1, [0])
        )
        cnt_s = gl.allocate_shared_memory(
            gl.int32, [1], gl.SwizzledSharedLayout(1, 1, 1, [0])
        )
        bar_l: gl.constexpr = mbarrier.MBarrierLayout()
        ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], bar_l)
        free = gl.allocate_shared_memory(gl.int64, [NBUF, 1], bar_l)
        st_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
        st_free = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
        fac_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
        fac_free = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
        hf_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
        hf_free = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
        for i in gl.static_range(NBUF):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(free.index(i), count=2)
        for i in gl.static_range(2):
            mbarrier.init(st_ready.index(i), count=1)
            mbarrier.init(st_free.index(i), count=1)
            mbarrier.init(fac_ready.index(i), count=1)
            mbarrier.init(fac_free.index(i), count=1)
            mbarrier.init(hf_ready.index(i), count=1)
            mbarrier.init(hf_free.index(i), count=1)
        return (
            x_s, b_s, c_s, st_ring, y_s, dt_r, cs_r, ecs_r, wout_r, wst_r, dA_r,
            cnt_s, ready, free, st_ready, st_free, fac_ready, fac_free, hf_ready,
            hf_free,
        )  # fmt: skip

    @gluon.jit
    def _ws_range(p, n_chunks, total, n_programs):
        """Program p's range, chunks [p * F // n_programs, (p + 1) * F //
        n_programs) of the F = nheads x n_chunks chunks in head-major order:
        the first range chunk's head ha and chunk a0; lo_prev, where program
        p - 1's range starts in head ha (0 if in an earlier head); and,
        where the range crosses into the next head (two), its first chunks
        [0, b1) of head hb = ha + 1 (else hb = ha and b1 = a1), ha's part
        ending at a1. n_programs >= nheads, so a range is at most n_chunks
        long and meets at most two heads."""
        lo = p.to(gl.int64) * total // n_programs
        hi = (p + 1).to(gl.int64) * total // n_programs
        ha = (lo // n_chunks).to(gl.int32)
        hb = ((hi - 1) // n_chunks).to(gl.int32)
        a0 = (lo - ha.to(gl.int64) * n_chunks).to(gl.int32)
        b1 = (hi - hb.to(gl.int64) * n_chunks).to(gl.int32)
        prev = (p - 1).to(gl.int64) * total // n_programs
        lo_prev = gl.maximum((prev - ha.to(gl.int64) * n_chunks).to(gl.int32), 0)
        two = hb > ha
        if two:  # noqa: SIM108
            a1 = gl.to_tensor(n_chunks)
        else:
            a1 = b1
        return ha, a0, a1, hb, b1, two, lo_prev

    @gluon.jit
    def _ws_entry_plan(p, seq_idx_ptr, n_chunks, total, n_programs, help_cost):
        """How program p gets the state entering its part of head ha (see
        _ws_plan): seq_first, the sequence of chunk a0, cont_in, whether it
        continues from chunk a0 - 1; the state pass over [f, a0) of it
        that the program runs first (from chunk hl, or from the start f >
        hl of seq_first) and take, whether the pass starts from the state
        program p - 1 hands over at chunk hl (else from seq_first's initial
        state)."""
        ha, a0, a1, hb, b1, two, lo_prev = _ws_range(p, n_chunks, total, n_programs)
        seq_first = gl.load(seq_idx_ptr + a0)
        cont_in = seq_first == gl.load(seq_idx_ptr + a0 - 1, mask=a0 > 0, other=-1)
        # Program p runs its part of head hb first ([0, b1): tb = b1 chunk
        # times where two), then a state pass over [hl, a0) (q chunk times
        # per chunk, q = help_cost), then needs program p - 1's state at hl,
        # which that program's running pass reaches after hl - lo_prev
        # chunk times, after its own state pass (estimated as this formula
        # with tb = 0 and program p - 2 starting the head: q lo_prev /
        # (1 + q)). hl makes the two meet.
        if two:  # noqa: SIM108
            tb = b1.to(gl.float32)
        else:
            tb = 0.0
        q = help_cost
        hl_t = (tb + q * a0 + lo_prev / (1.0 + q)) / (1.0 + q)
        hl = gl.minimum(gl.maximum((hl_t + 0.5).to(gl.int32), lo_prev), a0)
        if cont_in:
            f = _first_of(seq_idx_ptr, hl, a0, seq_first)
            # from the state at hl where seq_first runs through chunk hl - 1
            take = (f == hl) & (hl > 0)
            if take:
                take = gl.load(seq_idx_ptr + hl - 1) == seq_first
        else:
            f = a0
            take = False
        return seq_first, cont_in, hl, f, take

    @gluon.jit
    def _ws_plan(sync_ptr, seq_idx_ptr, n_chunks, nheads, n_programs, help_cost):
        """The warp-specialized run kernel's work item: program p (its ticket)
        takes a range of the chunks in head-major order (_ws_range): its
        part of head ha, chunks [a0, a1), and, where two, head hb's first
        chunks [0, b1). It runs head hb's part first: those chunks' state is
        known from their sequences' starts, so the state at any of them is
        known as the running pass reaches it. Where ha's part continues a
        sequence (cont_in) the program then runs a state pass over [f, a0)
        (_ws_entry_plan) and takes the state program p - 1 hands over at
        hl; its running pass hands over the state at chunk pub (-1: none)
        of its last head to program p + 1, the chunk where that program
        takes it."""
        # No deadlock, whatever order the hardware starts programs in: the
        # program holding ticket p waits only for the hand-over of ticket
        # p - 1 (at most once), taken before it by a running program, which
        # makes that hand-over in a running pass that waits for nothing but
        # its own take; the running program with the smallest ticket takes
        # nothing, so by induction every program gets its hand-over (as in
        # _run_plan).
        p = gl.atomic_add(sync_ptr, 1, sem="relaxed")
        total = nheads * n_chunks
        ha, a0, a1, hb, b1, two, _ = _ws_range(p, n_chunks, total, n_programs)
        seq_first, cont_in, _, f, take = _ws_entry_plan(
            p, seq_idx_ptr, n_chunks, total, n_programs, help_cost
        )
        pub = gl.to_tensor(-1)
        if p + 1 < n_programs:
            _, _, hl_next, _, take_next = _ws_entry_plan(
                p + 1, seq_idx_ptr, n_chunks, total, n_programs, help_cost
            )
            if take_next:
                pub = hl_next
        return p, ha, a0, a1, hb, b1, two, seq_first, cont_in, f, take, pub

    @gluon.jit
    def _ws_load_pass(
        lo, hi, kind, xcol, bcol, t, x_desc, b_desc, c_desc, x_s, b_s, c_s, ready,
        free, cu_chunk_ptr,
    ):  # fmt: skip
        """The loader's row tiles of chunks [lo, hi) for a state pass (kind 0:
        x, B; whole pairs of row blocks, _ws_state_pass) or an output pass
        (1: x, B, C), each into its ring slot once both consumers have
        released the slot; returns the tile count."""
        NBUF: gl.constexpr = x_s.shape[0]
        for c in range(lo, hi):
            istart, ilen = _chunk_bounds(cu_chunk_ptr, c)
            nblk = gl.cdiv(ilen, _BLOCK_M)
            if kind == 0:
                nblk = 2 * gl.cdiv(ilen, 2 * _BLOCK_M)
            for ij in range(nblk):
                s = t % NBUF
                if t >= NBUF:
                    mbarrier.wait(free.index(s), (t // NBUF - 1) & 1)
                _issue(
                    s, ij, istart, kind, x_desc, b_desc, c_desc, x_s, b_s, c_s, ready,
                    xcol, bcol,
                )  # fmt: skip
                t += 1
        return t

    @gluon.jit
    def _ws_loader(
        x_desc, b_desc, c_desc, x_s, b_s, c_s, ready, free, cu_chunk_ptr, ha, a0,
        a1, hb, b1, two, f, heads_per_group: gl.constexpr,
    ):  # fmt: skip
        """Loader partition: every row tile the program reads, in the order
        the state partition and the output partition consume them: the
        output pass's x / B / C over head hb's [0, b1) where two, the state
        pass's x / B over head ha's [f, a0), the output pass's over head
        ha's [a0, a1)."""
        P: gl.constexpr = x_desc.block_type.shape[1]
        N: gl.constexpr = b_desc.block_type.shape[1]
        xa = ha * P
        ba = (ha // heads_per_group) * N
        t = gl.to_tensor(0)
        if two:
            t = _ws_load_pass(
                0, b1, 1, hb * P, (hb // heads_per_group) * N, t, x_desc, b_desc,
                c_desc, x_s, b_s, c_s, ready, free, cu_chunk_ptr,
            )  # fmt: skip
        t = _ws_load_pass(
            f, a0, 0, xa, ba, t, x_desc, b_desc, c_desc, x_s, b_s, c_s, ready,
            free, cu_chunk_ptr,
        )  # fmt: skip
        _ws_load_pass(
            a0, a1, 1, xa, ba, t, x_desc, b_desc, c_desc, x_s, b_s, c_s, ready,
            free, cu_chunk_ptr,
        )  # fmt: skip

    @gluon.jit
    def _ws_state_run(
        s_run, h, c0, c1, seq_c_prev, pub, item, ws_ptr, sync_ptr, A, dt_bias, t,
        j, n, x_s, b_s, ready, free, st_ring, st_ready, st_free, fac_ready,
        fac_free, dt_r, cs_r, ecs_r, wout_r, dt_ptr, stride_dt_t, stride_dt_h,
        dt_min, dt_max, cu_chunk_ptr, seq_idx_ptr, last_chunk_ptr, n_chunks,
        batch, init_ptr, stride_init_b, stride_init_h, stride_init_p,
        stride_init_n, inter_ptr, stride_inter_c, stride_inter_h,
        stride_inter_p, stride_inter_n, final_ptr, final_idx_ptr, stride_final_s,
        stride_final_h, stride_final_p, stride_final_n, stride_final_idx,
        NB: gl.constexpr, HAS_DT_BIAS: gl.constexpr, DT_SOFTPLUS: gl.constexpr,
        HAS_INITSTATES: gl.constexpr, WRITE_INTER: gl.constexpr,
        WRITE_FINAL: gl.constexpr, FINAL_HAS_INDICES: gl.constexpr,
    ):  # fmt: skip
        """The state partition over chunks [c0, c1) of head h from S_run =
        s_run: each row block's S_run (bf16) into the state ring for the
        output partition while the block's update is in flight, each
        chunk's output factors into the factor ring, the chunk-end states
        where asked for, and the state entering chunk pub (c1: leaving the
        range) handed over as work item ``item``'s. t, j, n: tiles, row
        blocks and chunks the program has consumed before; returns them
        moved on."""
        NBUF: gl.constexpr = x_s.shape[0]
        P: gl.constexpr = x_s.shape[2]
        N: gl.constexpr = b_s.shape[2]
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16]
        )
        offs_p = gl.arange(0, P, layout=gl.SliceLayout(1, mma_s))
        offs_n = gl.arange(0, N, layout=gl.SliceLayout(0, mma_s))
        nstart, nlen = _chunk_bounds(cu_chunk_ptr, c0)
        dt_next = _dt_raw(dt_ptr, nstart, nlen, h, stride_dt_t, stride_dt_h, NB)
        for c in range(c0, c1):
            cstart, clength, dt_raw, nstart, nlen, dt_next = _next_chunk(
                c, c1, nstart, nlen, dt_next, cu_chunk_ptr, dt_ptr, h, stride_dt_t,
                stride_dt_h, NB,
            )  # fmt: skip
            if c == pub:
                _hand_over(ws_ptr, sync_ptr, item, s_run, mma_s)
            seq_c = gl.load(seq_idx_ptr + c)
            if seq_c != seq_c_prev:  # a sequence starts inside the range
                s_run = _seq_init_state(
                    init_ptr, seq_c, h, stride_init_b, stride_init_h, stride_init_p,
                    stride_init_n, offs_p, offs_n, mma_s, HAS_INITSTATES,
                )  # fmt: skip
            fs = n % 2  # the factor slot of the program's chunk n
            if n >= 2:
                mbarrier.wait(fac_free.index(fs), (n // 2 - 1) & 1)
            _chunk_factors(
                dt_raw, clength, A, dt_bias, dt_min, dt_max, dt_r.index(fs),
                cs_r.index(fs), ecs_r.index(fs), dt_r.index(fs), wout_r.index(fs), NB,
                HAS_DT_BIAS, DT_SOFTPLUS, False, True,
            )  # fmt: skip
            mbarrier.arrive(fac_ready.index(fs))
            wout_rows = _rows(wout_r.index(fs))
            ecs_rows = _rows(ecs_r.index(fs))
            for k in range(gl.cdiv(clength, _BLOCK_M)):
                # the block's update in flight while its S_run is published
                s = t % NBUF
                mbarrier.wait(ready.index(s), (t // NBUF) & 1)
                s_next = _state_issue(
                    s_run * _block_decay(ecs_rows, k), wout_rows.index(k),
                    x_s.index(s), b_s.index(s),
                )  # fmt: skip
                q = j % 2
                if j >= 2:
                    mbarrier.wait(st_free.index(q), (j // 2 - 1) & 1)
                st = st_ring.index(q)
                st.store(s_run.to(st.dtype))
                fence_async_shared()
                _cta_barrier()
                mbarrier.arrive(st_ready.index(q))
                s_run = warpgroup_mma_wait(0, deps=(s_next,))
                _cta_barrier()  # every warp is done with slot s
                mbarrier.arrive(free.index(s))
                t += 1
                j += 1
            _chunk_end_states(
                s_run, c, seq_c, h, offs_p, offs_n, inter_ptr, stride_inter_c,
                stride_inter_h, stride_inter_p, stride_inter_n, final_ptr,
                final_idx_ptr, last_chunk_ptr, stride_final_s, stride_final_h,
                stride_final_p, stride_final_n, stride_final_idx, seq_idx_ptr,
                n_chunks, batch, init_ptr, stride_init_b, stride_init_h,
                stride_init_p, stride_init_n, mma_s, WRITE_INTER, WRITE_FINAL,
                FINAL_HAS_INDICES, HAS_INITSTATES,
            )  # fmt: skip
            seq_c_prev = seq_c
            n += 1
        if pub == c1:
            _hand_over(ws_ptr, sync_ptr, item, s_run, mma_s)
        return t, j, n

    @gluon.jit
    def _ws_state_pass(
        lo, hi, t, cu_chunk_ptr, wst_r, dA_r, hf_ready, hf_free, x_s, b_s, ready,
        free,
    ):  # fmt: skip
        """The state partition's state pass over chunks [lo, hi) of one
        sequence, from a zero state, with each chunk's weights and dA total
        from the ring the output partition fills (_ws_pass_factors):
        returns the state it adds at hi, the chunks' dA total and the tile
        count moved on. Row blocks go in pairs, both dots in flight before
        one wait (the loader pads a chunk with an odd block count with one
        more tile, which its zero weights, dt being 0 past the chunk's end,
        leave out)."""
        NBUF: gl.constexpr = x_s.shape[0]
        P: gl.constexpr = x_s.shape[2]
        N: gl.constexpr = b_s.shape[2]
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16]
        )
        s_acc = gl.zeros([P, N], gl.float32, layout=mma_s)
        dA = 0.0
        for c in range(lo, hi):
            _, clength = _chunk_bounds(cu_chunk_ptr, c)
            m = c - lo
            fs = m % 2
            mbarrier.wait(hf_ready.index(fs), (m // 2) & 1)
            dA_tot = gl.max(dA_r.index(fs).load(_VEC), axis=0)
            s_acc = s_acc * _exp(dA_tot)
            wst_rows = _rows(wst_r.index(fs))
            for k2 in range(gl.cdiv(clength, 2 * _BLOCK_M)):
                s0 = t % NBUF
                s1 = (t + 1) % NBUF
                mbarrier.wait(ready.index(s0), (t // NBUF) & 1)
                s_acc = _state_issue(
                    s_acc, wst_rows.index(2 * k2), x_s.index(s0), b_s.index(s0)
                )
                mbarrier.wait(ready.index(s1), ((t + 1) // NBUF) & 1)
                s_acc = _state_issue(
                    s_acc, wst_rows.index(2 * k2 + 1), x_s.index(s1), b_s.index(s1)
                )
                s_acc = warpgroup_mma_wait(0, deps=(s_acc,))
                _cta_barrier()  # every warp is done with both slots
                mbarrier.arrive(free.index(s0), count=2)
                mbarrier.arrive(free.index(s1), count=2)
                t += 2
            mbarrier.arrive(hf_free.index(fs))
            dA += dA_tot
        return s_acc, dA, t

    @gluon.jit
    def _ws_pass_factors(
        lo, hi, h, A_ptr, dt_bias_ptr, dt_ptr, stride_dt_t, stride_dt_h, dt_min,
        dt_max, cu_chunk_ptr, wst_r, dA_r, hf_ready, hf_free, NB: gl.constexpr,
        HAS_DT_BIAS: gl.constexpr, DT_SOFTPLUS: gl.constexpr,
    ):  # fmt: skip
        """The output partition's part of the state pass over chunks [lo, hi)
        of head h (it has no output to compute meanwhile): each chunk's
        state-pass weights and dA total into the ring _ws_state_pass
        reads."""
        A, dt_bias = _head_params(A_ptr, dt_bias_ptr, h, HAS_DT_BIAS)
        nstart, nlen = _chunk_bounds(cu_chunk_ptr, lo)
        dt_next = _dt_raw(dt_ptr, nstart, nlen, h, stride_dt_t, stride_dt_h, NB)
        for c in range(lo, hi):
            cstart, clength, dt_raw, nstart, nlen, dt_next = _next_chunk(
                c, hi, nstart, nlen, dt_next, cu_chunk_ptr, dt_ptr, h, stride_dt_t,
                stride_dt_h, NB,
            )  # fmt: skip
            m = c - lo
            fs = m % 2
            if m >= 2:
                mbarrier.wait(hf_free.index(fs), (m // 2 - 1) & 1)
            w = wst_r.index(fs)
            dA_tot = _chunk_factors(
                dt_raw, clength, A, dt_bias, dt_min, dt_max, w, w, w, w, w, NB,
                HAS_DT_BIAS, DT_SOFTPLUS, True, False,
            )  # fmt: skip
            dA_r.index(fs).store(gl.full([32], dA_tot, gl.float32, layout=_VEC))
            _cta_barrier()
            mbarrier.arrive(hf_ready.index(fs))

    @gluon.jit
    def _ws_state(
        x_s, b_s, ready, free, st_ring, st_ready, st_free, fac_ready, fac_free,
        dt_r, cs_r, ecs_r, wout_r, wst_r, dA_r, hf_ready, hf_free, cnt_s, p, ha,
        a0, a1, hb, b1, two, seq_first, cont_in, f, take, pub, A_ptr,
        dt_bias_ptr, dt_ptr, stride_dt_t, stride_dt_h, dt_min, dt_max,
        cu_chunk_ptr, seq_idx_ptr, last_chunk_ptr, n_chunks, batch, init_ptr,
        stride_init_b, stride_init_h, stride_init_p, stride_init_n, ws_ptr,
        sync_ptr, inter_ptr,
        stride_inter_c, stride_inter_h, stride_inter_p, stride_inter_n,
        final_ptr, final_idx_ptr, stride_final_s, stride_final_h,
        stride_final_p, stride_final_n, stride_final_idx, NB: gl.constexpr,
        HAS_DT_BIAS: gl.constexpr, DT_SOFTPLUS: gl.constexpr,
        HAS_INITSTATES: gl.constexpr, WRITE_INTER: gl.constexpr,
        WRITE_FINAL: gl.constexpr, FINAL_HAS_INDICES: gl.constexpr,
    ):  # fmt: skip
        """State partition (_ws_plan): the running state through head hb's
        chunks [0, b1) where two, the state entering head ha's chunk a0 (a
        state pass over [f, a0) from the state handed over by program p - 1
        where take), the running state through head ha's [a0, a1); the
        state at chunk pub of the last head is handed over to program p +
        1."""
        P: gl.constexpr = x_s.shape[2]
        N: gl.constexpr = b_s.shape[2]
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16]
        )
        offs_p = gl.arange(0, P, layout=gl.SliceLayout(1, mma_s))
        offs_n = gl.arange(0, N, layout=gl.SliceLayout(0, mma_s))
        z = gl.to_tensor(0)
        t = z
        j = z
        n = z
        pub_a = pub
        if two:
            # head hb from its first chunk
            A_b, dtb_b = _head_params(A_ptr, dt_bias_ptr, hb, HAS_DT_BIAS)
            seq0 = gl.load(seq_idx_ptr)
            s0 = _seq_init_state(
                init_ptr, seq0, hb, stride_init_b, stride_init_h, stride_init_p,
                stride_init_n, offs_p, offs_n, mma_s, HAS_INITSTATES,
            )  # fmt: skip
            t, j, n = _ws_state_run(
                s0, hb, z, b1, seq0, pub, p, ws_ptr, sync_ptr, A_b, dtb_b, t, j, n,
                x_s, b_s, ready, free, st_ring, st_ready, st_free, fac_ready,
                fac_free, dt_r, cs_r, ecs_r, wout_r, dt_ptr, stride_dt_t,
                stride_dt_h, dt_min, dt_max, cu_chunk_ptr, seq_idx_ptr,
                last_chunk_ptr, n_chunks, batch, init_ptr, stride_init_b,
                stride_init_h,
                stride_init_p, stride_init_n, inter_ptr, stride_inter_c,
                stride_inter_h, stride_inter_p, stride_inter_n, final_ptr,
                final_idx_ptr, stride_final_s, stride_final_h, stride_final_p,
                stride_final_n, stride_final_idx, NB, HAS_DT_BIAS, DT_SOFTPLUS,
                HAS_INITSTATES, WRITE_INTER, WRITE_FINAL, FINAL_HAS_INDICES,
            )  # fmt: skip
            pub_a = -1
        A_a, dtb_a = _head_params(A_ptr, dt_bias_ptr, ha, HAS_DT_BIAS)
        # the state entering chunk a0: from seq_first's start, or a state
        # pass over [f, a0) of it, from the state handed over at f (take)
        # or from its initial state (it starts at f)
        if cont_in:
            s_acc, dA, t = _ws_state_pass(
                f, a0, t, cu_chunk_ptr, wst_r, dA_r, hf_ready, hf_free, x_s, b_s,
                ready, free,
            )  # fmt: skip
            if take:
                s_in = _take_state(ws_ptr, sync_ptr, p - 1, P, N, mma_s)
            else:
                s_in = _seq_init_state(
                    init_ptr, seq_first, ha, stride_init_b, stride_init_h,
                    stride_init_p, stride_init_n, offs_p, offs_n, mma_s,
                    HAS_INITSTATES,
                )  # fmt: skip
            s_run = _exp(dA) * s_in + s_acc
        else:
            s_run = _seq_init_state(
                init_ptr, seq_first, ha, stride_init_b, stride_init_h,
                stride_init_p, stride_init_n, offs_p, offs_n, mma_s,
                HAS_INITSTATES,
            )  # fmt: skip
        # the output partition's first tile of head ha's part (read once the
        # part's first st_ready fires)
        cnt_s.store(gl.full([1], t, gl.int32, layout=_VEC))
        _ws_state_run(
            s_run, ha, a0, a1, seq_first, pub_a, p, ws_ptr, sync_ptr, A_a, dtb_a,
            t, j, n, x_s, b_s, ready, free, st_ring, st_ready, st_free, fac_ready,
            fac_free, dt_r, cs_r, ecs_r, wout_r, dt_ptr, stride_dt_t,
            stride_dt_h, dt_min, dt_max, cu_chunk_ptr, seq_idx_ptr, last_chunk_ptr,
            n_chunks, batch, init_ptr, stride_init_b, stride_init_h,
            stride_init_p, stride_init_n, inter_ptr, stride_inter_c,
            stride_inter_h, stride_inter_p, stride_inter_n, final_ptr,
            final_idx_ptr, stride_final_s, stride_final_h, stride_final_p,
            stride_final_n, stride_final_idx, NB,
            HAS_DT_BIAS, DT_SOFTPLUS, HAS_INITSTATES, WRITE_INTER, WRITE_FINAL,
            FINAL_HAS_INDICES,
        )  # fmt: skip
        # (the program's flag accesses are this partition's)
        _sync_done(sync_ptr)

    @gluon.jit
    def _ws_output_run(
        h, c0, c1, t, j, n, x_s, b_s, c_s, ready, free, st_ring, st_ready, st_free,
        fac_ready, fac_free, dt_r, cs_r, ecs_r, wout_r, y_s, out_desc, out_ptr,
        z_ptr, D_ptr, stride_D_h, cu_chunk_ptr, stride_out_t, stride_out_h,
        stride_out_p, stride_z_t, stride_z_h, stride_z_p, exp_cap,
        HAS_D: gl.constexpr, D_HAS_HDIM: gl.constexpr, HAS_Z: gl.constexpr,
    ):  # fmt: skip
        """The output partition over chunks [c0, c1) of head h: each row
        block's outputs from its tiles, its S_run from the state ring and its
        chunk's factors from the factor ring (no state update). t, j, n as
        in _ws_state_run."""
        NBUF: gl.constexpr = x_s.shape[0]
        P: gl.constexpr = x_s.shape[2]
        mma_o: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, P, 16]
        )
        Dv = _load_D(
            D_ptr, h, stride_D_h, P, gl.SliceLayout(0, mma_o), HAS_D, D_HAS_HDIM
        )
        xcol = h * P
        nstart, nlen = _chunk_bounds(cu_chunk_ptr, c0)
        for c in range(c0, c1):
            cstart = nstart
            clength = nlen
            if c + 1 < c1:
                nstart, nlen = _chunk_bounds(cu_chunk_ptr, c + 1)
            fs = n % 2
            mbarrier.wait(fac_ready.index(fs), (n // 2) & 1)
            for k in range(gl.cdiv(clength, _BLOCK_M)):
                s = t % NBUF
                q = j % 2
                mbarrier.wait(ready.index(s), (t // NBUF) & 1)
                mbarrier.wait(st_ready.index(q), (j // 2) & 1)
                _output_block(
                    0.0, k, cstart, clength, h, xcol, x_s.index(s), b_s.index(s),
                    c_s.index(s), st_ring.index(q), y_s, out_desc, out_ptr, z_ptr,
                    Dv, _rows(dt_r.index(fs)), _rows(cs_r.index(fs)),
                    _rows(ecs_r.index(fs)), _rows(wout_r.index(fs)), stride_out_t,
                    stride_out_h, stride_out_p, stride_z_t, stride_z_h, stride_z_p,
                    HAS_D, D_HAS_HDIM, HAS_Z, False, exp_cap, True,
                )  # fmt: skip
                # (_output_block ends in a barrier: every warp is done with
                # the tiles and the state)
                mbarrier.arrive(st_free.index(q))
                mbarrier.arrive(free.index(s))
                t += 1
                j += 1
            mbarrier.arrive(fac_free.index(fs))
            n += 1
        return t, j, n

    @gluon.jit
    def _ws_output(
        x_s, b_s, c_s, ready, free, st_ring, st_ready, st_free, fac_ready,
        fac_free, dt_r, cs_r, ecs_r, wout_r, cnt_s, wst_r, dA_r, hf_ready,
        hf_free, y_s, out_desc, out_ptr, z_ptr, D_ptr, stride_D_h, A_ptr,
        dt_bias_ptr, dt_ptr, stride_dt_t, stride_dt_h, dt_min, dt_max,
        cu_chunk_ptr, ha, a0, a1, hb, b1, two, cont_in, f, stride_out_t,
        stride_out_h, stride_out_p, stride_z_t, stride_z_h, stride_z_p,
        NB: gl.constexpr, HAS_D: gl.constexpr, D_HAS_HDIM: gl.constexpr,
        HAS_Z: gl.constexpr, HAS_DT_BIAS: gl.constexpr, DT_SOFTPLUS: gl.constexpr,
    ):  # fmt: skip
        """Output partition (the program's first warpgroup): where the range
        crosses into head hb, its chunks [0, b1); the factors of the state
        pass over head ha's [f, a0) where the range continues a sequence;
        head ha's chunks [a0, a1)."""
        # the causal mask, once (this partition has the registers for it)
        exp_cap = _exp_cap(x_s.shape[2])
        z = gl.to_tensor(0)
        t = z
        j = z
        n = z
        if two:
            t, j, n = _ws_output_run(
                hb, z, b1, t, j, n, x_s, b_s, c_s, ready, free, st_ring, st_ready,
                st_free, fac_ready, fac_free, dt_r, cs_r, ecs_r, wout_r, y_s,
                out_desc, out_ptr, z_ptr, D_ptr, stride_D_h, cu_chunk_ptr,
                stride_out_t, stride_out_h, stride_out_p, stride_z_t, stride_z_h,
                stride_z_p, exp_cap, HAS_D, D_HAS_HDIM, HAS_Z,
            )  # fmt: skip
        if cont_in:
            _ws_pass_factors(
                f, a0, ha, A_ptr, dt_bias_ptr, dt_ptr, stride_dt_t, stride_dt_h,
                dt_min, dt_max, cu_chunk_ptr, wst_r, dA_r, hf_ready, hf_free, NB,
                HAS_DT_BIAS, DT_SOFTPLUS,
            )  # fmt: skip
        # past the state pass's tiles: the state partition has consumed them
        # before it publishes the first S_run of head ha's part
        mbarrier.wait(st_ready.index(j % 2), (j // 2) & 1)
        t = gl.max(cnt_s.load(_VEC), axis=0)
        _ws_output_run(
            ha, a0, a1, t, j, n, x_s, b_s, c_s, ready, free, st_ring, st_ready,
            st_free, fac_ready, fac_free, dt_r, cs_r, ecs_r, wout_r, y_s,
            out_desc, out_ptr, z_ptr, D_ptr, stride_D_h, cu_chunk_ptr,
            stride_out_t, stride_out_h, stride_out_p, stride_z_t, stride_z_h,
            stride_z_p, exp_cap, HAS_D, D_HAS_HDIM, HAS_Z,
        )  # fmt: skip
        tma.store_wait(0)

    @gluon.jit
    def _ssd_fused_sm90_kernel(
        x_desc,
        b_desc,
        c_desc,
        out_desc,
        dt_ptr,
        A_ptr,
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
        dt_min,
        dt_max,
        n_chunks,
        batch,
        run_chunks,
        n_programs,
        help_cost,
        nheads: gl.constexpr,
        hdim: gl.constexpr,
        dstate: gl.constexpr,
        heads_per_group: gl.constexpr,
        stride_dt_t,
        stride_dt_h: gl.constexpr,
        stride_D_h: gl.constexpr,
        stride_z_t,
        stride_z_h,
        stride_z_p: gl.constexpr,
        stride_out_t,
        stride_out_h,
        stride_out_p: gl.constexpr,
        stride_init_b,
        stride_init_h,
        stride_init_p,
        stride_init_n: gl.constexpr,
        stride_inter_c,
        stride_inter_h,
        stride_inter_p,
        stride_inter_n: gl.constexpr,
        stride_final_s,
        stride_final_h,
        stride_final_p,
        stride_final_n: gl.constexpr,
        stride_final_idx: gl.constexpr,
        STATE_SMEM_LAYOUT: gl.constexpr,
        CHUNK_SIZE: gl.constexpr,
        HAS_D: gl.constexpr,
        D_HAS_HDIM: gl.constexpr,
        HAS_Z: gl.constexpr,
        HAS_DT_BIAS: gl.constexpr,
        DT_SOFTPLUS: gl.constexpr,
        HAS_INITSTATES: gl.constexpr,
        WRITE_INTER: gl.constexpr,
        WRITE_FINAL: gl.constexpr,
        FINAL_HAS_INDICES: gl.constexpr,
        WS: gl.constexpr,
        WS_NBUF: gl.constexpr,
    ):
        """The fused prefill on sm_90: one program per (run of run_chunks
        consecutive chunks, head), the state carried across the run's chunks;
        WS, warp-specialized, one program per range of the heads x chunks
        (n_programs ranges; see the module docstring)."""
        P: gl.constexpr = hdim
        N: gl.constexpr = dstate
        NB: gl.constexpr = CHUNK_SIZE // _BLOCK_M
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16]
        )
        mma_o: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, P, 16]
        )

        if WS:
            # the run kernel on three warpgroups (see the module docstring):
            # the output pass (this one), the running state, the loads; its
            # work item: a range of the chunks in head-major order
            (
                p, ha, a0, a1, hb, b1, two, seq_first, cont_in, f, take, pub,
            ) = _ws_plan(
                sync_ptr, seq_idx_ptr, n_chunks, nheads, n_programs, help_cost
            )  # fmt: skip
            (
                x_s, b_s, c_s, st_ring, y_s, dt_r, cs_r, ecs_r, wout_r, wst_r, dA_r,
                cnt_s, ready, free, st_ready, st_free, fac_ready, fac_free,
                hf_ready, hf_free,
            ) = _allocate_ws(
                x_desc, b_desc, c_desc, out_desc, STATE_SMEM_LAYOUT, NB, WS_NBUF
            )  # fmt: skip
            gl.warp_specialize(
                [
                    (
                        _ws_output,
                        (
                            x_s, b_s, c_s, ready, free, st_ring, st_ready, st_free,
                            fac_ready, fac_free, dt_r, cs_r, ecs_r, wout_r, cnt_s,
                            wst_r, dA_r, hf_ready, hf_free, y_s, out_desc, out_ptr,
                            z_ptr, D_ptr, stride_D_h, A_ptr, dt_bias_ptr, dt_ptr,
                            stride_dt_t, stride_dt_h, dt_min, dt_max, cu_chunk_ptr,
                            ha, a0, a1, hb, b1, two, cont_in, f, stride_out_t,
                            stride_out_h, stride_out_p, stride_z_t, stride_z_h,
                            stride_z_p, NB, HAS_D, D_HAS_HDIM, HAS_Z, HAS_DT_BIAS,
                            DT_SOFTPLUS,
                        ),
                    ),
                    (
                        _ws_state,
                        (
                            x_s, b_s, ready, free, st_ring, st_ready, st_free,
                            fac_ready, fac_free, dt_r, cs_r, ecs_r, wout_r, wst_r,
                            dA_r, hf_ready, hf_free, cnt_s, p, ha, a0, a1, hb, b1,
                            two, seq_first, cont_in, f, take, pub, A_ptr,
                            dt_bias_ptr, dt_ptr, stride_dt_t, stride_dt_h, dt_min,
                            dt_max, cu_chunk_ptr, seq_idx_ptr,
                            last_chunk_ptr, n_chunks, batch, init_ptr,
                            stride_init_b, stride_init_h,
                            stride_init_p, stride_init_n, ws_ptr, sync_ptr,
                            inter_ptr, stride_inter_c, stride_inter_h,
                            stride_inter_p, stride_inter_n, final_ptr,
                            final_idx_ptr, stride_final_s, stride_final_h,
                            stride_final_p, stride_final_n, stride_final_idx, NB,
                            HAS_DT_BIAS, DT_SOFTPLUS, HAS_INITSTATES, WRITE_INTER,
                            WRITE_FINAL, FINAL_HAS_INDICES,
                        ),
                    ),
                    (
                        _ws_loader,
                        (
                            x_desc, b_desc, c_desc, x_s, b_s, c_s, ready, free,
                            cu_chunk_ptr, ha, a0, a1, hb, b1, two, f,
                            heads_per_group,
                        ),
                    ),
                ],
                [4, 4],
                [WS_STATE_REGS, WS_LOADER_REGS],
            )  # fmt: skip
        else:
            # one warpgroup; its work item: run r of head h
            (
                r, h, g, c0, c1, seq_first, cont_in, seq_last, cont_out, tail,
                own_hi, help_lo,
            ) = _run_plan(
                sync_ptr, seq_idx_ptr, n_chunks, run_chunks, nheads, heads_per_group
            )  # fmt: skip
            x_s, b_s, c_s, st_s, y_s, bars, dt_s, cs_s, ecs_s, wst_s, wout_s = (
                _allocate(x_desc, b_desc, c_desc, out_desc, STATE_SMEM_LAYOUT, NB)
            )
            xcol = h * P
            bcol = g * N
            # the load cursor, at the first row block of its first pass
            ic, ikind = _settle(tail, gl.to_tensor(0), own_hi, help_lo, c0, c1)
            istart, ilen = _chunk_bounds(cu_chunk_ptr, ic)
            inb = gl.cdiv(ilen, _BLOCK_M)
            ij = 0
            for i in gl.static_range(_NUM_BUFFERS):
                _issue_run(
                    i, ij, istart, ikind, x_desc, b_desc, c_desc, x_s, b_s, c_s, bars,
                    xcol, bcol,
                )  # fmt: skip
                ic, ij, inb, istart, ikind = _advance(
                    ic, ij, inb, istart, ikind, own_hi, help_lo, c0, c1, cu_chunk_ptr
                )
            t = 0  # loads consumed

            A, dt_bias = _head_params(A_ptr, dt_bias_ptr, h, HAS_DT_BIAS)
            item = r * nheads + h
            s_prev, t, ic, ij, inb, istart, ikind = _entry_state(
                item, item - nheads, h, c0, c1, seq_first, cont_in, seq_last,
                cont_out, tail, own_hi, help_lo, t, ic, ij, inb, istart, ikind,
                cu_chunk_ptr, dt_ptr, stride_dt_t, stride_dt_h, A, dt_bias, dt_min,
                dt_max, dt_s, cs_s, ecs_s, wst_s, wout_s, x_s, b_s, c_s, bars,
                x_desc, b_desc, c_desc, xcol, bcol, init_ptr, stride_init_b,
                stride_init_h, stride_init_p, stride_init_n, ws_ptr, sync_ptr, NB,
                HAS_DT_BIAS, DT_SOFTPLUS, HAS_INITSTATES,
            )  # fmt: skip
            _sync_done(sync_ptr)
            offs_p = gl.arange(0, P, layout=gl.SliceLayout(1, mma_s))
            offs_n = gl.arange(0, N, layout=gl.SliceLayout(0, mma_s))

            # ---- output pass over the run's chunks -----------------------------
            Dv = _load_D(
                D_ptr, h, stride_D_h, P, gl.SliceLayout(0, mma_o), HAS_D, D_HAS_HDIM
            )
            s_run = s_prev
            st_s.store(s_run.to(st_s.dtype))
            fence_async_shared()
            _cta_barrier()
            seq_c_prev = seq_first
            # dt of the next chunk is requested a chunk ahead (also in the
            # state passes)
            nstart, nlen = _chunk_bounds(cu_chunk_ptr, c0)
            dt_next = _dt_raw(dt_ptr, nstart, nlen, h, stride_dt_t, stride_dt_h, NB)
            for c in range(c0, c1):
                cstart, clength, dt_raw, nstart, nlen, dt_next = _next_chunk(
                    c, c1, nstart, nlen, dt_next, cu_chunk_ptr, dt_ptr, h,
                    stride_dt_t, stride_dt_h, NB,
                )  # fmt: skip
                seq_c = gl.load(seq_idx_ptr + c)
                if seq_c != seq_c_prev:  # a sequence starts inside the run
                    s_run = _seq_init_state(
                        init_ptr, seq_c, h, stride_init_b, stride_init_h,
                        stride_init_p, stride_init_n, offs_p, offs_n, mma_s,
                        HAS_INITSTATES,
                    )  # fmt: skip
                    st_s.store(s_run.to(st_s.dtype))
                    fence_async_shared()
                _chunk_factors(
                    dt_raw, clength, A, dt_bias, dt_min, dt_max, dt_s, cs_s, ecs_s,
                    wst_s, wout_s, NB, HAS_DT_BIAS, DT_SOFTPLUS, False, True,
                )  # fmt: skip
                for k in range(gl.cdiv(clength, _BLOCK_M)):
                    s = t % _NUM_BUFFERS
                    mbarrier.wait(bars.index(s), (t // _NUM_BUFFERS) & 1)
                    s_run = _output_block(
                        s_run, k, cstart, clength, h, xcol, x_s.index(s), b_s.index(s),
                        c_s.index(s), st_s, y_s, out_desc, out_ptr, z_ptr, Dv,
                        _rows(dt_s), _rows(cs_s), _rows(ecs_s), _rows(wout_s),
                        stride_out_t, stride_out_h, stride_out_p, stride_z_t,
                        stride_z_h, stride_z_p, HAS_D, D_HAS_HDIM, HAS_Z,
                    )  # fmt: skip
                    _issue_run(
                        s, ij, istart, ikind, x_desc, b_desc, c_desc,
                        x_s, b_s, c_s, bars, xcol, bcol,
                    )  # fmt: skip
                    # (the cursor is past the state passes here: own_hi and
                    # help_lo need not stay live)
                    ic, ij, inb, istart, ikind = _advance(
                        ic, ij, inb, istart, ikind, c0, c0, c0, c1, cu_chunk_ptr
                    )
                    t += 1
                # s_run is now the state at the chunk's end
                _chunk_end_states(
                    s_run, c, seq_c, h, offs_p, offs_n, inter_ptr, stride_inter_c,
                    stride_inter_h, stride_inter_p, stride_inter_n, final_ptr,
                    final_idx_ptr, last_chunk_ptr, stride_final_s, stride_final_h,
                    stride_final_p, stride_final_n, stride_final_idx, seq_idx_ptr,
                    n_chunks, batch, init_ptr, stride_init_b, stride_init_h,
                    stride_init_p, stride_init_n, mma_s, WRITE_INTER, WRITE_FINAL,
                    FINAL_HAS_INDICES, HAS_INITSTATES,
                )  # fmt: skip
                seq_c_prev = seq_c
        # all: the last output store has left y_s
        tma.store_wait(0)
        if not WS:
            for i in gl.static_range(_NUM_BUFFERS):
                mbarrier.invalidate(bars.index(i))


@cache
def _num_sms(device_index: int | None) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def ws_fills(nheads: int, sms: int) -> bool:
    """The default for the warp-specialized run kernel: whether whole heads
    per program (``sms // nheads`` programs per head, one per SM) fill at
    least WS_MIN_FILL of the SMs over the waves they take (its programs are
    then ``ws_programs``)."""
    programs = nheads * max(1, sms // nheads)
    waves = -(-programs // sms)
    return programs >= WS_MIN_FILL * waves * sms


def warp_specialized(nheads: int, device_index: int | None) -> bool:
    """The launcher's default: whether the run kernel runs on three
    warpgroups (where ws_fills or there are at least WS_MIN_HEADS heads per
    SM) for nheads heads on the GPU device_index."""
    sms = _num_sms(device_index)
    return ws_fills(nheads, sms) or nheads >= WS_MIN_HEADS * sms


def ws_programs(
    n_chunks: int, nheads: int, run: int | None, device_index: int | None
) -> int:
    """Programs of the warp-specialized run kernel, each a range of the
    n_chunks x nheads chunks in head-major order (``_ws_plan``): ranges of
    ``run`` chunks where it is forced; else one head per program where the
    heads fill the SMs (at least WS_MIN_FILL of them), one program per SM
    where they do not. At least nheads (a range then meets at most two
    heads), at most one per chunk."""
    total = n_chunks * nheads
    if run is None:
        sms = _num_sms(device_index)
        programs = nheads if nheads >= WS_MIN_FILL * sms else sms
    else:
        programs = -(-total // run)
    return min(total, max(nheads, programs))


def run_length(n_chunks: int, nheads: int, slots: int) -> int:
    """Chunks per program of the run kernel for a prefill of n_chunks chunks
    on a GPU with ``slots`` resident programs: ``slots // nheads`` runs per
    head, one wave (at least one run per head)."""
    return -(-n_chunks // max(1, slots // nheads))


@cache
def _smem_layouts(headdim: int, dstate: int) -> tuple:
    """Shared-memory layouts of the x / out row tiles, the B / C row tiles and
    the state operand (cached: this is host time on every prefill)."""
    return (
        gl.NVMMASharedLayout.get_default_for([BLOCK_M, headdim], gl.bfloat16),
        gl.NVMMASharedLayout.get_default_for([BLOCK_M, dstate], gl.bfloat16),
        gl.NVMMASharedLayout.get_default_for([headdim, dstate], gl.bfloat16),
    )


def _strides(t: torch.Tensor | None, n: int) -> tuple[int, ...]:
    return t.stride() if t is not None else (0,) * n


def launch(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    cu_chunk_seqlens: torch.Tensor,
    last_chunk_indices: torch.Tensor,
    seq_idx: torch.Tensor,
    out: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    initial_states: torch.Tensor | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    inter: torch.Tensor | None,
    final: torch.Tensor | None,
    final_state_indices: torch.Tensor | None,
    write_final: bool,
    config: LaunchConfig = DEFAULT_CONFIG,
) -> None:
    """Launch the run kernel (warp-specialized: ``ws_programs`` ranges; on
    one warpgroup: ``run_length`` runs; ``config`` overrides the plan);
    argument checks and the state outputs (and D with a unit last
    stride) are ``ssd_fused._mamba_chunk_scan_fused_fwd``'s. It takes
    what the hand-overs need from ssd_fused_launch (kept per stream): one
    fp32 (P, N) state per work item (a run or a range) and the flag
    buffer."""
    seqlen, nheads, headdim = x.shape
    _, ngroups, dstate = B.shape
    n_chunks = cu_chunk_seqlens.shape[0] - 1
    run = config.run_chunks
    specialize = config.warp_specialize
    if specialize is None:
        specialize = warp_specialized(nheads, x.device.index)
    if specialize:
        n_items = ws_programs(n_chunks, nheads, run, x.device.index)
        run = -(-n_chunks * nheads // n_items)  # (unused by WS)
    else:
        if run is None:
            slots = RUN_SLOTS_PER_SM * _num_sms(x.device.index)
            run = run_length(n_chunks, nheads, slots)
        n_items = -(-n_chunks // run) * nheads
    ws, sync = ssd_fused_launch.scratch(x.device, n_items * headdim * dstate, n_items)
    row_layout, bc_layout, _ = _smem_layouts(headdim, dstate)

    def rows_desc(t: torch.Tensor, width: int, layout) -> "_TmaView":
        """The (tokens, n, width) tensor t as a 2-D (tokens, n * width) TMA
        view, read in (BLOCK_M, width) boxes."""
        return _TmaView(
            t, [seqlen, t.shape[1] * width], [t.stride(0), 1], [BLOCK_M, width], layout
        )

    args = (
        rows_desc(x, headdim, row_layout),
        rows_desc(B, dstate, bc_layout),
        rows_desc(C, dstate, bc_layout),
        rows_desc(out, headdim, row_layout),
        dt, A, D, z, dt_bias, out, initial_states, ws, sync, inter, final,
        final_state_indices, cu_chunk_seqlens, seq_idx, last_chunk_indices,
        float(dt_limit[0]), float(dt_limit[1]), n_chunks,
        last_chunk_indices.shape[0], run, n_items,
        float(config.help_cost), nheads, headdim, dstate, nheads // ngroups,
        *dt.stride(),
        D.stride(0) if D is not None else 0,
        *_strides(z, 3), *out.stride(),
        *_strides(initial_states, 4), *_strides(inter, 4), *_strides(final, 4),
        final_state_indices.stride(0) if final_state_indices is not None else 0,
    )  # fmt: skip
    flags = ssd_fused_launch.meta_flags(
        D, z, dt_bias, dt_softplus, initial_states, inter is not None,
        write_final, final_state_indices is not None,
    )  # fmt: skip
    meta = _meta(
        headdim,
        dstate,
        chunk_size,
        flags,
        specialize,
        WS_NUM_BUFFERS[specialize and n_items > nheads],
    )
    ssd_fused_launch.launch(_ssd_fused_sm90_kernel, n_items, args, meta)


@cache
def _meta(
    headdim: int,
    dstate: int,
    chunk_size: int,
    flags: tuple,
    ws: bool,
    ws_nbuf: int,
) -> ssd_fused_launch.Meta:
    """The kernel's meta arguments for one configuration (made once); flags:
    ssd_fused_launch.meta_flags."""
    return ssd_fused_launch.Meta(
        STATE_SMEM_LAYOUT=_smem_layouts(headdim, dstate)[2],
        CHUNK_SIZE=chunk_size,
        **dict(zip(ssd_fused_launch.FLAG_NAMES, flags)),
        WS=ws,
        WS_NBUF=ws_nbuf,
        num_warps=4,
    )

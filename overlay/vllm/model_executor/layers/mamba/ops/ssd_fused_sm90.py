# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Hopper (sm_90) form of the fused Mamba2 SSD prefill kernel, in Gluon.

Same algorithm, work decomposition, ticket scheme (and deadlock-freedom
proof) and memory ordering as the portable Triton kernel in ``ssd_fused``;
what changes is how one program uses the SM, which Triton's ``tl.dot`` does
not let us control:

* x, B and C row tiles arrive by TMA into a two-deep ring of shared-memory
  buffers (mbarrier-tracked), requested two row blocks ahead across both
  passes, so the output pass's first tiles load during the state pass;
* the tensor-core dots are asynchronous wgmma: C.B^T and C.S_run are issued
  together and the decay factors, the masked block and the operand of the
  state update are computed while they run; the state update runs while the
  output block's epilogue does;
* dt of the whole chunk is gathered from global memory once (a strided
  2-byte gather per token is the slowest load of the kernel), and every
  per-row factor both passes derive from it (cumsums, decay weights,
  exponentials) is computed there once and kept in shared memory;
* full output row blocks are written by TMA stores from shared memory.

Gluon is Triton's experimental lower-level language; this module compiles with
the Triton releases in ``GLUON_TRITON_VERSIONS`` and is used by default only
with the one it has run with (``GLUON_TESTED_TRITON``).

Measured on H200 (granite-4.0-h-small dims, bf16, ms per call at 16k / 256k
tokens, one process): the chain 1.02 / 19.8, the Triton kernel 0.86 / 13.4,
this kernel 0.59 / 9.2 (the stack's results/ssd_prefill-h200). A plain port
of the Triton kernel's steps measured 0.80 / 12.5; dt kept in shared memory
and the TMA output stores took it to 0.65 / 10.1 (results/
ssd_fused_ablation-h200, run sm90-form), and the per-row factors computed
once per program to 0.58 / 9.4 (run sm90-breakdown).

Used by ``mamba_chunk_scan_fused_varlen`` where ``ssd_fused.use_sm90_kernel``
holds: ``supports`` below (sm_90, bf16 x / B / C / out with unit-stride,
TMA-compatible rows, headdim 64, dstate 32, 64 or 128, chunk 128 or 256) and
at least ``ssd_fused.SM90_MIN_TOKEN_HEADS`` tokens x heads; everything else
runs the Triton kernel.
"""

from functools import cache

import torch

from vllm.triton_utils import triton

# Gluon is experimental and its API changes between Triton releases. This
# kernel compiles with the releases in GLUON_TRITON_VERSIONS (the stack's CI
# compiles it with each); it has run on a GPU (tests, benchmarks) only with
# GLUON_TESTED_TRITON, so only there does ssd_fused use it by default
# (TESTED_HERE). vLLM 0.33.0's torch 2.14 brings Triton 3.8.
GLUON_TRITON_VERSIONS = ("3.6", "3.8")
GLUON_TESTED_TRITON = "3.6"
_TRITON_VERSION = getattr(triton, "__version__", "")
TESTED_HERE = _TRITON_VERSION.startswith(GLUON_TESTED_TRITON + ".")
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
        # unit inner strides, 16-byte aligned base and row stride.
        if t.dtype != torch.bfloat16 or t.stride(2) != 1 or t.stride(1) != inner:
            return False
        if t.data_ptr() % 16 != 0 or (t.stride(0) * t.element_size()) % 16 != 0:
            return False
    return True


if HAS_GLUON:
    _BLOCK_M = gl.constexpr(BLOCK_M)
    # CTA-wide barrier: thread_barrier in 3.6, barrier from 3.8 on
    _cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
    _NUM_BUFFERS = gl.constexpr(NUM_BUFFERS)

    @gluon.jit
    def _exp(x):
        return gl.exp2(x * 1.4426950408889634)

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _dt_processed(
        dt_base,
        offs,
        clen,
        stride_dt_t,
        dt_bias,
        dt_min,
        dt_max,
        HAS_DT_BIAS: gl.constexpr,
        DT_SOFTPLUS: gl.constexpr,
    ):
        """clamp(softplus?(dt + dt_bias), dt_min, dt_max) of rows offs of the
        chunk, 0 beyond clen (fp32)."""
        valid = offs < clen
        dt = gl.load(dt_base + offs * stride_dt_t, mask=valid, other=0.0)
        dt = dt.to(gl.float32)
        if HAS_DT_BIAS:
            dt += dt_bias
        if DT_SOFTPLUS:
            dt = gl.where(dt <= 20.0, gl.log(gl.exp(dt) + 1.0), dt)
        dt = gl.minimum(gl.maximum(dt, dt_min), dt_max)
        return gl.where(valid, dt, 0.0)

    @gluon.jit
    def _store_state(base, s, offs_p, offs_n, stride_p, stride_n):
        """Store the (P, N) state s at base with row / column strides, in the
        tensor's dtype."""
        gl.store(
            base + offs_p[:, None] * stride_p + offs_n[None, :] * stride_n,
            s.to(base.dtype.element_ty),
        )

    @gluon.jit
    def _issue_tiles(
        idx,
        nblk,
        x_desc,
        b_desc,
        c_desc,
        x_s,
        b_s,
        c_s,
        bars,
        row0,
        xcol,
        bcol,
    ):
        """Request load number idx of the program: row block idx of the state
        pass (x, B) for idx < nblk, then row block idx - nblk of the output
        pass (x, B, C); nothing past the last one."""
        if idx < 2 * nblk:
            s = idx % _NUM_BUFFERS
            bar = bars.index(s)
            if idx < nblk:
                r = row0 + idx * _BLOCK_M
                mbarrier.expect(
                    bar, x_desc.block_type.nbytes + b_desc.block_type.nbytes
                )
            else:
                r = row0 + (idx - nblk) * _BLOCK_M
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
    ):
        P: gl.constexpr = hdim
        N: gl.constexpr = dstate
        NB: gl.constexpr = CHUNK_SIZE // _BLOCK_M
        io_dtype: gl.constexpr = x_desc.dtype
        # Register layouts of one warpgroup: wgmma results with P (outputs,
        # C.B^T blocks) or N (states) columns, their A-operand forms, rows /
        # columns of those, and plain blocked layouts for the dt vectors.
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
        row_s: gl.constexpr = gl.SliceLayout(1, mma_s)
        col_s: gl.constexpr = gl.SliceLayout(0, mma_s)
        col_a: gl.constexpr = gl.SliceLayout(0, opa_s)
        # a vector held whole by every warp (warp-local reductions)
        vec_w: gl.constexpr = gl.BlockedLayout([2], [32], [4], [0])
        blk_c: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [4, 1], [1, 0])

        # Ticket and work item, as in ssd_fused._ssd_fused_varlen_kernel.
        ticket = gl.atomic_add(sync_ptr, 1, sem="relaxed").to(gl.int64)
        c = ticket // nheads
        h = ticket % nheads
        g = h // heads_per_group

        chunk_start = gl.load(cu_chunk_ptr + c).to(gl.int64)
        clen = (gl.load(cu_chunk_ptr + c + 1) - chunk_start).to(gl.int32)
        seq = gl.load(seq_idx_ptr + c)
        seq_prev = gl.load(seq_idx_ptr + c - 1, mask=c > 0, other=-1)
        is_first = seq != seq_prev
        is_last = c == gl.load(last_chunk_ptr + seq)
        nblk = gl.cdiv(clen, _BLOCK_M)

        # Shared memory: the TMA ring of x / B / C row tiles, the running
        # state as the B operand of C.S_run, an output staging tile and the
        # ring's barriers (the per-row factors of dt follow in A).
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

        row0 = chunk_start.to(gl.int32)
        xcol = (h * P).to(gl.int32)
        bcol = (g * N).to(gl.int32)
        for i in gl.static_range(_NUM_BUFFERS):
            _issue_tiles(
                i, nblk, x_desc, b_desc, c_desc, x_s, b_s, c_s, bars, row0,
                xcol, bcol,
            )  # fmt: skip

        # ---- A: dt of the chunk (once), total decay ----------------------
        dt_base = dt_ptr + chunk_start * stride_dt_t + h * stride_dt_h
        A = gl.load(A_ptr + h).to(gl.float32)
        if HAS_DT_BIAS:  # noqa: SIM108
            dt_bias = gl.load(dt_bias_ptr + h).to(gl.float32)
        else:
            dt_bias = 0.0
        offs_c = (
            gl.arange(0, NB, layout=gl.SliceLayout(1, blk_c))[:, None] * _BLOCK_M
            + gl.arange(0, _BLOCK_M, layout=gl.SliceLayout(0, blk_c))[None, :]
        )
        dt_c = _dt_processed(
            dt_base, offs_c, clen, stride_dt_t, dt_bias, dt_min, dt_max,
            HAS_DT_BIAS, DT_SOFTPLUS,
        )  # fmt: skip
        # Every per-row factor of both passes, once per program, row block
        # k in row k: cumsums of dt * A within the block (cs), block totals,
        # the state pass's weights dt * exp(dA_tot - chunk cumsum), where the
        # chunk cumsum is cs plus the totals of the blocks before (start),
        # and the output pass's dt * exp(block total - cs) and exp(cs). They
        # stay in shared memory: the passes load them in the layouts they
        # need, with no scans, reductions or layout changes per row block.
        dA_c = dt_c * A
        cs_c = gl.associative_scan(dA_c, 1, _add)
        blk_tot = gl.sum(dA_c, axis=1)
        rowid = gl.arange(0, NB, layout=gl.SliceLayout(1, blk_c))
        start = gl.zeros([NB], gl.float32, layout=gl.SliceLayout(1, blk_c))
        for r in gl.static_range(NB):
            tot_r = gl.sum(gl.where(rowid == r, blk_tot, 0.0), axis=0)
            start += gl.where(rowid > r, tot_r, 0.0)
        dA_tot = gl.sum(blk_tot, axis=0)
        w_st = dt_c * _exp(gl.minimum(dA_tot - (start[:, None] + cs_c), 0.0))
        w_out = dt_c * _exp(gl.minimum(blk_tot[:, None] - cs_c, 0.0))
        vec_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        vec_r: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        dt_s = gl.allocate_shared_memory(gl.float32, [NB, _BLOCK_M], vec_l, dt_c)
        cs_s = gl.allocate_shared_memory(gl.float32, [NB, _BLOCK_M], vec_l, cs_c)
        ecs_s = gl.allocate_shared_memory(gl.float32, [NB, _BLOCK_M], vec_l, _exp(cs_c))
        wst_s = gl.allocate_shared_memory(gl.float32, [NB, _BLOCK_M], vec_l, w_st)
        wout_s = gl.allocate_shared_memory(gl.float32, [NB, _BLOCK_M], vec_l, w_out)
        _cta_barrier()
        dt_rows = dt_s._reinterpret(gl.float32, [NB, _BLOCK_M], vec_r)
        cs_rows = cs_s._reinterpret(gl.float32, [NB, _BLOCK_M], vec_r)
        ecs_rows = ecs_s._reinterpret(gl.float32, [NB, _BLOCK_M], vec_r)
        wst_rows = wst_s._reinterpret(gl.float32, [NB, _BLOCK_M], vec_r)
        wout_rows = wout_s._reinterpret(gl.float32, [NB, _BLOCK_M], vec_r)

        # ---- B: chunk-local state, one row block at a time ---------------
        s_loc = gl.zeros([P, N], gl.float32, layout=mma_s)
        for k in range(nblk):
            s = k % _NUM_BUFFERS
            mbarrier.wait(bars.index(s), (k // _NUM_BUFFERS) & 1)
            w_k = wst_rows.index(k).load(col_a)
            # (x scaled by the weights)^T as the register A operand, B from
            # the ring
            xt = x_s.index(s).permute((1, 0)).load(opa_s)
            xw = (xt.to(gl.float32) * w_k[None, :]).to(io_dtype)
            s_loc = warpgroup_mma(xw, b_s.index(s), s_loc, is_async=True)
            s_loc = warpgroup_mma_wait(0, deps=(s_loc,))
            _cta_barrier()  # every warp is done with slot s
            _issue_tiles(
                k + _NUM_BUFFERS, nblk, x_desc, b_desc, c_desc, x_s, b_s, c_s,
                bars, row0, xcol, bcol,
            )  # fmt: skip

        # ---- C: state passing (see ssd_fused for the memory ordering) ----
        offs_p = gl.arange(0, P, layout=row_s)
        offs_n = gl.arange(0, N, layout=col_s)
        state_offs = offs_p[:, None] * N + offs_n[None, :]
        if is_first:
            if HAS_INITSTATES:
                s_prev = gl.load(
                    init_ptr
                    + seq.to(gl.int64) * stride_init_b
                    + h * stride_init_h
                    + offs_p[:, None] * stride_init_p
                    + offs_n[None, :] * stride_init_n
                ).to(gl.float32)
            else:
                s_prev = gl.zeros([P, N], gl.float32, layout=mma_s)
        else:
            flag_prev = sync_ptr + 1 + (c - 1) * nheads + h
            ready = gl.atomic_add(flag_prev, 0, sem="acquire", scope="gpu")
            while ready == 0:
                ready = gl.atomic_add(flag_prev, 0, sem="acquire", scope="gpu")
            _cta_barrier()
            s_prev = gl.load(
                ws_ptr + ((c - 1) * nheads + h) * (P * N) + state_offs,
                cache_modifier=".cg",
            )

        s_end = _exp(dA_tot) * s_prev + s_loc
        if is_last:
            if WRITE_FINAL:
                if FINAL_HAS_INDICES:
                    slot = gl.load(final_idx_ptr + seq * stride_final_idx)
                    slot = slot.to(gl.int64)
                else:
                    slot = seq.to(gl.int64)
                _store_state(
                    final_ptr + slot * stride_final_s + h * stride_final_h,
                    s_end, offs_p, offs_n, stride_final_p, stride_final_n,
                )  # fmt: skip
        else:
            gl.store(
                ws_ptr + (c * nheads + h) * (P * N) + state_offs,
                s_end,
                cache_modifier=".cg",
            )
            _cta_barrier()
            gl.atomic_xchg(sync_ptr + 1 + c * nheads + h, 1, sem="release", scope="gpu")
        if WRITE_INTER:
            _store_state(
                inter_ptr + c * stride_inter_c + h * stride_inter_h,
                s_end, offs_p, offs_n, stride_inter_p, stride_inter_n,
            )  # fmt: skip

        # ---- D: outputs, BLOCK_M rows at a time ----------------------------
        offs_i = gl.arange(0, _BLOCK_M, layout=row_o)
        offs_j = gl.arange(0, _BLOCK_M, layout=col_o)
        offs_po = gl.arange(0, P, layout=col_o)
        if HAS_D:
            if D_HAS_HDIM:
                Dv = gl.load(D_ptr + h * stride_D_h + offs_po).to(gl.float32)
            else:
                Dv = gl.load(D_ptr + h * stride_D_h).to(gl.float32)
        s_run = s_prev
        st_s.store(s_run.to(io_dtype))
        fence_async_shared()
        _cta_barrier()
        causal = offs_i[:, None] >= offs_j[None, :]
        last_w = gl.arange(0, _BLOCK_M, layout=vec_w) == _BLOCK_M - 1
        out_base = out_ptr + chunk_start * stride_out_t + h * stride_out_h
        for k in range(nblk):
            idx = nblk + k
            s = idx % _NUM_BUFFERS
            m0 = k * _BLOCK_M
            rows = m0 + offs_i
            mask_i = rows < clen
            mbarrier.wait(bars.index(s), (idx // _NUM_BUFFERS) & 1)
            # C_i . B_j^T and C_i . S_run, both in flight while the decay
            # factors and the state-update operand are computed
            cb = warpgroup_mma(
                c_s.index(s),
                b_s.index(s).permute((1, 0)),
                gl.zeros([_BLOCK_M, _BLOCK_M], gl.float32, layout=mma_o),
                use_acc=False,
                is_async=True,
            )
            inter = warpgroup_mma(
                c_s.index(s),
                st_s.permute((1, 0)),
                gl.zeros([_BLOCK_M, P], gl.float32, layout=mma_o),
                use_acc=False,
                is_async=True,
            )
            w_a = wout_rows.index(k).load(col_a)
            xt = x_s.index(s).permute((1, 0)).load(opa_s)
            xw = (xt.to(gl.float32) * w_a[None, :]).to(io_dtype)
            cs_i = cs_rows.index(k).load(row_o)
            dt_j = dt_rows.index(k).load(col_o)
            cs_j = cs_rows.index(k).load(col_o)
            fac = _exp(gl.minimum(cs_i[:, None] - cs_j[None, :], 0.0)) * dt_j[None, :]
            cb = warpgroup_mma_wait(1, deps=(cb,))
            lmat = gl.where(causal, cb * fac, 0.0).to(io_dtype)
            lmat = gl.convert_layout(lmat, opa_o)
            inter = warpgroup_mma_wait(0, deps=(inter,))
            # y = exp(cs_i) C_i . S_run + (L o C B^T) x, then the state
            # update for the next row block (also issued on the last one,
            # where it is unused, to keep the wgmma accounting static)
            y = warpgroup_mma(
                lmat,
                x_s.index(s),
                inter * ecs_rows.index(k).load(row_o)[:, None],
                is_async=True,
            )
            # exp(block total): the block's last exp(cs) (dt is 0 past clen)
            e_blk = gl.sum(gl.where(last_w, ecs_rows.index(k).load(vec_w), 0.0), axis=0)
            s_run = warpgroup_mma(xw, b_s.index(s), s_run * e_blk, is_async=True)
            if HAS_D:
                xo = x_s.index(s).load(mma_o).to(gl.float32)
            y = warpgroup_mma_wait(1, deps=(y,))
            if HAS_D:
                if D_HAS_HDIM:
                    y += xo * Dv[None, :]
                else:
                    y += xo * Dv
            if HAS_Z:
                z_base = z_ptr + chunk_start * stride_z_t + h * stride_z_h
                zv = gl.load(
                    z_base + rows[:, None] * stride_z_t + offs_po[None, :] * stride_z_p,
                    mask=mask_i[:, None],
                    other=0.0,
                ).to(gl.float32)
                y *= zv / (1.0 + gl.exp(-zv))
            if m0 + _BLOCK_M <= clen:
                tma.store_wait(0)  # the previous block's store left y_s
                y_s.store(y.to(io_dtype))
                fence_async_shared()
                _cta_barrier()
                tma.async_copy_shared_to_global(out_desc, [row0 + m0, xcol], y_s)
            else:
                # the chunk's last, partial block: rows past clen belong to
                # the next chunk, so no TMA box here
                gl.store(
                    out_base
                    + rows[:, None] * stride_out_t
                    + offs_po[None, :] * stride_out_p,
                    y.to(out_ptr.dtype.element_ty),
                    mask=mask_i[:, None],
                )
            s_run = warpgroup_mma_wait(0, deps=(s_run,))
            _cta_barrier()
            st_s.store(s_run.to(io_dtype))
            fence_async_shared()
            _cta_barrier()  # also: every warp is done with slot s
            _issue_tiles(
                idx + _NUM_BUFFERS, nblk, x_desc, b_desc, c_desc, x_s, b_s, c_s,
                bars, row0, xcol, bcol,
            )  # fmt: skip
        tma.store_wait(0)
        for i in gl.static_range(_NUM_BUFFERS):
            mbarrier.invalidate(bars.index(i))


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
    ws: torch.Tensor,
    sync: torch.Tensor,
    inter: torch.Tensor | None,
    final: torch.Tensor | None,
    final_state_indices: torch.Tensor | None,
    write_final: bool,
) -> None:
    """Launch the kernel; argument checks, the workspace ``ws`` (fp32, K x H
    x P x N), the zeroed ``sync`` buffer (1 + K * H int32) and the state
    outputs (and D with a unit last stride) are
    ``ssd_fused._mamba_chunk_scan_fused_fwd``'s."""
    seqlen, nheads, headdim = x.shape
    _, ngroups, dstate = B.shape
    n_items = (cu_chunk_seqlens.shape[0] - 1) * nheads
    row_layout, bc_layout, st_layout = _smem_layouts(headdim, dstate)

    def rows_desc(t: torch.Tensor, width: int, layout) -> "TensorDescriptor":
        """The (tokens, n, width) tensor t as a 2-D (tokens, n * width) TMA
        view, read in (BLOCK_M, width) boxes."""
        return TensorDescriptor(
            t, [seqlen, t.shape[1] * width], [t.stride(0), 1], [BLOCK_M, width], layout
        )

    _ssd_fused_sm90_kernel[(n_items,)](
        rows_desc(x, headdim, row_layout),
        rows_desc(B, dstate, bc_layout),
        rows_desc(C, dstate, bc_layout),
        rows_desc(out, headdim, row_layout),
        dt, A, D, z, dt_bias, out, initial_states, ws, sync, inter, final,
        final_state_indices, cu_chunk_seqlens, seq_idx, last_chunk_indices,
        float(dt_limit[0]), float(dt_limit[1]),
        nheads, headdim, dstate, nheads // ngroups,
        *dt.stride(),
        D.stride(0) if D is not None else 0,
        *_strides(z, 3), *out.stride(),
        *_strides(initial_states, 4), *_strides(inter, 4), *_strides(final, 4),
        final_state_indices.stride(0) if final_state_indices is not None else 0,
        STATE_SMEM_LAYOUT=st_layout,
        CHUNK_SIZE=chunk_size,
        HAS_D=D is not None,
        D_HAS_HDIM=D is not None and D.dim() == 2,
        HAS_Z=z is not None,
        HAS_DT_BIAS=dt_bias is not None,
        DT_SOFTPLUS=dt_softplus,
        HAS_INITSTATES=initial_states is not None,
        WRITE_INTER=inter is not None,
        WRITE_FINAL=write_final,
        FINAL_HAS_INDICES=final_state_indices is not None,
        num_warps=4,
    )  # fmt: skip

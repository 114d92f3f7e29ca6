# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tests for the fused single-launch Mamba2 SSD prefill kernel (Triton form).

GPU tests compare ``mamba_chunk_scan_fused_varlen`` against a slow, obvious
token-by-token SSM recurrence in float64 and against the upstream five-kernel
chain (``mamba_chunk_scan_combined_varlen``). The fused kernel's error against
the float64 reference is bounded by a multiple of the chain's own error on the
same inputs (``assert_as_accurate_as_chain``), so a regression that leaves the
kernel "roughly right" still fails.

The tests take the kernel through the ``fused_form`` fixture: here the
portable Triton form, always (``_mamba_chunk_scan_fused_fwd``); other forms'
test modules import these tests and override the fixture.

``test_fused_ssd_triton_interpreter`` and ``test_fused_ssd_empty_sequences``
run the kernel under the Triton interpreter on the CPU, so CPU-only CI catches
indexing and masking bugs:

    TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES="" \\
        pytest tests/kernels/mamba/test_ssd_fused.py -k "interpreter or empty"

(skipped unless TRITON_INTERPRET=1 is set or a GPU is present; they use fp32
since the interpreter's bf16 ``tl.dot`` is not usable).
"""

import dataclasses
import functools
import itertools
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from vllm.model_executor.layers.mamba.ops import ssd_fused, ssd_fused_launch
from vllm.model_executor.layers.mamba.ops.ssd_combined import (
    mamba_chunk_scan_combined_varlen,
)
from vllm.model_executor.layers.mamba.ops.ssd_fused import (
    _mamba_chunk_scan_fused_fwd,
    mamba_chunk_scan_fused_varlen,
    select_mamba_chunk_scan_varlen,
)
from vllm.platforms import current_platform

requires_gpu = pytest.mark.skipif(
    not current_platform.is_cuda_alike(),
    reason="The fused Mamba2 SSD kernel needs a CUDA-alike GPU "
    "(the CPU is covered by the Triton interpreter tests).",
)
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
requires_gpu_or_interpreter = pytest.mark.skipif(
    not (current_platform.is_cuda_alike() or INTERPRETER),
    reason="needs a CUDA-alike GPU or the Triton interpreter (TRITON_INTERPRET=1)",
)

# The fused error against the float64 reference may be at most
# CHAIN_ERR_FACTOR times the chain's on the same inputs, plus CHAIN_ERR_EPS
# (both kernels round their dot operands to the input dtype, in different
# places; the eps covers a chain error that happens to be near zero).
CHAIN_ERR_FACTOR = 2.0
CHAIN_ERR_EPS = {torch.float32: 1e-5, torch.float16: 2e-4, torch.bfloat16: 1e-3}


@dataclasses.dataclass
class FusedForm:
    """A form of the fused kernel under test: ``fn`` has the signature of
    ``mamba_chunk_scan_fused_varlen``; ``handles(inp, chunk_size)`` says
    whether this form takes such inputs (a test of a case it does not take is
    skipped)."""

    name: str
    fn: Callable[..., torch.Tensor | None]
    handles: Callable[[dict[str, torch.Tensor], int], bool] = lambda inp, c: True


@pytest.fixture(params=["triton"])
def fused_form(request) -> FusedForm:
    """The portable Triton form, whatever the GPU."""
    return FusedForm(request.param, _mamba_chunk_scan_fused_fwd)


def require_form(form: FusedForm, inp: dict[str, torch.Tensor], chunk_size: int):
    if not form.handles(inp, chunk_size):
        pytest.skip(f"case not handled by the {form.name} form")


def chunk_metadata(
    lens: list[int], chunk_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """cu_seqlens, cu_chunk_seqlens, last_chunk_indices, seq_idx with the
    rule of vLLM's Mamba2 metadata builder: chunks end at sequence ends and
    at multiples of chunk_size of the packed token position."""
    bounds, seq_idx, last = [0], [], []
    pos = 0
    for s, n in enumerate(lens):
        end = pos + n
        while pos < end:
            pos += min(chunk_size - pos % chunk_size, end - pos)
            bounds.append(pos)
            seq_idx.append(s)
        last.append(len(seq_idx) - 1 if n else -1)  # -1: no chunks
    cu = [0, *itertools.accumulate(lens)]

    def t(v: list[int]) -> torch.Tensor:
        return torch.tensor(v, dtype=torch.int32, device=device)

    return t(cu), t(bounds), t(last), t(seq_idx)


def ssd_reference(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    cu_seqlens: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    state_at: set[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """Slow, obvious SSM recurrence in float64 on the CPU, one token at a time:
    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,  y_t = h_t C_t + D x_t,
    y_t *= silu(z_t).  Returns (y, final states, {token: state after it})."""
    x, dt, A, B, C = (t.double().cpu() for t in (x, dt, A, B, C))
    T, H, P = x.shape
    G, N = B.shape[1:]
    if dt_bias is not None:
        dt = dt + dt_bias.double().cpu()
    if dt_softplus:
        dt = torch.where(dt <= 20.0, F.softplus(dt), dt)
    dt = dt.clamp(dt_limit[0], dt_limit[1])
    Bh = B.repeat_interleave(H // G, dim=1)
    Ch = C.repeat_interleave(H // G, dim=1)
    y = torch.empty(T, H, P, dtype=torch.float64, device=x.device)
    finals, snap = [], {}
    for s in range(cu_seqlens.numel() - 1):
        if initial_states is not None:
            h = initial_states[s].double().cpu()
        else:
            h = torch.zeros(H, P, N, dtype=torch.float64, device=x.device)
        for t in range(int(cu_seqlens[s]), int(cu_seqlens[s + 1])):
            decay = torch.exp(dt[t] * A)[:, None, None]
            h = decay * h + dt[t][:, None, None] * x[t][:, :, None] * Bh[t][:, None]
            y[t] = (h * Ch[t][:, None]).sum(-1)
            if state_at is not None and t in state_at:
                snap[t] = h.clone()
        finals.append(h)
    if D is not None:
        Dd = D.double().cpu()
        y = y + x * (Dd[None] if Dd.dim() == 2 else Dd[None, :, None])
    if z is not None:
        zd = z.double().cpu()
        y = y * zd * torch.sigmoid(zd)
    return y, torch.stack(finals), snap


def reference_for(
    inp: dict[str, torch.Tensor],
    cu_seqlens: torch.Tensor,
    D: torch.Tensor | None,
    *,
    use_z: bool,
    use_init: bool,
    state_at: set[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """ssd_reference on make_inputs() inputs, as run_case() passes them."""
    return ssd_reference(
        inp["x"],
        inp["dt"],
        inp["A"],
        inp["B"],
        inp["C"],
        cu_seqlens,
        D=D,
        z=inp["z"] if use_z else None,
        dt_bias=inp["dt_bias"],
        initial_states=inp["init"] if use_init else None,
        dt_softplus=True,
        state_at=state_at,
    )


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


def make_inputs(
    lens: list[int],
    nheads: int,
    headdim: int,
    ngroups: int,
    dstate: int,
    itype: torch.dtype,
    device: torch.device | str,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    T = sum(lens)

    def r(*s: int, dtype: torch.dtype = itype) -> torch.Tensor:
        return torch.randn(*s, device=device, dtype=dtype, generator=g)

    return dict(
        x=r(T, nheads, headdim),
        dt=r(T, nheads) * 0.5 - 1.0,
        A=-torch.rand(nheads, device=device, generator=g) - 0.5,
        B=r(T, ngroups, dstate),
        C=r(T, ngroups, dstate),
        z=r(T, nheads, headdim),
        dt_bias=r(nheads, dtype=torch.float32) * 0.1,
        D_head=r(nheads, dtype=torch.float32),
        D_dim=r(nheads, headdim, dtype=torch.float32),
        init=r(len(lens), nheads, headdim, dstate, dtype=torch.float32),
    )


def run_case(
    fn,
    lens: list[int],
    chunk_size: int,
    inp: dict[str, torch.Tensor],
    *,
    use_z: bool,
    d_mode: str,
    use_init: bool,
    scatter: bool,
    intermediate: bool = False,
    state_dtype: torch.dtype | None = torch.float32,
):
    device = inp["x"].device
    T, H, P = inp["x"].shape
    N = inp["B"].shape[-1]
    cu, cu_chunk, last, seq_idx = chunk_metadata(lens, chunk_size, device)
    out = torch.full((T, H, P), float("nan"), device=device, dtype=inp["x"].dtype)
    D = {"none": None, "head": inp["D_head"], "dim": inp["D_dim"]}[d_mode]
    cache = idx = None
    if scatter:
        # non-contiguous, permuted slots inside a larger state cache
        nslots = 3 * len(lens) + 2
        cache = torch.full(
            (nslots, H, P, N), float("nan"), device=device, dtype=state_dtype
        )
        perm = torch.randperm(nslots, generator=torch.Generator().manual_seed(1))
        idx = perm[: len(lens)].to(device=device, dtype=torch.int32)
    scatter_kw = {}
    if scatter and fn is not mamba_chunk_scan_combined_varlen:
        scatter_kw = {"final_states_out": cache, "final_state_indices": idx}
    ret = fn(
        inp["x"],
        inp["dt"],
        inp["A"],
        inp["B"],
        inp["C"],
        chunk_size,
        cu,
        cu_chunk,
        last,
        seq_idx,
        out,
        D=D,
        z=inp["z"] if use_z else None,
        dt_bias=inp["dt_bias"],
        initial_states=inp["init"] if use_init else None,
        dt_softplus=True,
        return_intermediate_states=intermediate,
        state_dtype=state_dtype,
        **scatter_kw,
    )
    if scatter and fn is mamba_chunk_scan_combined_varlen:
        # vLLM 0.32.0's chain returns the final states (its caller scatters)
        assert ret is not None and cache is not None and idx is not None
        cache[idx.long()] = ret.to(cache.dtype)
        ret = None
    if scatter:
        assert ret is None and cache is not None and idx is not None
        untouched = torch.ones(cache.shape[0], dtype=torch.bool, device=device)
        untouched[idx.long()] = False
        # slots that are not ours stay untouched
        assert cache[untouched].isnan().all()
        finals = cache[idx.long()]
    elif intermediate:
        finals = ret[last.long()]
    else:
        finals = ret
    return out, finals, ret, (cu, cu_chunk, last, seq_idx), D


def assert_as_accurate_as_chain(
    got: torch.Tensor,
    chain: torch.Tensor,
    ref: torch.Tensor,
    itype: torch.dtype,
    what: str,
) -> None:
    """Got's relative error against the float64 reference ref is at most
    CHAIN_ERR_FACTOR times the chain's (plus CHAIN_ERR_EPS)."""
    err, chain_err = rel_err(got, ref), rel_err(chain, ref)
    bound = CHAIN_ERR_FACTOR * chain_err + CHAIN_ERR_EPS[itype]
    assert err <= bound, f"{what}: fused {err:.3g}, chain {chain_err:.3g}"


def check_against_reference(
    fn,
    lens: list[int],
    chunk_size: int,
    inp: dict[str, torch.Tensor],
    itype: torch.dtype,
    **kw,
) -> None:
    """Fn and the chain on the same inputs against the float64 reference."""
    out, finals, ret, (cu, _, _, _), D = run_case(fn, lens, chunk_size, inp, **kw)
    assert not out.isnan().any(), "some output elements were not written"
    assert not finals.isnan().any()
    out_c, finals_c = run_case(
        mamba_chunk_scan_combined_varlen, lens, chunk_size, inp, **kw
    )[:2]
    ref_out, ref_final, _ = reference_for(
        inp, cu, D, use_z=kw["use_z"], use_init=kw["use_init"]
    )
    assert_as_accurate_as_chain(out, out_c, ref_out, itype, "outputs")
    assert_as_accurate_as_chain(finals, finals_c, ref_final, itype, "final states")


@requires_gpu
@pytest.mark.parametrize("itype", [torch.bfloat16])
def test_fused_ssd_long_sequence(itype, fused_form):
    """One sequence of >= 64k tokens (257 chunks of 256 handed on in
    order), plus a short one behind it."""
    device = current_platform.device_type
    lens = [65536 + 101, 77]
    inp = make_inputs(lens, 2, 64, 1, 32, itype, device, seed=7)
    require_form(fused_form, inp, 256)
    check_against_reference(
        fused_form.fn,
        lens,
        256,
        inp,
        itype,
        use_z=True,
        d_mode="head",
        use_init=True,
        scatter=True,
    )


@requires_gpu
def test_fused_ssd_more_chunks_than_resident_ctas(fused_form):
    """Far more work items (chunks x heads) than can be resident at once,
    in one sequence so every item waits on its predecessor; compared with
    the chain. With the ticket scheme this cannot deadlock whatever order
    the hardware starts the programs in."""
    device = current_platform.device_type
    itype = torch.bfloat16
    chunk_size = 128
    lens = [32768, 1000, 3]  # 265 chunks x 128 heads = 33920 programs
    inp = make_inputs(lens, 128, 64, 1, 128, itype, device, seed=11)
    require_form(fused_form, inp, chunk_size)
    sm = torch.cuda.get_device_properties(device).multi_processor_count
    nchunks = sum(-(-n // chunk_size) for n in lens)
    assert nchunks * 128 > 16 * sm
    kw = dict(use_z=False, d_mode="head", use_init=True, scatter=True)
    out_f, fin_f = run_case(fused_form.fn, lens, chunk_size, inp, **kw)[:2]
    out_c, fin_c = run_case(
        mamba_chunk_scan_combined_varlen, lens, chunk_size, inp, **kw
    )[:2]
    assert not out_f.isnan().any()
    # (too long for the token-by-token reference: against the chain, with
    # the bound the reference tests see between the two)
    assert rel_err(out_f, out_c) < 5e-3
    assert rel_err(fin_f, fin_c) < 1e-2


# Lengths below / equal to / not a multiple of the chunk, in one batch.
SHORT_LENS = {
    128: [1, 127, 128, 129, 5, 256, 300, 77],
    256: [3, 255, 256, 257, 40, 512, 600, 1],
}


# Each feature on and off, both dtypes, both chunk sizes and 1 / 2 / 8 groups,
# without the full cross product (every case is its own Triton compile).
REFERENCE_CASES = [
    # itype, chunk_size, ngroups, use_z, d_mode, use_init, scatter
    (torch.float32, 128, 1, True, "dim", True, True),
    (torch.bfloat16, 256, 1, False, "head", False, False),
    (torch.bfloat16, 128, 2, True, "head", True, False),
    (torch.float32, 256, 8, False, "none", False, True),
    (torch.bfloat16, 256, 8, True, "dim", True, True),
    (torch.float32, 128, 2, False, "head", False, False),
    (torch.bfloat16, 128, 1, False, "none", True, True),
]


@requires_gpu
@pytest.mark.parametrize(
    "itype,chunk_size,ngroups,use_z,d_mode,use_init,scatter", REFERENCE_CASES
)
def test_fused_ssd_vs_reference(
    itype, chunk_size, ngroups, use_z, d_mode, use_init, scatter, fused_form
):
    device = current_platform.device_type
    lens = SHORT_LENS[chunk_size]
    inp = make_inputs(lens, 8, 64, ngroups, 64, itype, device, seed=ngroups)
    require_form(fused_form, inp, chunk_size)
    check_against_reference(
        fused_form.fn,
        lens,
        chunk_size,
        inp,
        itype,
        use_z=use_z,
        d_mode=d_mode,
        use_init=use_init,
        scatter=scatter,
    )


@requires_gpu
@pytest.mark.parametrize(
    "itype,chunk_size,headdim,dstate",
    [
        (torch.float32, 128, 64, 128),
        (torch.bfloat16, 256, 64, 128),
        (torch.bfloat16, 128, 32, 16),
        (torch.float32, 256, 80, 128),
    ],
)
def test_fused_ssd_vs_chain(itype, chunk_size, headdim, dstate, fused_form):
    """Same inputs through both implementations, against the float64
    reference: outputs, final states written into the cache, and
    intermediate (per-chunk) states (same shape and dtype as the chain's)."""
    device = current_platform.device_type
    lens = [chunk_size * 3 + 17, 9, chunk_size, 2 * chunk_size - 1, 700]
    inp = make_inputs(lens, 16, headdim, 2, dstate, itype, device, seed=3)
    require_form(fused_form, inp, chunk_size)
    kw = dict(use_z=True, d_mode="dim", use_init=True)
    outs = {}
    for name, fn in (
        ("chain", mamba_chunk_scan_combined_varlen),
        ("fused", fused_form.fn),
    ):
        outs[name] = run_case(fn, lens, chunk_size, inp, scatter=True, **kw)
        outs[name + "_inter"] = run_case(
            fn, lens, chunk_size, inp, scatter=False, intermediate=True, **kw
        )[2]
    out_f, fin_f, _, (cu, cu_chunk, _, _), D = outs["fused"]
    assert not out_f.isnan().any()
    ends = [int(e) - 1 for e in cu_chunk[1:]]
    ref_out, ref_final, snap = reference_for(
        inp, cu, D, use_z=True, use_init=True, state_at=set(ends)
    )
    ref_inter = torch.stack([snap[e] for e in ends])
    inter_f, inter_c = outs["fused_inter"], outs["chain_inter"]
    assert inter_f.shape == inter_c.shape and inter_f.dtype == inter_c.dtype
    assert_as_accurate_as_chain(out_f, outs["chain"][0], ref_out, itype, "outputs")
    assert_as_accurate_as_chain(fin_f, outs["chain"][1], ref_final, itype, "finals")
    assert_as_accurate_as_chain(inter_f, inter_c, ref_inter, itype, "intermediate")


@requires_gpu
@pytest.mark.parametrize("itype", [torch.float32, torch.bfloat16])
def test_fused_ssd_intermediate_states(itype, fused_form):
    """return_intermediate_states: the state after the last token of every
    (pseudo) chunk, as used by the prefix-caching checkpoint path."""
    device = current_platform.device_type
    chunk_size = 128
    lens = [300, 128, 50, 513]
    inp = make_inputs(lens, 4, 64, 1, 32, itype, device, seed=5)
    require_form(fused_form, inp, chunk_size)
    kw = dict(use_z=False, d_mode="head", use_init=True, scatter=False)
    out, _, inter, (cu, cu_chunk, _, _), D = run_case(
        fused_form.fn, lens, chunk_size, inp, intermediate=True, **kw
    )
    inter_c = run_case(
        mamba_chunk_scan_combined_varlen, lens, chunk_size, inp, intermediate=True, **kw
    )[2]
    assert not out.isnan().any()
    ends = [int(e) - 1 for e in cu_chunk[1:]]
    _, _, snap = reference_for(
        inp, cu, D, use_z=False, use_init=True, state_at=set(ends)
    )
    ref = torch.stack([snap[e] for e in ends])
    assert inter.shape == ref.shape
    assert_as_accurate_as_chain(inter, inter_c, ref, itype, "intermediate states")


@requires_gpu
def test_fused_ssd_flag_buffer_kept_and_graphs(fused_form):
    """The flag buffer is kept per stream and every launch leaves it zeroed
    (ssd_fused, "Flag buffer"): launches back to back on one stream and on a
    second stream, and replays of a CUDA graph with new inputs, each
    against the reference; the kept buffers are all zero afterwards."""
    device = current_platform.device_type
    itype = torch.bfloat16
    chunk_size = 128
    lens = [700, 128, 5, 1000]
    inps = [
        make_inputs(lens, 8, 64, 1, 64, itype, device, seed=20 + i) for i in range(3)
    ]
    require_form(fused_form, inps[0], chunk_size)
    cu, cu_chunk, last, seq_idx = chunk_metadata(lens, chunk_size, device)

    def call(fn, inp: dict, out: torch.Tensor) -> torch.Tensor:
        return fn(
            inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], chunk_size, cu,
            cu_chunk, last, seq_idx, out, D=inp["D_head"], z=inp["z"],
            dt_bias=inp["dt_bias"], initial_states=inp["init"],
            dt_softplus=True, state_dtype=torch.float32,
        )  # fmt: skip

    def check(out: torch.Tensor, finals: torch.Tensor, inp: dict) -> None:
        ref_out, ref_final, _ = reference_for(
            inp, cu, inp["D_head"], use_z=True, use_init=True
        )
        out_c = torch.empty_like(out)
        finals_c = call(mamba_chunk_scan_combined_varlen, inp, out_c)
        assert not out.isnan().any(), "some output elements were not written"
        assert_as_accurate_as_chain(out, out_c, ref_out, itype, "outputs")
        assert_as_accurate_as_chain(finals, finals_c, ref_final, itype, "finals")

    def fresh_out() -> torch.Tensor:
        return torch.full_like(inps[0]["x"], float("nan"))

    for inp in inps[:2]:  # one stream, back to back
        out = fresh_out()
        check(out, call(fused_form.fn, inp, out), inp)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = fresh_out()
        finals = call(fused_form.fn, inps[2], out)
    side.synchronize()
    check(out, finals, inps[2])

    static = {k: v.clone() for k, v in inps[0].items()}
    out = fresh_out()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        finals = call(fused_form.fn, static, out)
    for inp in inps:
        for k, v in inp.items():
            static[k].copy_(v)
        out.fill_(float("nan"))
        graph.replay()
        torch.accelerator.synchronize()
        check(out, finals.clone(), inp)

    torch.accelerator.synchronize()
    dev = out.device.index
    kept = [b for (d, _), b in ssd_fused_launch._SYNC.items() if d == dev]
    assert len(kept) >= 2  # this test's two streams
    assert all(int(b.abs().sum()) == 0 for b in kept)


EMPTY_SEQ_LENS = [
    [37, 0, 50, 0, 0, 20],  # empty sequences between non-empty ones
    [0, 0, 40, 9],  # empty first sequences
    [25, 0],  # an empty last sequence
]


@requires_gpu_or_interpreter
@pytest.mark.parametrize("lens", EMPTY_SEQ_LENS)
@pytest.mark.parametrize("use_init,scatter", [(True, True), (False, False)])
@pytest.mark.parametrize("itype", [torch.float32, torch.bfloat16])
def test_fused_ssd_empty_sequences(lens, use_init, scatter, itype, fused_form):
    """Empty sequences (repeated cu_seqlens entries, last_chunk_indices -1):
    the final state of one is its initial state, or zeros; the sequences
    around it are computed as without it (fp64 reference and the chain)."""
    if INTERPRETER and itype != torch.float32:
        pytest.skip("the interpreter's bf16 tl.dot is not usable")
    device = "cpu" if INTERPRETER else current_platform.device_type
    chunk_size = 16 if INTERPRETER else 128
    lens = [n * chunk_size // 16 for n in lens]
    hd, ds = (16, 16) if INTERPRETER else (64, 32)
    inp = make_inputs(lens, 4, hd, 2, ds, itype, device, seed=len(lens))
    require_form(fused_form, inp, chunk_size)
    kw = dict(use_z=False, d_mode="head", use_init=use_init, scatter=scatter)
    out, finals, _, (cu, _, last, _), D = run_case(
        fused_form.fn, lens, chunk_size, inp, **kw
    )
    assert int((last == -1).sum()) == lens.count(0)
    out_c, finals_c = run_case(
        mamba_chunk_scan_combined_varlen, lens, chunk_size, inp, **kw
    )[:2]
    ref_out, ref_final, _ = reference_for(inp, cu, D, use_z=False, use_init=use_init)
    assert not out.isnan().any() and not finals.isnan().any()
    assert_as_accurate_as_chain(out, out_c, ref_out, itype, "outputs")
    for s, n in enumerate(lens):
        if n == 0:  # exactly the initial state (state_dtype fp32), or zeros
            want = inp["init"][s] if use_init else torch.zeros_like(finals[s])
            torch.testing.assert_close(finals[s], want, rtol=0, atol=0)
        else:
            assert_as_accurate_as_chain(
                finals[s], finals_c[s], ref_final[s], itype, f"final state {s}"
            )


@requires_gpu_or_interpreter
@pytest.mark.parametrize("use_init,scatter", [(True, True), (False, False)])
def test_fused_ssd_all_sequences_empty(use_init, scatter):
    """No tokens at all: nothing is launched, the final states are the
    initial states (or zeros), returned or written into their slots."""
    device = "cpu" if INTERPRETER else current_platform.device_type
    lens = [0, 0, 0]
    inp = make_inputs(lens, 4, 16, 2, 16, torch.float32, device, seed=1)
    kw = dict(use_z=False, d_mode="head", use_init=use_init, scatter=scatter)
    finals = run_case(_mamba_chunk_scan_fused_fwd, lens, 16, inp, **kw)[1]
    want = inp["init"] if use_init else torch.zeros_like(finals)
    torch.testing.assert_close(finals, want, rtol=0, atol=0)


def record_launch(monkeypatch, run: Callable[[], None]) -> tuple:
    """(kernel, args, meta) of the one ssd_fused_launch.launch that run()
    makes: recorded, not run."""
    got: dict[str, Any] = {}

    def record(fn, grid, args, meta):
        got.update(fn=fn, args=args, meta=meta)

    monkeypatch.setattr(ssd_fused_launch, "launch", record)
    run()
    return got["fn"], got["args"], got["meta"]


def _launch_triton_form() -> None:
    """A launch of the Triton form on small CPU tensors."""
    lens = [300, 128, 50]
    inp = make_inputs(lens, 16, 64, 2, 64, torch.bfloat16, "cpu")
    x = inp["x"]
    cu, cu_chunk, last, seq_idx = chunk_metadata(lens, 128, "cpu")
    _mamba_chunk_scan_fused_fwd(
        x, inp["dt"], inp["A"], inp["B"], inp["C"], 128, cu, cu_chunk, last,
        seq_idx, torch.empty_like(x), D=inp["D_dim"], z=inp["z"],
        dt_bias=inp["dt_bias"], initial_states=inp["init"], dt_softplus=True,
    )  # fmt: skip


@pytest.fixture(params=["triton"])
def launch_case(request) -> Callable[[], None]:
    """A function making one launch of a fused kernel form (CPU tensors)."""
    return _launch_triton_form


def _one_changed(args: tuple, constexpr: tuple[bool, ...]):
    """The arguments with one non-constexpr one changed at a time: tensors to an
    unaligned view, an aligned view and another dtype, None to a tensor, ints
    around 1, multiples of 16 and the int32 range, floats."""
    for i, (a, c) in enumerate(zip(args, constexpr)):
        if c:
            continue
        if isinstance(a, torch.Tensor):
            flat = torch.empty(a.numel() + 16, dtype=a.dtype)
            other = torch.float32 if a.dtype != torch.float32 else torch.bfloat16
            alts = [flat[1 : 1 + a.numel()], flat[8 : 8 + a.numel()], a.to(other)]
        elif a is None:
            alts = [torch.empty(4, dtype=torch.float32)]
        elif type(a) is int:
            alts = [0, 1, 2, 16, 17, 48, 2**31 - 16, 2**31, 2**31 + 16, 2**32 + 1]
        elif type(a) is float:
            alts = [0.0, 1.5, float("inf")]
        else:  # TMA descriptors
            alts = []
        for alt in alts:
            yield args[:i] + (alt,) + args[i + 1 :]


def test_launch_key_determines_the_specialization(launch_case, monkeypatch):
    """ssd_fused_launch caches compiled kernels under args_key instead of
    binding every argument through the JIT on each launch: calls with equal
    keys must get the same specialization from Triton's own binder. Checked
    on a recorded launch and on every variant of it with one argument changed
    (its dtype, alignment, value class or None-ness). Runs on the CPU: the
    binder needs no GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime import JITFunction
    from triton.runtime.jit import create_function_from_signature

    fn, args, meta = record_launch(monkeypatch, launch_case)
    if not isinstance(fn, JITFunction):  # TRITON_INTERPRET=1: the raw function
        fn = JITFunction(fn.fn)
    binder = create_function_from_signature(
        fn.signature, fn.params, CUDABackend(GPUTarget("cuda", 90, 32))
    )

    class Kernel:  # args_key reads the parameters (a JITFunction hashes its
        params = fn.params  # source's dependencies, interpreted ones here)

    constexpr = tuple(p.is_constexpr for p in fn.params)
    spec_of_key: dict = {}
    key_of_fast: dict = {}
    variants = [args, *_one_changed(args, constexpr)]
    for v in variants:
        spec = repr(binder(*v, **meta)[1])
        key = ssd_fused_launch.args_key(Kernel, v)
        assert spec_of_key.setdefault(key, spec) == spec, (key, spec)
        # launch() looks fast_key up first: it must determine args_key
        fast = ssd_fused_launch.fast_key(Kernel, v)
        assert key_of_fast.setdefault(fast, key) == key, (fast, key)
    # the variants did reach different specializations
    assert len(set(spec_of_key.values())) > len(variants) // 4


class _Driver:
    """Stand-in for Triton's active driver: device 0, stream 1234."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 1234


def test_launch_skips_only_empty_hooks(launch_case, monkeypatch):
    """A compiled kernel's first launch under a key goes through Triton
    (CompiledKernel[grid], which loads its handles); later ones call its
    launcher directly, with no launch metadata and no hooks, unless a launch
    hook is registered or the Triton release is not one whose calling
    convention is checked (ssd_fused_launch.DIRECT_RUN_TRITON). The callers'
    Meta is made once per configuration and cannot be changed. Runs on the
    CPU: a stand-in compiled kernel records the launches."""
    import triton
    from triton.runtime import JITFunction

    launch = ssd_fused_launch.launch  # (record_launch replaces it)
    fn, args, meta = record_launch(monkeypatch, launch_case)
    if not isinstance(fn, JITFunction):  # TRITON_INTERPRET=1: the raw function
        pytest.skip("launch() hands the Triton interpreter's kernels to it")
    assert isinstance(meta, ssd_fused_launch.Meta)
    with pytest.raises(TypeError):
        meta["num_warps"] = 8
    assert hash(ssd_fused_launch.Meta(meta)) == hash(meta)
    launches: list[tuple] = []

    class Compiled:  # a stand-in for the CompiledKernel
        function, packed_metadata = 7, (4, 1, 0)

        def __getitem__(self, grid):
            return lambda *a: launches.append(("triton", grid, a))

        def run(self, *a):
            launches.append(("direct", a))

    monkeypatch.setattr(triton.runtime.driver, "_active", _Driver())
    monkeypatch.setattr(ssd_fused_launch, "_FAST", {})
    monkeypatch.setattr(ssd_fused_launch, "_KERNELS", {})
    monkeypatch.setattr(ssd_fused_launch, "_DIRECT_RUN", True)
    constexprs = tuple(meta[n] for n in fn.arg_names[len(args) :])
    key = ssd_fused_launch.launch_key(fn, args, meta)
    ssd_fused_launch._KERNELS[key] = (Compiled(), constexprs)
    kernel_args = (*args, *constexprs)
    launch(fn, 5, args, meta)
    assert launches.pop() == ("triton", (5, 1, 1), kernel_args)
    launch(fn, 5, args, meta)
    assert launches.pop() == (
        "direct",
        (5, 1, 1, 1234, 7, (4, 1, 0), None, None, None, *kernel_args),
    )
    # a release whose runner is not checked: always through Triton
    monkeypatch.setattr(ssd_fused_launch, "_DIRECT_RUN", False)
    launch(fn, 5, args, meta)
    assert launches.pop() == ("triton", (5, 1, 1), kernel_args)
    monkeypatch.setattr(ssd_fused_launch, "_DIRECT_RUN", True)
    hooks = triton.knobs.runtime.launch_enter_hook
    if getattr(hooks, "calls", None) != []:
        pytest.skip("this Triton has no empty launch-hook chain to add to")
    hook = launches.append
    hooks.add(hook)
    try:
        launch(fn, 5, args, meta)
    finally:
        hooks.remove(hook)
    assert launches.pop() == ("triton", (5, 1, 1), kernel_args)
    assert not launches


def test_direct_run_matches_triton_runner(monkeypatch):
    """launch()'s direct call of CompiledKernel.run passes what the installed
    Triton's own ``CompiledKernel[grid](*args)`` passes when no hook is
    registered (its launch metadata only read by hooks, so None). Runs the
    real ``CompiledKernel.__getitem__`` on a stand-in with the compiled
    kernel's attributes; CI runs it under every release in
    ssd_fused_launch.DIRECT_RUN_TRITON. Under other releases launch() never
    takes the direct path, which this checks too."""
    import triton
    from triton.compiler.compiler import CompiledKernel

    version = triton.__version__
    supported = version.startswith(
        tuple(v + "." for v in ssd_fused_launch.DIRECT_RUN_TRITON)
    )
    assert supported == ssd_fused_launch._DIRECT_RUN
    if not supported:
        pytest.skip(f"Triton {version}: launch() always goes through Triton")
    calls: list[tuple] = []

    class Stub:
        function, packed_metadata = 7, (4, 1, 0)

        def _init_handles(self):
            pass

        def launch_metadata(self, grid, stream, *args):
            return "launch-metadata"

        def run(self, *a):
            calls.append(a)

    monkeypatch.setattr(triton.runtime.driver, "_active", _Driver())
    args = (object(), 3, 2.5, None, 16)
    CompiledKernel.__getitem__(Stub(), (5, 1, 1))(*args)
    (through_triton,) = calls
    assert through_triton[:7] == (5, 1, 1, 1234, 7, (4, 1, 0), "launch-metadata")
    # the two hook chains: unset or empty (none is registered here)
    for hook in through_triton[7:9]:
        assert hook is None or getattr(hook, "calls", None) == [], hook
    assert through_triton[9:] == args

    # launch() on a cached kernel: the same call, no metadata and no hooks
    class Fn(triton.runtime.JITFunction):
        def __init__(self):
            pass

    meta = ssd_fused_launch.Meta(num_warps=4)
    monkeypatch.setattr(ssd_fused_launch, "fast_key", lambda fn, args: "key")
    monkeypatch.setattr(ssd_fused_launch, "_FAST", {(0, "key", meta): (Stub(), ())})
    ssd_fused_launch.launch(Fn(), 5, args, meta)
    assert calls[-1] == (*through_triton[:6], None, None, None, *args)


@requires_gpu_or_interpreter
@pytest.mark.parametrize("scatter,intermediate", [(True, False), (False, True)])
def test_fused_ssd_triton_interpreter(scatter, intermediate, monkeypatch):
    """Small fp32 case under TRITON_INTERPRET=1 (or on the GPU): several
    sub-blocks per chunk, several head-dim blocks (headdim not a power of
    two), 2 groups, sequences shorter / equal / longer than the chunk, both
    forms of the output loop (unpipelined and pipelined) and of the state
    pass. The launch leaves its flag buffer zeroed (ssd_fused, "Flag
    buffer")."""
    device = "cpu" if INTERPRETER else current_platform.device_type
    buffers = []
    scratch = ssd_fused_launch.scratch

    def recording_scratch(device, ws_numel, n_programs):
        ws, sync = scratch(device, ws_numel, n_programs)
        buffers.append(sync)
        return ws, sync

    monkeypatch.setattr(ssd_fused_launch, "scratch", recording_scratch)
    lens = [5, 32, 45, 70]
    chunk_size = 32
    inp = make_inputs(lens, 4, 24, 2, 16, torch.float32, device, seed=13)
    config = dict(
        BLOCK_M=16,
        BLOCK_KB=16 if scatter else 32,
        BLOCK_P=16,
        OUT_STAGES=1 if scatter else 2,
    )
    fn = functools.partial(_mamba_chunk_scan_fused_fwd, triton_config=config)
    out, finals, ret, (cu, cu_chunk, last, _), D = run_case(
        fn,
        lens,
        chunk_size,
        inp,
        use_z=True,
        d_mode="dim",
        use_init=True,
        scatter=scatter,
        intermediate=intermediate,
    )
    assert not out.isnan().any()
    assert len(buffers) == 1 and int(buffers[0].abs().sum()) == 0
    ends = [int(e) - 1 for e in cu_chunk[1:]]
    ref_out, ref_final, snap = reference_for(
        inp, cu, D, use_z=True, use_init=True, state_at=set(ends)
    )
    out_c, finals_c, ret_c = run_case(
        mamba_chunk_scan_combined_varlen,
        lens,
        chunk_size,
        inp,
        use_z=True,
        d_mode="dim",
        use_init=True,
        scatter=scatter,
        intermediate=intermediate,
    )[:3]
    assert_as_accurate_as_chain(out, out_c, ref_out, torch.float32, "outputs")
    assert_as_accurate_as_chain(finals, finals_c, ref_final, torch.float32, "finals")
    if intermediate:
        ref_inter = torch.stack([snap[e] for e in ends])
        assert_as_accurate_as_chain(ret, ret_c, ref_inter, torch.float32, "inter")
    if INTERPRETER:  # fp32 throughout on the CPU (no tf32)
        assert rel_err(out, ref_out) < 1e-5
        assert rel_err(finals, ref_final) < 1e-5


def test_launch_config_override_is_checked():
    """An unknown launch parameter is an error, not silently ignored."""
    with pytest.raises(ValueError, match="BLOCK_Q"):
        ssd_fused._launch_meta(128, 64, 64, (False,) * 9, {"BLOCK_Q": 16})


def test_select_mamba_chunk_scan_varlen():
    assert select_mamba_chunk_scan_varlen() is mamba_chunk_scan_combined_varlen
    assert select_mamba_chunk_scan_varlen("chain") is (mamba_chunk_scan_combined_varlen)
    assert select_mamba_chunk_scan_varlen("fused") is mamba_chunk_scan_fused_varlen
    for gone in ("auto", "nope"):
        with pytest.raises(ValueError):
            select_mamba_chunk_scan_varlen(gone)

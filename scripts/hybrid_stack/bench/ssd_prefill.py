# SPDX-License-Identifier: Apache-2.0
"""Benchmark: Mamba2 SSD prefill (chunked scan), upstream vs the stack's kernel.

Baseline: ``mamba_chunk_scan_combined_varlen`` (vllm.model_executor.layers.mamba.
ops.ssd_combined), called with the arguments ``MambaMixer2`` passes (bf16 x/dt/B/C,
fp32 A/D/dt_bias, dt softplus, no z, fp32 final states written into a state cache).
Value: the stack's fused ``mamba_chunk_scan_fused_varlen`` (module
``vllm.model_executor.layers.mamba.ops.ssd_fused``, same signature) when it is
importable, else the baseline itself. Both run in one process on the same fresh
random inputs; the fused kernel's output and final states are compared with the
baseline's (relative L2 error) before timing.

Accuracy: the timing inputs are model-like (B and C scaled by 1/sqrt(N)), where
the D*x skip term is nearly the whole output, so the fused-vs-chain error on
them says little. Each row therefore also runs both kernels on inputs of the
same dims and sequence split (at most ``--accuracy-tokens`` tokens) where the
scan term carries the output (B and C unscaled, no D), and reports each
kernel's relative error against a float64 token-by-token recurrence
(``baseline_err_fp64`` / ``value_err_fp64`` for the outputs,
``baseline_state_err_fp64`` / ``value_state_err_fp64`` for the final states).

Timing: ``baseline_ms`` / ``value_ms`` are back-to-back wall time per call
(their samples interleaved); ``baseline_graph_ms`` / ``value_graph_ms`` are GPU
time per call (CUDA-graph replay, no host launch cost) and ``gpu_ratio`` their
ratio. Where ``ratio`` (wall time) exceeds ``gpu_ratio`` the difference is
launch overhead, and ``host_bound`` names the side(s) whose host time per call
(``*_host_ms``, up to ``--split-max-tokens`` tokens) exceeds its GPU time.

Where the fused module has two forms of the kernel (``ssd_fused_sm90``, the
Gluon kernels used on sm_90, and the portable Triton kernel), each row records
the form the value measured (``value_kernel``: "triton", "sm90-runs" = the run
kernel on one warpgroup or "sm90-ws" = on three, warp-specialized) and, for the
sm_90 forms, the Triton form's ms per call on the same inputs (``triton_ms``,
and its GPU time ``triton_graph_ms``) and, where the warp-specialized kernel
ran, the one-warpgroup run kernel's (``sm90_runs_ms``). Other forms are reached
through the entry's private ``_mamba_chunk_scan_fused_fwd`` with explicit
launch configurations, not by changing module state.

Cases: total tokens as 1 and as 8 sequences, for granite-4.0-h-small dims
(128 heads x 64, dstate 128, 1 group, chunk 256), Mamba2-2.7B (80 x 64, dstate
128, 1 group, chunk 256) and Nemotron-H-8B (128 x 64, dstate 128, 8 groups,
chunk 128). Metrics: tokens/s (the row metric) and an estimated TFLOP/s:
per token 2*L*N*G (C.B^T) + 2*L*P*H (intra-chunk scan) + 4*N*P*H (chunk
states and their contribution to the output), L = chunk size. Up to
``--split-max-tokens`` tokens, where host launch cost can bound a call, each row
also splits the time of one call into host time (``*_host_ms``: calls issued
without synchronizing) and GPU time (``*_graph_ms``: CUDA-graph replay).
``--cases DIMS:TOKENS:SEQS[,...]`` (repeatable) runs only those cases.

A/B mode (``--variant NAME=PATH``, repeatable): a kernel change measured
against the committed kernel before it is committed. PATH is a modified copy
of the entry's sm_90 module (``ssd_fused_sm90.py``: the committed entry runs
with it in place of its own during each call) or of the entry module
(``ssd_fused.py``: its ``mamba_chunk_scan_fused_varlen`` is called). Rows
(bench ``ssd_prefill_ab``): baseline = the committed fused kernel, value =
the variant, all of them timed interleaved on the same inputs; each variant's
output and final states are compared with the committed kernel's and counted
for elements left unwritten (NaN-prefilled).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

try:
    from hybrid_stack.bench import common
except ImportError:  # run as a script from an unpacked bundle
    import common  # type: ignore[no-redef]

BENCH = "ssd_prefill"
BENCH_AB = "ssd_prefill_ab"
DIMS: dict[str, dict[str, int]] = {
    "granite-4.0-h-small": {"heads": 128, "headdim": 64, "dstate": 128, "groups": 1, "chunk": 256},
    "mamba2-2.7b": {"heads": 80, "headdim": 64, "dstate": 128, "groups": 1, "chunk": 256},
    "nemotron-h-8b": {"heads": 128, "headdim": 64, "dstate": 128, "groups": 8, "chunk": 128},
}
TOKENS = {
    "granite-4.0-h-small": (1 << 10, 1 << 11, 1 << 12, 1 << 14, 1 << 16, 1 << 18),
    "mamba2-2.7b": (1 << 10, 1 << 14, 1 << 18),
    "nemotron-h-8b": (1 << 10, 1 << 14, 1 << 18),
}
SEQS = (1, 8)
FUSED_MODULE = "vllm.model_executor.layers.mamba.ops.ssd_fused"
FUSED_NAME = "mamba_chunk_scan_fused_varlen"


def parse_case(text: str) -> tuple[str, int, int]:
    """A ``--cases`` item, DIMS:TOKENS:SEQS (tokens as a count or with a k
    suffix: 16k = 16384)."""
    parts = text.split(":")
    m = re.fullmatch(r"(\d+)(k?)", parts[1]) if len(parts) == 3 else None
    if m is None or parts[0] not in DIMS or not parts[2].isdigit() or int(parts[2]) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected DIMS:TOKENS:SEQS with DIMS one of {', '.join(DIMS)}"
        )
    tokens = int(m.group(1)) << (10 if m.group(2) else 0)
    return parts[0], tokens, int(parts[2])


def parse_cases(text: str) -> list[tuple[str, int, int]]:
    """A ``--cases`` value: one or more cases, comma-separated."""
    return [parse_case(item) for item in text.split(",")]


def default_cases(dims: list[str], quick: bool) -> list[tuple[str, int, int]]:
    return [
        (d, tokens, seqs)
        for d in dims
        for tokens in (TOKENS[d][:2] if quick else TOKENS[d])
        for seqs in SEQS
    ]


def with_sm90_module(sm90: Any, entry: Any = None) -> Callable[..., Any]:
    """The fused entry, run with ``sm90`` in place of its ``ssd_fused_sm90``
    module during each call (the entry looks the module up per call)."""
    entry = entry if entry is not None else importlib.import_module(FUSED_MODULE)
    fused = getattr(entry, FUSED_NAME)

    def call(*args: Any, **kwargs: Any) -> Any:
        saved = entry.ssd_fused_sm90
        entry.ssd_fused_sm90 = sm90
        try:
            return fused(*args, **kwargs)
        finally:
            entry.ssd_fused_sm90 = saved

    return call


def load_variant(spec: str, entry: Any = None) -> tuple[str, Callable[..., Any]]:
    """``--variant NAME=PATH``: the variant's name and the function to time."""
    name, sep, path = spec.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or not Path(path).is_file():
        raise SystemExit(f"--variant {spec!r}: expected NAME=PATH with PATH an existing file")
    modname = "_ssd_prefill_variant_" + re.sub(r"\W", "_", name)
    loader_spec = importlib.util.spec_from_file_location(modname, path)
    assert loader_spec is not None and loader_spec.loader is not None
    mod = importlib.util.module_from_spec(loader_spec)
    sys.modules[modname] = mod  # dataclasses and the JIT look their module up
    loader_spec.loader.exec_module(mod)
    if callable(getattr(mod, FUSED_NAME, None)):
        return name, getattr(mod, FUSED_NAME)
    if callable(getattr(mod, "launch", None)) and callable(getattr(mod, "supports", None)):
        return name, with_sm90_module(mod, entry)
    raise SystemExit(
        f"--variant {name}: {path} has neither {FUSED_NAME} (a copy of ssd_fused.py) "
        "nor launch and supports (a copy of ssd_fused_sm90.py)"
    )


def flops_per_token(d: dict[str, int]) -> int:
    L, N, G, P, H = d["chunk"], d["dstate"], d["groups"], d["headdim"], d["heads"]
    return 2 * L * N * G + 2 * L * P * H + 4 * N * P * H


def _fused_module() -> Any:
    return importlib.import_module(FUSED_MODULE)


def _sm90_module() -> Any:
    """The entry's sm_90 module, or None (a stack without that form)."""
    return getattr(_fused_module(), "ssd_fused_sm90", None)


def kernel_form(s: Inputs) -> str | None:
    """Which form of the fused kernel the entry point runs these inputs on:
    "sm90-runs" / "sm90-ws" (the Gluon Hopper run kernel of ssd_fused_sm90 on
    one warpgroup / on three, warp-specialized), "triton" (the portable
    kernel) or None (a stack without the sm_90 form)."""
    sm90 = _sm90_module()
    if sm90 is None or not hasattr(sm90, "LaunchConfig"):
        return None
    if not sm90.supports(s.x, s.B, s.C, s.out, s.chunk):
        return "triton"
    if sm90.warp_specialized(s.x.shape[1], s.x.device.index):
        return "sm90-ws"
    return "sm90-runs"


def form_fn(**kwargs: Any) -> Callable[..., Any]:
    """The fused entry's private implementation with explicit launch
    arguments (``sm90_config=None``: the Triton form)."""
    return functools.partial(_fused_module()._mamba_chunk_scan_fused_fwd, **kwargs)


def rotating(sets: list[Inputs], fn: Any) -> Callable[[int], None]:
    """Call i of a timed loop: fn on input set i mod len(sets)."""
    return lambda i: sets[i % len(sets)].run(fn)


def load_fused() -> tuple[Any, str]:
    try:
        mod = importlib.import_module(FUSED_MODULE)
        return getattr(mod, FUSED_NAME), ""
    except (ImportError, AttributeError) as e:
        return None, f"{type(e).__name__}: {e}"


class Inputs:
    """One input set. scan_dominated: B and C unscaled and no D, so that the
    scan term C.h carries the output (the accuracy inputs); else model-like
    B and C scaled by 1/sqrt(N) with a D skip term (the timing inputs)."""

    def __init__(
        self, d: dict[str, int], tokens: int, seqs: int, gen: Any, scan_dominated: bool = False
    ) -> None:
        import torch
        from vllm.v1.attention.backends.mamba2_attn import compute_varlen_chunk_metadata

        H, P, N, G = d["heads"], d["headdim"], d["dstate"], d["groups"]
        dev, bf16 = "cuda", torch.bfloat16

        def randn(*shape: int, dtype: Any = bf16) -> Any:
            return torch.randn(*shape, device=dev, generator=gen, dtype=torch.float32).to(dtype)

        self.chunk = d["chunk"]
        self.x = randn(tokens, H, P)
        self.dt = randn(tokens, H) * 0.5
        scale = 1.0 if scan_dominated else 1.0 / math.sqrt(N)
        self.B = (randn(tokens, G, N, dtype=torch.float32) * scale).to(bf16)
        self.C = (randn(tokens, G, N, dtype=torch.float32) * scale).to(bf16)
        u = torch.rand(H, device=dev, generator=gen)
        self.A = -torch.exp(u * math.log(16.0))
        self.D = None if scan_dominated else randn(H, dtype=torch.float32)
        self.lens = list(common.seq_lens(tokens, seqs))
        dt0 = torch.exp(
            torch.rand(H, device=dev, generator=gen) * (math.log(0.1) - math.log(1e-3))
            + math.log(1e-3)
        )
        self.dt_bias = dt0 + torch.log(-torch.expm1(-dt0))  # inverse softplus
        qsl = torch.tensor([0, *self.lens], dtype=torch.int32).cumsum(0).to(torch.int32)
        self.cu_seqlens = qsl.to(dev)
        self.cu_chunk, self.last_chunk, self.seq_idx = compute_varlen_chunk_metadata(
            self.cu_seqlens, self.chunk
        )
        self.out = torch.empty_like(self.x)
        self.states = torch.empty(seqs, H, P, N, device=dev, dtype=torch.float32)
        self.state_idx = torch.arange(seqs, device=dev, dtype=torch.int32)

    def run(self, fn: Any) -> None:
        import torch

        fn(
            self.x,
            self.dt,
            self.A,
            self.B,
            self.C,
            self.chunk,
            cu_seqlens=self.cu_seqlens,
            cu_chunk_seqlens=self.cu_chunk,
            last_chunk_indices=self.last_chunk,
            seq_idx=self.seq_idx,
            out=self.out,
            D=self.D,
            z=None,
            dt_bias=self.dt_bias,
            initial_states=None,
            dt_softplus=True,
            dt_limit=(0.0, float("inf")),
            state_dtype=torch.float32,
            final_states_out=self.states,
            final_state_indices=self.state_idx,
        )


def input_sets(d: dict[str, int], tokens: int, seqs: int, gen: Any) -> list[Inputs]:
    """Enough input sets that one rotation is >= 256 MiB (L2: 60 MB)."""
    per_token = d["heads"] * (4 * d["headdim"] + 2) + 4 * d["groups"] * d["dstate"]
    nsets = max(1, min(8, math.ceil((256 << 20) / (tokens * per_token))))
    return [Inputs(d, tokens, seqs, gen) for _ in range(nsets)]


def rel_err(a: Any, b: Any) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def fp64_reference(s: Inputs) -> tuple[Any, Any]:
    """Outputs and final states of s by the float64 recurrence, one token at a
    time on the GPU: h = exp(dt A) h + dt x B^T, y = h C (+ D x)."""
    import torch
    import torch.nn.functional as F

    f64 = torch.float64
    x, A, B, C = (t.to(f64) for t in (s.x, s.A, s.B, s.C))
    dt = s.dt.to(f64) + s.dt_bias.to(f64)
    dt = torch.where(dt <= 20.0, F.softplus(dt), dt)
    T, H, P = x.shape
    G, N = B.shape[1:]
    Bh = B.repeat_interleave(H // G, dim=1)
    Ch = C.repeat_interleave(H // G, dim=1)
    y = torch.empty(T, H, P, dtype=f64, device=x.device)
    finals, start = [], 0
    for n in s.lens:
        h = torch.zeros(H, P, N, dtype=f64, device=x.device)
        for t in range(start, start + n):
            h = torch.exp(dt[t] * A)[:, None, None] * h + (
                dt[t][:, None, None] * x[t][:, :, None] * Bh[t][:, None]
            )
            y[t] = (h * Ch[t][:, None]).sum(-1)
        start += n
        finals.append(h)
    if s.D is not None:
        y = y + x * s.D.to(f64)[None, :, None]
    return y, torch.stack(finals)


def accuracy(
    d: dict[str, int], tokens: int, seqs: int, gen: Any, fns: dict[str, Any]
) -> dict[str, float]:
    """Each function's relative error against the float64 reference on
    scan-dominated inputs of these dims and sequences: {NAME_err_fp64,
    NAME_state_err_fp64}."""
    s = Inputs(d, tokens, seqs, gen, scan_dominated=True)
    ref_y, ref_final = fp64_reference(s)
    out: dict[str, float] = {}
    for name, fn in fns.items():
        s.out.fill_(float("nan"))
        s.states.fill_(float("nan"))
        s.run(fn)
        out[f"{name}_err_fp64"] = rel_err(s.out, ref_y)
        out[f"{name}_state_err_fp64"] = rel_err(s.states, ref_final)
    return out


def reference(s: Inputs, fn: Callable[..., Any]) -> tuple[Any, Any]:
    """fn's output and final states on s (copies)."""
    s.run(fn)
    return s.out.clone(), s.states.clone()


def checked_run(s: Inputs, fn: Callable[..., Any], ref: tuple[Any, Any]) -> dict[str, Any]:
    """fn run on s with its outputs NaN-prefilled: its relative errors against
    ref (``reference``) and the elements it left unwritten."""
    s.out.fill_(float("nan"))
    s.states.fill_(float("nan"))
    s.run(fn)
    return {
        "out_rel_err": rel_err(s.out, ref[0]),
        "state_rel_err": rel_err(s.states, ref[1]),
        "nan_outputs": int(s.out.isnan().sum()) + int(s.states.isnan().sum()),
    }


def ab_main(
    args: argparse.Namespace,
    cases: list[tuple[str, int, int]],
    fused_fn: Callable[..., Any],
    variants: list[tuple[str, Callable[..., Any]]],
    timer: Any,
    gen: Any,
    reps: int,
) -> int:
    """A/B mode: every variant against the committed fused kernel, their
    samples interleaved (``Timer.paired_median_ms``) on the same inputs."""
    import torch

    rows = []
    for dims, tokens, seqs in cases:
        sets = input_sets(DIMS[dims], tokens, seqs, gen)
        ref = reference(sets[0], fused_fn)
        checks = [checked_run(sets[0], fn, ref) for _, fn in variants]
        fns = [rotating(sets, fused_fn)] + [rotating(sets, fn) for _, fn in variants]
        base_ms, *var_ms = timer.paired_median_ms(fns, reps=reps)
        for (name, _), check, ms in zip(variants, checks, var_ms):
            case = {"dims": dims, "tokens": tokens, "seqs": seqs, "variant": name}
            rows.append(
                common.make_row(
                    case,
                    "tok_per_s",
                    tokens / (base_ms * 1e-3),
                    tokens / (ms * 1e-3),
                    base_ms,
                    ms,
                    **check,
                )
            )
            print(
                f"  {dims} {tokens:7d} tok x {seqs} seq: {name} {base_ms / ms:.3f}x "
                f"({ms:.4f} against {base_ms:.4f} ms), unwritten {check['nan_outputs']}"
            )
        del sets
        torch.cuda.empty_cache()
    result = common.make_result(
        BENCH_AB,
        rows,
        timing=timer.method,
        stack_kernel=f"{FUSED_MODULE}.{FUSED_NAME}",
        legend="`baseline` is the committed fused kernel, `value` the variant; ratio = "
        "value / baseline, higher is better; times are medians of interleaved samples.",
        notes={
            "variants": ", ".join(args.variant),
            "checks": "out_rel_err / state_rel_err: the variant's outputs / final states "
            "against the committed kernel's (relative L2); nan_outputs: elements the "
            "variant left unwritten (NaN-prefilled)",
            "inputs": "as bench ssd_prefill: bf16 x/dt/B/C, fp32 A/D/dt_bias, dt softplus, "
            "no z, no initial states, fp32 final states written to a cache",
        },
    )
    common.finish(result, args)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_output_args(parser)
    parser.add_argument(
        "--dims", nargs="*", choices=list(DIMS), help="default: all (not with --cases)"
    )
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument(
        "--split-max-tokens",
        type=int,
        default=4096,
        help="host / GPU time split for cases up to this many tokens (0: none)",
    )
    parser.add_argument(
        "--accuracy-tokens",
        type=int,
        default=2048,
        help="tokens of each row's accuracy inputs (at most the row's; 0: none)",
    )
    parser.add_argument(
        "--cases",
        action="extend",
        type=parse_cases,
        metavar="DIMS:TOKENS:SEQS[,...]",
        help="only these cases, comma-separated or repeated (default: every dims x "
        "tokens x sequences)",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="A/B mode: time this modified copy of ssd_fused_sm90.py or ssd_fused.py "
        "against the committed fused kernel (repeatable)",
    )
    args = parser.parse_args(argv)
    if args.cases and args.dims is not None:
        parser.error("--cases names its dims: give --cases or --dims, not both")
    import torch
    from vllm.model_executor.layers.mamba.ops.ssd_combined import (
        mamba_chunk_scan_combined_varlen as baseline_fn,
    )

    if not torch.cuda.is_available():
        raise SystemExit(f"{BENCH}: needs a CUDA device")
    fused_fn, why_not = load_fused()
    print(
        f"stack kernel {FUSED_MODULE}.{FUSED_NAME}: "
        f"{'importable' if fused_fn else 'not importable (' + why_not + ')'}"
    )
    reps = 5 if args.quick else args.reps
    timer = common.Timer()
    gen = torch.Generator(device="cuda").manual_seed(4321)
    rows = []
    cases = args.cases or default_cases(args.dims or list(DIMS), args.quick)
    if args.variant:
        if fused_fn is None:
            raise SystemExit(f"{BENCH_AB}: the committed fused kernel is not importable")
        variants = [load_variant(v) for v in args.variant]
        if len({n for n, _ in variants}) < len(variants):
            raise SystemExit(f"{BENCH_AB}: two variants share a name")
        return ab_main(args, cases, fused_fn, variants, timer, gen, reps)
    for dims, tokens, seqs in cases:
        d = DIMS[dims]
        sets = input_sets(d, tokens, seqs, gen)
        extra: dict[str, Any] = {}

        if fused_fn is None:
            base_ms = val_ms = timer.median_ms(rotating(sets, baseline_fn), reps=reps)
        else:
            s0 = sets[0]
            check = checked_run(s0, fused_fn, reference(s0, baseline_fn))
            extra["out_rel_err"] = check["out_rel_err"]
            extra["state_rel_err"] = check["state_rel_err"]
            base_ms, val_ms = timer.paired_median_ms(
                [rotating(sets, baseline_fn), rotating(sets, fused_fn)], reps=reps
            )
            form = kernel_form(s0)
            if form is not None:
                extra["value_kernel"] = form
            others: dict[str, Any] = {}
            if form in ("sm90-runs", "sm90-ws"):
                others["triton"] = form_fn(sm90_config=None)
            if form == "sm90-ws":
                sm90 = _sm90_module()
                others["sm90_runs"] = form_fn(sm90_config=sm90.LaunchConfig(warp_specialize=False))
            for name, fn in others.items():
                extra[f"{name}_ms"] = timer.median_ms(rotating(sets, fn), reps=reps)
                extra[f"{name}_graph_ms"] = timer.graph_ms(functools.partial(sets[0].run, fn))
            if args.accuracy_tokens > 0:
                extra.update(
                    accuracy(
                        d,
                        min(tokens, args.accuracy_tokens),
                        seqs,
                        gen,
                        {"baseline": baseline_fn, "value": fused_fn},
                    )
                )
        for side, fn in (("baseline", baseline_fn), ("value", fused_fn)):
            if fn is not None:
                call = functools.partial(sets[0].run, fn)
                extra[f"{side}_graph_ms"] = timer.graph_ms(call)
                if tokens <= args.split_max_tokens:
                    extra[f"{side}_host_ms"] = timer.host_ms(call)
        if fused_fn is not None:
            extra["gpu_ratio"] = extra["baseline_graph_ms"] / extra["value_graph_ms"]
            bound = [
                side
                for side in ("baseline", "value")
                if extra.get(f"{side}_host_ms", 0.0) > extra[f"{side}_graph_ms"]
            ]
            extra["host_bound"] = "+".join(bound) or "none"
        base_tps = tokens / (base_ms * 1e-3)
        val_tps = tokens / (val_ms * 1e-3)
        fpt = flops_per_token(d)
        rows.append(
            common.make_row(
                {"dims": dims, "tokens": tokens, "seqs": seqs},
                "tok_per_s",
                base_tps,
                val_tps,
                base_ms,
                val_ms,
                baseline_tflops=base_tps * fpt / 1e12,
                value_tflops=val_tps * fpt / 1e12,
                **extra,
            )
        )
        print(
            f"  {dims} {tokens:7d} tok x {seqs} seq: baseline "
            f"{base_tps / 1e6:6.2f}M tok/s, value {val_tps / 1e6:6.2f}M tok/s"
        )
        common.write_partial(common.make_result(BENCH, rows), args)
        del sets
        torch.cuda.empty_cache()
    result = common.make_result(
        BENCH,
        rows,
        timing=timer.method,
        stack_kernel=f"{FUSED_MODULE}.{FUSED_NAME}" if fused_fn else None,
        # the series entries whose kernels the table measures (their PR bodies quote it)
        entries=["mamba2-ssd-fused-prefill", "mamba2-ssd-fused-prefill-sm90"],
        notes={
            "value": "the stack's fused kernel"
            if fused_fn
            else f"stack kernel not importable ({why_not}): value == baseline",
            "tflops": "estimated: 2LNG + 2LPH + 4NPH flop per token",
            "kernel": "value_kernel: form of the fused kernel measured (sm90-runs = "
            "Gluon Hopper run kernel on one warpgroup, sm90-ws = run kernel on three "
            "warp-specialized warpgroups, triton = portable kernel); triton_ms / "
            "triton_graph_ms: the portable form on the same inputs, same process "
            "(wall / GPU time); sm90_runs_ms / sm90_runs_graph_ms: the "
            "one-warpgroup run kernel (where sm90-ws ran)",
            "inputs": "timing: bf16 x/dt/B/C (B, C scaled by 1/sqrt(N)), fp32 "
            "A/D/dt_bias, dt softplus, no z, no initial states, fp32 final states "
            "written to a cache; out_rel_err / state_rel_err: fused vs chain on "
            "them (the D*x skip term dominates the output there)",
            "accuracy": f"*_err_fp64 / *_state_err_fp64: each kernel's relative "
            f"error against a float64 recurrence on inputs of the row's dims and "
            f"sequences (at most {args.accuracy_tokens} tokens) with B, C unscaled "
            f"and no D, so the scan term carries the output",
            "timing": "ratio: back-to-back wall time per call (baseline_ms / "
            "value_ms); gpu_ratio: GPU time per call (*_graph_ms, CUDA-graph "
            "replay, one input set, so small cases run from L2); where ratio > "
            "gpu_ratio the difference is host launch overhead; host_bound: the "
            "side(s) whose host time per call exceeds their GPU time",
            "pairing": "baseline_ms and value_ms: their samples interleaved "
            "(bench/common.py Timer.paired_median_ms), so a slow phase of the "
            "shared host weighs on both; the other *_ms columns are timed after",
            "split": f"up to {args.split_max_tokens} tokens: *_host_ms = host time per "
            "call (300 calls issued without synchronizing); every row: *_graph_ms = "
            "GPU time per call (CUDA-graph replay of one call, one input set)",
        },
    )
    common.finish(result, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

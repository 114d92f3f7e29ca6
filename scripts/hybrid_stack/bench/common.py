# SPDX-License-Identifier: Apache-2.0
"""Shared helpers of the stack's GPU benchmarks: timing, device facts, results.

Every benchmark writes ONE JSON schema (``make_result``), defined exactly by
``SCHEMA`` / ``ROW_SCHEMA`` below and checked by ``validate``::

    {"bench": str, "gpu": str, "torch": str, "triton": str, "vllm_base": str,
     "command": str, "rows": [row, ...], ...optional keys of SCHEMA_OPTIONAL}

    row = {"case": {...}, "metric": str,   # e.g. "tok_per_s", "pct_of_d2d"
           "baseline": float,              # upstream kernel's value
           "value": float,                 # the stack's kernel (== baseline if none)
           "ratio": float,                 # value / baseline, higher is better
           "baseline_ms": float, "value_ms": float, ...extra per-row facts}

Committed runs live in ``results/<bench>-<gpu>.json`` with a markdown table beside
it (``results/<bench>-<gpu>.md``). This module imports nothing from vLLM, so it is
usable from the repository (``hybrid_stack.bench.common``) and from an unpacked
GPU bundle (``bench/common.py``, imported as ``common``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

# The one results schema: key -> allowed types (None: JSON null). A result has
# every key of SCHEMA, may have those of SCHEMA_OPTIONAL and nothing else, so a
# new top-level fact is added here first (or goes under "notes").
_NUM = (int, float)
SCHEMA: dict[str, tuple[type | None, ...]] = {
    "bench": (str,),  # benchmark name: results/<bench>-<gpu>.json (CPU: <bench>.json)
    "gpu": (str,),  # gpu_slug() of the device; "cpu" for CPU-only benchmarks
    "torch": (str,),
    "triton": (str, None),  # None: Triton not installed (CPU benchmarks)
    "vllm_base": (str,),
    "command": (str,),  # the command that regenerates the file
    "rows": (list,),  # non-empty list of rows (ROW_SCHEMA)
}
SCHEMA_OPTIONAL: dict[str, tuple[type | None, ...]] = {
    "gpu_name": (str,),
    "cuda": (str,),
    "created": (str,),  # UTC, ISO 8601
    "timing": (str,),  # how the *_ms were measured
    "legend": (str,),  # what baseline / value / ratio mean, when not LEGEND
    "stack_kernel": (str, None),  # the stack's kernel measured as value, if any
    "entry": (str,),  # series entry the result belongs to (pr-stack bodies)
    "entries": (list,),
    "notes": (dict, list),  # {name: text} (benchmarks) or [text] (e2e harness --note)
    "d2d_gbps": _NUM,  # state_copy: the device-to-device copy it is a % of
    "d2d_ms": _NUM,
    "settings": (dict,),  # e2e: engine settings
    "failures": (list,),  # e2e: engines that failed
    "compiled_ops_called": (dict,),  # e2e: model -> {op: calls}
    "shared_gpu": (list,),  # e2e: models whose engine shared the GPU
}
ROW_SCHEMA: dict[str, tuple[type | None, ...]] = {
    "case": (dict,),
    "metric": (str,),
    # null: nothing to measure (hitrate: the mode cannot hold one request in the
    # budget; ratio: baseline 0)
    "baseline": (*_NUM, None),
    "value": (*_NUM, None),
    "ratio": (*_NUM, None),
}
# Kernel benchmarks carry their median times; CPU simulations (gpu "cpu", e.g.
# the prefix-cache hit-rate benchmark) time nothing. Other row keys are free.
ROW_TIMED: dict[str, tuple[type | None, ...]] = {"baseline_ms": _NUM, "value_ms": _NUM}
SCHEMA_KEYS = tuple(SCHEMA)
ROW_KEYS = (*ROW_SCHEMA, *ROW_TIMED)
# Set by the bundle runner so a result names the command a person typed.
COMMAND_ENV = "HYBRID_STACK_BENCH_COMMAND"
L2_FLUSH_BYTES = 256 << 20


def gpu_slug(name: str) -> str:
    """'NVIDIA H200' -> 'h200'; used in result file names."""
    words = [w for w in name.lower().replace("_", " ").split() if w != "nvidia"]
    slug = "-".join(words) or "gpu"
    return "".join(c for c in slug if c.isalnum() or c in "-.")


def versions() -> dict[str, str]:
    """torch / triton / vLLM versions, and the GPU name (CUDA required)."""
    import torch
    import triton

    try:
        vllm_base = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        vllm_base = "unknown"
    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": gpu_slug(props.name),
        "gpu_name": props.name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "vllm_base": os.environ.get("HYBRID_STACK_VLLM_BASE", vllm_base),
        "cuda": str(torch.version.cuda),
        "sm_count": str(props.multi_processor_count),
    }


def command_line() -> str:
    return os.environ.get(COMMAND_ENV) or shlex.join([sys.executable, *sys.argv])


class Timer:
    """Median CUDA-event time of one ``fn(i)`` call, measured back-to-back.

    Each of ``reps`` samples flushes the L2 (a 256 MiB memset, outside the timed
    window), then times ``inner`` back-to-back calls between two CUDA events and
    divides by ``inner``; ``inner`` is chosen so a sample lasts at least
    ``min_sample_ms``, so the host's launch latency is hidden the way it is in a
    forward pass. ``fn`` receives a running call index so callers rotate among
    input sets larger than the L2 together.
    """

    METHOD = (
        "CUDA events; median of samples, each sample = back-to-back calls lasting "
        ">= {ms} ms over rotating input sets, L2 flushed (256 MiB memset) before "
        "each sample"
    )

    def __init__(self, min_sample_ms: float = 5.0, max_inner: int = 64) -> None:
        import torch

        self.torch = torch
        self.min_sample_ms = min_sample_ms
        self.max_inner = max_inner
        self.flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")

    @property
    def method(self) -> str:
        return self.METHOD.format(ms=self.min_sample_ms)

    def median_ms(self, fn: Callable[[int], Any], *, warmup: int = 3, reps: int = 20) -> float:
        return self.paired_median_ms([fn], warmup=warmup, reps=reps)[0]

    def paired_median_ms(
        self, fns: Sequence[Callable[[int], Any]], *, warmup: int = 3, reps: int = 20
    ) -> list[float]:
        """``median_ms`` of each of ``fns``, their samples interleaved: round r
        takes one sample of every function, starting with function r mod n,
        so a slow phase of the host or the GPU (1k-token calls are bound by
        host launch cost, which moves by up to 2x for seconds on a shared
        host) falls on all of them alike and their ratio stays stable."""
        torch = self.torch
        n = len(fns)
        inner = [self._inner_calls(fn, warmup) for fn in fns]
        k = [warmup + 1] * n
        events = [
            [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                for _ in range(reps)
            ]
            for _ in fns
        ]
        for r in range(reps):
            for j in range(n):
                f = (r + j) % n
                self.flush.zero_()
                start, end = events[f][r]
                start.record()
                for _ in range(inner[f]):
                    fns[f](k[f])
                    k[f] += 1
                end.record()
        torch.cuda.synchronize()
        return [
            statistics.median(s.elapsed_time(e) / inner[f] for s, e in events[f]) for f in range(n)
        ]

    def _inner_calls(self, fn: Callable[[int], Any], warmup: int) -> int:
        """Warm fn up (calls 0 .. warmup - 1), time call ``warmup`` and return
        how many back-to-back calls make a sample of min_sample_ms (at most
        max_inner)."""
        torch = self.torch
        for i in range(warmup):
            fn(i)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(warmup)
        torch.cuda.synchronize()
        est_ms = (time.perf_counter() - t0) * 1e3
        return max(1, min(self.max_inner, math.ceil(self.min_sample_ms / max(est_ms, 1e-3))))

    def graph_ms(self, fn: Callable[[], Any], *, replays: int = 100) -> float:
        """GPU time of one ``fn()`` call with no host launch cost: the call is
        captured once in a CUDA graph (after warm-up on a side stream) and the
        graph replayed ``replays`` times between two CUDA events. One input
        set, so small cases run from L2."""
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / replays

    def host_ms(self, fn: Callable[[], Any], *, calls: int = 300) -> float:
        """Host time of one ``fn()`` call: ``calls`` calls issued without
        synchronizing, wall clock over ``calls``. Meaningful while the GPU
        drains the launches faster than the host issues them (small cases)."""
        torch = self.torch
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - t0
        torch.cuda.synchronize()
        return elapsed * 1e3 / calls


def make_row(
    case: dict[str, Any],
    metric: str,
    baseline: float,
    value: float,
    baseline_ms: float,
    value_ms: float,
    **extra: Any,
) -> dict[str, Any]:
    ratio = value / baseline if baseline else math.nan
    row: dict[str, Any] = {
        "case": case,
        "metric": metric,
        "baseline": baseline,
        "value": value,
        "ratio": ratio,
        "baseline_ms": baseline_ms,
        "value_ms": value_ms,
    }
    row.update(extra)
    return row


def make_result(bench: str, rows: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    v = versions()
    result: dict[str, Any] = {
        "bench": bench,
        "gpu": v["gpu"],
        "torch": v["torch"],
        "triton": v["triton"],
        "vllm_base": v["vllm_base"],
        "command": command_line(),
        "rows": rows,
        "gpu_name": v["gpu_name"],
        "cuda": v["cuda"],
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    result.update(extra)
    return result


def _type_problem(field: str, value: Any, types: tuple[type | None, ...]) -> str | None:
    if value is None and None in types:
        return None
    real = [ty for ty in types if ty is not None]
    if isinstance(value, bool) and bool not in real:  # JSON true is not a number
        real = []
    if isinstance(value, tuple(real)):
        return None
    names = " or ".join("null" if ty is None else ty.__name__ for ty in types)
    return f"field '{field}': expected {names}, got {type(value).__name__}"


def validate(result: Any) -> list[str]:
    """Schema problems of a result, each naming its field (empty when it conforms)."""
    if not isinstance(result, dict):
        return [f"top level: expected an object, got {type(result).__name__}"]
    problems = [f"field '{k}': missing" for k in SCHEMA if k not in result]
    for key, value in result.items():
        types = SCHEMA.get(key, SCHEMA_OPTIONAL.get(key))
        if types is None:
            problems.append(
                f"field '{key}': not in the schema "
                "(add it to SCHEMA_OPTIONAL or put it under 'notes')"
            )
        elif (p := _type_problem(key, value, types)) is not None:
            problems.append(p)
    rows = result.get("rows")
    if isinstance(rows, list) and not rows:
        problems.append("field 'rows': empty")
    row_schema = dict(ROW_SCHEMA)
    if result.get("gpu") != "cpu":
        row_schema.update(ROW_TIMED)
    for i, row in enumerate(rows if isinstance(rows, list) else []):
        if not isinstance(row, dict):
            problems.append(f"field 'rows[{i}]': expected dict, got {type(row).__name__}")
            continue
        for key, types in row_schema.items():
            if key not in row:
                problems.append(f"field 'rows[{i}].{key}': missing")
            elif (p := _type_problem(f"rows[{i}].{key}", row[key], types)) is not None:
                problems.append(p)
    return problems


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        if abs(x) >= 1e6:
            return f"{x / 1e6:.2f}M"
        if abs(x) >= 100:
            return f"{x:.0f}"
        return f"{x:.3g}" if abs(x) < 10 else f"{x:.1f}"
    return str(x)


def table_lines(result: dict[str, Any], markdown: bool = False) -> list[str]:
    rows = result["rows"]
    case_keys: list[str] = []
    for r in rows:
        case_keys += [k for k in r["case"] if k not in case_keys]
    extra_keys: list[str] = []
    for r in rows:
        extra_keys += [k for k in r if k not in ROW_KEYS and k not in extra_keys and k != "case"]
    head = [*case_keys, "metric", "baseline", "value", "ratio", "baseline_ms"]
    head += ["value_ms", *extra_keys]
    body = [
        [_fmt(r["case"].get(k, "")) for k in case_keys]
        + [_fmt(r.get(k, "")) for k in head[len(case_keys) :]]
        for r in rows
    ]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return lines + ["| " + " | ".join(b) + " |" for b in body]
    widths = [max([len(h), *(len(b[i]) for b in body)]) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return [fmt.format(*head)] + [fmt.format(*b) for b in body]


LEGEND = (
    "`baseline` is the upstream kernel, `value` the stack's (equal to the baseline "
    "where the stack carries none); ratio = value / baseline, higher is better; "
    "times are medians."
)


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# {result['bench']} on {result.get('gpu_name', result['gpu'])}",
        "",
        f"- command: `{result['command']}`",
        f"- vLLM base {result['vllm_base']}, torch {result['torch']}, "
        f"triton {result['triton']}, CUDA {result.get('cuda', '?')}",
        f"- created {result.get('created', '?')}",
    ]
    skip = {*SCHEMA_KEYS, "notes", "gpu_name", "cuda", "created", "legend"}
    lines += [
        f"- {k}: {_fmt(v)}"
        for k, v in result.items()
        if k not in skip and isinstance(v, (str, int, float)) and not isinstance(v, bool)
    ]
    lines += [f"- {k}: {v}" for k, v in result.get("notes", {}).items()]
    lines += [
        "",
        result.get("legend", LEGEND),
        "",
        *table_lines(result, markdown=True),
        "",
    ]
    return "\n".join(lines)


def add_output_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, help="write <out>/<bench>-<gpu>.json and .md here")
    parser.add_argument("--json", type=Path, help="write the JSON result here")
    parser.add_argument("--md", type=Path, help="write the markdown table here")
    parser.add_argument(
        "--quick", action="store_true", help="fewer cases and repetitions (smoke run)"
    )


def partial_path(result: dict[str, Any], args: argparse.Namespace) -> Path | None:
    return args.out / f"{result['bench']}-{result['gpu']}.partial.json" if args.out else None


def write_partial(result: dict[str, Any], args: argparse.Namespace) -> None:
    """The rows measured so far (``make_result`` of them), written after each
    row with ``--out``: a run stopped by a time limit keeps them. ``finish``
    removes the file."""
    path = partial_path(result, args)
    if path is None:
        return
    note = f"{len(result['rows'])} row(s): the run stopped before its last case"
    result = dict(result, notes={"partial": note})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(path)


def finish(result: dict[str, Any], args: argparse.Namespace) -> None:
    """Validate, print the table last, and write the requested files."""
    problems = validate(result)
    if problems:
        raise SystemExit(f"{result['bench']}: result breaks the schema: {problems}")
    partial = partial_path(result, args)
    if partial is not None:
        partial.unlink(missing_ok=True)
    stem = f"{result['bench']}-{result['gpu']}"
    targets: list[tuple[Path, str]] = []
    if args.out:
        targets += [(args.out / f"{stem}.json", "json"), (args.out / f"{stem}.md", "md")]
    if args.json:
        targets.append((args.json, "json"))
    if args.md:
        targets.append((args.md, "md"))
    for path, kind in targets:
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(result, indent=1) + "\n" if kind == "json" else markdown(result)
        path.write_text(text)
        print(f"wrote {path}")
    print()
    print(f"{result['bench']} on {result.get('gpu_name')} (vLLM {result['vllm_base']})")
    for line in table_lines(result):
        print(line)


def seq_lens(total: int, seqs: int) -> Sequence[int]:
    """Split ``total`` tokens into ``seqs`` near-equal sequence lengths."""
    base, rem = divmod(total, seqs)
    return [base + (1 if i < rem else 0) for i in range(seqs)]

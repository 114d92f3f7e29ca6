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

A table measured in parts (a device call's time limit stops a long benchmark;
``--cases`` / ``--dims`` run the rest in another call) is joined by ``merge``,
also run as ``python bench/common.py --merge --out DIR PART.json ...``: the rows
in the order given, each part's command and creation time kept under ``parts``.
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
    "parts": (list,),  # merge: [{command, created, rows, partial}] of the joined parts
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


def draft_k(case: dict[str, Any]) -> str:
    """An end-to-end row's draft tokens a step (its case's ``mtp_k``), naming
    the drafter where it is not MTP ("3 (ngram)")."""
    k, drafter = case["mtp_k"], case.get("drafter")
    return f"{k} ({drafter})" if drafter and k else str(k)


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
    for i, part in enumerate(result.get("parts", []), 1):
        stopped = " (stopped before its last case)" if part.get("partial") else ""
        lines.append(
            f"- part {i}: `{part.get('command', '?')}`, created {part.get('created', '?')}, "
            f"{part.get('rows', '?')} row(s){stopped}"
        )
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


# The note write_partial adds (merge drops it: the merged table is whole as far as it goes).
PARTIAL_NOTE = "partial"


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
    result = dict(result, notes={PARTIAL_NOTE: note})
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
    write_result(result, args)


def write_result(result: dict[str, Any], args: argparse.Namespace) -> None:
    """Write <out>/<bench>-<gpu>.json and .md (and --json / --md), then print
    the table last."""
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


# --- joining a table measured in parts ---------------------------------------------

# Keys merge makes itself. Every other key must agree among the parts that carry
# it: bench, gpu, torch, triton and vllm_base (every part has them; rows measured
# under other versions or on another GPU are not one table) and optional facts
# such as cuda, timing or stack_kernel (a .partial.json lacks the latter two).
MERGE_OWN = frozenset({"command", "rows", "created", "notes", "parts"})


class MergeError(ValueError):
    """The parts cannot be one table (the message lists every reason)."""


def _case_key(row: dict[str, Any]) -> str:
    return json.dumps(row.get("case"), sort_keys=True)


def _merge_notes(
    parts: Sequence[dict[str, Any]], names: Sequence[str], problems: list[str]
) -> dict[str, Any] | list[Any] | None:
    """The parts' notes joined: {name: text} dicts (a name given twice must
    carry the same text) or [text] lists (e2e; concatenated, repeats once);
    write_partial's note is dropped."""
    found = [(n, p["notes"]) for n, p in zip(names, parts) if "notes" in p]
    if not found:
        return None
    if all(isinstance(v, list) for _, v in found):
        joined: list[Any] = []
        for _, v in found:
            joined += [t for t in v if t not in joined]
        return joined
    if not all(isinstance(v, dict) for _, v in found):
        problems.append("notes: some parts hold a dict, others a list")
        return None
    merged: dict[str, Any] = {}
    first: dict[str, str] = {}
    for name, notes in found:
        for key, text in notes.items():
            if key == PARTIAL_NOTE:
                continue
            if key in merged and merged[key] != text:
                problems.append(f"notes['{key}']: {first[key]} and {name} differ")
            elif key not in merged:
                merged[key], first[key] = text, name
    return merged


def merge(
    parts: Sequence[dict[str, Any]],
    names: Sequence[str] | None = None,
    merge_command: str | None = None,
) -> dict[str, Any]:
    """One result of ``parts`` (results of one benchmark, e.g. a run's
    ``.partial.json`` and a ``--cases`` run of the rest): their rows in the
    order given. ``names`` label the parts in errors (default: part 1, 2, ...).

    Refused with one MergeError naming every problem: a part that fails
    ``validate``, parts that differ in bench, gpu, torch, triton, vllm_base or
    another key they both carry (MERGE_OWN aside), or a case measured twice.
    ``command`` is the parts' commands joined with ``&&``, then
    ``merge_command`` (the merge itself) when given; ``parts`` keeps each
    part's command, creation time, row count and whether it stopped early;
    ``created`` is the newest part's, so merging the same parts gives the
    same file."""
    names = list(names) if names is not None else [f"part {i}" for i in range(1, len(parts) + 1)]
    if not parts:
        raise MergeError("merge: no parts given")
    problems: list[str] = []
    for name, part in zip(names, parts):
        if bad := validate(part):
            problems.append(f"{name} breaks the schema: {'; '.join(bad)}")
    if problems:  # the checks below read the schema's keys
        raise MergeError("merge refused: " + " | ".join(problems))
    keys: list[str] = []
    for part in parts:
        keys += [k for k in part if k not in keys and k not in MERGE_OWN]
    for key in keys:
        have = [(n, p[key]) for n, p in zip(names, parts) if key in p]
        if any(v != have[0][1] for _, v in have[1:]):
            values = ", ".join(f"{n}: {json.dumps(v)}" for n, v in have)
            problems.append(f"parts differ in '{key}' ({values})")
    seen: dict[str, str] = {}
    rows: list[dict[str, Any]] = []
    for name, part in zip(names, parts):
        for row in part["rows"]:
            key = _case_key(row)
            if key in seen:
                problems.append(f"case {key} measured twice ({seen[key]} and {name})")
            seen.setdefault(key, name)
            rows.append(row)
    notes = _merge_notes(parts, names, problems)
    if problems:
        raise MergeError("merge refused: " + " | ".join(problems))
    result: dict[str, Any] = {}
    for part in parts:  # key order: the first part's, then keys only later parts have
        result.update({k: v for k, v in part.items() if k not in MERGE_OWN and k not in result})
    commands = [p["command"] for p in parts] + ([merge_command] if merge_command else [])
    result["command"] = " && ".join(commands)
    result["rows"] = rows
    created = [p["created"] for p in parts if "created" in p]
    if created:
        result["created"] = max(created)
    if notes:
        result["notes"] = notes
    flat: list[dict[str, Any]] = []
    for part in parts:  # a merged part contributes its own parts
        flat += part.get("parts") or [
            {
                "command": part["command"],
                "created": part.get("created", "?"),
                "rows": len(part["rows"]),
                "partial": PARTIAL_NOTE in (part.get("notes") or {}),
            }
        ]
    result["parts"] = flat
    order = [*SCHEMA_KEYS, *(k for k in result if k not in SCHEMA)]
    return {k: result[k] for k in order}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Join results of one benchmark measured in parts into one table."
    )
    parser.add_argument(
        "--merge", action="store_true", required=True, help="join the PART files (the one mode)"
    )
    parser.add_argument(
        "parts", nargs="+", type=Path, metavar="PART", help="<bench>-<gpu>[.partial].json files"
    )
    parser.add_argument("--out", type=Path, help="write <out>/<bench>-<gpu>.json and .md here")
    parser.add_argument("--json", type=Path, help="write the JSON result here")
    parser.add_argument("--md", type=Path, help="write the markdown table here")
    args = parser.parse_args(argv)
    # the merge as typed; called with argv from code, in the form the bundle runs it
    typed = command_line() if argv is None else shlex.join(["python3", "bench/common.py", *argv])
    if not (args.out or args.json or args.md):
        parser.error("give --out, --json or --md")
    loaded = []
    for path in args.parts:
        try:
            loaded.append(json.loads(path.read_text()))
        except (OSError, ValueError) as e:
            print(f"merge refused: {path}: {e}", file=sys.stderr)
            return 2
    try:
        result = merge(loaded, [str(p) for p in args.parts], typed)
    except MergeError as e:
        print(e, file=sys.stderr)
        return 2
    write_result(result, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

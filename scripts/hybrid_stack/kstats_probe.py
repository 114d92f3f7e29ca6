# SPDX-License-Identifier: Apache-2.0
"""Compile the stack's Triton kernels for a GPU architecture on a CPU box.

Run by ``hybrid-stack kernel-stats`` with the build venv's Python, in the
applied tree (it imports vllm and triton; the module itself imports neither at
load time, so the tooling tests can import its parser).

A case calls the stack's real launcher with tensors on the ``meta`` device and
a spy in place of the kernel: the spy records what the launcher would launch
(arguments, constexprs, warps, stages), and the probe compiles exactly that
with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))``.
Triton's own ptxas then reports registers, spill bytes and stack per thread
(``ptxas -v``); shared memory comes from the compiled metadata. Nothing runs.

Gluon kernels (Triton's experimental lower-level language) are compiled the
same way through ``GluonASTSource``; their TMA descriptor arguments are typed
with Triton's own launch-time mangling. A group of cases whose kernel does
not exist in the running Triton (the stack's sm_90 form is written for one
Triton release) is reported as skipped, with the reason, never dropped.

Integer arguments are given Triton's launch-time specialisation: divisibility
by 16 where the value has it, pointers 16-byte aligned (what the launcher's
tensors are). Without that the pipeliner cannot use async copies and the
shared-memory numbers differ from a GPU build.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Largest dynamic shared memory one CTA may use, bytes (CUDA programming
# guide, "Technical Specifications per Compute Capability"). A kernel that
# needs more compiles but cannot launch there.
SMEM_LIMIT = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448,
              120: 101376}  # fmt: skip

_PTXAS_STACK = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
# ptxas falls back to issuing a function's wgmma one at a time, each waited
# for, where it cannot prove an asynchronous pipeline safe (an accumulator
# read or moved while its wgmma may be in flight, too few registers): the
# kernel still runs, correctly and much slower (a serialized variant of the
# fused SSD kernel's sm_90 form measured 0.73-0.79x of the committed kernel,
# patches/mamba2-ssd-fused-prefill.notes.md), so the probe fails such a case unless
# the entry's WGMMA_SERIAL_OK names it, with the reason.
_PTXAS_WGMMA = re.compile(
    r"\((C75\d\d)\) Potential Performance Loss: wgmma\.mma_async instructions"
    r" are serialized due to (.+?) (?:in|for) the function"
)


def parse_ptxas(text: str) -> dict[str, Any]:
    """Registers, spill bytes and stack frame of the one function in the
    output of ``ptxas -v`` (a ValueError if either line is missing), and why
    ptxas serialized its wgmma instructions, if it did ("C75xx: reason";
    an empty list where it did not)."""
    regs = _PTXAS_REGS.findall(text)
    stack = _PTXAS_STACK.findall(text)
    if len(regs) != 1 or len(stack) != 1:
        raise ValueError(
            f"ptxas -v output has {len(regs)} register and {len(stack)} stack-frame "
            "lines, expected one of each"
        )
    frame, st, ld = (int(v) for v in stack[0])
    serialized = [f"{code}: {' '.join(why.split())}" for code, why in _PTXAS_WGMMA.findall(text)]
    return {"regs": int(regs[0]), "spill_store_bytes": st, "spill_load_bytes": ld,
            "stack_bytes": frame, "wgmma_serialized": serialized}  # fmt: skip


class CasesSkipped(Exception):
    """A case group cannot be compiled here (reason in the message)."""


class _Spy:
    """Stands in for a @triton.jit kernel: ``spy[grid](*args, **kwargs)``
    records the launch instead of running it."""

    def __init__(self) -> None:
        self.launches: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.launches.append((args, kwargs))

        return launch


def _capture(module: Any, kernel_name: str, call: Callable[[], Any]) -> tuple[Any, tuple, dict]:
    """Run ``call()`` (a launcher) with ``module.<kernel_name>`` replaced by a
    _Spy; the real kernel and the one launch's (args, kwargs)."""
    spy = _Spy()
    real = getattr(module, kernel_name)
    setattr(module, kernel_name, spy)
    try:
        call()
    finally:
        setattr(module, kernel_name, real)
    ((args, kwargs),) = spy.launches
    return real, args, kwargs


_TORCH_TO_TRITON = {
    "torch.bfloat16": "bf16",
    "torch.float16": "fp16",
    "torch.float32": "fp32",
    "torch.int32": "i32",
    "torch.int64": "i64",
}


def _signature(kernel: Any, args: tuple, kwargs: dict) -> tuple[dict, dict, dict, dict]:
    """(signature, constexprs, attrs, options) for ASTSource from one recorded
    launch."""
    import torch

    names = [p.name for p in kernel.params]
    values = dict(zip(names, args))
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in kwargs}
    values.update(kwargs)
    sig: dict[str, str] = {}
    constexprs: dict[tuple[int, ...], Any] = {}
    attrs: dict[tuple[int, ...], list] = {}
    for i, p in enumerate(kernel.params):
        v = values.get(p.name, p.default)
        annotation = str(getattr(p, "annotation", "") or "")
        if p.is_constexpr or v is None:
            sig[p.name] = "constexpr"
            constexprs[(i,)] = v
        elif any(t.__name__ == "TensorDescriptor" for t in type(v).__mro__):
            from triton.runtime.jit import mangle_type

            sig[p.name] = mangle_type(v)
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + _TORCH_TO_TRITON[str(v.dtype)]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            wide = "int64" in annotation or not -(2**31) <= v < 2**31
            sig[p.name] = "i64" if wide else "i32"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        else:
            raise TypeError(f"argument {p.name}: cannot type {type(v).__name__}")
    return sig, constexprs, attrs, options


def compile_launch(kernel: Any, args: tuple, kwargs: dict, arch: int) -> dict[str, Any]:
    """Compile one recorded launch for sm_<arch>; its resource usage."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, constexprs, attrs, options = _signature(kernel, args, dict(kwargs))
    source = ASTSource
    if getattr(kernel, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource

        source = GluonASTSource
    src = source(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    t0 = time.monotonic()
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    suffix = "a" if arch >= 90 else ""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(compiled.asm["ptx"])
        ptx.flush()
        out = subprocess.run(
            [str(ptxas), f"-arch=sm_{arch}{suffix}", "-v", ptx.name, "-o", "/dev/null"],
            capture_output=True,
            text=True,
            check=True,
        )
    usage = parse_ptxas(out.stdout + out.stderr)
    usage["smem_bytes"] = int(compiled.metadata.shared)
    usage["num_warps"] = int(compiled.metadata.num_warps)
    usage["num_stages"] = int(compiled.metadata.num_stages)
    usage["compile_s"] = round(time.monotonic() - t0, 1)
    limit = SMEM_LIMIT.get(arch)
    if limit is not None and usage["smem_bytes"] > limit:
        raise RuntimeError(
            f"needs {usage['smem_bytes']} bytes of shared memory per program; "
            f"sm_{arch} allows {limit}: it would not launch there"
        )
    return usage


# ---------------------------------------------------------------------------
# Cases are declared by the entries: an entry's ``kernel_cases`` (series.toml)
# names a Python file of the stack defining
#   GROUPS: a tuple of case groups; a group is called with the target arch
#           and yields (case name, kernel, launch args, launch kwargs), or
#           raises CasesSkipped (its docstring's first words name it);
#   WGMMA_SERIAL_OK (optional): case name -> why ptxas serializing its wgmma
#           is accepted there.
# The file imports its helpers from this module as ``kstats_probe``
# (``capture``, ``CasesSkipped``).
# ---------------------------------------------------------------------------

capture = _capture


def load_cases(path: Path) -> tuple[tuple[Callable[[int], Any], ...], dict[str, str]]:
    """(GROUPS, WGMMA_SERIAL_OK) of one entry's case file."""
    import importlib.util

    # the case file's `import kstats_probe` must find this very module (run as
    # a script it is __main__), so that CasesSkipped is one class
    sys.modules.setdefault("kstats_probe", sys.modules[__name__])
    spec = importlib.util.spec_from_file_location(f"kernel_cases_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load kernel cases from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    groups = tuple(getattr(module, "GROUPS", ()))
    if not groups:
        raise SystemExit(f"{path} defines no GROUPS of kernel cases")
    return groups, dict(getattr(module, "WGMMA_SERIAL_OK", {}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument(
        "--cases",
        action="append",
        default=[],
        metavar="ENTRY=FILE",
        help="an entry and its file of kernel cases (repeatable)",
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    import triton

    if not args.cases or not all("=" in c for c in args.cases):
        print("give each entry's kernel cases as --cases ENTRY=FILE")
        return 2
    cases: dict[str, tuple[Callable[[int], Any], ...]] = {}
    serial_ok: dict[str, str] = {}
    for item in args.cases:
        entry, _, file = item.partition("=")
        cases[entry], ok = load_cases(Path(file))
        serial_ok.update(ok)
    rows: list[dict[str, Any]] = []
    failed = 0
    head = f"{'entry: case':60} {'regs':>4} {'spill st/ld':>11} {'smem':>7} {'warps':>5} {'s':>5}"
    print(f"sm_{args.arch}, triton {triton.__version__} (compiled on the CPU, nothing run)")
    print(head)
    skipped = 0
    for entry, groups in cases.items():
        for group in groups:
            try:
                cases = list(group(args.arch))
            except CasesSkipped as e:
                skipped += 1
                label = f"{entry}: {(group.__doc__ or group.__name__).split(' (')[0]}"
                print(f"{label[:60]:60} skipped: {e}")
                rows.append({"entry": entry, "group": group.__name__, "skipped": str(e)})
                continue
            for name, kernel, kargs, kkwargs in cases:
                label = f"{entry}: {name}"
                try:
                    usage = compile_launch(kernel, kargs, kkwargs, args.arch)
                    serial = "; ".join(usage["wgmma_serialized"])
                    if serial and name not in serial_ok:
                        raise RuntimeError(f"ptxas serializes its wgmma ({serial})")
                except Exception as e:  # one clear line per failing case, then go on
                    failed += 1
                    msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
                    print(f"{label:60} FAILED: {type(e).__name__}: {msg[:200]}")
                    rows.append({"entry": entry, "case": name, "error": f"{type(e).__name__}: {e}"})
                    continue
                rows.append({"entry": entry, "case": name, "kernel": kernel.fn.__name__, **usage})
                spills = f"{usage['spill_store_bytes']}/{usage['spill_load_bytes']}"
                note = f"  (wgmma serialized: {serial_ok[name]})" if serial else ""
                print(f"{label:60} {usage['regs']:>4} {spills:>11} {usage['smem_bytes']:>7} "
                      f"{usage['num_warps']:>5} {usage['compile_s']:>5}{note}")  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"arch": args.arch, "triton": triton.__version__, "rows": rows}, indent=1)
            + "\n"
        )
    compiled = len(rows) - failed - skipped
    print(f"kernel-stats: {compiled} compiled, {failed} failed, {skipped} group(s) skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

# SPDX-License-Identifier: Apache-2.0
"""`hybrid-stack kernel-stats`: compile the stack's Triton kernels for a GPU on this CPU box.

For every carried entry with kernel cases (the file its ``kernel_cases`` in
series.toml names; see kstats_probe) it calls the
entry's real launcher on ``meta`` tensors, captures the launch, compiles it for
``sm_<arch>`` with the build venv's Triton and prints registers, spill bytes
and shared memory per program. A case that fails to compile, or needs more
shared memory than the architecture gives one program, fails the command:
that is GPU breakage the Triton interpreter tests cannot see. Nothing runs on
a GPU; speed still needs ``hybrid-stack bundle`` on a real one.

``--triton X.Y.Z`` compiles with another Triton release (installed once into
work/triton-X.Y.Z): the fused kernel's sm_90 form is Gluon, whose API changes
between releases; it compiles with Triton 3.6 and 3.8 and is reported as
skipped under any other release.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

from hybrid_stack import kstats_probe
from hybrid_stack.errors import StackError
from hybrid_stack.stack import load_stack
from hybrid_stack.venvs import check_venv, test_env, venv_and_tree

PROBE = Path(kstats_probe.__file__)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "kernel-stats",
        help="compile the stack's Triton kernels for sm_<arch> on the CPU; registers, spills, smem",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
    )
    p.add_argument("--venv", type=Path, default=None, help="default: work/venv")
    p.add_argument("--tree", type=Path, default=None, help="default: work/vllm")
    p.add_argument("--arch", type=int, default=90, help="compute capability x10 (default 90)")
    p.add_argument(
        "--entry", action="append", default=[], metavar="NAME", help="only this entry's kernels"
    )
    p.add_argument(
        "--json", type=Path, default=None, help="default: work/kernel-stats-sm<arch>.json"
    )
    p.add_argument(
        "--triton",
        metavar="X.Y.Z",
        default=None,
        help="compile with this Triton release instead of the venv's: installed once "
        "(pip --target, no deps) into work/triton-X.Y.Z and put first on the probe's "
        "import path; Gluon kernels (the fused kernel's sm_90 form) compile only with "
        "the releases they were written for",
    )
    p.set_defaults(func=run)


def triton_release(stack_root: Path, py: Path, version: str) -> Path:
    """work/triton-<version>: that Triton release alone, installed with the
    venv's pip on first use. A failed or wrong install leaves nothing behind."""
    dest = stack_root / "work" / f"triton-{version}"
    if (dest / f"triton-{version}.dist-info").is_dir() and (dest / "triton").is_dir():
        return dest
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    cmd = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
           "--only-binary=:all:", "--target", str(partial), f"triton=={version}"]  # fmt: skip
    print(f"kernel-stats: installing triton=={version} into {dest}", flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if p.returncode != 0 or not (partial / f"triton-{version}.dist-info").is_dir():
        shutil.rmtree(partial, ignore_errors=True)
        last = ((p.stderr or p.stdout).strip().splitlines() or ["(no output)"])[-1]
        raise StackError(f"could not install triton=={version} with pip: {last}")
    shutil.rmtree(dest, ignore_errors=True)
    partial.rename(dest)
    return dest


def run(args: argparse.Namespace) -> int:
    if args.triton is not None and not re.fullmatch(r"\d+\.\d+\.\d+", args.triton):
        raise StackError(f"--triton wants a release like 3.6.0, not {args.triton!r}")
    stack = load_stack(args.root)
    # entry -> its file of kernel cases (series.toml's kernel_cases)
    cases = {e.name: stack.root / e.kernel_cases for e in stack.carried if e.kernel_cases}
    wanted = args.entry or list(cases)
    unknown = sorted(set(wanted) - set(cases))
    if unknown:
        raise StackError(
            f"no kernel cases for {', '.join(unknown)} (carried entries with kernel_cases "
            f"in patches/series.toml: {', '.join(cases) or 'none'})"
        )
    if not wanted:
        raise StackError(
            "no carried entry has kernel cases: name a file of them with kernel_cases "
            "in the entry (patches/series.toml)"
        )
    venv, tree = venv_and_tree(stack, args.venv, args.tree)
    py = check_venv(stack, venv, tree)
    out = (args.json or stack.root / "work" / f"kernel-stats-sm{args.arch}.json").absolute()
    argv = [str(py), str(PROBE), "--arch", str(args.arch), "--json", str(out)]
    for name in wanted:
        argv += ["--cases", f"{name}={cases[name]}"]
    # The build venv's vLLM on a CPU box: CUDA_VISIBLE_DEVICES="" makes
    # vllm.triton_utils hand out the real triton module with no active driver.
    env = test_env(dict(os.environ), stack.root / "work" / "hf-home", interpret=False)
    env["CUDA_VISIBLE_DEVICES"] = ""
    if args.triton:
        env["PYTHONPATH"] = str(triton_release(stack.root, py, args.triton))
        print(f"$ export PYTHONPATH={shlex.quote(env['PYTHONPATH'])}", flush=True)
    print(f"$ cd {tree} && {shlex.join(argv)}", flush=True)
    return subprocess.run(argv, cwd=tree, env=env).returncode

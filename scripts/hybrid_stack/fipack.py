# SPDX-License-Identifier: Apache-2.0
"""A FlashInfer release for the GPU machine, in parts small enough to carry.

On Hopper, vLLM 0.33.0 runs the GDN prefill through FlashInfer by default
(``gdn_prefill_backend`` unset: auto -> flashinfer on SM90), and pins
flashinfer-python in requirements/cuda.txt; the GPU machine has no FlashInfer.
`hybrid-stack bundle --flashinfer [VERSION]` packs the wheels that path needs
so that `run.py --flashinfer DIR` puts them on the engine's import path.

What vLLM's FlashInfer GDN path imports: ``fi_chunk_gated_delta_rule`` imports
``flashinfer.gdn_prefill`` (so ``flashinfer/__init__``, which imports most of
the package), whose SM90 kernel ``gdn_kernels.chunk_gated_delta_rule_sm90`` is
a CuTe DSL kernel (``import cutlass``, ``cuda.bindings``), and the package
imports ``tvm_ffi``, ``torch``, ``numpy``, ``packaging``, ``filelock``,
``jinja2``, ``pynvml``, ``requests`` and ``tqdm`` at module level. Carried
(``CARRIED``), because the GPU image lacks them:

- flashinfer-python (the pinned version; pure Python plus cubins and headers);
- nvidia-cutlass-dsl and its libs-base, libs-core and libs-cu13 wheels (the
  CuTe DSL compiler the SM90 GDN prefill is written in; cu13 because the GPU
  image's torch is built for CUDA 13). nvidia-cutlass-dsl itself only holds a
  ``.pth`` file that puts ``nvidia_cutlass_dsl/dsl_packages`` on sys.path; a
  ``.pth`` only works in a site directory, so the index names that folder
  (``import_paths``) and run.py puts it on the import path itself.

Declared dependencies left out (``LEFT_OUT``, with why): apache-tvm-ffi is a
bundle wheel already (bundle.DEPS); cuda-python is a metapackage without code
over cuda-bindings / cuda-core / cuda-pathfinder, which the GPU image has, as
it has numpy, packaging, requests, tqdm, tabulate, click, einops, ninja,
filelock, jinja2 and nvidia-ml-py; nvidia-cudnn-frontend is imported only
when present (``CUDNN_AVAILABLE``), for cuDNN backends vLLM's GDN path does not
ask for; nccl4py and nccl-extensions serve communication kernels only;
cuda-tile is not on the configured package index, and only the cuTile kernels
(``flashinfer.cutile``) import it, which the GDN path does not reach.

Wheels are kept whole (each checked against the sha256 the index announces
and again by run.py before it installs anything): they are written one after
another as one stream, cut into parts of at most ``part_mib`` MiB
(packparts.split). ``flashinfer-pack.json`` beside the parts names each wheel
with its size and sha256, the import paths, what was left out and why, and
each part's size and sha256.
"""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path

from hybrid_stack import downloads, packparts
from hybrid_stack.errors import StackError
from hybrid_stack.stack import cache_dir

INDEX_NAME = "flashinfer-pack.json"
FORMAT = "hybrid-stack-flashinfer-pack/1"
PROJECT = "flashinfer-python"
# The CuTe DSL release carried with it: the newest on the index that meets
# flashinfer-python 0.7.2.post1's nvidia-cutlass-dsl>=4.6.2a0.
CUTLASS_DSL = "4.8.1"
# project -> version (None: the FlashInfer version packed), in install order.
CARRIED: dict[str, str | None] = {
    PROJECT: None,
    "nvidia-cutlass-dsl": CUTLASS_DSL,
    "nvidia-cutlass-dsl-libs-base": CUTLASS_DSL,
    "nvidia-cutlass-dsl-libs-core": CUTLASS_DSL,
    "nvidia-cutlass-dsl-libs-cu13": CUTLASS_DSL,
}
LEFT_OUT: dict[str, str] = {
    "apache-tvm-ffi": "a bundle wheel already (bundle.DEPS)",
    "cuda-python": "metapackage without code; the GPU image has cuda-bindings, "
    "cuda-core and cuda-pathfinder",
    "nvidia-cudnn-frontend": "imported only when present, for cuDNN backends the GDN "
    "path does not use",
    "nccl4py": "communication kernels only",
    "nccl-extensions": "communication kernels only",
    "cuda-tile": "not on the configured package index; only flashinfer.cutile imports it",
    "numpy, packaging, requests, tqdm, tabulate, click, einops, ninja, nvidia-ml-py": (
        "on the GPU image"
    ),
}
# A wheel's .pth file -> the folder (relative to the install folder) it puts
# on sys.path; run.py cannot run .pth files outside a site directory.
PTH_PATHS = {"nvidia_cutlass_dsl_packages.pth": "nvidia_cutlass_dsl/dsl_packages"}
REQ_PIN = re.compile(r"^\s*flashinfer-python\s*==\s*([^\s;#]+)", re.MULTILINE)


def pinned_version(tree: Path) -> str:
    """The flashinfer-python version the applied tree's requirements/cuda.txt pins."""
    req = tree / "requirements" / "cuda.txt"
    try:
        m = REQ_PIN.search(req.read_text())
    except OSError as e:
        raise StackError(f"cannot read {req} ({e.strerror}): pass --flashinfer VERSION") from None
    if not m:
        raise StackError(f"{req} pins no flashinfer-python: pass --flashinfer VERSION")
    return m.group(1)


def fetch_wheels(version: str, python: str, platforms: list[str]) -> list[Path]:
    """The carried wheels, verified, cached under the cache's flashinfer/."""
    folder = cache_dir() / "flashinfer"
    return [
        packparts.fetch_wheel(project, pin or version, python, platforms, folder)
        for project, pin in CARRIED.items()
    ]


def import_paths(wheels: list[Path]) -> list[str]:
    """The folders the wheels' .pth files put on sys.path (PTH_PATHS)."""
    paths: list[str] = []
    for whl in wheels:
        with zipfile.ZipFile(whl) as zf:
            for name in zf.namelist():
                if "/" in name or not name.endswith(".pth"):
                    continue
                if name not in PTH_PATHS or PTH_PATHS[name].rsplit("/", 1)[-1] not in (
                    zf.read(name).decode("utf-8", "replace")
                ):
                    raise StackError(
                        f"{whl.name} has {name}, which run.py cannot follow: add what it "
                        "puts on sys.path to PTH_PATHS in hybrid_stack/fipack.py"
                    )
                paths.append(PTH_PATHS[name])
    return paths


def write_pack(version: str, wheels: list[Path], out: Path, python: str, part_mib: float) -> dict:
    """Parts and ``flashinfer-pack.json`` for ``wheels`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("flashinfer-*.wheels.*"):
        old.unlink()
    name = f"flashinfer-{version}-cp{python.replace('.', '')}.wheels"
    pack = {
        "format": FORMAT,
        "flashinfer": version,
        "python": python,
        "wheels": [
            {"name": w.name, "size": w.stat().st_size, "sha256": downloads.sha256_file(w)}
            for w in wheels
        ],
        "import_paths": import_paths(wheels),
        "left_out": LEFT_OUT,
        "parts": packparts.split(wheels, out, name, part_mib),
    }
    (out / INDEX_NAME).write_text(json.dumps(pack, indent=1) + "\n")
    return pack

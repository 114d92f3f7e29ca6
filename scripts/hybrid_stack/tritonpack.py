# SPDX-License-Identifier: Apache-2.0
"""A Triton release for the GPU machine, in parts small enough to carry.

The GPU machine has its own Triton (3.6 here); the pinned vLLM installs another
(3.8). `hybrid-stack bundle --triton 3.8.0` packs the release's wheel for the
bundle's Python so that `run.py --triton DIR` runs the tests and benchmarks
under it. A Triton wheel is about 250 MB and one device call carries 64 MiB,
so the pack is made smaller and split:

- the wheel comes from pip's configured index and must match the sha256 the
  index announces (an unannounced hash is refused);
- what only profiling needs is left out (CUPTI, the proton profiler library,
  an instrumentation test library: ``DROPPED``);
- debug sections are stripped from the shared libraries (binutils' ``strip
  --strip-debug``: code and data stay byte for byte what the release ships);
- the rest is one ``.tar.xz``, cut into parts of at most ``part_mib`` MiB.

``triton-pack.json`` beside the parts names the wheel and its sha256, what was
left out and stripped, the archive's sha256 and each part's size and sha256;
run.py checks all of them before it installs anything. The archive is cached
under the stack cache dir, keyed by the wheel's hash and ``RECIPE``.
"""

from __future__ import annotations

import io
import json
import lzma
import shutil
import subprocess
import tarfile
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from hybrid_stack import downloads, packparts
from hybrid_stack.errors import StackError
from hybrid_stack.proc import pid_tag, sweep_stale
from hybrid_stack.stack import cache_dir

INDEX_NAME = "triton-pack.json"
FORMAT = "hybrid-stack-triton-pack/1"
# Bump when what goes into the archive changes: cached archives are keyed by it.
RECIPE = 1
# Members only profiling and Triton's own instrumentation tests load.
DROPPED = (
    "triton/backends/nvidia/lib/cupti/",
    "triton/backends/nvidia/lib/cupti-blackwell/",
    "triton/_C/libproton.so",
    "triton/instrumentation/libGPUInstrumentationTestLib.so",
)
# Wheel metadata that no longer describes the unpacked files.
SKIPPED_METADATA = ("/RECORD",)
ELF_MAGIC = b"\x7fELF"
DEFAULT_PART_MIB = packparts.DEFAULT_PART_MIB

Stripper = Callable[[bytes], bytes]


def strip_debug(data: bytes) -> bytes:
    """``data`` (an ELF file) without its debug sections, via binutils' strip."""
    tool = shutil.which("strip")
    if tool is None:
        raise StackError(
            "binutils' 'strip' is needed to pack Triton (its libraries ship with "
            "debug info, 2x their size): install binutils"
        )
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "in", Path(tmp) / "out"
        src.write_bytes(data)
        p = subprocess.run(
            [tool, "--strip-debug", "-o", str(dst), str(src)],
            capture_output=True,
            text=True,
            check=False,
        )
        if p.returncode != 0:
            raise StackError(f"strip --strip-debug failed: {p.stderr.strip()}")
        return dst.read_bytes()


def dropped(name: str) -> bool:
    return any(name == d or (d.endswith("/") and name.startswith(d)) for d in DROPPED)


def repack(wheel: Path, archive: Path, stripper: Stripper = strip_debug) -> dict:
    """Write the wheel's files, less ``DROPPED`` and with debug info stripped
    from ELF files, as ``archive`` (.tar.xz). Returns what was done."""
    left_out: list[str] = []
    stripped: list[str] = []
    tmp = archive.with_name(f"{archive.name}.part{pid_tag()}")
    sweep_stale(archive.parent, f"{archive.name}.part-")
    try:
        with (
            zipfile.ZipFile(wheel) as zf,
            lzma.open(tmp, "wb", preset=6) as xz,
            tarfile.open(fileobj=xz, mode="w", format=tarfile.PAX_FORMAT) as tar,
        ):
            for info in sorted(zf.infolist(), key=lambda i: i.filename):
                name = info.filename
                if info.is_dir() or name.endswith(SKIPPED_METADATA):
                    continue
                if dropped(name):
                    left_out.append(name)
                    continue
                data = zf.read(info)
                if data[:4] == ELF_MAGIC and name.endswith(".so"):
                    smaller = stripper(data)
                    if len(smaller) < len(data):
                        stripped.append(name)
                        data = smaller
                ti = tarfile.TarInfo(name)
                ti.size = len(data)
                ti.mode = ((info.external_attr >> 16) & 0o777) or 0o644
                ti.mtime = 0
                tar.addfile(ti, io.BytesIO(data))
        tmp.replace(archive)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return {"dropped": left_out, "debug_stripped": stripped}


sha256_bytes = packparts.sha256_bytes
split = packparts.split


def wheel_name(project_files: list[str], version: str, python: str, platforms: list[str]) -> str:
    """The release's wheel for CPython ``python`` on one of ``platforms``."""
    return packparts.wheel_name("triton", project_files, version, python, platforms)


def fetch_wheel(version: str, python: str, platforms: list[str]) -> Path:
    """The verified cached wheel (packparts.fetch_wheel) under the cache's triton/."""
    return packparts.fetch_wheel("triton", version, python, platforms, cache_dir() / "triton")


def write_pack(wheel: Path, out: Path, part_mib: float, stripper: Stripper = strip_debug) -> dict:
    """Archive (cached), parts and ``triton-pack.json`` for ``wheel`` in ``out``."""
    parts_ = wheel.name[: -len(".whl")].split("-")
    version, pytag = parts_[1], parts_[2].split(".")[0]
    wheel_sha = downloads.sha256_file(wheel)
    cached = cache_dir() / "triton" / f"triton-{version}-{pytag}-r{RECIPE}-{wheel_sha[:16]}.tar.xz"
    meta_path = cached.with_name(cached.name + ".json")
    if cached.is_file() and meta_path.is_file():
        meta = json.loads(meta_path.read_text())
    else:
        cached.parent.mkdir(parents=True, exist_ok=True)
        print(f"bundle: packing {wheel.name} (strip, xz; a minute or two)", flush=True)
        meta = repack(wheel, cached, stripper)
        meta_path.write_text(json.dumps(meta, indent=1) + "\n")
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("triton-*.tar.xz.*"):
        old.unlink()
    name = f"triton-{version}-{pytag}.tar.xz"
    pack = {
        "format": FORMAT,
        "triton": version,
        "python": f"{pytag[2]}.{pytag[3:]}",
        "wheel": {"name": wheel.name, "sha256": wheel_sha},
        **meta,
        "archive": {
            "name": name,
            "size": cached.stat().st_size,
            "sha256": downloads.sha256_file(cached),
        },
        "parts": split(cached, out, name, part_mib),
    }
    (out / INDEX_NAME).write_text(json.dumps(pack, indent=1) + "\n")
    return pack

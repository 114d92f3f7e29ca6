# SPDX-License-Identifier: Apache-2.0
"""What the packs for the GPU machine share (tritonpack, fipack).

One device call carries 64 MiB in all, so a pack is a byte stream (an archive,
or wheels one after another) cut into parts of at most ``part_mib`` MiB, each
named with its size and sha256 in the pack's index json; run.py stages the
parts over calls and joins them only when every one is there and verified.
Wheels come from pip's configured index and must match the sha256 the index
announces (an unannounced hash is refused).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from hybrid_stack import downloads
from hybrid_stack.errors import StackError

DEFAULT_PART_MIB = 56.0
CHUNK = 1 << 20


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def split(sources: Path | list[Path], out: Path, name: str, part_mib: float) -> list[dict]:
    """Cut the files ``sources``, read one after another as one stream, into
    ``<name>.NN`` files in ``out``; [{name, size, sha256}]. A file larger than
    a part is cut too, and a part may hold the end of one file and the start
    of the next (run.py cuts the joined stream back by the index's sizes)."""
    limit = int(part_mib * 2**20)
    if limit < 2**20:
        raise StackError(f"--triton-part-mib must be at least 1, not {part_mib:g}")
    files = [sources] if isinstance(sources, Path) else list(sources)
    parts: list[dict] = []
    buf = bytearray()

    def flush() -> None:
        part = f"{name}.{len(parts) + 1:02d}"
        (out / part).write_bytes(buf)
        parts.append({"name": part, "size": len(buf), "sha256": sha256_bytes(bytes(buf))})
        buf.clear()

    for path in files:
        with path.open("rb") as f:
            while block := f.read(min(CHUNK, limit - len(buf))):
                buf += block
                if len(buf) == limit:
                    flush()
    if buf:
        flush()
    return parts


def wheel_fits(fname: str, project: str, version: str, python: str, platforms: list[str]) -> bool:
    """Whether ``fname`` is ``project`` ``version``'s wheel for CPython
    ``python`` (its own cpXY, abi3 up to it, or pure py3) on one of
    ``platforms`` (or any)."""
    if not fname.endswith(".whl"):
        return False
    parts = fname[: -len(".whl")].split("-")
    if len(parts) not in (5, 6) or norm(parts[0]) != norm(project) or parts[1] != version:
        return False
    minor = int(python.split(".")[1])
    py, abi, plat = (set(t.split(".")) for t in parts[-3:])
    py_ok = bool(py & {"py3", f"py3{minor}", f"cp3{minor}"}) or (
        "abi3" in abi and any(t.startswith("cp3") and int(t[3:]) <= minor for t in py)
    )
    return py_ok and ("any" in plat or bool(plat & set(platforms)))


def wheel_name(
    project: str, files: list[str], version: str, python: str, platforms: list[str]
) -> str:
    """``project`` ``version``'s wheel for ``python`` on ``platforms`` among ``files``."""
    for fname in files:
        if wheel_fits(fname, project, version, python, platforms):
            return fname
    raise StackError(
        f"no {project} {version} wheel for CPython {python} on {platforms[0]} "
        f"on the index (it lists {sum(f.endswith('.whl') for f in files)} wheels)"
    )


def fetch_wheel(
    project: str, version: str, python: str, platforms: list[str], folder: Path
) -> Path:
    """The verified cached wheel in ``folder``: downloaded once from pip's
    configured index, checked against the sha256 the index announces."""
    folder.mkdir(parents=True, exist_ok=True)
    errors: list[str] = []
    for index in downloads.pip_indexes():
        try:
            files = downloads.index_files(index, project)
        except StackError as e:
            errors.append(str(e))
            continue
        name = wheel_name(project, list(files), version, python, platforms)
        url, announced = files[name]
        if not announced:
            raise StackError(f"the index announces no sha256 for {name}: refusing to use it")
        dest = folder / name
        if not (dest.is_file() and downloads.sha256_file(dest) == announced):
            print(f"bundle: downloading {name}", flush=True)
            downloads.download_verified(
                url, dest, announced, "the index's", "the index serves another file"
            )
        return dest
    raise StackError(f"{project} is not listed on any configured index: " + "; ".join(errors))

# SPDX-License-Identifier: Apache-2.0
"""The Triton pack: `hybrid-stack bundle --triton` packs a Triton release in
parts, `run.py --triton` stages them over calls and installs the whole only
when every byte is verified. A fake release stands in for the 250 MB wheel."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

from hybrid_stack import tritonpack
from hybrid_stack.errors import StackError

RUN_PY = Path(tritonpack.__file__).parent / "bundle_data" / "run.py"
PY = f"{sys.version_info.major}.{sys.version_info.minor}"
CP = f"cp{sys.version_info.major}{sys.version_info.minor}"
DEBUG = b"DEBUG-SECTION" * 4096


def load_runner() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bundle_run_triton", RUN_PY)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fake_strip(data: bytes) -> bytes:
    """What strip --strip-debug does to the fake library: its debug tail goes."""
    return data.removesuffix(DEBUG)


def fake_triton(dest: Path, version: str = "9.9.0", seed: int = 0) -> Path:
    """A wheel laid out like Triton's: a 3 MiB library (incompressible, with a
    debug tail), an executable ptxas, and the profiling files the pack drops."""
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / f"triton-{version}-{CP}-{CP}-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl"
    lib = b"\x7fELF" + hashlib.shake_256(f"lib{seed}".encode()).digest(3 << 20) + DEBUG
    dist = f"triton-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("triton/__init__.py", f"__version__ = {version!r}\n")
        zf.writestr("triton/_C/libtriton.so", lib)
        ptxas = zipfile.ZipInfo("triton/backends/nvidia/bin/ptxas")
        ptxas.external_attr = 0o755 << 16
        zf.writestr(ptxas, "#!/bin/sh\necho ptxas\n")
        zf.writestr("triton/_C/libproton.so", b"\x7fELF proton")
        zf.writestr("triton/backends/nvidia/lib/cupti/libcupti.so", b"\x7fELF cupti")
        zf.writestr(
            f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: triton\nVersion: {version}\n"
        )
        zf.writestr(f"{dist}/RECORD", "triton/__init__.py,,\n")
    return path


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HYBRID_STACK_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def pack_dir(tmp_path: Path, cache: Path) -> Path:
    wheel = fake_triton(tmp_path / "wheels")
    out = tmp_path / "pack"
    tritonpack.write_pack(wheel, out, part_mib=1.0, stripper=fake_strip)
    return out


def test_pack_drops_profiling_strips_debug_and_splits(pack_dir: Path):
    pack = json.loads((pack_dir / tritonpack.INDEX_NAME).read_text())
    assert pack["triton"] == "9.9.0" and pack["python"] == PY
    assert sorted(pack["dropped"]) == [
        "triton/_C/libproton.so",
        "triton/backends/nvidia/lib/cupti/libcupti.so",
    ]
    assert pack["debug_stripped"] == ["triton/_C/libtriton.so"]
    assert len(pack["parts"]) >= 3  # 3 MiB that xz cannot shrink, 1 MiB parts
    assert all(p["size"] <= 2**20 for p in pack["parts"])
    assert sum(p["size"] for p in pack["parts"]) == pack["archive"]["size"]
    for p in pack["parts"]:
        assert hashlib.sha256((pack_dir / p["name"]).read_bytes()).hexdigest() == p["sha256"]
    assert not list(pack_dir.glob("*.tar.xz"))  # only the parts travel


def split_over_calls(pack_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    """The parts as two device calls would carry them."""
    pack = json.loads((pack_dir / tritonpack.INDEX_NAME).read_text())
    first, second = tmp_path / "call1", tmp_path / "call2"
    for folder, parts in ((first, pack["parts"][:1]), (second, pack["parts"][1:])):
        folder.mkdir()
        shutil.copy(pack_dir / tritonpack.INDEX_NAME, folder)
        for p in parts:
            shutil.copy(pack_dir / p["name"], folder)
    return first, second


def test_parts_carried_over_two_calls_install_the_release(
    pack_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
):
    run = load_runner()
    first, second = split_over_calls(pack_dir, tmp_path)
    stash = tmp_path / "stash"
    assert run.main(["--triton", str(first), "--triton-stash", str(stash), "--stage"]) == 0
    out = capsys.readouterr().out
    assert "1 of" in out and "still missing" in out
    pack, missing = run.stage_triton(second, stash)
    assert missing == []
    site = tmp_path / "bundle" / ".site"
    site.mkdir(parents=True)
    target = run.install_triton(pack, stash, site)
    assert (target / "triton" / "_C" / "libtriton.so").stat().st_size == (3 << 20) + 4
    assert os.access(target / "triton/backends/nvidia/bin/ptxas", os.X_OK)
    assert not (target / "triton/_C/libproton.so").exists()
    assert not (target / "triton/backends/nvidia/lib/cupti").exists()
    env = run.child_env(site, target)
    got = subprocess.run(
        [sys.executable, "-c", "import triton; print(triton.__version__, triton.__file__)"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert got[0] == "9.9.0" and got[1].startswith(str(target))


def test_a_damaged_part_is_refused_and_nothing_installed(pack_dir: Path, tmp_path: Path):
    run = load_runner()
    pack = json.loads((pack_dir / tritonpack.INDEX_NAME).read_text())
    bad = pack_dir / pack["parts"][1]["name"]
    data = bytearray(bad.read_bytes())
    data[100] ^= 1
    bad.write_bytes(bytes(data))
    stash = tmp_path / "stash"
    with pytest.raises(run.RunError, match="damaged or from another pack"):
        run.stage_triton(pack_dir, stash)
    assert not (stash / pack["parts"][1]["sha256"]).exists()
    rc = run.main(["--triton", str(pack_dir), "--triton-stash", str(stash), "quick"])
    assert rc == run.EXIT_USAGE
    assert not list(tmp_path.rglob("*-triton-9.9.0"))


def test_missing_parts_are_named_and_the_rest_kept(
    pack_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
):
    run = load_runner()
    first, _ = split_over_calls(pack_dir, tmp_path)
    stash = tmp_path / "stash"
    assert run.main(["--triton", str(first), "--triton-stash", str(stash), "quick"]) == 2
    err = capsys.readouterr().err
    assert "missing part(s) triton-9.9.0-" in err and ".02" in err
    assert len(list(stash.iterdir())) == 1


def test_parts_of_two_packs_do_not_join(tmp_path: Path, cache: Path):
    run = load_runner()
    a, b = tmp_path / "a", tmp_path / "b"
    tritonpack.write_pack(fake_triton(tmp_path / "wa", seed=1), a, 1.0, fake_strip)
    tritonpack.write_pack(fake_triton(tmp_path / "wb", seed=2), b, 1.0, fake_strip)
    pack_a = json.loads((a / tritonpack.INDEX_NAME).read_text())
    pack_b = json.loads((b / tritonpack.INDEX_NAME).read_text())
    mixed = dict(pack_a, parts=[pack_a["parts"][0], *pack_b["parts"][1:]])
    stash = tmp_path / "stash"
    for d in (a, b):
        run.stage_triton(d, stash)
    with pytest.raises(run.RunError, match="join to sha256"):
        run.install_triton(mixed, stash, tmp_path / ".site")
    assert not (tmp_path / ".site-triton-9.9.0").exists()


def test_a_pack_for_another_python_is_refused(pack_dir: Path, tmp_path: Path):
    run = load_runner()
    pack, _ = run.stage_triton(pack_dir, tmp_path / "stash")
    with pytest.raises(run.RunError, match="for Python 2.7"):
        run.install_triton(dict(pack, python="2.7"), tmp_path / "stash", tmp_path / ".site")


def test_the_archive_is_cached_per_wheel(tmp_path: Path, cache: Path):
    wheel = fake_triton(tmp_path / "w")
    calls = []

    def counting(data: bytes) -> bytes:
        calls.append(len(data))
        return fake_strip(data)

    first = tritonpack.write_pack(wheel, tmp_path / "o1", 1.0, counting)
    second = tritonpack.write_pack(wheel, tmp_path / "o2", 2.0, counting)
    assert len(calls) == 1  # packed once
    assert first["archive"]["sha256"] == second["archive"]["sha256"]
    assert len(second["parts"]) < len(first["parts"])


def test_strip_debug_keeps_a_program_running(tmp_path: Path):
    src = Path(shutil.which("true") or "/bin/true").read_bytes()
    out = tmp_path / "true"
    out.write_bytes(tritonpack.strip_debug(src))
    out.chmod(0o755)
    assert len(out.read_bytes()) <= len(src)
    assert subprocess.run([str(out)], check=False).returncode == 0


def index_of(tmp_path: Path, wheel: Path, sha: str | None) -> str:
    page = tmp_path / "index" / "triton"
    page.mkdir(parents=True, exist_ok=True)
    frag = f"#sha256={sha}" if sha else ""
    (page / "index.html").write_text(f'<a href="{wheel.as_uri()}{frag}">{wheel.name}</a>')
    return (tmp_path / "index").as_uri()


def test_the_wheel_must_match_the_hash_the_index_announces(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
):
    wheel = fake_triton(tmp_path / "dist")
    good = hashlib.sha256(wheel.read_bytes()).hexdigest()
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    plats = ["manylinux_2_31_x86_64", "manylinux_2_28_x86_64"]
    monkeypatch.setenv("PIP_INDEX_URL", index_of(tmp_path / "i1", wheel, None))
    with pytest.raises(StackError, match="announces no sha256"):
        tritonpack.fetch_wheel("9.9.0", PY, plats)
    monkeypatch.setenv("PIP_INDEX_URL", index_of(tmp_path / "i2", wheel, "0" * 64))
    with pytest.raises(StackError, match="!= the index.s 0000"):
        tritonpack.fetch_wheel("9.9.0", PY, plats)
    assert not (cache / "triton" / wheel.name).exists()
    monkeypatch.setenv("PIP_INDEX_URL", index_of(tmp_path / "i3", wheel, good))
    got = tritonpack.fetch_wheel("9.9.0", PY, plats)
    assert got == cache / "triton" / wheel.name
    with pytest.raises(StackError, match="no triton 9.9.1 wheel"):
        tritonpack.fetch_wheel("9.9.1", PY, plats)

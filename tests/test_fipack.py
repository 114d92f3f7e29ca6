# SPDX-License-Identifier: Apache-2.0
"""The FlashInfer pack: `hybrid-stack bundle --flashinfer` packs FlashInfer and
the CuTe DSL wheels in parts, `run.py --flashinfer` stages them over calls and
installs them onto the children's import path only when every wheel is
verified.
Fake wheels on a file:// index stand in for the 150 MiB release."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from test_tritonpack import CP, PY, fake_strip, fake_triton, load_runner

from hybrid_stack import fipack, tritonpack
from hybrid_stack.errors import StackError

VERSION = "9.9.9"
PLATS = ["manylinux_2_31_x86_64", "manylinux_2_28_x86_64"]
PTH = (
    "import sys, os, nvidia_cutlass_dsl; sys.path.insert(0, os.path.join("
    "nvidia_cutlass_dsl.__path__[0], 'dsl_packages'))\n"
)


def wheel(dest: Path, project: str, version: str, tag: str, files: dict[str, bytes]) -> Path:
    dist = f"{project.replace('-', '_')}-{version}"
    path = dest / f"{dist}-{tag}.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr(f"{dist}.dist-info/METADATA", f"Name: {project}\nVersion: {version}\n")
    return path


def fake_release(dest: Path, seed: int = 0) -> dict[str, Path]:
    """Wheels laid out like flashinfer-python and the CuTe DSL's: a pure
    flashinfer package, the .pth-only nvidia-cutlass-dsl, and libs wheels, one
    with a 3 MiB incompressible library (larger than a 1 MiB part)."""
    dest.mkdir(parents=True, exist_ok=True)
    cp = f"{CP}-{CP}-manylinux_2_28_x86_64"
    lib = hashlib.shake_256(f"cute{seed}".encode()).digest(3 << 20)
    dsl = "nvidia_cutlass_dsl/dsl_packages/cutlass"
    return {
        "flashinfer-python": wheel(
            dest,
            "flashinfer-python",
            VERSION,
            "py3-none-any",
            {"flashinfer/__init__.py": f"__version__ = {VERSION!r}\n".encode()},
        ),
        "nvidia-cutlass-dsl": wheel(
            dest,
            "nvidia-cutlass-dsl",
            fipack.CUTLASS_DSL,
            "py3-none-any",
            {"nvidia_cutlass_dsl_packages.pth": PTH.encode()},
        ),
        "nvidia-cutlass-dsl-libs-base": wheel(
            dest,
            "nvidia-cutlass-dsl-libs-base",
            fipack.CUTLASS_DSL,
            cp,
            {f"{dsl}/__init__.py": b"CUTE = 'dsl'\n"},
        ),
        "nvidia-cutlass-dsl-libs-core": wheel(
            dest,
            "nvidia-cutlass-dsl-libs-core",
            fipack.CUTLASS_DSL,
            "py3-none-any",
            {"nvidia_cutlass_dsl/dsl_packages/iket/__init__.py": b""},
        ),
        "nvidia-cutlass-dsl-libs-cu13": wheel(
            dest,
            "nvidia-cutlass-dsl-libs-cu13",
            fipack.CUTLASS_DSL,
            cp,
            {"nvidia_cutlass_dsl/cu13/lib/libcute_dsl_runtime.so": lib},
        ),
    }


def fake_index(root: Path, wheels: dict[str, Path], bad: str = "", unannounced: str = "") -> str:
    """A PEP 503 index over ``wheels``; ``bad`` announces a wrong sha256,
    ``unannounced`` none."""
    for project, path in wheels.items():
        sha = hashlib.sha256(path.read_bytes()).hexdigest()
        frag = "" if project == unannounced else f"#sha256={'0' * 64 if project == bad else sha}"
        page = root / project
        page.mkdir(parents=True, exist_ok=True)
        (page / "index.html").write_text(f'<a href="{path.as_uri()}{frag}">{path.name}</a>')
    return root.as_uri()


@pytest.fixture
def index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    monkeypatch.setenv("HYBRID_STACK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    wheels = fake_release(tmp_path / "dist")
    monkeypatch.setenv("PIP_INDEX_URL", fake_index(tmp_path / "index", wheels))
    return wheels


@pytest.fixture
def pack_dir(tmp_path: Path, index: dict[str, Path]) -> Path:
    wheels = fipack.fetch_wheels(VERSION, PY, PLATS)
    fipack.write_pack(VERSION, wheels, tmp_path / "pack", PY, part_mib=1.0)
    return tmp_path / "pack"


def test_pack_names_every_wheel_and_part_within_the_limit(pack_dir: Path, index: dict):
    pack = json.loads((pack_dir / fipack.INDEX_NAME).read_text())
    assert pack["format"] == fipack.FORMAT and pack["flashinfer"] == VERSION
    assert pack["python"] == PY
    assert [w["name"] for w in pack["wheels"]] == [index[p].name for p in fipack.CARRIED]
    for w in pack["wheels"]:
        src = index[next(p for p in fipack.CARRIED if index[p].name == w["name"])]
        assert w["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()
        assert w["size"] == src.stat().st_size
    assert pack["import_paths"] == ["nvidia_cutlass_dsl/dsl_packages"]
    assert "cuda-tile" in pack["left_out"] and "nccl4py" in pack["left_out"]
    assert len(pack["parts"]) >= 4  # 3 MiB that zip cannot shrink, 1 MiB parts
    assert all(p["size"] <= 2**20 for p in pack["parts"])
    assert sum(p["size"] for p in pack["parts"]) == sum(w["size"] for w in pack["wheels"])
    for p in pack["parts"]:
        assert hashlib.sha256((pack_dir / p["name"]).read_bytes()).hexdigest() == p["sha256"]
    assert not list(pack_dir.glob("*.whl"))  # only the parts travel


def test_a_wheel_must_match_the_hash_the_index_announces(
    tmp_path: Path, index: dict, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("HYBRID_STACK_CACHE", str(tmp_path / "cache2"))
    root = fake_index(tmp_path / "i2", index, bad="nvidia-cutlass-dsl-libs-cu13")
    monkeypatch.setenv("PIP_INDEX_URL", root)
    with pytest.raises(StackError, match="!= the index.s 0000"):
        fipack.fetch_wheels(VERSION, PY, PLATS)
    monkeypatch.setenv(
        "PIP_INDEX_URL", fake_index(tmp_path / "i3", index, unannounced=fipack.PROJECT)
    )
    with pytest.raises(StackError, match="announces no sha256 for flashinfer_python"):
        fipack.fetch_wheels(VERSION, PY, PLATS)
    with pytest.raises(StackError, match="no flashinfer-python 9.9.8 wheel"):
        fipack.fetch_wheels("9.9.8", PY, PLATS)


def test_the_version_comes_from_the_trees_requirements(tmp_path: Path):
    req = tmp_path / "requirements" / "cuda.txt"
    req.parent.mkdir()
    req.write_text("# comment\ntorch==2.11.0\nflashinfer-python==0.7.2.post1\n")
    assert fipack.pinned_version(tmp_path) == "0.7.2.post1"
    req.write_text("torch==2.11.0\n")
    with pytest.raises(StackError, match="pins no flashinfer-python"):
        fipack.pinned_version(tmp_path)


def test_an_unknown_pth_file_is_refused(tmp_path: Path):
    odd = wheel(tmp_path, "odd", "1.0", "py3-none-any", {"odd.pth": b"import os\n"})
    with pytest.raises(StackError, match="odd.pth, which run.py cannot follow"):
        fipack.import_paths([odd])


def split_over_calls(pack_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    """The parts as two device calls would carry them."""
    pack = json.loads((pack_dir / fipack.INDEX_NAME).read_text())
    first, second = tmp_path / "call1", tmp_path / "call2"
    for folder, parts in ((first, pack["parts"][:2]), (second, pack["parts"][2:])):
        folder.mkdir()
        shutil.copy(pack_dir / fipack.INDEX_NAME, folder)
        for p in parts:
            shutil.copy(pack_dir / p["name"], folder)
    return first, second


def test_parts_carried_over_two_calls_install_onto_the_child_path(
    pack_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
):
    run = load_runner()
    first, second = split_over_calls(pack_dir, tmp_path)
    stash = tmp_path / "stash"
    argv = ["--flashinfer-stash", str(stash), "--site", str(tmp_path / "s"), "--stage"]
    assert run.main(["--flashinfer", str(first), *argv]) == 0
    out = capsys.readouterr().out
    assert f"FlashInfer {VERSION}: 2 of" in out and "still missing" in out
    assert run.main(["--flashinfer", str(second), *argv]) == 0
    assert "still missing" not in capsys.readouterr().out
    pack, missing = run.stage_flashinfer(second, stash)
    assert missing == []
    site = tmp_path / "bundle" / ".site"
    site.mkdir(parents=True)
    paths = run.install_flashinfer(pack, stash, site)
    target = paths[0]
    assert target == site.parent / f".site-flashinfer-{VERSION}"
    assert paths[1] == target / "nvidia_cutlass_dsl" / "dsl_packages"
    assert (target / "nvidia_cutlass_dsl/cu13/lib/libcute_dsl_runtime.so").stat().st_size == (
        3 << 20
    )
    assert not (target / ".wheels").exists()  # the cut wheels are not kept
    env = run.child_env(site, None, paths)
    got = subprocess.run(
        [
            sys.executable,
            "-c",
            "import flashinfer, cutlass; print(flashinfer.__file__, cutlass.CUTE)",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert got[0].startswith(str(target)) and got[1] == "dsl"
    # a second install finds it done (the stamp)
    mtime = (target / "flashinfer" / "__init__.py").stat().st_mtime_ns
    assert run.install_flashinfer(pack, stash, site) == paths
    assert (target / "flashinfer" / "__init__.py").stat().st_mtime_ns == mtime


def test_a_damaged_part_is_refused_and_nothing_installed(
    pack_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
):
    run = load_runner()
    pack = json.loads((pack_dir / fipack.INDEX_NAME).read_text())
    bad = pack_dir / pack["parts"][1]["name"]
    data = bytearray(bad.read_bytes())
    data[100] ^= 1
    bad.write_bytes(bytes(data))
    stash = tmp_path / "stash"
    site = ["--site", str(tmp_path / ".site")]
    rc = run.main(
        ["--flashinfer", str(pack_dir), "--flashinfer-stash", str(stash), *site, "--stage"]
    )
    assert rc == run.EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "damaged or from another pack" in err[0]
    assert not (stash / pack["parts"][1]["sha256"]).exists()
    assert not list(tmp_path.rglob(f"*-flashinfer-{VERSION}"))


def test_an_incomplete_set_is_refused_with_the_missing_parts_named(
    pack_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
):
    run = load_runner()
    first, _ = split_over_calls(pack_dir, tmp_path)
    stash = tmp_path / "stash"
    site = ["--site", str(tmp_path / ".site")]  # where a wrong install would land
    argv = ["--flashinfer", str(first), "--flashinfer-stash", str(stash), *site, "quick"]
    assert run.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"FlashInfer {VERSION}: missing part(s) flashinfer-" in err[0]
    assert len(list(stash.iterdir())) == 2


def test_parts_of_two_packs_do_not_join(tmp_path: Path, index: dict):
    run = load_runner()
    packs = []
    for seed in (1, 2):
        wheels = list(fake_release(tmp_path / f"w{seed}", seed=seed).values())
        fipack.write_pack(VERSION, wheels, tmp_path / f"p{seed}", PY, 1.0)
        packs.append(json.loads((tmp_path / f"p{seed}" / fipack.INDEX_NAME).read_text()))
        run.stage_flashinfer(tmp_path / f"p{seed}", tmp_path / "stash")
    a, b = packs
    mixed = dict(a, parts=[*a["parts"][:-2], *b["parts"][-2:]])
    with pytest.raises(run.RunError, match="parts are from different packs"):
        run.install_flashinfer(mixed, tmp_path / "stash", tmp_path / ".site")
    assert not list(tmp_path.glob(".site-flashinfer-*"))
    with pytest.raises(run.RunError, match="for Python 2.7"):
        run.install_flashinfer(dict(a, python="2.7"), tmp_path / "stash", tmp_path / ".site")


def test_flashinfer_and_triton_stage_together(
    pack_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
):
    run = load_runner()
    tdir = tmp_path / "triton"
    tritonpack.write_pack(fake_triton(tmp_path / "tw"), tdir, 1.0, fake_strip)
    rc = run.main(
        [
            *("--triton", str(tdir), "--triton-stash", str(tmp_path / "ts")),
            *("--flashinfer", str(pack_dir), "--flashinfer-stash", str(tmp_path / "fs")),
            *("--site", str(tmp_path / ".site"), "--stage"),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "Triton 9.9.0:" in out and f"FlashInfer {VERSION}:" in out
    assert "still missing" not in out
    assert run.main(["--stage"]) == run.EXIT_USAGE
    assert "--triton DIR or --flashinfer DIR" in capsys.readouterr().err
    site = tmp_path / ".site"
    pack, _ = run.stage_flashinfer(pack_dir, tmp_path / "fs")
    fi = run.install_flashinfer(pack, tmp_path / "fs", site)
    env = run.child_env(site, tmp_path / "T", fi)
    paths = env["PYTHONPATH"].split(os.pathsep)
    # a packed Triton first, then the bundle's wheels, FlashInfer, the vLLM sources
    assert paths[:5] == [str(tmp_path / "T"), str(site), *map(str, fi), str(run.HERE / "src")]

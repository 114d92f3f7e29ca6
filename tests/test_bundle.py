# SPDX-License-Identifier: Apache-2.0
"""`hybrid-stack bundle`: the GPU kernel-test/benchmark bundle, checked on the CPU.

Wheels come from a folder of tiny fake wheels (or a file:// index of them), so
no test touches the network. Tests that pack the applied tree skip when
work/vllm is absent (CI applies the stack first).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from hybrid_stack import bundle
from hybrid_stack.bench import common, ssd_prefill
from hybrid_stack.cli import main
from hybrid_stack.errors import StackError
from hybrid_stack.stack import load_stack

ROOT = Path(__file__).resolve().parents[1]
TREE = ROOT / "work" / "vllm"
needs_tree = pytest.mark.skipif(
    not (TREE / "vllm" / "__init__.py").is_file(),
    reason="work/vllm is absent: run 'hybrid-stack apply' (CI applies it first)",
)


def fake_wheel(dest: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> Path:
    """A minimal valid py3-none-any wheel named like the real one."""
    mod = bundle.norm(name)
    dist = f"{mod}-{version}.dist-info"
    path = dest / f"{mod}-{version}-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{mod}/__init__.py", f"VERSION = {version!r}\n")
        zf.writestr(f"{mod}-{version}.data/purelib/{mod}_extra.py", "X = 1\n")
        zf.writestr(f"{mod}-{version}.data/scripts/{mod}-tool", "#!/bin/sh\n")
        zf.writestr(f"{dist}/METADATA", meta)
        zf.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n")
        zf.writestr(f"{dist}/RECORD", "")
    return path


def make_wheels(dest: Path, skip: str = "", core_pin: str = "") -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    for name, version in bundle.DEPS.items():
        if name == skip:
            continue
        requires: tuple[str, ...] = ()
        if name == "pydantic":
            requires = (
                f"pydantic-core=={core_pin or bundle.DEPS['pydantic-core']}",
                "email-validator>=2.0.0; extra == 'email'",
            )
        fake_wheel(dest, name, version, requires)
    return dest


@pytest.fixture(scope="module")
def wheel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_wheels(tmp_path_factory.mktemp("wheels"))


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, wheel_dir: Path) -> Path:
    """The bundle of the applied tree, unpacked; returns its top folder."""
    if not (TREE / "vllm" / "__init__.py").is_file():
        pytest.skip("work/vllm is absent: run 'hybrid-stack apply' (CI applies it first)")
    out = tmp_path_factory.mktemp("bundle")
    rc = main(["--root", str(ROOT), "bundle", "--wheel-dir", str(wheel_dir), "--out", str(out)])
    assert rc == 0
    tarball = out / f"{bundle.DEFAULT_NAME}.tar.gz"
    with tarfile.open(tarball) as tf:
        tf.extractall(out / "x", filter="data")
    return out / "x" / bundle.DEFAULT_NAME


def runtime_python() -> str | None:
    """An interpreter with torch and vLLM's pure-Python deps (the lean build venv)."""
    cands = [os.environ.get("HYBRID_STACK_TEST_PYTHON", ""), str(ROOT / "work/venv/bin/python")]
    cands.append(sys.executable)
    for py in filter(None, cands):
        if not Path(py).exists():
            continue
        probe = subprocess.run(
            [py, "-c", "import torch, pydantic, msgspec, zmq"], capture_output=True, check=False
        )
        if probe.returncode == 0:
            return py
    return None


def load_runner(top: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("bundle_run", top / "run.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# --- contents -----------------------------------------------------------------


@needs_tree
def test_bundle_holds_sources_tests_benches_wheels(built: Path, wheel_dir: Path):
    files = {p.relative_to(built).as_posix() for p in built.rglob("*") if p.is_file()}
    tree_py = {
        f"src/{p.relative_to(TREE).as_posix()}"
        for p in (TREE / "vllm").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert tree_py - files == set()
    assert not [f for f in files if f.endswith((".so", ".pyc")) or "__pycache__" in f]
    version = load_stack(ROOT).pin.version
    assert f"src/vllm-{version}.dist-info/METADATA" in files
    assert {f"wheels/{w.name}" for w in wheel_dir.glob("*.whl")} <= files
    names = bundle.benches(load_stack(ROOT))
    # the entries name their benchmarks (series.toml benches), the base ones are added
    assert set(bundle.BASE_BENCHES) < set(names)
    assert {b for e in load_stack(ROOT).entries for b in e.benches} <= set(names)
    assert {f"bench/{b}.py" for b in names} | {"bench/common.py"} <= files
    manifest = json.loads((built / "manifest.json").read_text())
    assert manifest["vllm_version"] == version
    assert manifest["benches"] == names
    # every selected test file (upstream and series gpu_tests) is in the bundle
    for name, ids in manifest["selections"].items():
        for tid in ids:
            assert tid.split("::")[0] in files, (name, tid)
    # quick is the few upstream files, never an entry's (large) selection
    assert manifest["selections"]["quick"] == list(bundle.QUICK)
    tree_tests = {p.relative_to(TREE).as_posix() for p in (TREE / "tests/kernels/mamba").rglob("*")}
    assert {t for t in tree_tests if t.endswith(".py")} <= files
    # helpers the tests import are carried (tests.kernels.utils, tests.utils, ...)
    assert "tests/kernels/mamba/utils.py" in files
    # upstream's engine-wide conftest is replaced by the bundle's small one
    assert "hybrid-stack" in (built / "tests/conftest.py").read_text()


@needs_tree
def test_listing_names_every_file(built: Path):
    listing = built.parent.parent / f"{bundle.DEFAULT_NAME}.listing.txt"
    listed = {
        line.split()[-1] for line in listing.read_text().splitlines() if not line.startswith("#")
    }
    files = {p.relative_to(built).as_posix() for p in built.rglob("*") if p.is_file()}
    assert listed == files


@needs_tree
def test_flash_attn_shim_only_in_the_bundle(built: Path):
    rel = "vllm/vllm_flash_attn/__init__.py"
    assert "raise ImportError(" in (TREE / rel).read_text()
    shimmed = (built / "src" / rel).read_text()
    assert "raise ImportError(" not in shimmed
    assert "HYBRID_STACK_STUB" in shimmed


@needs_tree
def test_size_limit_is_enforced(tmp_path: Path, wheel_dir: Path, capsys: pytest.CaptureFixture):
    out = tmp_path / "out"
    argv = ["--root", str(ROOT), "bundle", "--wheel-dir", str(wheel_dir), "--out", str(out)]
    rc = main([*argv, "--max-size-mib", "0.5"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "over the 0.5 MiB limit" in err
    assert not (out / f"{bundle.DEFAULT_NAME}.tar.gz").exists()


@needs_tree
def test_out_may_name_the_tarball(tmp_path: Path, wheel_dir: Path):
    out = tmp_path / "sub" / "b.tgz"
    rc = main(["--root", str(ROOT), "bundle", "--wheel-dir", str(wheel_dir), "--out", str(out)])
    assert rc == 0
    assert out.is_file() and tarfile.is_tarfile(out)
    assert (tmp_path / "sub" / "b.listing.txt").is_file()
    with tarfile.open(out) as tf:
        assert f"{bundle.DEFAULT_NAME}/run.py" in tf.getnames()


@needs_tree
def test_out_that_cannot_be_written_is_one_line(
    tmp_path: Path, wheel_dir: Path, capsys: pytest.CaptureFixture
):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    argv = ["--root", str(ROOT), "bundle", "--wheel-dir", str(wheel_dir)]
    rc = main([*argv, "--out", str(blocker / "b")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert "cannot write the bundle to" in err and "writable folder" in err
    assert blocker.read_text() == "not a folder"


def test_an_entrys_unknown_benchmark_is_refused():
    stack = load_stack(ROOT)
    first = stack.entries[0]
    stack.entries[0] = dataclasses.replace(first, benches=(*first.benches, "no_such_bench"))
    with pytest.raises(StackError, match="no benchmark script no_such_bench"):
        bundle.benches(stack)


# --- wheels ---------------------------------------------------------------------


def test_missing_wheel_is_a_clear_error(tmp_path: Path):
    folder = make_wheels(tmp_path / "w", skip="msgspec")
    with pytest.raises(StackError, match=r"msgspec==" + bundle.DEPS["msgspec"]):
        bundle.collect_wheels("3.12", bundle.DEFAULT_PLATFORM, folder)


def test_exact_pins_between_wheels_are_checked(tmp_path: Path):
    folder = make_wheels(tmp_path / "w", core_pin="0.0.1")
    with pytest.raises(StackError, match="pydantic-core==0.0.1"):
        bundle.collect_wheels("3.12", bundle.DEFAULT_PLATFORM, folder)


def test_wheels_for_another_python_are_not_picked(tmp_path: Path):
    folder = make_wheels(tmp_path / "w")
    name = "msgspec"
    (folder / f"msgspec-{bundle.DEPS[name]}-py3-none-any.whl").rename(
        folder / f"msgspec-{bundle.DEPS[name]}-cp311-cp311-manylinux_2_17_x86_64.whl"
    )
    with pytest.raises(StackError, match="msgspec"):
        bundle.collect_wheels("3.12", bundle.DEFAULT_PLATFORM, folder)
    picked = bundle.collect_wheels("3.11", bundle.DEFAULT_PLATFORM, folder)
    assert any(w.path.name.startswith("msgspec-") for w in picked)


def test_pip_download_fills_the_cache_then_works_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    dist = make_wheels(tmp_path / "dist")
    index = tmp_path / "index"
    for whl in dist.glob("*.whl"):
        project = bundle.norm(whl.name.split("-")[0]).replace("_", "-")
        page = index / project
        page.mkdir(parents=True)
        (page / "index.html").write_text(f'<a href="{whl.as_uri()}">{whl.name}</a>')
    monkeypatch.setenv("HYBRID_STACK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_INDEX_URL", index.as_uri())
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    first = bundle.collect_wheels("3.12", bundle.DEFAULT_PLATFORM, None)
    assert {w.name for w in first} == {bundle.norm(n) for n in bundle.DEPS}
    assert all(str(tmp_path / "cache") in str(w.path) for w in first)
    monkeypatch.setenv("PIP_INDEX_URL", (tmp_path / "gone").as_uri())
    again = bundle.collect_wheels("3.12", bundle.DEFAULT_PLATFORM, None)
    assert [w.path for w in again] == [w.path for w in first]


def test_platform_tags_cover_older_manylinux():
    tags = bundle.platform_tags("manylinux_2_28_x86_64")
    assert "manylinux_2_17_x86_64" in tags and "manylinux2014_x86_64" in tags
    assert "manylinux_2_31_x86_64" not in tags
    assert bundle.platform_tags("win_amd64") == ["win_amd64"]


# --- the runner -----------------------------------------------------------------


@needs_tree
def test_runner_refuses_without_cuda(built: Path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    p = subprocess.run(
        [sys.executable, "run.py", "quick", "--out", "r"],
        cwd=built,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert p.returncode == 3, p.stderr
    assert "no CUDA device" in p.stderr
    assert not (built / "r").exists()


@needs_tree
def test_runner_lists_and_rejects_unknown_selections(built: Path):
    p = subprocess.run(
        [sys.executable, "run.py", "--list"], cwd=built, capture_output=True, text=True
    )
    assert p.returncode == 0
    manifest = json.loads((built / "manifest.json").read_text())
    for name in manifest["selections"]:
        assert f"{name}:" in p.stdout
    bad = subprocess.run(
        [sys.executable, "run.py", "no-such-selection"], cwd=built, capture_output=True, text=True
    )
    assert bad.returncode == 2 and "unknown selection" in bad.stderr


@needs_tree
def test_runner_installs_wheels_privately(built: Path, tmp_path: Path):
    run = load_runner(built)
    manifest = run.load_manifest()
    site = tmp_path / "site"
    names = run.install_wheels(manifest, site)
    assert sorted(names) == sorted(manifest["wheels"])
    for name in bundle.DEPS:
        mod = bundle.norm(name)
        assert (site / mod / "__init__.py").is_file()
        assert (site / f"{mod}_extra.py").is_file()  # .data/purelib lands in the root
        assert list(site.glob(f"{mod}-*.dist-info/METADATA"))
    assert not list(site.rglob("*-tool"))  # scripts are not installed
    (site / "pydantic" / "__init__.py").unlink()
    run.install_wheels(manifest, site)  # stamped: a no-op
    assert not (site / "pydantic" / "__init__.py").exists()


@needs_tree
def test_runner_env_exports_the_bundle_import_path(
    built: Path, tmp_path: Path, capsys: pytest.CaptureFixture
):
    run = load_runner(built)
    run.check_python = lambda manifest: None  # the bundle's wheels are for 3.12
    site = tmp_path / "site"
    assert run.main(["--env", "--site", str(site)]) == 0
    exports = capsys.readouterr().out
    assert (site / ".hybrid-stack-installed").is_file()
    probe = (  # find_spec locates vllm without importing it (no torch here)
        "import importlib.metadata as m, importlib.util as u, pydantic; "
        "print(m.version('vllm'), pydantic.__file__, u.find_spec('vllm').origin)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run(
        ["bash", "-c", f'{exports}\n"{sys.executable}" -c "{probe}"'],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert p.returncode == 0, p.stderr
    version, pydantic_file, vllm_file = p.stdout.split()
    assert version == load_stack(ROOT).pin.version
    assert Path(pydantic_file).is_relative_to(site)
    assert Path(vllm_file).is_relative_to(built / "src")


def test_runner_parses_junit_skips_as_skips(tmp_path: Path):
    run = load_runner(bundle.DATA_DIR)
    xml = tmp_path / "j.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="a" name="ok"/>'
        '<testcase classname="a" name="gpu"><skipped message="needs CUDA"/></testcase>'
        '<testcase classname="a" name="bad"><failure message="x"/></testcase>'
        '<testcase classname="a" name="err"><error message="y"/></testcase>'
        "</testsuite></testsuites>"
    )
    res = run.parse_junit(xml)
    assert (res["passed"], res["skipped"], res["failed"], res["errors"]) == (1, 1, 1, 1)
    assert res["skip_reasons"] == {"needs CUDA": 1}
    assert res["failed_ids"] == ["a::bad", "a::err"]


@pytest.mark.parametrize("workers", [1, 2])
def test_runner_keeps_the_results_of_a_stopped_run(tmp_path: Path, workers: int):
    """A step stopped by --timeout keeps the tests that finished, and why
    each failure failed (pytest's own summary never comes)."""
    run = load_runner(bundle.DATA_DIR)
    t = tmp_path / "test_sleepy.py"
    t.write_text(
        "import time\nimport pytest\n"
        "def test_fast():\n    pass\n"
        "def test_skip():\n    pytest.skip('later')\n"
        "def test_bad():\n    assert 0, 'the reason it failed'\n"
        "def test_slow():\n    time.sleep(120)\n"
    )
    args = argparse.Namespace(out=tmp_path, workers=workers, k=None, pytest_arg=[], timeout=20.0)
    res = run.run_tests("sleepy", [str(t)], args, dict(os.environ))
    assert res["rc"] != 0 and res["seconds"] < 60
    log = Path(res["log"]).read_text()
    assert "the reason it failed" in log and "short test summary" not in log
    assert (res["passed"], res["failed"], res["skipped"]) == (1, 1, 1)
    # (pytest names it relative to the runner's folder)
    assert [i.rsplit("/", 1)[-1] for i in res["failed_ids"]] == ["test_sleepy.py::test_bad"]
    assert "no junit report" in res["note"] and "3 test(s)" in res["note"]
    # pytest-xdist's lines: each test's last status counts
    log = tmp_path / "x.log"
    log.write_text(
        "[gw0] [ 25%] PASSED t.py::test_a \n[gw1] [ 50%] FAILED t.py::test_b[x-1] \n"
        "[gw1] [ 75%] ERROR t.py::test_b[x-1] \n[gw2] [100%] SKIPPED t.py::test_c \n"
    )
    res = run.parse_log(log)
    assert (res["passed"], res["errors"], res["skipped"], res["finished"]) == (1, 1, 1, 3)


def test_runner_shards_split_a_selection(tmp_path: Path):
    """--shard I/N: the N shards of a selection run each of its tests once."""
    run = load_runner(bundle.DATA_DIR)
    t = tmp_path / "test_many.py"
    t.write_text(
        "import pytest\n"
        "@pytest.mark.parametrize('i', range(7))\n"
        "def test_p(i):\n    pass\n"
        "def test_q():\n    pass\n"
    )
    env = dict(os.environ, PYTHONPATH=str(bundle.DATA_DIR))
    ran: list[str] = []
    for i in (1, 2, 3):
        args = argparse.Namespace(
            out=tmp_path, workers=1, k=None, pytest_arg=[], timeout=None, shard=f"{i}/3"
        )
        res = run.run_tests("many", [str(t)], args, env)
        assert res["rc"] == 0 and res["selection"] == f"many [shard {i}/3]"
        junit = ET.parse(tmp_path / f"junit-many__shard_{i}_3_.xml")
        names = [c.get("name") for c in junit.iter("testcase")]
        assert res["passed"] == len(names) == [3, 3, 2][i - 1]
        ran += names
    assert sorted(ran) == sorted([f"test_p[{i}]" for i in range(7)] + ["test_q"])


def test_runner_runs_the_test_ids_given_in_one_step():
    """Test ids given as selections run in one pytest (where the first one
    stands), selection names each in their own; unknown names are refused."""
    run = load_runner(bundle.DATA_DIR)
    manifest = {"selections": {"quick": ["tests/a.py"]}}
    ids = ["conftest.py::test_a", "hybrid_stack_shard.py::test_b[x]", "conftest.py::test_c"]
    got = run.resolve(manifest, [ids[0], "quick", ids[1], ids[2]])
    assert got == [("conftest.py::test_a and 2 more", ids), ("quick", ["tests/a.py"])]
    assert run.resolve(manifest, ["quick", ids[1]]) == [
        ("quick", ["tests/a.py"]),
        (ids[1], [ids[1]]),
    ]
    with pytest.raises(run.RunError, match="unknown selection 'nope'"):
        run.resolve(manifest, [ids[0], "nope"])


def test_runner_forwards_benchmark_arguments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """--bench-arg reaches the benchmark's command line; a result named
    <bench>_<mode>-<gpu>.json (ssd_prefill's A/B mode) is found."""
    run = load_runner(bundle.DATA_DIR)
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "demo.py").write_text(
        "import json, pathlib, sys\n"
        "print('argv', *sys.argv[1:])\n"
        "out = pathlib.Path(sys.argv[sys.argv.index('--out') + 1])\n"
        "(out / 'demo_ab-h200.json').write_text(json.dumps({'rows': [{'ratio': 1.25}]}))\n"
    )
    monkeypatch.setattr(run, "HERE", tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    extra = ["--variant=v1=/tmp/v1.py", "--cases", "mamba2-2.7b:16k:1"]
    args = argparse.Namespace(out=out, bench_quick=True, bench_arg=extra, timeout=60)
    res = run.run_bench("demo", args, dict(os.environ), "python run.py --bench demo")
    assert res["rc"] == 0
    log = (out / "bench-demo.log").read_text()
    assert f"argv --out {out} --quick {' '.join(extra)}" in log
    assert res["json"] == str(out / "demo_ab-h200.json") and res["min_ratio"] == 1.25


def test_runner_rejects_a_bad_shard(capsys: pytest.CaptureFixture):
    run = load_runner(bundle.DATA_DIR)
    for bad in ("3/2", "0/2", "1", "a/b", "1/0"):
        with pytest.raises(SystemExit) as e:
            run.main(["--shard", bad])
        assert e.value.code == run.EXIT_USAGE
        assert "expected I/N" in capsys.readouterr().err


# --- stubs ------------------------------------------------------------------------

PROBE = """
import importlib.metadata as m, json, torch
out = {"version": m.version("vllm")}
import vllm.vllm_flash_attn as fa
out["fa2"] = fa.flash_attn_interface.FA2_AVAILABLE
import vllm._C_stable_libtorch as c
out["stub"] = c.HYBRID_STACK_STUB
out["fp8"] = torch.ops._C.cutlass_scaled_mm_supports_fp8(90)
out["uva_schema"] = str(torch.ops._C.get_cuda_view_from_cpu_tensor.default._schema)
from vllm import _custom_ops as ops
x = torch.randn(2, 8)
for name, call in (
    ("rms_norm", lambda: ops.rms_norm(torch.empty_like(x), x, torch.ones(8), 1e-6)),
    ("fa", lambda: fa.flash_attn_varlen_func(
        x.view(2, 1, 8), x.view(2, 1, 8), x.view(2, 1, 8), 2,
        torch.tensor([0, 2], dtype=torch.int32), 2,
        cu_seqlens_k=torch.tensor([0, 2], dtype=torch.int32))),
):
    try:
        call()
        out[name] = "returned"
    except Exception as e:
        out[name] = type(e).__name__
print(json.dumps(out))
"""


@needs_tree
def test_stubs_import_and_compiled_calls_raise(built: Path, tmp_path: Path):
    py = runtime_python()
    if py is None:
        pytest.skip("no interpreter with torch + vLLM's deps (build the lean venv)")
    env = dict(os.environ, PYTHONPATH=str(built / "src"), CUDA_VISIBLE_DEVICES="")
    p = subprocess.run(
        [py, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True, check=False
    )
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["version"] == load_stack(ROOT).pin.version
    assert out["fa2"] is False and out["stub"] is True and out["fp8"] is False
    assert out["rms_norm"] != "returned"
    # the UVA view op is implemented in Python with the compiled op's schema
    bindings = (TREE / "csrc" / "torch_bindings.cpp").read_text()
    schema = out["uva_schema"].removeprefix("_C::")
    assert f'ops.def("{schema}");' in bindings
    assert out["fa"] != "returned"
    # without the bundle's shim the same import fails: the shim is what makes it work
    env["PYTHONPATH"] = str(TREE)
    raw = subprocess.run(
        [py, "-c", "import vllm.vllm_flash_attn"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert raw.returncode != 0 and "ImportError" in raw.stderr


# --- benchmark results ------------------------------------------------------------


def fake_result() -> dict:
    rows = [
        common.make_row({"tokens": 1024, "seqs": 1}, "tok_per_s", 2.0e6, 3.0e6, 0.5, 0.33),
        common.make_row({"tokens": 4096, "seqs": 8}, "tok_per_s", 4.0e6, 4.0e6, 1.0, 1.0),
    ]
    return {
        "bench": "demo",
        "gpu": common.gpu_slug("NVIDIA H200"),
        "torch": "t",
        "triton": "tr",
        "vllm_base": "0.33.0",
        "command": "python run.py --bench demo",
        "rows": rows,
    }


def test_result_rows_and_files(tmp_path: Path, capsys: pytest.CaptureFixture):
    result = fake_result()
    assert result["gpu"] == "h200"
    assert [r["ratio"] for r in result["rows"]] == [1.5, 1.0]
    assert common.validate(result) == []
    broken = dict(result, rows=[{"case": {}, "metric": "x"}])
    assert common.validate(broken)
    args = type("A", (), {"out": tmp_path, "json": None, "md": None})()
    common.write_partial(dict(result, rows=result["rows"][:1]), args)
    partial = json.loads((tmp_path / "demo-h200.partial.json").read_text())
    assert partial["rows"] == result["rows"][:1] and common.validate(partial) == []
    common.finish(result, args)
    assert not (tmp_path / "demo-h200.partial.json").exists()
    saved = json.loads((tmp_path / "demo-h200.json").read_text())
    assert saved["rows"] == result["rows"]
    md = (tmp_path / "demo-h200.md").read_text()
    assert result["command"] in md and md.count("\n| ") == 3
    assert "tokens" in capsys.readouterr().out.splitlines()[-3]


def test_result_legend_names_the_baseline():
    result = fake_result()
    assert common.LEGEND in common.markdown(result)
    legend = "`baseline` is the committed fused kernel, `value` the variant."
    md = common.markdown(dict(result, legend=legend))
    assert legend in md and common.LEGEND not in md
    assert "- legend" not in md  # the legend is the footer, not a header line


def test_committed_results_follow_the_schema():
    results = sorted((ROOT / "results").glob("*.json"))
    for path in results:
        data = json.loads(path.read_text())
        assert common.validate(data) == [], path.name
        # <bench>-<gpu>.json; a CPU-only benchmark is just <bench>.json
        stem = data["bench"] if data["gpu"] == "cpu" else f"{data['bench']}-{data['gpu']}"
        assert path.stem == stem
        md = path.with_suffix(".md")
        assert md.is_file(), f"{md.name} missing beside {path.name}"
        assert data["command"] in md.read_text()


def _parts(tmp_path: Path) -> tuple[Path, Path]:
    """A run stopped after its first row (write_partial's file) and a --cases
    run of the second row, as two device calls leave them."""
    first, rest = fake_result(), fake_result()
    first.update(command="python run.py --bench demo --out o/1", created="2026-01-01T00:00:00Z")
    rest.update(
        command="python run.py --bench demo --bench-arg=--cases=4k:8 --out o/2",
        created="2026-01-01T01:00:00Z",
        rows=first["rows"][1:],
        timing="events",
        notes={"value": "the stack's kernel"},
    )
    a = tmp_path / "1"
    common.write_partial(dict(first, rows=first["rows"][:1]), SimpleNamespace(out=a))
    b = tmp_path / "2" / "demo-h200.json"
    b.parent.mkdir()
    b.write_text(json.dumps(rest))
    return a / "demo-h200.partial.json", b


def test_merge_joins_parts_in_order_and_keeps_their_commands(tmp_path: Path):
    a, b = _parts(tmp_path)
    out = tmp_path / "merged"
    assert common.main(["--merge", "--out", str(out), str(b), str(a)]) == 0
    merged = json.loads((out / "demo-h200.json").read_text())
    assert common.validate(merged) == []
    parts = [json.loads(a.read_text()), json.loads(b.read_text())]
    # rows in the order the parts were given
    assert merged["rows"] == parts[1]["rows"] + parts[0]["rows"]
    assert [r["case"]["tokens"] for r in merged["rows"]] == [4096, 1024]
    # the partial note goes, the complete part's notes and facts stay
    assert merged["notes"] == {"value": "the stack's kernel"} and merged["timing"] == "events"
    assert merged["command"].startswith(f"{parts[1]['command']} && {parts[0]['command']} && ")
    assert merged["command"].endswith(f"&& python3 bench/common.py --merge --out {out} {b} {a}")
    assert merged["parts"] == [
        {"command": parts[1]["command"], "created": "2026-01-01T01:00:00Z", "rows": 1,
         "partial": False},
        {"command": parts[0]["command"], "created": "2026-01-01T00:00:00Z", "rows": 1,
         "partial": True},
    ]  # fmt: skip
    assert merged["created"] == "2026-01-01T01:00:00Z"
    md = (out / "demo-h200.md").read_text()
    assert merged["command"] in md and md.count("\n| ") == 3
    assert "- part 2: `python run.py --bench demo --out o/1`" in md
    assert "stopped before its last case" in md and "- partial:" not in md
    # a merged table merges again: its parts stay the parts that were measured
    again = common.merge([merged], merge_command="m")
    assert again["parts"] == merged["parts"] and again["rows"] == merged["rows"]
    assert again["command"] == f"{merged['command']} && m"


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"bench": "other"}, "parts differ in 'bench'"),
        ({"gpu": "a100"}, "parts differ in 'gpu'"),
        ({"torch": "t2"}, "parts differ in 'torch'"),
        ({"triton": "3.6.0"}, "parts differ in 'triton'"),
        ({"vllm_base": "0.32.0"}, "parts differ in 'vllm_base'"),
        ({"timing": "wall clock"}, "parts differ in 'timing'"),
        ({"notes": {"value": "other"}}, "notes['value']"),
        ({"rows": "dup"}, "measured twice"),
        ({"command": 1}, "breaks the schema: field 'command': expected str, got int"),
    ],
)
def test_merge_refuses_parts_that_are_not_one_table(tmp_path: Path, capsys, change, reason):
    a, b = _parts(tmp_path)
    # the stopped part carries the complete one's facts and notes too, where it agrees
    part = json.loads(a.read_text())
    part["notes"]["value"] = "the stack's kernel"
    a.write_text(json.dumps(dict(part, timing="events")))
    assert common.merge([json.loads(a.read_text()), json.loads(b.read_text())])
    part = json.loads(b.read_text())
    if change.get("rows") == "dup":  # the first part's case again
        change = {"rows": json.loads(a.read_text())["rows"]}
    b.write_text(json.dumps(dict(part, **change)))
    out = tmp_path / "merged"
    with pytest.raises(common.MergeError, match=re.escape(reason)):
        common.merge([json.loads(a.read_text()), json.loads(b.read_text())], [str(a), str(b)])
    assert common.main(["--merge", "--out", str(out), str(a), str(b)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("merge refused: ") and reason in err[0]
    assert not out.exists()  # nothing written


def test_merge_runs_from_an_unpacked_bundle(tmp_path: Path):
    """bench/common.py is a plain script there (no hybrid_stack package)."""
    a, b = _parts(tmp_path)
    bench = tmp_path / "bundle" / "bench"
    bench.mkdir(parents=True)
    bench.joinpath("common.py").write_text(Path(common.__file__).read_text())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cmd = [sys.executable, "-S", "bench/common.py", "--merge", "--out", "m", str(a), str(b)]
    p = subprocess.run(cmd, cwd=bench.parent, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    merged = json.loads((bench.parent / "m" / "demo-h200.json").read_text())
    assert len(merged["rows"]) == 2 and merged["parts"][0]["partial"] is True
    # imported as the plain module `common`, as the bundle's benchmarks do
    probe = (
        "import common, json, sys; print(len(common.merge([json.load(open(sys.argv[1]))])['rows']))"
    )
    p = subprocess.run(
        [sys.executable, "-S", "-c", probe, str(a)],
        cwd=bench,
        env=env,
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0 and p.stdout.strip() == "1", p.stderr


class _FakeCuda:
    """torch.cuda stand-in for Timer on the CPU: events read a fake clock that
    the timed functions move on."""

    def __init__(self) -> None:
        self.now = 0.0
        clock = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.t = math.nan

            def record(self) -> None:
                self.t = clock.now

            def elapsed_time(self, end: Event) -> float:
                return end.t - self.t

        self.Event = Event

    def synchronize(self) -> None:
        pass


def fake_timer(order: list[str]) -> tuple[common.Timer, _FakeCuda]:
    """A Timer on the fake clock; every L2 flush (one per sample) appends "|"
    to order."""
    cuda = _FakeCuda()
    timer = object.__new__(common.Timer)
    timer.torch = type("T", (), {"cuda": cuda})()
    timer.min_sample_ms, timer.max_inner = 4.9, 64  # off float ties
    timer.flush = type("F", (), {"zero_": lambda self: order.append("|")})()
    return timer, cuda


def test_paired_timer_interleaves_samples_and_pairs_slow_phases(
    monkeypatch: pytest.MonkeyPatch,
):
    order: list[str] = []
    timer, cuda = fake_timer(order)
    # the sample-size estimate reads the wall clock: the fake one (s)
    monkeypatch.setattr(common.time, "perf_counter", lambda: cuda.now / 1e3)

    def work(name: str, ms: float):
        def fn(i: int) -> None:
            order.append(name)
            # a shared host 3x slower while the clock is in [45, 90) ms
            cuda.now += ms * (3.0 if 45.0 <= cuda.now < 90.0 else 1.0)

        return fn

    base, val = timer.paired_median_ms([work("b", 1.0), work("v", 0.25)], warmup=2, reps=8)
    samples = "".join(order).split("|")[1:]
    # one sample of each per round, round r starting with function r mod 2;
    # 1.0 ms calls make 5-call samples, 0.25 ms calls 20-call samples
    assert samples == ["b" * 5, "v" * 20, "v" * 20, "b" * 5] * 4
    # the slow phase spans several samples of both: their medians keep the
    # 4x ratio (timed one after the other, v's samples would all be slow)
    assert base == pytest.approx(1.0) and val == pytest.approx(0.25)
    order.clear()
    assert timer.median_ms(work("b", 2.0), warmup=1, reps=5) == pytest.approx(2.0)
    assert "".join(order).split("|")[1:] == ["bbb"] * 5


# --- ssd_prefill: case selection and A/B variants ------------------------------


def test_ssd_prefill_cases_parse_and_bad_ones_are_usage_errors(capsys: pytest.CaptureFixture):
    assert ssd_prefill.parse_case("mamba2-2.7b:16k:1") == ("mamba2-2.7b", 16384, 1)
    assert ssd_prefill.parse_case("nemotron-h-8b:4096:8") == ("nemotron-h-8b", 4096, 8)
    bad = ("mamba2:16k:1", "mamba2-2.7b:16k", "mamba2-2.7b:16m:1", "mamba2-2.7b:16k:0")
    for text in (*bad, "mamba2-2.7b:16k:x", "mamba2-2.7b:16k:1:2"):
        with pytest.raises(argparse.ArgumentTypeError, match="DIMS:TOKENS:SEQS"):
            ssd_prefill.parse_case(text)
    assert ssd_prefill.parse_cases("mamba2-2.7b:16k:1,granite-4.0-h-small:1k:8") == [
        ("mamba2-2.7b", 16384, 1),
        ("granite-4.0-h-small", 1024, 8),
    ]
    with pytest.raises(SystemExit) as e:  # a usage error before torch is imported
        ssd_prefill.main(["--cases=mamba2-2.7b:16k:1", "--cases", "mamba2-2.7b:16k,x"])
    assert e.value.code == 2 and "DIMS:TOKENS:SEQS" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # --dims would be ignored: refused
        ssd_prefill.main(["--dims", "mamba2-2.7b", "--cases=nemotron-h-8b:1k:1"])
    assert e.value.code == 2 and "not both" in capsys.readouterr().err
    # without --cases: every dims x tokens x sequences, in the order the
    # inputs are drawn from the one generator (the committed tables' order)
    assert ssd_prefill.default_cases(["mamba2-2.7b", "nemotron-h-8b"], quick=True) == [
        (d, t, s) for d in ("mamba2-2.7b", "nemotron-h-8b") for t in (1024, 16384) for s in (1, 8)
    ]


def _fake_entry() -> ModuleType:
    """A stand-in for the fused entry module: its entry point returns the
    sm_90 module it sees when called (and fails on request)."""
    entry = ModuleType("fake_ssd_fused")
    entry.ssd_fused_sm90 = "committed"  # type: ignore[attr-defined]

    def fused(*args: object, fail: bool = False) -> object:
        if fail:
            raise RuntimeError("kernel failed")
        return entry.ssd_fused_sm90  # type: ignore[attr-defined]

    entry.mamba_chunk_scan_fused_varlen = fused  # type: ignore[attr-defined]
    return entry


def test_ssd_prefill_sm90_variant_stands_in_during_each_call(tmp_path: Path):
    path = tmp_path / "ssd_fused_sm90_wide.py"
    path.write_text(
        "from __future__ import annotations\n"
        "import dataclasses\n\n\n"
        "@dataclasses.dataclass\n"
        "class Plan:\n    rows: int = 64\n\n\n"
        "def supports(*args):\n    return True\n\n\n"
        "def launch(*args):\n    pass\n"
    )
    entry = _fake_entry()
    name, fn = ssd_prefill.load_variant(f"wide-1={path}", entry)
    assert name == "wide-1"
    active = fn(1, 2)
    assert active.__file__ == str(path) and active.Plan().rows == 64
    assert entry.ssd_fused_sm90 == "committed"  # put back after the call
    with pytest.raises(RuntimeError, match="kernel failed"):
        fn(fail=True)
    assert entry.ssd_fused_sm90 == "committed"  # and after a failing one


def test_ssd_prefill_entry_variant_is_called_itself(tmp_path: Path):
    path = tmp_path / "ssd_fused_v.py"
    path.write_text("def mamba_chunk_scan_fused_varlen(*args):\n    return 'variant', args\n")
    entry = _fake_entry()
    name, fn = ssd_prefill.load_variant(f"e={path}", entry)
    assert (name, fn(3)) == ("e", ("variant", (3,)))
    assert entry.ssd_fused_sm90 == "committed"


def test_ssd_prefill_bad_variants_are_refused(tmp_path: Path):
    other = tmp_path / "other.py"
    other.write_text("x = 1\n")
    for spec, msg in (
        (str(other), "expected NAME=PATH"),
        (f"a={tmp_path / 'missing.py'}", "expected NAME=PATH"),
        (f"a b={other}", "expected NAME=PATH"),
        (f"a={other}", "has neither mamba_chunk_scan_fused_varlen"),
    ):
        with pytest.raises(SystemExit, match=msg):
            ssd_prefill.load_variant(spec, _fake_entry())


class _Vec:
    """The few tensor methods ssd_prefill's checks use, on a list of floats."""

    def __init__(self, vals: list[float]):
        self.vals = list(vals)

    def fill_(self, v: float) -> None:
        self.vals = [v] * len(self.vals)

    def clone(self) -> _Vec:
        return _Vec(self.vals)

    def double(self) -> _Vec:
        return self

    def isnan(self) -> _Vec:
        return _Vec([float(math.isnan(v)) for v in self.vals])

    def sum(self) -> float:
        return sum(self.vals)

    def __sub__(self, other: _Vec) -> _Vec:
        return _Vec([a - b for a, b in zip(self.vals, other.vals)])

    def norm(self) -> _Vec:
        return _Vec([math.sqrt(sum(v * v for v in self.vals))])

    def clamp_min(self, lo: float) -> _Vec:
        return _Vec([max(v, lo) for v in self.vals])

    def __truediv__(self, other: _Vec) -> _Vec:
        return _Vec([self.vals[0] / other.vals[0]])

    def __float__(self) -> float:
        return self.vals[0]


def test_ssd_prefill_checked_run_prefills_and_counts_unwritten():
    """checked_run NaN-prefills both outputs before the call, so what a kernel
    leaves unwritten is counted, and compares against reference's copies."""
    s = SimpleNamespace(out=_Vec([0.0] * 4), states=_Vec([0.0] * 2))

    def kernel(values: list[float], states: list[float]):
        def fn(inputs: SimpleNamespace) -> None:
            # writes the first len(values) outputs, leaves the rest as found
            inputs.out.vals[: len(values)] = values
            inputs.states.vals[: len(states)] = states

        return fn

    s.run = lambda fn: fn(s)
    ref = ssd_prefill.reference(s, kernel([3.0, 4.0, 0.0, 0.0], [1.0, 1.0]))
    assert ref[0].vals == [3.0, 4.0, 0.0, 0.0]
    s.out.vals[0] = 99.0  # the reference is a copy
    assert ref[0].vals[0] == 3.0
    full = ssd_prefill.checked_run(s, kernel([3.0, 4.0, 0.0, 0.0], [1.0, 1.0]), ref)
    assert full == {"out_rel_err": 0.0, "state_rel_err": 0.0, "nan_outputs": 0}
    off = ssd_prefill.checked_run(s, kernel([3.0, 4.0, 0.0, 5.0], [1.0, 1.0]), ref)
    assert off["out_rel_err"] == pytest.approx(1.0) and off["nan_outputs"] == 0
    part = ssd_prefill.checked_run(s, kernel([3.0, 4.0], [1.0]), ref)
    assert part["nan_outputs"] == 3


def test_walk_leaves_out_tool_caches(tmp_path: Path):
    """A working copy's tool caches (a linter run inside bundle_data/e2e
    once put .ruff_cache in the bundle) never travel."""
    (tmp_path / "e2e" / "models").mkdir(parents=True)
    (tmp_path / "e2e" / "harness.py").write_text("")
    (tmp_path / "e2e" / "models" / "config.json").write_text("{}")
    for cache in (".ruff_cache/0.17.6", "__pycache__", ".hypothesis/examples", ".pytest_cache"):
        (tmp_path / "e2e" / cache).mkdir(parents=True)
        (tmp_path / "e2e" / cache / "x").write_text("")
    got = [p.relative_to(tmp_path).as_posix() for p in bundle.walk(tmp_path)]
    assert got == ["e2e/harness.py", "e2e/models/config.json"]


def test_runner_gives_each_worker_its_share_of_the_cores(tmp_path: Path):
    """pytest-xdist workers get OMP_NUM_THREADS = cores // workers (at least
    1), so the tests' CPU references do not oversubscribe the cores; a
    caller's own OMP_NUM_THREADS is kept."""
    run = load_runner(bundle.DATA_DIR)
    assert run.worker_threads({}, 17, cores=16)["OMP_NUM_THREADS"] == "1"
    assert run.worker_threads({}, 3, cores=16)["OMP_NUM_THREADS"] == "5"
    assert run.worker_threads({"OMP_NUM_THREADS": "7"}, 4, cores=16) == {"OMP_NUM_THREADS": "7"}
    seen = tmp_path / "seen"
    t = tmp_path / "test_env.py"
    t.write_text(
        "import os, pathlib\n"
        "def test_a():\n"
        f"    pathlib.Path({str(seen)!r}).write_text(os.environ.get('OMP_NUM_THREADS', '-'))\n"
        "def test_b():\n    pass\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    assert run.have_xdist(env)
    share = str(max(1, len(os.sched_getaffinity(0)) // 2))
    for workers, want in ((2, share), (1, "-")):
        args = argparse.Namespace(
            out=tmp_path, workers=workers, k=None, pytest_arg=[], timeout=None
        )
        res = run.run_tests(f"env{workers}", [str(t)], args, env)
        assert res["rc"] == 0 and res["passed"] == 2
        assert seen.read_text() == want

# SPDX-License-Identifier: Apache-2.0
"""Tests of `hybrid-stack build`: arguments, the dependency stamp, errors.

The pip steps are faked (``run_step``/``verify_import``) except in the one
integration test, which needs a built venv (marker ``venv``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from hybrid_stack import build, cli
from hybrid_stack.errors import StackError
from hybrid_stack.stack import load_stack

REPO = Path(__file__).resolve().parents[1]

SHA_A, SHA_B = "a" * 64, "b" * 64
WHEEL = "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
PIN = f"""\
[upstream]
project = "vllm"
version = "0.33.0"
sdist = {{ filename = "vllm-0.33.0.tar.gz", sha256 = "{SHA_A}" }}
wheel = {{ filename = "{WHEEL}", sha256 = "{SHA_B}" }}
"""


def git(cwd: Path, *argv: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@e",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@e",
    }
    return subprocess.run(
        ["git", "-C", str(cwd), *argv],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    ).stdout.strip()


@pytest.fixture
def stack_root(tmp_path: Path) -> Path:
    """A stack with an empty series and a fake applied tree under work/vllm."""
    root = tmp_path / "stack"
    (root / "patches").mkdir(parents=True)
    (root / "patches" / "pin.toml").write_text(PIN)
    (root / "patches" / "series.toml").write_text("")
    tree = root / "work" / "vllm"
    (tree / "vllm").mkdir(parents=True)
    (tree / "requirements").mkdir()
    (tree / "requirements" / "common.txt").write_text("regex\n")
    (tree / "setup.py").write_text("")
    (tree / "vllm" / "__init__.py").write_text("")
    git(tree, "init", "-q")
    git(tree, "add", "-A")
    git(tree, "commit", "-q", "-m", "base")
    return root


class FakeVenv:
    """Records the steps build() would run; pretends each succeeds."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, venv: Path) -> None:
        self.steps: list[str] = []
        (venv / "bin").mkdir(parents=True)
        (venv / "lib" / "python3.11" / "site-packages").mkdir(parents=True)
        (venv / "bin" / "python").write_text("")
        monkeypatch.setattr(build, "python_version", lambda py: "3.11.7")
        monkeypatch.setattr(build, "run_step", self.run_step)
        monkeypatch.setattr(build, "verify_import", self.verify)
        monkeypatch.setattr(build, "dir_size", lambda p: 0)

    def run_step(self, step: build.Step, i: int, n: int, log: Path, **kw) -> float:
        self.steps.append(step.name)
        self.last_env = step.env
        return 1.0

    def verify(self, py: Path, tree: Path, version: str, cwd: Path):
        return str(tree / "vllm" / "__init__.py"), version

    def take(self) -> list[str]:
        steps, self.steps = self.steps, []
        return steps


def do_build(root: Path, **kw) -> dict:
    stack = load_stack(root)
    return build.build(
        stack,
        profile=kw.pop("profile", "lean"),
        venv=root / "work" / "venv",
        tree=stack.default_work,
        **kw,
    )


def test_parser_defaults_and_choices() -> None:
    parser = cli.make_parser()
    args = parser.parse_args(["build"])
    assert args.profile == "lean" and args.venv is None and not args.force
    assert args.func is build.run
    args = parser.parse_args(["build", "--profile", "full", "--venv", "/x", "--force"])
    assert args.profile == "full" and args.venv == Path("/x") and args.force
    with pytest.raises(SystemExit):
        parser.parse_args(["build", "--profile", "huge"])


def test_rebuild_skips_dependencies(stack_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeVenv(monkeypatch, stack_root / "work" / "venv")
    tree = stack_root / "work" / "vllm"
    first = do_build(stack_root)
    steps = fake.take()
    assert steps[0].startswith("torch (CPU)") and len(steps) == 3
    assert fake.last_env["VLLM_TARGET_DEVICE"] == "empty"
    version = first["editable"]["version"]
    assert version == f"0.33.0+hybridstack.{git(tree, 'rev-parse', '--short=10', 'HEAD')}"
    assert fake.last_env["VLLM_VERSION_OVERRIDE"] == version

    # the lean profile's torchvision startup hook is in site-packages
    sp = stack_root / "work" / "venv" / "lib" / "python3.11" / "site-packages"
    assert (sp / build.SITE_HOOK_PTH).read_text() == f"import {build.SITE_HOOK.stem}\n"
    assert (sp / build.SITE_HOOK.name).read_text() == build.SITE_HOOK.read_text()

    # nothing changed: nothing to do
    do_build(stack_root)
    assert fake.take() == []

    # a patch changed the tree: only the editable install is redone
    (tree / "vllm" / "__init__.py").write_text("# patched\n")
    git(tree, "commit", "-qam", "patch")
    second = do_build(stack_root)
    assert fake.take() == [build.editable_step("lean", tree, tree, "", None).name]
    assert second["deps"] == first["deps"]
    assert second["editable"]["version"] != version

    # uncommitted edits show in the version
    (tree / "vllm" / "__init__.py").write_text("# dirty\n")
    third = do_build(stack_root)
    assert third["editable"]["version"].endswith(".dirty")
    assert len(fake.take()) == 1

    # the requirements changed: the dependencies are reinstalled
    (tree / "requirements" / "common.txt").write_text("regex\nnumpy\n")
    fourth = do_build(stack_root)
    assert len(fake.take()) == 3
    assert fourth["deps"] != first["deps"]

    # --force reinstalls them too
    do_build(stack_root, force=True)
    assert len(fake.take()) == 3


def test_stamp_survives_a_failed_editable_install(
    stack_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeVenv(monkeypatch, stack_root / "work" / "venv")

    def failing(step: build.Step, *a, **kw) -> float:
        fake.steps.append(step.name)
        if step.env:  # the editable step
            raise StackError("boom")
        return 1.0

    monkeypatch.setattr(build, "run_step", failing)
    with pytest.raises(StackError):
        do_build(stack_root)
    assert len(fake.take()) == 3
    assert build.read_stamp(stack_root / "work" / "venv")["deps"]
    monkeypatch.setattr(build, "run_step", fake.run_step)
    do_build(stack_root)
    assert len(fake.take()) == 1  # dependencies were recorded as installed

    # a dependency step that fails leaves no current-looking stamp behind
    def failing_deps(step: build.Step, *a, **kw) -> float:
        raise StackError("boom")

    (stack_root / "work" / "vllm" / "requirements" / "common.txt").write_text("numpy\n")
    monkeypatch.setattr(build, "run_step", failing_deps)
    with pytest.raises(StackError):
        do_build(stack_root)
    assert build.read_stamp(stack_root / "work" / "venv")["deps"] is None


def test_full_disk_is_refused_before_pip(stack_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeVenv(monkeypatch, stack_root / "work" / "venv")
    do_build(stack_root)
    fake.take()
    stamp = build.read_stamp(stack_root / "work" / "venv")
    # the requirements changed, so the dependencies must be reinstalled
    (stack_root / "work" / "vllm" / "requirements" / "common.txt").write_text("numpy\n")

    def free_gb(gb: float) -> None:
        usage = shutil._ntuple_diskusage(int(9e10), int(9e10 - gb * 1e9), int(gb * 1e9))
        monkeypatch.setattr(build.shutil, "disk_usage", lambda p: usage)

    free_gb(1.0)
    with pytest.raises(StackError, match=r"not enough disk for the lean.*1\.0 GB free"):
        do_build(stack_root)
    assert fake.take() == []  # no pip step started
    assert build.read_stamp(stack_root / "work" / "venv") == stamp
    # with the space there, the same build goes ahead
    free_gb(8.0)
    do_build(stack_root)
    assert len(fake.take()) == 3


def test_disk_check_sums_needs_per_file_system(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    venv = tmp_path / "not" / "yet" / "venv"
    assert build.existing_ancestor(venv) == tmp_path
    need = build.DISK_NEEDED_GB["lean"]
    free = {"gb": need["venv"] + need["tmp"] - 0.5}
    monkeypatch.setattr(
        build.shutil,
        "disk_usage",
        lambda p: shutil._ntuple_diskusage(0, 0, int(free["gb"] * 1e9)),
    )
    # venv and temp on one file system: their needs add up
    monkeypatch.setattr(build.tempfile, "gettempdir", lambda: str(tmp_path))
    with pytest.raises(StackError, match="the venv .* and pip's temporary directory"):
        build.check_disk("lean", venv)
    # on two file systems each only needs its own share
    real_stat = os.stat

    def stat(path, *a, **kw):
        st = real_stat(path, *a, **kw)
        if Path(path) == tmp_path / "tmp":
            return os.stat_result((*st[:2], st.st_dev + 1, *st[3:]))
        return st

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(build.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    monkeypatch.setattr(build.os, "stat", stat)
    build.check_disk("lean", venv)
    free["gb"] = need["tmp"] - 0.5
    with pytest.raises(StackError) as err:
        build.check_disk("lean", venv)
    assert "the venv" in str(err.value) and "temporary directory" in str(err.value)
    assert " and pip's" not in str(err.value)  # two separate lines, not one sum


def test_dependency_key(stack_root: Path) -> None:
    stack = load_stack(stack_root)
    tree = stack.default_work
    lean = build.dependency_key(stack, "lean", tree, "3.11.7")
    assert lean == build.dependency_key(stack, "lean", tree, "3.11.7")
    assert lean != build.dependency_key(stack, "lean", tree, "3.12.1")
    assert lean != build.dependency_key(stack, "full", tree, "3.11.7")
    assert lean != build.dependency_key(stack, "lean", tree, "3.11.7", torch_index="https://x")
    (tree / "requirements" / "common.txt").unlink()
    with pytest.raises(StackError, match="hybrid-stack apply"):
        build.dependency_key(stack, "lean", tree, "3.11.7")


def test_full_profile_uses_the_wheel(
    stack_root: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake = FakeVenv(monkeypatch, stack_root / "work" / "venv")
    wheel = tmp_path / "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"")
    do_build(stack_root, profile="full", wheel=wheel)
    steps = fake.take()
    assert len(steps) == 3 and "wheel" in steps[0]
    assert fake.last_env["VLLM_PRECOMPILED_WHEEL_LOCATION"] == str(wheel)
    assert fake.last_env["VLLM_TARGET_DEVICE"] == "cuda"
    sp = stack_root / "work" / "venv" / "lib" / "python3.11" / "site-packages"
    assert not (sp / build.SITE_HOOK_PTH).exists()  # only the lean profile has it
    with pytest.raises(StackError, match="does not exist"):
        do_build(stack_root, profile="full", wheel=tmp_path / "missing.whl")


def test_not_a_tree(stack_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    FakeVenv(monkeypatch, stack_root / "work" / "venv")
    shutil.rmtree(stack_root / "work" / "vllm")
    with pytest.raises(StackError, match="hybrid-stack apply"):
        do_build(stack_root)


@pytest.mark.parametrize(
    ("output", "package"),
    [
        (
            "ERROR: Could not find a version that satisfies the requirement "
            "torch==2.13.0+cpu\nERROR: No matching distribution found for "
            "torch==2.13.0+cpu\n",
            "torch==2.13.0+cpu",
        ),
        ("Building wheel for xgrammar\nERROR: Failed to build xgrammar\n", "xgrammar"),
        ("Collecting regex\nCollecting weird-pkg\nKilled\n", "weird-pkg"),
    ],
)
def test_diagnose_names_the_package(output: str, package: str) -> None:
    pkg, fix = build.diagnose(build.Step("deps", []), output)
    assert pkg == package and fix


def test_failed_step_is_one_line_with_package(tmp_path: Path) -> None:
    code = (
        "print('Collecting nosuchpkg'); "
        "print('ERROR: No matching distribution found for nosuchpkg'); "
        "raise SystemExit(1)"
    )
    step = build.Step("deps", [sys.executable, "-c", code])
    with pytest.raises(StackError) as e:
        build.run_step(step, 1, 1, tmp_path / "log", verbose=False)
    msg = str(e.value)
    assert "\n" not in msg and "nosuchpkg" in msg and "--torch-index" in msg
    assert "nosuchpkg" in (tmp_path / "log").read_text()


# ------------------------------------------------------------------ integration

VENV = REPO / "work" / "venv"


@pytest.mark.venv
@pytest.mark.skipif(
    not (VENV / "bin" / "python").exists(),
    reason="needs work/venv: run 'hybrid-stack build' first (CI does)",
)
def test_build_imports_the_patched_tree(tmp_path: Path) -> None:
    """Real lean build (a no-op or an editable reinstall on a built venv), then
    the venv's python imports vllm from work/vllm, with the stack's version,
    and sees a file written into the tree's vllm/ package just now."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "scripts")}
    proc = subprocess.run(
        [sys.executable, "-m", "hybrid_stack.cli", "--root", str(REPO), "build"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    stack = load_stack(REPO)
    tree = stack.default_work
    expected = build.tree_version(stack, tree)
    assert f"vllm {expected} from {tree / 'vllm'}" in proc.stdout

    marker = uuid.uuid4().hex
    probe = tree / "vllm" / f"_hybridstack_probe_{marker[:8]}.py"
    probe.write_text(f"MARKER = {marker!r}\n")
    try:
        code = (
            "import importlib, vllm; "
            f"m = importlib.import_module('vllm.{probe.stem}'); "
            "print(vllm.__file__); print(vllm.__version__); print(m.MARKER)"
        )
        out = subprocess.run(
            [str(VENV / "bin" / "python"), "-c", code],
            cwd=tmp_path,  # never the tree root: its vllm/ would shadow the install
            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
    finally:
        probe.unlink()
    assert Path(out[0]).resolve().is_relative_to((tree / "vllm").resolve())
    assert out[1] == expected and out[1].startswith(f"{stack.pin.version}+hybridstack.")
    assert out[2] == marker


def test_a_half_made_venv_is_made_again(
    stack_root: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A build killed while `python -m venv` ran left the venv half-made (its
    marker inside): the next build removes it and creates it again."""
    venv = stack_root / "work" / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / build.CREATING).write_text("")
    (venv / "bin" / "half").write_text("")
    maker = tmp_path / "python"  # stands in for `python -m venv DIR`
    maker.write_text(
        '#!/bin/sh\nmkdir -p "$3/bin" "$3/lib/python3.11/site-packages"\ntouch "$3/bin/python"\n'
    )
    maker.chmod(0o755)
    fake = FakeVenv.__new__(FakeVenv)
    fake.steps = []
    monkeypatch.setattr(build, "python_version", lambda py: "3.11.7")
    monkeypatch.setattr(build, "run_step", fake.run_step)
    monkeypatch.setattr(build, "verify_import", fake.verify)
    monkeypatch.setattr(build, "dir_size", lambda p: 0)
    do_build(stack_root, python=str(maker))
    assert not (venv / "bin" / "half").exists()
    assert not (venv / build.CREATING).exists()
    assert (venv / "bin" / "python").exists()

# SPDX-License-Identifier: Apache-2.0
"""Kill apply / fetch at many instants; the rerun gives the clean result.

Each kill is a SIGKILL (nothing of the tool's own clean-up runs): at named
points (``HYBRID_STACK_KILL_AT``, proc.crash_point) and after a delay. The
rerun, with no manual step, must give the tree a clean apply gives (same
commit id: apply is deterministic), on branch ``stack``, clean, with the
build outputs present, and leave no temporary data, backup ref or marker.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import CORE_V1, Toy, add_entry, git
from hybrid_stack.stack import cache_dir

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
EDIT_A = CORE_V1.replace("return x + 3\n", "return x + 3  # A\n")
EDIT_B = CORE_V1.replace("return x + 9\n", "return x + 9  # B\n")


def cli_proc(toy: Toy, *args: str, kill_at: str = "") -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(SCRIPTS)}
    env.pop("HYBRID_STACK_KILL_AT", None)
    if kill_at:
        env["HYBRID_STACK_KILL_AT"] = kill_at
    return subprocess.Popen(
        [sys.executable, "-m", "hybrid_stack.cli", "--root", str(toy.root), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def cli(toy: Toy, *args: str, kill_at: str = "") -> tuple[int, str]:
    p = cli_proc(toy, *args, kill_at=kill_at)
    out, errs = p.communicate(timeout=120)
    return p.returncode, out + errs


@pytest.fixture
def two_entries(toy: Toy, tmp_path: Path) -> Toy:
    """A series of two entries (a: patch + overlay file, b: patch), exported;
    work/vllm removed so the next apply makes it from scratch."""
    assert toy.cli("apply") == 0
    add_entry(
        toy,
        "a",
        {"vllm/core.py": EDIT_A, "vllm/new_op.py": "NEW = 1\n"},
        overlay=("vllm/new_op.py",),
    )
    (toy.work / "vllm/core.py").write_text(EDIT_A.replace("return x + 9\n", "return x + 9  # B\n"))
    git(toy.work, "commit", "-qam", "b\n\nStack-Entry: b")
    series = (toy.root / "patches/series.toml").read_text()
    toy.set_series(series + toy.entry_toml("b", "b.patch"))
    assert toy.cli("export") == 0
    shutil.rmtree(toy.work)
    return toy


def clean_head(toy: Toy, tmp_path: Path) -> str:
    """HEAD of a clean apply of the series as it is now, in its own tree."""
    ref = tmp_path / f"ref-{time.monotonic_ns()}"
    assert toy.cli("apply", "--work", str(ref)) == 0
    return git(ref, "rev-parse", "HEAD")


def assert_clean_result(toy: Toy, want: str) -> None:
    w = toy.work
    assert git(w, "rev-parse", "HEAD") == want
    assert git(w, "rev-parse", "--abbrev-ref", "HEAD") == "stack"
    assert git(w, "status", "--porcelain", "--untracked-files=all") == ""
    assert (w / "vllm/_version.py").is_file() and (w / "vllm.egg-info/PKG-INFO").is_file()
    assert git(w, "for-each-ref", "refs/hybrid-stack/backup/") == ""
    gitdir = w / ".git"
    assert not (gitdir / "hybrid-stack-applying").exists()
    assert not (gitdir / "rebase-apply").exists()
    # git's lock files (the tool's own hybrid-stack.lock stays: an flock target)
    assert [p.name for p in gitdir.rglob("*.lock") if p.name != "hybrid-stack.lock"] == []
    # no temporary data beside the tree or in the base cache
    assert [p.name for p in w.parent.iterdir() if p.name != "vllm"] == []
    base = cache_dir() / "base"
    assert [p.name for p in base.iterdir() if p.name.startswith(".tmp")] == []


# point, and the n-th time it is reached: the base being built, the new tree's
# clone, git am done for entry 1 / 2 (HEAD detached on an intermediate
# commit, files staged), overlay copied in (untracked) or staged, branch moved
# but no state written, state written but the marker not removed
POINTS = ["base", "clone", "am", "am:2", "copied", "overlay", "overlay:2", "branch", "state"]


@pytest.mark.parametrize("point", POINTS)
def test_fresh_apply_killed_at_a_point(two_entries: Toy, tmp_path: Path, monkeypatch, point: str):
    toy = two_entries
    if point == "base":  # a cache without the base, so apply builds it
        monkeypatch.setenv("HYBRID_STACK_CACHE", str(tmp_path / "cache2"))
    rc, out = cli(toy, "apply", kill_at=point)
    assert rc == -signal.SIGKILL, out
    rc, out = cli(toy, "apply")
    assert rc == 0, out
    assert_clean_result(toy, clean_head(toy, tmp_path))


@pytest.mark.parametrize("point", ["am", "am:2", "overlay:2", "branch", "state"])
def test_update_apply_killed_at_a_point(two_entries: Toy, tmp_path: Path, point: str):
    """An applied tree, then an overlay edit: the apply that takes it in is
    killed half-way (entry a rebuilt, b not yet)."""
    toy = two_entries
    rc, out = cli(toy, "apply")
    assert rc == 0, out
    (toy.root / "overlay/vllm/new_op.py").write_text("NEW = 2\n")
    rc, out = cli(toy, "apply", kill_at=point)
    assert rc == -signal.SIGKILL, out
    rc, out = cli(toy, "apply")
    assert rc == 0, out
    assert (toy.work / "vllm/new_op.py").read_text() == "NEW = 2\n"
    assert_clean_result(toy, clean_head(toy, tmp_path))


def test_apply_killed_inside_git_am(two_entries: Toy, tmp_path: Path):
    """A one-shot hook inside `git am` kills apply (its git am then dies
    too): the tree holds a git am in progress, half-applied."""
    toy = two_entries
    rc, out = cli(toy, "apply")
    assert rc == 0, out
    hook = toy.work / ".git/hooks/pre-applypatch"
    hook.write_text(
        '#!/bin/sh\nrm -f -- "$0"\nkill -9 "$(ps -o ppid= -p "$PPID" | tr -d " ")"\nsleep 5\n'
    )
    hook.chmod(0o755)
    (toy.root / "overlay/vllm/new_op.py").write_text("NEW = 2\n")
    rc, out = cli(toy, "apply")
    assert rc == -signal.SIGKILL, out
    assert (toy.work / ".git/rebase-apply").is_dir()
    rc, out = cli(toy, "apply")
    assert rc == 0, out
    assert_clean_result(toy, clean_head(toy, tmp_path))


@pytest.mark.parametrize("delay_ms", [150, 300, 450, 600, 800, 1100])
def test_apply_killed_after_a_delay(two_entries: Toy, tmp_path: Path, monkeypatch, delay_ms: int):
    toy = two_entries
    monkeypatch.setenv("HYBRID_STACK_CACHE", str(tmp_path / "cache2"))  # base built too
    p = cli_proc(toy, "apply")
    time.sleep(delay_ms / 1000)
    p.send_signal(signal.SIGKILL)
    p.communicate(timeout=60)
    rc, out = cli(toy, "apply")
    assert rc == 0, out
    assert_clean_result(toy, clean_head(toy, tmp_path))


def test_fetch_killed_mid_download(toy: Toy):
    rc, out = cli(toy, "fetch", kill_at="download")
    assert rc == -signal.SIGKILL, out
    dist = cache_dir() / "dist"
    assert any(".part-" in p.name for p in dist.iterdir())  # the killed run's part
    assert not (dist / toy.filename).exists()
    rc, out = cli(toy, "fetch")
    assert rc == 0, out
    assert sorted(p.name for p in dist.iterdir()) == [toy.filename]


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(stat.read_text().split(") ", 1)[1].split()[1]) == pid:
                kids.append(int(stat.parent.name))
    return kids


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_tool_leaves_no_git_running(tmp_path: Path):
    """A git child (here one that waits on a hook) dies with the tool."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    code = (
        "import sys; from pathlib import Path; from hybrid_stack.gitops import Repo; "
        "Repo(Path(sys.argv[1])).run('-c', 'alias.wait=!exec sleep 30', 'wait')"
    )
    env = {**os.environ, "PYTHONPATH": str(SCRIPTS)}
    tool = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], env=env)
    deadline = time.monotonic() + 20
    gits: list[int] = []
    while not gits and time.monotonic() < deadline:
        time.sleep(0.05)
        gits = _children(tool.pid)
    assert gits, "the tool never started git"
    (git_pid,) = gits
    sleeper = []
    while not sleeper and time.monotonic() < deadline:
        time.sleep(0.05)
        sleeper = _children(git_pid)
    tool.send_signal(signal.SIGKILL)
    tool.wait()
    try:
        for _ in range(100):
            if not Path(f"/proc/{git_pid}").exists() or "Z" in _state(git_pid):
                break
            time.sleep(0.05)
        assert not Path(f"/proc/{git_pid}").exists() or "Z" in _state(git_pid)
    finally:
        for pid in sleeper:  # git's own child (the alias' shell), started by this test
            with_suppress_kill(pid)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].split()[0]
    except OSError:
        return "Z"


def with_suppress_kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def test_check_killed_leaves_no_trial_tree(two_entries: Toy, tmp_path: Path, monkeypatch):
    """check applies into a temporary tree; killed there, the next check
    removes that tree."""
    toy = two_entries
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    rc, out = cli(toy, "check", kill_at="am")
    assert rc == -signal.SIGKILL, out
    assert [p.name for p in (tmp_path / "tmp").iterdir() if "trial" in p.name]
    rc, out = cli(toy, "check")
    assert rc == 0, out
    assert [p.name for p in (tmp_path / "tmp").iterdir() if "trial" in p.name] == []

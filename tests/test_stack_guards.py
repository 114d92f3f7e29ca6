# SPDX-License-Identifier: Apache-2.0
"""CLI-level tests of the promises apply / export / check / fetch make.

Each test here was written against a deliberate bug (a mutation of the tool)
that every earlier tooling test let through; the mutation it catches is
named in its docstring. They run the verbs as a user does, on the synthetic
upstream of conftest.py.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from conftest import CORE_V1, Toy, add_entry, git, make_sdist, write_index
from hybrid_stack.stack import cache_dir

# two edits of vllm/core.py close enough that the second patch's context holds
# the first one's line: f3's return (line 14) and f4's def (line 17)
EDIT_A = CORE_V1.replace("return x + 3\n", "return x + 3  # A\n")
EDIT_AB = EDIT_A.replace("def f4(x):\n", "def f4(x):  # B\n")


def err(capsys: pytest.CaptureFixture) -> str:
    return capsys.readouterr().err.strip()


def head(toy: Toy, work: Path | None = None) -> str:
    return git(work or toy.work, "rev-parse", "HEAD")


def canonical(toy: Toy) -> None:
    """apply twice: the tree holds the canonical commits and apply's record."""
    assert toy.cli("apply") == 0
    assert toy.cli("apply") == 0


def with_overlay_entry(toy: Toy) -> None:
    assert toy.cli("apply") == 0
    add_entry(
        toy,
        "edit-core",
        {"vllm/core.py": EDIT_A, "vllm/new_op.py": "NEW = 1\n"},
        overlay=("vllm/new_op.py",),
    )
    canonical(toy)


# -- apply notices every input of an entry --------------------------------------
def test_apply_takes_an_overlay_edit_into_the_tree(toy: Toy, capsys):
    """Mutation: overlay contents left out of the entry fingerprint."""
    with_overlay_entry(toy)
    before = head(toy)
    (toy.root / "overlay/vllm/new_op.py").write_text("NEW = 2\n")
    capsys.readouterr()
    assert toy.cli("apply") == 0
    assert "up to date" not in capsys.readouterr().out
    assert (toy.work / "vllm/new_op.py").read_text() == "NEW = 2\n"
    assert git(toy.work, "show", "HEAD:vllm/new_op.py") == "NEW = 2"
    assert head(toy) != before
    assert git(toy.work, "status", "--porcelain") == ""


def test_apply_takes_an_overlay_exec_bit_into_the_tree(toy: Toy):
    """Mutations: the exec bit left out of the fingerprint; overlay files
    copied without it."""
    with_overlay_entry(toy)
    op = toy.root / "overlay/vllm/new_op.py"
    op.chmod(0o755)
    assert toy.cli("apply") == 0
    assert git(toy.work, "ls-files", "-s", "vllm/new_op.py").startswith("100755")
    assert os.access(toy.work / "vllm/new_op.py", os.X_OK)
    assert git(toy.work, "status", "--porcelain") == ""


def test_apply_takes_a_patch_edit_into_the_tree(toy: Toy):
    """Mutation: the patch file left out of the entry fingerprint."""
    with_overlay_entry(toy)
    patch = toy.root / "patches/edit-core.patch"
    patch.write_text(patch.read_text().replace("+    return x + 3  # A", "+    return x + 3  # A2"))
    assert toy.cli("apply") == 0
    assert "return x + 3  # A2\n" in (toy.work / "vllm/core.py").read_text()


def test_apply_takes_a_description_edit_into_the_commit(toy: Toy):
    """Mutation: the commit message left out of the entry fingerprint."""
    with_overlay_entry(toy)
    series = toy.root / "patches/series.toml"
    series.write_text(series.read_text().replace("Why: testing", "Why: still testing"))
    assert toy.cli("apply") == 0
    assert "Why: still testing edit-core" in git(toy.work, "log", "-1", "--format=%B")


def test_entry_that_changes_nothing_is_refused(toy: Toy, capsys):
    """Mutation: the "entry changes nothing" guard removed."""
    assert toy.cli("apply") == 0
    # an overlay file equal to the upstream file: the entry's commit is empty
    toy.set_series(toy.entry_toml("no-op", overlay=("vllm/__init__.py",)))
    init = toy.work / "vllm/__init__.py"
    (toy.root / "overlay/vllm").mkdir(parents=True)
    (toy.root / "overlay/vllm/__init__.py").write_bytes(init.read_bytes())
    assert toy.cli("apply") == 2
    assert (
        "entry 'no-op' changes nothing on top of the previous entries "
        "(already upstream? mark it upstreamed or dropped)" in err(capsys)
    )


def test_apply_merges_three_way_when_the_context_moved(toy: Toy):
    """Mutation: --3way dropped from git am. Entry B's patch has entry A's
    line in its context; A's edit changes, so B's context no longer matches
    verbatim, but the tree holds B's preimage and a 3-way merge applies it."""
    assert toy.cli("apply") == 0
    add_entry(toy, "a", {"vllm/core.py": EDIT_A})
    add_entry(toy, "b", {"vllm/core.py": EDIT_AB})
    canonical(toy)
    pa = toy.root / "patches/a.patch"
    pa.write_text(pa.read_text().replace("+    return x + 3  # A", "+    return x + 3  # A v2"))
    assert toy.cli("apply") == 0
    core = (toy.work / "vllm/core.py").read_text()
    assert "return x + 3  # A v2\n" in core and "def f4(x):  # B\n" in core
    assert git(toy.work, "status", "--porcelain") == ""


# -- export's refusals ----------------------------------------------------------
def test_export_refuses_commits_out_of_series_order(toy: Toy, capsys):
    """Mutation: export's commits-match-the-series check removed."""
    assert toy.cli("apply") == 0
    add_entry(toy, "first", {"tools/run.sh": "#!/bin/sh\necho first\n"})
    add_entry(toy, "second", {"vllm/core.py": EDIT_A})
    canonical(toy)
    series = (toy.root / "patches/series.toml").read_text()
    a, b = series.split("[[entry]]")[1:]
    toy.set_series("[[entry]]" + b + "[[entry]]" + a)  # swapped in series.toml only
    before = toy.snapshot()
    assert toy.cli("export") == 2
    assert "do not match the carried entries in series.toml" in err(capsys)
    assert toy.snapshot() == before


def test_export_refuses_two_trailers(toy: Toy, capsys):
    """Mutation: a commit with two Stack-Entry trailers taken as its first."""
    assert toy.cli("apply") == 0
    toy.set_series(toy.entry_toml("a", "a.patch") + toy.entry_toml("b", "b.patch"))
    (toy.work / "vllm/core.py").write_text(EDIT_A)
    git(toy.work, "commit", "-qam", "both\n\nStack-Entry: a\nStack-Entry: b")
    assert toy.cli("export") == 2
    assert "('both') has 2 'Stack-Entry:' trailers" in err(capsys)


def test_export_refuses_a_dirty_tree(toy: Toy, capsys):
    """Mutation: export's uncommitted-changes check removed."""
    with_overlay_entry(toy)
    (toy.work / "vllm/new_op.py").write_text("NEW = 9\n")
    before = toy.snapshot()
    assert toy.cli("export") == 2
    assert "has uncommitted changes (vllm/new_op.py)" in err(capsys)
    assert toy.snapshot() == before


def test_export_keeps_an_overlay_file_executable(toy: Toy):
    """Mutation: export writes overlay files without their mode."""
    assert toy.cli("apply") == 0
    add_entry(toy, "tool", {"tools/new.sh": "#!/bin/sh\n"}, overlay=("tools/new.sh",), patch=False)
    (toy.work / "tools/new.sh").chmod(0o755)
    git(toy.work, "commit", "-q", "-a", "--amend", "--no-edit")
    assert toy.cli("export", "--force") == 0
    assert os.access(toy.root / "overlay/tools/new.sh", os.X_OK)


# -- check ----------------------------------------------------------------------
def test_check_names_an_orphan_patch(toy: Toy, capsys):
    """Mutation: check ignores patch files no entry names."""
    with_overlay_entry(toy)
    assert toy.cli("check") == 0
    (toy.root / "patches/left-over.patch").write_text("old\n")
    capsys.readouterr()
    assert toy.cli("check") == 2
    out = capsys.readouterr()
    assert "stale patches/left-over.patch  [(no entry)]" in out.out
    assert "patches not up to date" in out.err


# -- apply on trees it did not make ----------------------------------------------
def test_apply_refuses_a_repository_on_another_base(toy: Toy, capsys):
    """Mutation: apply's base-tag check removed."""
    toy.work.mkdir(parents=True)
    (toy.work / "x.txt").write_text("mine\n")
    git(toy.work, "init", "-q")
    git(toy.work, "add", "x.txt")
    git(toy.work, "commit", "-qm", "mine")
    assert toy.cli("apply") == 2
    assert "has no tag v0.0.1: it was made from another base" in err(capsys)
    assert git(toy.work, "log", "--format=%s") == "mine"


def test_apply_refuses_a_git_am_it_did_not_start(toy: Toy, capsys):
    """Mutation: apply's operation-in-progress check removed."""
    assert toy.cli("apply") == 0
    add_entry(toy, "a", {"vllm/core.py": EDIT_A})
    canonical(toy)
    git(toy.work, "format-patch", "-1", "-o", str(toy.root / "tmp"))
    (patch,) = (toy.root / "tmp").iterdir()
    git(toy.work, "reset", "-q", "--hard", "HEAD~1")
    (toy.work / "vllm/core.py").write_text(EDIT_A.replace("# A", "# mine"))
    git(toy.work, "commit", "-qam", "mine")
    with pytest.raises(Exception):  # noqa: B017 - git am stops on the conflict
        git(toy.work, "am", str(patch))
    assert toy.cli("apply") == 2
    assert "a git am/rebase is in progress" in err(capsys)
    assert (toy.work / ".git/rebase-apply").is_dir()


# -- fetch ----------------------------------------------------------------------
def test_fetch_offline_never_downloads(toy: Toy, capsys):
    """Mutation: --offline ignored."""
    assert toy.cli("fetch", "--offline") == 2
    assert f"{toy.filename} is not in the cache" in err(capsys)
    assert not (cache_dir() / "dist" / toy.filename).exists()


def test_fetch_checks_a_cached_file(toy: Toy, capsys):
    """Mutation: a cached file used without checking its sha256."""
    assert toy.cli("fetch") == 0
    cached = cache_dir() / "dist" / toy.filename
    cached.write_bytes(b"damaged")
    assert toy.cli("fetch", "--offline") == 2
    msg = err(capsys)
    assert str(cached) in msg and toy.sha in msg


def test_export_is_the_same_whatever_the_users_git_config(toy: Toy, tmp_path, monkeypatch):
    """Mutation: the user's global git config let into the tool's git calls."""
    with_overlay_entry(toy)
    clean = toy.snapshot()
    cfg = tmp_path / "gitconfig"
    cfg.write_text(
        "[diff]\n\tnoprefix = true\n\tmnemonicPrefix = true\n"
        "[format]\n\tsignature = my signature\n\tnumbered = true\n"
    )
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(cfg))
    assert toy.cli("export", "--force") == 0
    assert toy.snapshot() == clean


def test_a_wrong_option_prints_the_verbs_usage(toy: Toy, capsys):
    """Mutation: unknown options reported with the top-level usage."""
    with pytest.raises(SystemExit) as e:
        toy.cli("apply", "--frobnicate")
    assert e.value.code == 2
    msg = err(capsys)
    assert msg.startswith("usage: hybrid-stack apply [-h] [--work WORK]")
    assert msg.endswith("hybrid-stack apply: error: unrecognized arguments: --frobnicate")


def test_continue_adds_the_overlay_files_of_the_resolved_entry(toy: Toy, tmp_path: Path):
    """Mutation: apply --continue leaves out the overlay files of the entry
    resolved by hand (git am brings only its patch)."""
    assert toy.cli("apply") == 0
    add_entry(
        toy,
        "edit-core",
        {"vllm/core.py": EDIT_A, "vllm/new_op.py": "NEW = 1\n"},
        overlay=("vllm/new_op.py",),
    )
    core2 = CORE_V1.replace("return x + 3\n", "return x + 3 + 0\n")
    name, sha = make_sdist(toy.dist, "0.0.2", core=core2)
    write_index(toy.index, toy.dist)
    toy.set_pin(name, sha, version="0.0.2")
    work2 = tmp_path / "rebase"
    assert toy.cli("apply", "--work", str(work2)) == 2
    with pytest.raises(subprocess.CalledProcessError):
        git(work2, "am", "-3", "-k", str(toy.root / "patches/edit-core.patch"))
    (work2 / "vllm/core.py").write_text(core2.replace("+ 0\n", "+ 0  # A\n", 1))
    git(work2, "add", "vllm/core.py")
    git(work2, "-c", "core.editor=true", "am", "--continue")
    assert toy.cli("apply", "--work", str(work2), "--continue") == 0
    assert git(work2, "show", "HEAD:vllm/new_op.py") == "NEW = 1"
    assert git(work2, "status", "--porcelain") == ""

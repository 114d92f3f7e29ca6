# SPDX-License-Identifier: Apache-2.0
"""fetch / apply / export / check / status against a synthetic tiny upstream."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CORE_V1, Toy, add_entry, git, make_sdist, write_index
from hybrid_stack.stack import cache_dir

CORE_EDITED = CORE_V1.replace("return x + 3\n", "return x + 3  # stack edit\n")


def err(capsys: pytest.CaptureFixture) -> str:
    return capsys.readouterr().err.strip()


def edit_core_with_overlay(toy: Toy) -> None:
    """Apply, then add entry edit-core: a patch to vllm/core.py and the
    overlay file vllm/new_op.py (NEW = 1)."""
    assert toy.cli("apply") == 0
    add_entry(
        toy,
        "edit-core",
        {"vllm/core.py": CORE_EDITED, "vllm/new_op.py": "NEW = 1\n"},
        overlay=("vllm/new_op.py",),
    )


# -- fetch ----------------------------------------------------------------------
def test_fetch_verifies_and_caches(toy: Toy, capsys):
    assert toy.cli("fetch") == 0
    cached = cache_dir() / "dist" / toy.filename
    assert hashlib.sha256(cached.read_bytes()).hexdigest() == toy.sha
    # offline afterwards: the index can vanish
    (toy.index / "vllm" / "index.html").unlink()
    assert toy.cli("fetch", "--offline") == 0


def test_fetch_sha_mismatch_is_one_clear_error(toy: Toy, capsys):
    bad = "0" * 64
    toy.set_pin(toy.filename, bad)
    assert toy.cli("fetch") == 2
    msg = err(capsys)
    assert f"the index announces sha256 {toy.sha}" in msg and bad in msg
    assert not (cache_dir() / "dist" / toy.filename).exists()


def test_fetch_sha_mismatch_after_download(toy: Toy, capsys):
    # an index that announces no hash: the download itself must be checked
    page = toy.index / "vllm" / "index.html"
    page.write_text(page.read_text().split("#sha256=")[0] + f'">{toy.filename}</a>')
    toy.set_pin(toy.filename, "1" * 64)
    assert toy.cli("fetch") == 2
    msg = err(capsys)
    assert f"downloaded sha256 {toy.sha} != pinned {'1' * 64}" in msg
    assert not (cache_dir() / "dist" / toy.filename).exists()
    assert (cache_dir() / "dist" / f"{toy.filename}.sha256-mismatch").exists()


def test_fetch_missing_file(toy: Toy, capsys):
    toy.set_pin("vllm-9.9.9.tar.gz", toy.sha, version="9.9.9")
    assert toy.cli("fetch") == 2
    assert "vllm-9.9.9.tar.gz is not listed on" in err(capsys)


# -- apply ----------------------------------------------------------------------
def test_apply_base_holds_the_sdist(toy: Toy):
    assert toy.cli("apply") == 0
    tracked = set(git(toy.work, "ls-files").split("\n"))
    # hidden by the sdist's own .gitignore, still force-added
    assert "vllm/hidden_kernel.py" in tracked
    assert "tools/run.sh" in tracked and "vllm/core.py" in tracked
    assert git(toy.work, "ls-files", "-s", "tools/run.sh").startswith("100755")
    # build outputs: present on disk, untracked, ignored
    assert "vllm/_version.py" not in tracked
    assert (toy.work / "vllm/_version.py").read_text() == "__version__ = '0.0.1'\n"
    assert (toy.work / "vllm.egg-info/PKG-INFO").is_file()
    assert git(toy.work, "status", "--porcelain") == ""
    assert git(toy.work, "describe", "--tags") == "v0.0.1"


def test_round_trip_is_byte_identical(toy: Toy, tmp_path: Path):
    assert toy.cli("apply") == 0
    add_entry(
        toy,
        "edit-core",
        {"vllm/core.py": CORE_EDITED, "vllm/new_op.py": "# SPDX\nNEW = 1\n"},
        overlay=("vllm/new_op.py",),
    )
    patch = (toy.root / "patches/edit-core.patch").read_text()
    assert "Subject: [Test] edit-core" in patch
    assert "Stack-Entry: edit-core" in patch and "stack edit" in patch
    assert "new_op.py" not in patch  # overlay files stay out of the patch
    assert (toy.root / "overlay/vllm/new_op.py").read_text() == "# SPDX\nNEW = 1\n"
    before = toy.snapshot()
    # apply from scratch elsewhere, export again: nothing may change
    other = tmp_path / "other"
    assert toy.cli("apply", "--work", str(other)) == 0
    assert toy.cli("export", "--work", str(other)) == 0
    assert toy.snapshot() == before
    # and the same series gives the same commit ids
    assert toy.cli("apply") == 0  # rebuilds the hand-made commit canonically
    assert git(toy.work, "rev-parse", "HEAD") == git(other, "rev-parse", "HEAD")
    assert toy.cli("check") == 0


def test_apply_is_idempotent(toy: Toy, capsys):
    assert toy.cli("apply") == 0
    add_entry(toy, "edit-core", {"vllm/core.py": CORE_EDITED})
    assert toy.cli("apply") == 0
    head = git(toy.work, "rev-parse", "HEAD")
    capsys.readouterr()
    assert toy.cli("apply") == 0
    assert "is up to date (1 entries)" in capsys.readouterr().out
    assert git(toy.work, "rev-parse", "HEAD") == head
    assert git(toy.work, "status", "--porcelain") == ""


def test_apply_keeps_unexported_commits(toy: Toy, capsys):
    assert toy.cli("apply") == 0
    toy.commit_in_work("nobody", {"vllm/core.py": CORE_EDITED})
    head = git(toy.work, "rev-parse", "HEAD")
    assert toy.cli("apply") == 0
    backups = git(toy.work, "for-each-ref", "--format=%(objectname)", "refs/hybrid-stack/backup/")
    assert backups == head
    assert "kept the previous head" in capsys.readouterr().out


def test_check_detects_stale_overlay_and_patch(toy: Toy, capsys):
    edit_core_with_overlay(toy)
    assert toy.cli("check") == 0
    # a hand edit of an exported patch's message is stale against series.toml
    p = toy.root / "patches/edit-core.patch"
    p.write_text(p.read_text().replace("Why: testing", "Why: hand-edited"))
    assert toy.cli("check") == 2
    out = capsys.readouterr()
    assert "stale patches/edit-core.patch  [edit-core]" in out.out
    assert "patches not up to date for edit-core" in out.err
    assert toy.cli("export") == 2  # would drop the hand edit: only when told to
    assert "changed since the last apply or export (patches/edit-core.patch)" in err(capsys)
    assert toy.cli("export", "--force") == 0  # regenerate
    # a stray overlay file nobody owns
    stray = toy.root / "overlay/vllm/stray.py"
    stray.write_text("x = 1\n")
    assert toy.cli("check") == 2
    assert "stale overlay/vllm/stray.py  [(no entry)]" in capsys.readouterr().out


def test_apply_refuses_an_overlay_file_no_entry_owns(toy: Toy, capsys):
    edit_core_with_overlay(toy)
    head = git(toy.work, "rev-parse", "HEAD")
    stray = toy.root / "overlay/vllm/stray.py"
    stray.write_text("x = 1\n")
    # apply would leave it out of the tree and export then delete it
    assert toy.cli("apply") == 2
    assert "overlay/vllm/stray.py: owned by no carried entry" in err(capsys)
    assert stray.read_text() == "x = 1\n"
    assert git(toy.work, "rev-parse", "HEAD") == head


def test_export_keeps_an_overlay_file_only_it_holds(toy: Toy, capsys):
    edit_core_with_overlay(toy)
    # the entry drops vllm/new_op.py from its commit and its overlay list, but
    # overlay/ still has the only copy of a newer version of it
    series = (toy.root / "patches/series.toml").read_text()
    toy.set_series(series.replace('"vllm/new_op.py"', ""))
    git(toy.work, "rm", "-q", "vllm/new_op.py")
    git(toy.work, "commit", "-q", "--amend", "--no-edit")
    new_op = toy.root / "overlay/vllm/new_op.py"
    assert toy.cli("export") == 2
    assert "export would delete overlay/vllm/new_op.py" in err(capsys)
    assert new_op.read_text() == "NEW = 1\n"
    assert toy.cli("export", "--force") == 0
    assert not new_op.exists()


def test_conflict_report_and_continue(toy: Toy, capsys, tmp_path: Path):
    assert toy.cli("apply") == 0
    add_entry(toy, "first", {"tools/run.sh": "#!/bin/sh\necho first\n"})
    add_entry(toy, "edit-core", {"vllm/core.py": CORE_EDITED})
    # a new upstream release changes the lines the second entry edits
    core2 = CORE_V1.replace("return x + 3\n", "return x + 3 + 0\n")
    name, sha = make_sdist(toy.dist, "0.0.2", core=core2)
    write_index(toy.index, toy.dist)
    toy.set_pin(name, sha, version="0.0.2")
    work2 = tmp_path / "rebase"
    capsys.readouterr()
    assert toy.cli("apply", "--work", str(work2)) == 2
    msg = err(capsys)
    assert msg.startswith("hybrid-stack apply: error: entry 'edit-core' (2/2) does not apply")
    assert "conflicting files: vllm/core.py" in msg
    assert "vllm/core.py: @@ -" in msg  # the failed hunk, by header
    assert "left clean at 'first'" in msg and "apply --continue" in msg
    # nothing half-applied: clean tree at the last good entry
    assert git(work2, "status", "--porcelain") == ""
    assert "Stack-Entry: first" in git(work2, "log", "-1", "--format=%B")
    assert git(work2, "rev-parse", "--abbrev-ref", "HEAD") == "stack"
    # status names the conflicting entry from the same trial apply
    assert toy.cli("status") == 1
    rows = {line.split()[1]: line.split()[-1] for line in capsys.readouterr().out.splitlines()[3:]}
    assert rows == {"first": "yes", "edit-core": "CONFLICT"}
    # resolve by hand as the message says, then continue and export
    patch = toy.root / "patches/edit-core.patch"
    with pytest.raises(subprocess.CalledProcessError):
        git(work2, "am", "-3", "-k", str(patch))  # stops on the conflict
    (work2 / "vllm/core.py").write_text(
        core2.replace("return x + 3 + 0\n", "return x + 3 + 0  # stack edit\n")
    )
    git(work2, "add", "vllm/core.py")
    git(work2, "-c", "core.editor=true", "am", "--continue")
    assert toy.cli("apply", "--work", str(work2), "--continue") == 0
    assert toy.cli("export", "--work", str(work2)) == 0
    assert "+    return x + 3 + 0  # stack edit" in patch.read_text()
    assert toy.cli("check") == 0


# -- bad input: one clear error, nothing lost ------------------------------------
def test_series_names_missing_patch(toy: Toy, capsys):
    toy.set_series(toy.entry_toml("ghost", "ghost.patch"))
    assert toy.cli("apply") == 2
    assert err(capsys) == (
        "hybrid-stack apply: error: entry 'ghost' names patches/ghost.patch, which does "
        "not exist (run 'hybrid-stack export' from a work tree, or fix series.toml)"
    )
    assert not toy.work.exists()


def test_unknown_status(toy: Toy, capsys):
    toy.set_series(toy.entry_toml("odd", "odd.patch", status="parked"))
    assert toy.cli("status", "--no-apply") == 2
    assert "entry 'odd': unknown status 'parked' (use one of carried, upstreamed, dropped)" in err(
        capsys
    )


def test_malformed_patch_leaves_last_good_entry(toy: Toy, capsys, tmp_path: Path):
    assert toy.cli("apply") == 0
    add_entry(toy, "first", {"tools/run.sh": "#!/bin/sh\necho first\n"})
    add_entry(toy, "second", {"vllm/core.py": CORE_EDITED})
    (toy.root / "patches/second.patch").write_text("this is not a patch\n")
    work2 = tmp_path / "w2"
    capsys.readouterr()
    assert toy.cli("apply", "--work", str(work2)) == 2
    assert "entry 'second' (2/2) does not apply" in err(capsys)
    assert git(work2, "status", "--porcelain") == ""
    assert "Stack-Entry: first" in git(work2, "log", "-1", "--format=%B")


def test_dirty_work_tree_is_refused_and_kept(toy: Toy, capsys):
    assert toy.cli("apply") == 0
    add_entry(toy, "edit-core", {"vllm/core.py": CORE_EDITED})
    (toy.work / "vllm/core.py").write_text("my unsaved work\n")
    (toy.work / "notes.txt").write_text("untracked\n")
    head = git(toy.work, "rev-parse", "HEAD")
    assert toy.cli("apply") == 2
    msg = err(capsys)
    assert "has uncommitted changes (1: vllm/core.py)" in msg and "git stash" in msg
    assert (toy.work / "vllm/core.py").read_text() == "my unsaved work\n"
    assert (toy.work / "notes.txt").exists()
    assert git(toy.work, "rev-parse", "HEAD") == head
    # an untracked file alone: git stash would not take it; the advice says so
    git(toy.work, "checkout", "vllm/core.py")
    assert toy.cli("apply") == 2
    msg = err(capsys)
    assert "has untracked files (1: notes.txt): move them out of the tree" in msg
    assert "stash" not in msg
    assert (toy.work / "notes.txt").exists()


def test_export_keeps_edits_made_since_apply(toy: Toy, capsys):
    edit_core_with_overlay(toy)
    assert toy.cli("export") == 0  # nothing edited since the last export
    op = toy.root / "overlay/vllm/new_op.py"
    op.write_text("NEW = 2\n")  # edited in overlay/, not in the work tree
    capsys.readouterr()
    assert toy.cli("export") == 2
    assert (
        "1 file(s) of patches/ or overlay/ changed since the last apply or export "
        "(overlay/vllm/new_op.py); export would overwrite them" in err(capsys)
    )
    assert op.read_text() == "NEW = 2\n"
    # apply takes the edit into the work tree; export then agrees with it
    assert toy.cli("apply") == 0
    assert (toy.work / "vllm/new_op.py").read_text() == "NEW = 2\n"
    assert toy.cli("export") == 0
    assert op.read_text() == "NEW = 2\n"
    # --force drops an edit for the work tree's version
    op.write_text("NEW = 3\n")
    assert toy.cli("export", "--force") == 0
    assert op.read_text() == "NEW = 2\n"


def test_export_refuses_commit_without_trailer(toy: Toy, capsys):
    assert toy.cli("apply") == 0
    (toy.work / "vllm/core.py").write_text(CORE_EDITED)
    git(toy.work, "commit", "-qam", "no trailer here")
    before = toy.snapshot()
    assert toy.cli("export") == 2
    assert "('no trailer here') has 0 'Stack-Entry:' trailers" in err(capsys)
    assert toy.snapshot() == before


def test_export_requires_patch_for_upstream_edits(toy: Toy, capsys):
    assert toy.cli("apply") == 0
    toy.set_series(toy.entry_toml("only-overlay", "", ("vllm/x.py",)))
    toy.commit_in_work("only-overlay", {"vllm/x.py": "X = 1\n", "vllm/core.py": CORE_EDITED})
    assert toy.cli("export") == 2
    assert (
        "edits upstream files (vllm/core.py) but names no patch: set patch = "
        '"only-overlay.patch"' in err(capsys)
    )


def test_status_table(toy: Toy, capsys):
    assert toy.cli("apply") == 0
    add_entry(
        toy,
        "edit-core",
        {"vllm/core.py": CORE_EDITED, "vllm/new_op.py": "A = 1\nB = 2\n"},
        overlay=("vllm/new_op.py",),
    )
    series = (toy.root / "patches/series.toml").read_text()
    toy.set_series(
        series + toy.entry_toml("old-fix", status="upstreamed", extra='upstreamed_in = "0.0.1"\n')
    )
    capsys.readouterr()
    assert toy.cli("status") == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if " edit-core " in line)
    assert row.split()[2:] == ["carried", "-", "2", "+3/-1", "yes"]
    assert "upstreamed in 0.0.1" in out


def test_cached_file_and_wrong_pin_says_the_pin_is_wrong(toy: Toy, capsys):
    assert toy.cli("fetch") == 0
    cached = cache_dir() / "dist" / toy.filename
    toy.set_pin(toy.filename, "2" * 64)
    assert toy.cli("fetch") == 2
    msg = err(capsys)
    assert f"patches/pin.toml's sha256 for {toy.filename} is wrong" in msg
    assert f"the cached file and the index both have {toy.sha}; fix the pin" in msg
    assert cached.is_file()  # the good file stays


def test_damaged_cached_file_is_fetched_again(toy: Toy, capsys):
    assert toy.cli("fetch") == 0
    cached = cache_dir() / "dist" / toy.filename
    cached.write_bytes(b"damaged")
    assert toy.cli("fetch") == 0
    assert "is damaged" in capsys.readouterr().out
    assert hashlib.sha256(cached.read_bytes()).hexdigest() == toy.sha


def test_python_m_hybrid_stack_is_the_command(toy: Toy):
    """`python -m hybrid_stack` runs the `hybrid-stack` command (a worktree or
    machine with scripts/ on PYTHONPATH and no entry-point script)."""
    runs = [
        subprocess.run(
            [sys.executable, "-m", module, "--root", str(toy.root), "status"],
            capture_output=True,
            text=True,
        )
        for module in ("hybrid_stack", "hybrid_stack.cli")
    ]
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr
    assert runs[0].stdout == runs[1].stdout and "entries" in runs[0].stdout.lower()
    bad = subprocess.run(
        [sys.executable, "-m", "hybrid_stack", "no-such-verb"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "usage: hybrid-stack" in bad.stderr

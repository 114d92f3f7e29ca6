# SPDX-License-Identifier: Apache-2.0
"""rebase / range-diff against the synthetic tiny upstream (tests/conftest.py)."""

from __future__ import annotations

import hashlib
import io
import re
import subprocess
import tarfile
from pathlib import Path

import pytest

from conftest import CORE_V1, Toy, add_entry, git, write_index
from hybrid_stack import rebase
from hybrid_stack.stack import load_pin, load_series

# the upstream files of the tiny release, by path (make_sdist's, plus old.py)
BASE_FILES = {
    "PKG-INFO": "Metadata-Version: 2.1\nName: vllm\nVersion: {v}\n",
    ".gitignore": "/vllm/_version.py\n*.egg-info/\nhidden_*.py\n",
    "vllm/__init__.py": "# SPDX-License-Identifier: Apache-2.0\n",
    "vllm/old.py": "def legacy():\n    return 1\n",
    "vllm/_version.py": "__version__ = '{v}'\n",
    "vllm.egg-info/PKG-INFO": "Name: vllm\n",
    "tests/test_core.py": "def test_f0():\n    assert True\n",
}


def release(toy: Toy, version: str, core: str, drop=(), files=None) -> tuple[str, str]:
    """Publish vllm-<version>.tar.gz on the toy index; returns (filename, sha256)."""
    root = f"vllm-{version}"
    content = {k: v.format(v=version) for k, v in {**BASE_FILES, **(files or {})}.items()}
    content["vllm/core.py"] = core
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for rel, text in sorted(content.items()):
            if rel in drop:
                continue
            data = text.encode()
            info = tarfile.TarInfo(f"{root}/{rel}")
            info.size = len(data)
            info.mtime = 1_700_000_000
            tf.addfile(info, io.BytesIO(data))
    name = f"{root}.tar.gz"
    (toy.dist / name).write_bytes(buf.getvalue())
    write_index(toy.index, toy.dist)
    return name, hashlib.sha256(buf.getvalue()).hexdigest()


def edit(text: str, i: int, new: str) -> str:
    old = f"    return x + {i}\n"
    assert old in text
    return text.replace(old, new)


@pytest.fixture
def base(toy: Toy) -> Toy:
    """The toy stack pinned on 0.0.1 (with old.py and an upstream test file)."""
    name, sha = release(toy, "0.0.1", CORE_V1)
    toy.set_pin(name, sha, version="0.0.1")
    assert toy.cli("apply") == 0
    return toy


def stack_state(toy: Toy) -> dict:
    """Everything --abort must restore: files, pin, the work tree's refs and status."""
    return {
        "files": {**toy.snapshot(), "pin": (toy.root / "patches/pin.toml").read_bytes()},
        "head": git(toy.work, "rev-parse", "HEAD"),
        "branch": git(toy.work, "rev-parse", "--abbrev-ref", "HEAD"),
        "refs": git(toy.work, "for-each-ref", "--format=%(refname) %(objectname)"),
        "status": git(toy.work, "status", "--porcelain", "--ignored"),
        "version": (toy.work / "vllm/_version.py").read_text(),
        "apply_state": (toy.work / ".git/hybrid-stack-state.json").read_text(),
    }


def outcomes(report: str) -> dict[str, str]:
    """entry -> outcome, from the report's summary table."""
    rows = re.findall(r"^\| \d+ \| `([^`]+)` \| ([^|]+) \|", report, re.MULTILINE)
    return {name: outcome.strip() for name, outcome in rows}


CLEAN_CORE = edit(CORE_V1, 1, "    return x + 1  # clean\n")


def five_entries(toy: Toy) -> str:
    """Entries for every outcome; returns the new release's core.py."""
    add_entry(
        toy,
        "clean",
        {"vllm/core.py": CLEAN_CORE, "vllm/new_op.py": "NEW = 1\n"},
        overlay=("vllm/new_op.py",),
    )
    core = (toy.work / "vllm/core.py").read_text()
    add_entry(toy, "threeway", {"vllm/core.py": edit(core, 10, "    return x + 10  # 3w\n")})
    core = (toy.work / "vllm/core.py").read_text()
    add_entry(toy, "conflict", {"vllm/core.py": edit(core, 3, "    return x + 3  # mine\n")})
    core = (toy.work / "vllm/core.py").read_text()
    add_entry(toy, "upstream", {"vllm/core.py": edit(core, 15, "    return x + 15  # fix\n")})
    add_entry(toy, "obsolete", {"vllm/old.py": "def legacy():\n    return 2\n"})
    # 0.0.2: f11's def line renamed (context of threeway), f3 changed the other
    # way (conflict), upstream made entry 'upstream''s exact change, old.py gone
    new = CORE_V1.replace("def f11(x):", "def f11(x):  # renamed")
    new = edit(new, 3, "    return x + 3 + 0\n")
    return edit(new, 15, "    return x + 15  # fix\n")


def test_dry_run_reports_every_outcome(base: Toy, capsys):
    toy = base
    new = five_entries(toy)
    release(toy, "0.0.2", new, drop=("vllm/old.py",))
    before = stack_state(toy)
    capsys.readouterr()
    assert toy.cli("rebase", "0.0.2", "--dry-run") == 1  # entries need work
    report = (toy.root / "results/rebase-0.0.2.md").read_text()
    assert outcomes(report) == {
        "clean": "applied cleanly",
        "threeway": "applied with a 3-way merge",
        "conflict": "conflict",
        "upstream": "already upstream",
        "obsolete": "obsolete",
    }
    assert "Command: `hybrid-stack rebase 0.0.2 --dry-run`" in report
    assert "vllm/core.py: 1 conflict region(s) at line(s)" in report
    assert "the new base has none of the files it edits (vllm/old.py)" in report
    assert "patch-id" in report.split("`upstream`", 1)[1].splitlines()[0]
    # the dry run changes nothing but the report
    assert stack_state(toy) == before


def test_rebase_conflict_continue(base: Toy, capsys):
    toy = base
    add_entry(toy, "clean", {"vllm/core.py": CLEAN_CORE})
    core = (toy.work / "vllm/core.py").read_text()
    add_entry(toy, "conflict", {"vllm/core.py": edit(core, 3, "    return x + 3  # mine\n")})
    core = (toy.work / "vllm/core.py").read_text()
    add_entry(
        toy,
        "upstream",
        {"vllm/core.py": edit(core, 15, "    return x + 15  # fix\n"), "vllm/up.py": "U = 1\n"},
        overlay=("vllm/up.py",),
    )
    new = edit(edit(CORE_V1, 3, "    return x + 3 + 0\n"), 15, "    return x + 15  # fix\n")
    name, sha = release(toy, "0.0.2", new, files={"vllm/up.py": "U = 1\n"})
    assert toy.cli("apply") == 0  # the canonical commits (messages from the series)
    pin_before = (toy.root / "patches/pin.toml").read_bytes()
    capsys.readouterr()
    assert toy.cli("rebase", "0.0.2") == 2
    msg = capsys.readouterr().err
    assert "entry 'conflict' is conflict on vLLM 0.0.2" in msg and "rebase --continue" in msg
    assert (toy.root / "patches/pin.toml").read_bytes() == pin_before
    # --continue refuses while conflicts remain
    assert toy.cli("rebase", "--continue") == 2
    assert "still have conflicts (vllm/core.py)" in capsys.readouterr().err
    resolved = edit(new, 1, "    return x + 1  # clean\n")
    (toy.work / "vllm/core.py").write_text(
        resolved.replace("    return x + 3 + 0\n", "    return x + 3 + 0  # mine\n")
    )
    git(toy.work, "add", "vllm/core.py")
    assert toy.cli("rebase", "--continue") == 0
    pin = load_pin(toy.root / "patches/pin.toml")
    assert (pin.version, pin.sdist.filename, pin.sdist.sha256) == ("0.0.2", name, sha)
    series = {e.name: e for e in load_series(toy.root / "patches/series.toml")}
    up = series["upstream"]
    assert (up.status, up.upstreamed_in, up.patch, up.overlay) == ("upstreamed", "0.0.2", "", ())
    assert not (toy.root / "patches/upstream.patch").exists()
    assert not (toy.root / "overlay/vllm/up.py").exists()
    assert "+    return x + 3 + 0  # mine" in (toy.root / "patches/conflict.patch").read_text()
    report = (toy.root / "work/rebase-0.0.2.md").read_text()
    assert outcomes(report) == {
        "clean": "applied cleanly",
        "conflict": "resolved by hand",
        "upstream": "already upstream",
    }
    # the range-diff per entry: the hand-resolved patch changed, the clean one did not
    assert "| `conflict` | changed |" in report and "| `clean` | unchanged |" in report
    assert "| `upstream` | only before |" in report
    assert not rebase.state_dir(rebase.load_stack(toy.root)).exists()
    assert git(toy.work, "describe", "--tags", "--abbrev=0") == "v0.0.2"
    assert toy.cli("check") == 0


def test_abort_restores_everything(base: Toy, capsys):
    toy = base
    add_entry(
        toy,
        "clean",
        {"vllm/core.py": CLEAN_CORE},
    )
    core = (toy.work / "vllm/core.py").read_text()
    add_entry(
        toy,
        "conflict",
        {"vllm/core.py": edit(core, 3, "    return x + 3  # mine\n"), "vllm/o.py": "O = 1\n"},
        overlay=("vllm/o.py",),
    )
    release(toy, "0.0.2", edit(CORE_V1, 3, "    return x + 3 + 0\n"))
    before = stack_state(toy)
    assert toy.cli("rebase", "0.0.2") == 2
    assert stack_state(toy) != before  # mid-rebase: the work tree moved
    assert toy.cli("rebase", "--abort") == 0
    assert stack_state(toy) == before
    assert toy.cli("rebase", "--continue") == 2
    assert "no rebase in progress" in capsys.readouterr().err


def test_interrupted_rebase_never_half_moves_the_pin(base: Toy, monkeypatch, capsys):
    toy = base
    add_entry(toy, "one", {"vllm/core.py": CLEAN_CORE})
    core = (toy.work / "vllm/core.py").read_text()
    add_entry(toy, "two", {"vllm/core.py": edit(core, 5, "    return x + 5  # two\n")})
    release(toy, "0.0.2", CORE_V1.replace("def f19(x):", "def f19(x):  # new"))
    pin_before = (toy.root / "patches/pin.toml").read_bytes()
    real = rebase.classify_and_replay
    calls = []

    def killed_at_second(repo, commit, entry, *a):
        calls.append(entry.name)
        got = real(repo, commit, entry, *a)
        if entry.name == "two" and calls.count("two") == 1:
            raise KeyboardInterrupt  # committed in the tree, not yet recorded
        return got

    monkeypatch.setattr(rebase, "classify_and_replay", killed_at_second)
    assert toy.cli("rebase", "0.0.2") == 130
    assert (toy.root / "patches/pin.toml").read_bytes() == pin_before
    # killed again while finishing, just before the pin moves
    real_write = rebase.write_pin
    monkeypatch.setattr(rebase, "write_pin", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    assert toy.cli("rebase", "--continue") == 130
    assert (toy.root / "patches/pin.toml").read_bytes() == pin_before
    monkeypatch.setattr(rebase, "write_pin", real_write)
    assert toy.cli("rebase", "--continue") == 0
    assert load_pin(toy.root / "patches/pin.toml").version == "0.0.2"
    # HEAD held both entries: neither was replayed again (nor taken for upstream)
    assert calls == ["one", "two"]
    assert [e.status for e in load_series(toy.root / "patches/series.toml")] == ["carried"] * 2
    assert outcomes((toy.root / "work/rebase-0.0.2.md").read_text()) == {
        "one": "applied cleanly",
        "two": "applied cleanly",
    }
    assert toy.cli("check") == 0


def test_abort_after_an_interrupted_finish(base: Toy, monkeypatch):
    toy = base
    add_entry(toy, "clean", {"vllm/core.py": CLEAN_CORE})
    core = (toy.work / "vllm/core.py").read_text()
    add_entry(toy, "threeway", {"vllm/core.py": edit(core, 10, "    return x + 10  # 3w\n")})
    release(toy, "0.0.2", CORE_V1.replace("def f11(x):", "def f11(x):  # renamed"))
    before = stack_state(toy)
    monkeypatch.setattr(rebase, "write_pin", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    assert toy.cli("rebase", "0.0.2") == 130
    # export already rewrote the moved patch; the pin did not move
    assert toy.snapshot()["patches/threeway.patch"] != before["files"]["patches/threeway.patch"]
    assert (toy.root / "patches/pin.toml").read_bytes() == before["files"]["pin"]
    monkeypatch.undo()
    assert toy.cli("rebase", "--abort") == 0
    assert stack_state(toy) == before
    assert not (toy.root / "work/rebase-0.0.2.md").exists()


def test_round_trip_is_byte_identical(base: Toy):
    toy = base
    add_entry(
        toy,
        "clean",
        {"vllm/core.py": CLEAN_CORE, "vllm/new_op.py": "NEW = 1\n"},
        overlay=("vllm/new_op.py",),
    )
    core = (toy.work / "vllm/core.py").read_text()
    add_entry(toy, "threeway", {"vllm/core.py": edit(core, 10, "    return x + 10  # 3w\n")})
    release(toy, "0.0.2", CORE_V1.replace("def f11(x):", "def f11(x):  # renamed"))
    before = {**toy.snapshot(), "pin": (toy.root / "patches/pin.toml").read_bytes()}
    assert toy.cli("rebase", "0.0.2") == 0
    moved = toy.snapshot()
    assert moved["patches/threeway.patch"] != before["patches/threeway.patch"]
    assert toy.cli("rebase", "0.0.1") == 0
    assert {**toy.snapshot(), "pin": (toy.root / "patches/pin.toml").read_bytes()} == before
    assert toy.cli("check") == 0


def test_range_diff_between_two_commits(base: Toy, capsys):
    toy = base
    add_entry(toy, "clean", {"vllm/core.py": CLEAN_CORE})
    core = (toy.work / "vllm/core.py").read_text()
    add_entry(toy, "other", {"vllm/core.py": edit(core, 7, "    return x + 7  # a\n")})
    git(toy.root, "init", "-q")
    git(toy.root, "add", "patches", "overlay")
    git(toy.root, "commit", "-qm", "a")
    a = git(toy.root, "rev-parse", "HEAD")
    (toy.work / "vllm/core.py").write_text(edit(CLEAN_CORE, 7, "    return x + 7  # b\n"))
    git(toy.work, "commit", "-qa", "--amend", "--no-edit")
    assert toy.cli("export") == 0
    git(toy.root, "commit", "-qam", "b")
    capsys.readouterr()
    assert toy.cli("range-diff", a, "HEAD") == 0
    out = capsys.readouterr().out
    assert re.search(r"\| `clean` \| unchanged \|", out)
    assert re.search(r"\| `other` \| changed \|", out)
    assert "-+    return x + 7  # a" in out and "++    return x + 7  # b" in out
    assert toy.cli("range-diff", a, "HEAD", "--entry", "other") == 0
    only = capsys.readouterr().out
    assert "| `other` | changed |" in only and "`clean`" not in only


def test_target_without_announced_hash_is_refused(base: Toy, capsys):
    toy = base
    release(toy, "0.0.2", CORE_V1)
    page = toy.index / "vllm" / "index.html"
    page.write_text(re.sub(r"#sha256=[0-9a-f]+", "", page.read_text()))
    pin = (toy.root / "patches/pin.toml").read_bytes()
    assert toy.cli("rebase", "0.0.2") == 2
    assert "announces no sha256 for vllm-0.0.2.tar.gz" in capsys.readouterr().err
    assert (toy.root / "patches/pin.toml").read_bytes() == pin
    assert not subprocess.run(["true"]).returncode
    assert not (Path(toy.root) / "work/rebase").exists()


def test_rebase_onto_a_git_ref(base: Toy, tmp_path: Path):
    toy = base
    add_entry(toy, "clean", {"vllm/core.py": CLEAN_CORE})
    release(toy, "0.0.2", CORE_V1)  # the pin still names the release's sdist
    upstream = tmp_path / "upstream"
    (upstream / "vllm").mkdir(parents=True)
    (upstream / "vllm/core.py").write_text(CORE_V1)
    (upstream / "vllm/from_git.py").write_text("GIT = 1\n")
    git(upstream, "init", "-q")
    git(upstream, "add", ".")
    git(upstream, "commit", "-qm", "v0.0.2")
    git(upstream, "tag", "v0.0.2")
    pin = toy.root / "patches/pin.toml"
    pin.write_text(pin.read_text() + f'\n[upstream.git]\nurl = "{upstream}"\nref = "v0.0.1"\n')
    assert toy.cli("rebase", "v0.0.2", "--source", "git") == 0
    moved = load_pin(pin)
    assert (moved.version, moved.git_ref, moved.git_url) == ("0.0.2", "v0.0.2", str(upstream))
    assert git(toy.work, "ls-files", "vllm/from_git.py") == "vllm/from_git.py"
    assert "return x + 1  # clean" in (toy.work / "vllm/core.py").read_text()


def test_obsolete_entry_ported_by_hand(base: Toy, capsys):
    toy = base
    add_entry(toy, "legacy", {"vllm/old.py": "def legacy():\n    return 2\n"})
    # 0.0.2 moved legacy() into vllm/compat.py
    release(
        toy,
        "0.0.2",
        CORE_V1,
        drop=("vllm/old.py",),
        files={"vllm/compat.py": "def legacy():\n    return 1\n"},
    )
    capsys.readouterr()
    assert toy.cli("rebase", "0.0.2") == 2
    msg = capsys.readouterr().err
    assert "entry 'legacy' is obsolete on vLLM 0.0.2 (vllm/old.py)" in msg
    assert "commit it with the trailer 'Stack-Entry: legacy'" in msg
    assert toy.cli("rebase", "--continue") == 2  # nothing ported yet
    assert "HEAD does not hold entry 'legacy' yet" in capsys.readouterr().err
    toy.commit_in_work("legacy", {"vllm/compat.py": "def legacy():\n    return 2\n"})
    assert toy.cli("rebase", "--continue") == 0
    patch = (toy.root / "patches/legacy.patch").read_text()
    assert "vllm/compat.py" in patch and "vllm/old.py" not in patch
    report = (toy.root / "work/rebase-0.0.2.md").read_text()
    assert outcomes(report) == {"legacy": "resolved by hand"}
    assert "obsolete: the new base has none of the files it edits" in report
    assert toy.cli("check") == 0

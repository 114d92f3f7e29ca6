# SPDX-License-Identifier: Apache-2.0
"""`hybrid-stack port` and the ports' staleness report, on the synthetic tiny
upstream (tests/conftest.py): a port records the committed series it was made
from, and status says how far the series has moved on since (never a failure).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_rebase import edit, release

from conftest import CORE_V1, Toy, add_entry, git
from hybrid_stack import port as port_mod
from hybrid_stack.port import (
    PREVIOUS_PORT_REF,
    RECORD,
    digest,
    disk_files,
    lag,
    load_record,
    make_record,
)

V2 = CORE_V1.replace("def f11(x):", "def f11(x):  # renamed")


def commit_all(toy: Toy, msg: str) -> str:
    git(toy.root, "add", "--all")
    git(toy.root, "commit", "-q", "-m", msg)
    return git(toy.root, "rev-parse", "HEAD")


@pytest.fixture
def repo(toy: Toy) -> Toy:
    """The toy stack on 0.0.1 with two entries, committed in a git repository;
    0.0.2 on the index (the entries replay onto it: one clean, one 3-way)."""
    name, sha = release(toy, "0.0.1", CORE_V1)
    toy.set_pin(name, sha, version="0.0.1")
    assert toy.cli("apply") == 0
    add_entry(
        toy,
        "clean",
        {"vllm/core.py": edit(CORE_V1, 1, "    return x + 1  # clean\n"), "vllm/op.py": "A = 1\n"},
        overlay=("vllm/op.py",),
    )
    core = (toy.work / "vllm/core.py").read_text()
    add_entry(toy, "threeway", {"vllm/core.py": edit(core, 10, "    return x + 10  # 3w\n")})
    release(toy, "0.0.2", V2)
    (toy.root / ".gitignore").write_text("work/\nresults/\n")
    git(toy.root, "init", "-q")
    commit_all(toy, "the series")
    return toy


def port_dir(toy: Toy) -> Path:
    return toy.root / "patches" / "ports" / "0.0.2"


def status_out(toy: Toy, capsys, *args: str) -> str:
    capsys.readouterr()
    assert toy.cli(*args, "status", "--no-apply") == 0  # staleness never fails
    return capsys.readouterr().out


def test_port_records_its_source_and_status_reports_the_lag(repo: Toy, capsys):
    toy = repo
    head = git(toy.root, "rev-parse", "HEAD")
    assert "no ported-from" not in status_out(toy, capsys)
    assert toy.cli("port", "0.0.2") == 0
    port = port_dir(toy)
    assert (port / "patches/pin.toml").read_text().count('version = "0.0.2"') == 1
    r = load_record(port)
    assert r is not None and r.commit == head and r.version == "0.0.1"
    assert r.digest == digest(disk_files(toy.root))  # ports/ is not part of the source
    assert [n for n, _ in r.entries] == ["clean", "threeway"]
    assert toy.cli("--root", str(port), "check") == 0
    out = status_out(toy, capsys)
    assert "patches/ports/0.0.2 (vLLM 0.0.2): ported from" in out
    assert "current (the main series is the one it was made from)" in out
    commit_all(toy, "the port")

    # the series moves on: a new entry, a changed description
    add_entry(toy, "later", {"vllm/later.py": "L = 1\n"}, overlay=("vllm/later.py",), patch=False)
    md = toy.root / "patches" / "series.toml"
    md.write_text(md.read_text().replace("Why: testing clean.", "Why: testing clean, again."))
    out = status_out(toy, capsys)
    assert "2 entries behind the series: new later; changed clean" in out
    assert "refresh: hybrid-stack port 0.0.2" in out
    out = status_out(toy, capsys, "--root", str(port))
    assert "2 entries behind the series: new later; changed clean" in out
    # the port's own files are untouched and still current
    assert toy.cli("--root", str(port), "check") == 0


def test_lag_names_each_kind_of_change(repo: Toy):
    toy = repo
    files = disk_files(toy.root)
    r = make_record("0" * 40, files)
    assert lag(r, files).current and lag(r, files).behind == 0
    series = files["patches/series.toml"].decode()
    # drop 'threeway', change clean's overlay file, move the pin
    without = series[: series.index('\n[[entry]]\nname = "threeway"')] + "\n"
    moved = {
        **files,
        "patches/series.toml": without.encode(),
        "overlay/vllm/op.py": b"A = 2\n",
        "patches/pin.toml": files["patches/pin.toml"].replace(b"0.0.1", b"0.0.9"),
    }
    del moved["patches/threeway.patch"]
    lg = lag(r, moved)
    assert not lg.current
    assert (lg.added, lg.changed, lg.removed, lg.pin_moved) == (
        (),
        ("clean",),
        ("threeway",),
        "0.0.9",
    )
    assert lg.text() == (
        "2 entries behind the series: changed clean; removed threeway; main pin moved to 0.0.9"
    )
    # a change outside any entry still says the port is not current
    other = {**files, "patches/pin.toml": files["patches/pin.toml"] + b"# comment\n"}
    assert not lag(r, other).current and lag(r, other).behind == 0


def test_port_refuses_an_uncommitted_series(repo: Toy, capsys):
    toy = repo
    (toy.root / "overlay/vllm/op.py").write_text("A = 3  # edited, not committed\n")
    capsys.readouterr()
    assert toy.cli("port", "0.0.2") == 2
    err = capsys.readouterr().err
    assert "overlay/vllm/op.py" in err and "commit the series first" in err
    assert not port_dir(toy).exists()


def test_record_is_written_when_a_stopped_port_finishes(repo: Toy, capsys):
    toy = repo
    assert toy.cli("port", "0.0.2") == 0
    first = (port_dir(toy) / RECORD).read_bytes()
    commit_all(toy, "the port")
    # 0.0.2 renamed f11's def line: an entry editing that line conflicts there
    core = (toy.work / "vllm/core.py").read_text()
    mine = core.replace("def f11(x):", "def f11(x):  # mine")
    add_entry(toy, "conflict", {"vllm/core.py": mine})
    head = commit_all(toy, "an entry that conflicts on 0.0.2")
    capsys.readouterr()
    assert toy.cli("port", "0.0.2") == 2
    assert "entry 'conflict' is conflict" in capsys.readouterr().err
    assert (port_dir(toy) / RECORD).read_bytes() == first  # not yet
    assert toy.cli("--root", str(port_dir(toy)), "rebase", "--abort") == 0
    assert (port_dir(toy) / RECORD).read_bytes() == first  # the previous record kept
    assert git(toy.root, "status", "--porcelain", "--untracked-files=all") == ""

    assert toy.cli("port", "0.0.2") == 2
    work = port_dir(toy) / "work" / "vllm"
    core = (work / "vllm/core.py").read_text()
    assert "<<<<<<<" in core
    (work / "vllm/core.py").write_text(
        edit(V2, 3, "    return x + 3 + 0  # mine\n")
        .replace("    return x + 1\n", "    return x + 1  # clean\n")
        .replace("    return x + 10\n", "    return x + 10  # 3w\n")
    )
    git(work, "add", "vllm/core.py")
    assert toy.cli("--root", str(port_dir(toy)), "rebase", "--continue") == 0
    r = load_record(port_dir(toy))
    assert r.commit == head and [n for n, _ in r.entries][-1] == "conflict"
    assert "current (the main series" in status_out(toy, capsys)


def port_files(toy: Toy) -> dict[str, bytes]:
    """The port as a checkout holds it: every file but its (ignored) work/, links as targets."""
    port = port_dir(toy)
    out = {}
    for f in sorted(port.rglob("*")):
        rel = f.relative_to(port).as_posix()
        if rel == "work" or rel.startswith("work/"):
            continue
        if f.is_symlink():
            out[rel] = f"-> {f.readlink()}".encode()
        elif f.is_file():
            out[rel] = f.read_bytes()
    return out


def test_a_refresh_replaces_the_port_only_when_it_finishes(repo: Toy, capsys):
    """Stopped at a conflict, given up with --abort or failed, a refresh leaves the
    committed port as it is (its hand resolutions with it); --continue replaces it."""
    toy = repo
    assert toy.cli("port", "0.0.2") == 0
    commit_all(toy, "the port")
    committed = port_files(toy)
    assert 'version = "0.0.2"' in committed["patches/pin.toml"].decode()
    core = (toy.work / "vllm/core.py").read_text()
    add_entry(toy, "conflict", {"vllm/core.py": core.replace("def f11(x):", "def f11(x):  # mine")})
    commit_all(toy, "an entry that conflicts on 0.0.2")
    port = str(port_dir(toy))

    def as_committed() -> None:
        assert port_files(toy) == committed
        assert git(toy.root, "status", "--porcelain", "--untracked-files=all") == ""

    capsys.readouterr()
    assert toy.cli("port", "0.0.2") == 2
    err = capsys.readouterr().err
    as_committed()  # stopped: the refresh lives in the port's work dir, not in the port
    assert "entry 'conflict' is conflict" in err and f"--root {port} rebase --continue" in err
    work = port_dir(toy) / "work" / "vllm"
    previous = git(work, "rev-parse", PREVIOUS_PORT_REF)
    assert toy.cli("port", "0.0.2") == 2  # one refresh at a time
    assert "rebase is in progress" in capsys.readouterr().err
    assert toy.cli("--root", port, "rebase", "--abort") == 0
    as_committed()
    assert toy.cli("--root", port, "rebase", "--continue") == 2
    assert "no rebase in progress" in capsys.readouterr().err
    # a refresh that fails before it starts (no such release) changes nothing either
    assert toy.cli("port", "0.0.9") == 2
    assert "vllm-0.0.9.tar.gz is on no configured index" in capsys.readouterr().err
    as_committed()

    # resolved, --continue writes the new port
    assert toy.cli("port", "0.0.2") == 2
    # the tree held the copy an abort left, not the port: the port's commits stay at the ref
    assert git(work, "rev-parse", PREVIOUS_PORT_REF) == previous
    (work / "vllm/core.py").write_text(
        V2.replace("def f11(x):  # renamed", "def f11(x):  # renamed, mine")
        .replace("    return x + 1\n", "    return x + 1  # clean\n")
        .replace("    return x + 10\n", "    return x + 10  # 3w\n")
    )
    git(work, "add", "vllm/core.py")
    assert toy.cli("--root", port, "rebase", "--continue") == 0
    now = port_files(toy)
    assert now != committed and "patches/conflict.patch" in now
    assert "# renamed, mine" in now["patches/conflict.patch"].decode()
    assert now["ci"] == committed["ci"]
    assert toy.cli("--root", port, "check") == 0
    assert (port_dir(toy) / "work" / "rebase-0.0.2.md").is_file()
    assert not (port_dir(toy) / "work" / "refresh").exists()


def test_a_port_of_a_series_with_kernel_cases(repo: Toy):
    """The staged copy of the series sees the main root's ci/: an entry's
    kernel_cases names a file there (the real series does)."""
    toy = repo
    cases = toy.root / "ci" / "kernel-cases" / "clean.py"
    cases.parent.mkdir(parents=True)
    cases.write_text("CASES = []\n")
    series = toy.root / "patches" / "series.toml"
    text = series.read_text()
    assert text.count('name = "clean"\n') == 1
    series.write_text(
        text.replace(
            'name = "clean"\n', 'name = "clean"\nkernel_cases = "ci/kernel-cases/clean.py"\n'
        )
    )
    commit_all(toy, "kernel cases")
    assert toy.cli("port", "0.0.2") == 0
    assert toy.cli("--root", str(port_dir(toy)), "check") == 0


def test_a_refresh_killed_while_it_installs_is_undone_or_redone(repo: Toy, monkeypatch, capsys):
    toy = repo
    assert toy.cli("port", "0.0.2") == 0
    commit_all(toy, "the port")
    committed = port_files(toy)
    add_entry(toy, "later", {"vllm/later.py": "L = 1\n"}, overlay=("vllm/later.py",), patch=False)
    commit_all(toy, "a new entry")
    real = port_mod._put

    def killed(src: Path, dest: Path) -> None:
        if src == port_mod.refresh_root(dest):  # the refresh into the port: killed halfway
            real(src, dest)
            (dest / "patches" / "series.toml").unlink()
            raise KeyboardInterrupt
        real(src, dest)

    monkeypatch.setattr(port_mod, "_put", killed)
    assert toy.cli("port", "0.0.2") == 130
    assert not (port_dir(toy) / "patches" / "series.toml").exists()
    monkeypatch.setattr(port_mod, "_put", real)
    assert toy.cli("--root", str(port_dir(toy)), "rebase", "--abort") == 0
    assert port_files(toy) == committed
    assert not port_mod.refresh_root(port_dir(toy)).exists()
    # the work tree held the copy: apply puts the port back there, its previous commits
    work = port_dir(toy) / "work" / "vllm"
    assert toy.cli("--root", str(port_dir(toy)), "apply") == 0
    assert git(work, "rev-parse", "HEAD") == git(work, "rev-parse", PREVIOUS_PORT_REF)
    # killed again, then --continue redoes the install
    monkeypatch.setattr(port_mod, "_put", killed)
    assert toy.cli("port", "0.0.2") == 130
    monkeypatch.setattr(port_mod, "_put", real)
    assert toy.cli("--root", str(port_dir(toy)), "rebase", "--continue") == 0
    assert "overlay/vllm/later.py" in port_files(toy)
    assert toy.cli("--root", str(port_dir(toy)), "check") == 0
    assert "current (the main series" in status_out(toy, capsys)


def test_a_refresh_of_a_port_whose_tree_its_own_apply_made(repo: Toy, capsys):
    """A port's work tree made fresh by `--root PORT apply` holds only the port's
    base: the refresh brings the main pin's tag in and keeps the port's commits."""
    toy = repo
    assert toy.cli("port", "0.0.2") == 0
    commit_all(toy, "the port")
    port = port_dir(toy)
    work = port / "work" / "vllm"
    shutil.rmtree(work)
    assert toy.cli("--root", str(port), "apply") == 0
    assert git(work, "tag", "--list", "v0.0.1") == ""
    head = git(work, "rev-parse", "HEAD")
    md = toy.root / "patches" / "series.toml"
    md.write_text(md.read_text().replace("Why: testing clean.", "Why: testing clean, again."))
    assert toy.cli("apply") == 0 and toy.cli("export") == 0
    commit_all(toy, "a description changed")
    assert toy.cli("port", "0.0.2") == 0
    assert git(work, "rev-parse", PREVIOUS_PORT_REF) == head
    assert "current (the main series" in status_out(toy, capsys)


def test_the_report_names_the_port_and_carries_the_release_notes(repo: Toy):
    toy = repo
    notes = toy.root / "results" / "rebase-notes" / "0.0.2.md"
    notes.parent.mkdir(parents=True)
    notes.write_text("Why `threeway` merges: upstream renamed f11.\n")
    report = toy.root / "results" / "rebase-0.0.2.md"
    assert toy.cli("port", "0.0.2", "--report", str(report)) == 0
    text = report.read_text()
    # the command the report shows is the port's, without the paths it was given
    assert "Command: `hybrid-stack rebase 0.0.2` (run by `hybrid-stack port 0.0.2`)\n" in text
    # the notes of this release's earlier ports come along by default
    assert "## Notes (from `results/rebase-notes/0.0.2.md`, by the person who ran it)" in text
    assert "Why `threeway` merges: upstream renamed f11." in text

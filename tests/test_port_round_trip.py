# SPDX-License-Identifier: Apache-2.0
"""The committed port of the stack onto vLLM 0.32.0 (patches/ports/0.32.0) and
the round trip 0.33.0 -> 0.32.0 -> 0.33.0 on the real sdists.

A port is made from the main series as it was at one commit and lags it
afterwards; its ported-from.toml records that commit and a digest of the
source files (hybrid_stack.port). So the tests compare the port with the
source it records, read from git at the recorded commit (a clone without that
commit falls back to today's series where its digest is the recorded one),
never with today's series: a series change on main does not make them fail.

The port keeps the source's series (series.toml, the entries' descriptions)
and carries 0.32.0 forms of the entries' code. Rebasing it back onto 0.33.0
replays each entry; where an entry stops (it was changed for 0.32.0, so its
0.33.0 form must come back), the entry's tree is taken from the source series
applied on 0.33.0, exactly what a user resolving by hand would restore. The
result must be the source's patches/, overlay/ and pin.toml byte for byte (and
their recorded digest), and the entries that replay on their own must be the
ones results/rebase-0.32.0.md says.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hybrid_stack.applier import apply
from hybrid_stack.cli import main
from hybrid_stack.errors import StackError
from hybrid_stack.export import export_files
from hybrid_stack.gitops import Repo
from hybrid_stack.port import (
    Record,
    digest,
    disk_files,
    entry_digests,
    git_files,
    load_record,
    materialize,
)
from hybrid_stack.stack import load_stack

ROOT = Path(__file__).resolve().parents[1]
PORT = ROOT / "patches" / "ports" / "0.32.0"
# entries whose 0.32.0 form differs from their 0.33.0 one (results/rebase-0.32.0.md)
PORTED_BY_HAND = [
    "mamba2-ssd-varlen-empty-seq",
    "mamba2-ssd-fused-prefill",
    "gdn-all-mode-config",
    "gdn-all-mode-scheduler-split",
    "gdn-all-mode-kv-cache-manager",
    "gdn-all-mode-metadata",
    "gdn-all-mode-layer",
]


def record() -> Record:
    r = load_record(PORT)
    assert r is not None, f"{PORT}/ported-from.toml is missing (hybrid-stack port --record)"
    return r


def source_files(r: Record) -> dict[str, bytes]:
    """patches/ (without ports/) and overlay/ of the series the port was made from."""
    try:
        return git_files(ROOT, r.commit)
    except StackError as e:
        today = disk_files(ROOT)
        if digest(today) == r.digest:
            return today
        pytest.skip(f"the port's source is not in this clone and today's series moved on: {e}")


def source_root(tmp_path: Path, r: Record) -> Path:
    root = materialize(source_files(r), tmp_path / "source")
    (root / "ci").symlink_to(ROOT / "ci")
    return root


def test_record_matches_its_source():
    """The record is the source's: digest, file count, entries (no network)."""
    r = record()
    files = source_files(r)
    assert digest(files) == r.digest
    assert len(files) == r.files
    assert tuple(entry_digests(files)) == r.entries


@pytest.mark.network
def test_port_keeps_the_series_and_is_current(tmp_path: Path):
    r = record()
    port = load_stack(PORT)
    src = load_stack(source_root(tmp_path, r))
    assert port.pin.version == "0.32.0"
    assert src.pin.version == r.version
    assert port.entries == src.entries  # same entries, subjects, descriptions
    for e in src.carried:
        md = f"{e.name}.md"
        assert (PORT / "patches" / md).read_bytes() == (src.root / "patches" / md).read_bytes()
    work = tmp_path / "vllm"
    assert apply(port, work) == 0
    for rel, content in export_files(port, work).items():
        data = content[1] if isinstance(content, tuple) else content
        assert (PORT / rel).read_bytes() == data, f"{rel} is stale in the port"


@pytest.mark.network
def test_round_trip_gives_the_source_byte_for_byte(tmp_path: Path, capsys):
    r = record()
    src = source_root(tmp_path, r)
    root = tmp_path / "stack"
    root.mkdir()
    shutil.copytree(PORT / "patches", root / "patches")
    shutil.copytree(PORT / "overlay", root / "overlay")
    (root / "ci").symlink_to(ROOT / "ci")
    # the source series on 0.33.0: the 0.33.0 form of every entry
    orig = tmp_path / "orig"
    assert apply(load_stack(src), orig) == 0
    rc = main(["--root", str(root), "rebase", "0.33.0"])
    work = Repo(root / "work" / "vllm")
    work.run("fetch", "--quiet", str(orig), "stack:refs/orig/stack")
    stopped = []
    for _ in range(len(PORTED_BY_HAND) + 1):
        if rc == 0:
            break
        assert rc == 2, capsys.readouterr().err
        state = json.loads((root / "work" / "rebase" / "state.json").read_text())
        name = state["stopped"]
        stopped.append(name)
        commit = work.run(
            "log", "--format=%H", f"--grep=Stack-Entry: {name}$", "v0.33.0..refs/orig/stack"
        )
        work.run("read-tree", "-u", "--reset", commit)
        rc = main(["--root", str(root), "rebase", "--continue"])
    assert rc == 0
    assert stopped == PORTED_BY_HAND
    got, want = disk_files(root), source_files(r)
    assert sorted(got) == sorted(want)
    for rel in want:  # pin.toml included
        assert got[rel] == want[rel], f"{rel} differs after the round trip"
    assert digest(got) == r.digest
    # the same series gives the same commits: the tree is the source's, commit for commit
    assert work.rev("HEAD") == Repo(orig).rev("HEAD")

# SPDX-License-Identifier: Apache-2.0
"""The committed port of the stack onto vLLM 0.32.0 (patches/ports/0.32.0) and
the round trip 0.33.0 -> 0.32.0 -> 0.33.0 on the real sdists.

The port keeps the series (series.toml, the entries' descriptions) and carries
0.32.0 forms of the entries' code. Rebasing it back onto 0.33.0 replays each
entry; where an entry stops (it was changed for 0.32.0, so its 0.33.0 form
must come back), the entry's tree is taken from today's series applied on
0.33.0, exactly what a user resolving by hand would restore. The result must
be today's patches/, overlay/ and pin.toml byte for byte, and the entries
that replay on their own must be the ones results/rebase-0.32.0.md says.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hybrid_stack.applier import apply
from hybrid_stack.cli import main
from hybrid_stack.export import export_files
from hybrid_stack.gitops import Repo
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
]


def tree_files(root: Path) -> dict[str, bytes]:
    out = {}
    for sub in ("patches", "overlay"):
        for f in sorted((root / sub).rglob("*")):
            rel = f.relative_to(root).as_posix()
            if f.is_file() and not rel.startswith("patches/ports/"):
                out[rel] = f.read_bytes()
    return out


@pytest.mark.network
def test_port_keeps_the_series_and_is_current(tmp_path: Path):
    port = load_stack(PORT)
    main_stack = load_stack(ROOT)
    assert port.pin.version == "0.32.0"
    assert port.entries == main_stack.entries  # same entries, subjects, descriptions
    for e in main_stack.carried:
        md = f"{e.name}.md"
        assert (PORT / "patches" / md).read_bytes() == (ROOT / "patches" / md).read_bytes()
    work = tmp_path / "vllm"
    assert apply(port, work) == 0
    for rel, content in export_files(port, work).items():
        data = content[1] if isinstance(content, tuple) else content
        assert (PORT / rel).read_bytes() == data, f"{rel} is stale in the port"


@pytest.mark.network
def test_round_trip_gives_todays_patches_byte_for_byte(tmp_path: Path, capsys):
    root = tmp_path / "stack"
    root.mkdir()
    shutil.copytree(PORT / "patches", root / "patches")
    shutil.copytree(PORT / "overlay", root / "overlay")
    (root / "ci").symlink_to(ROOT / "ci")
    # today's series on 0.33.0: the 0.33.0 form of every entry
    orig = tmp_path / "orig"
    assert apply(load_stack(ROOT), orig) == 0
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
    got, want = tree_files(root), tree_files(ROOT)
    assert sorted(got) == sorted(want)
    for rel in want:
        assert got[rel] == want[rel], f"{rel} differs after the round trip"
    assert (root / "patches" / "pin.toml").read_bytes() == (
        ROOT / "patches" / "pin.toml"
    ).read_bytes()
    # the same series gives the same commits: the tree is today's, commit for commit
    assert work.rev("HEAD") == Repo(orig).rev("HEAD")

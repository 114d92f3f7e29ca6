# SPDX-License-Identifier: Apache-2.0
"""An entry's description lives in patches/<name>.md; series.toml holds metadata."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from conftest import Toy
from hybrid_stack.errors import StackError
from hybrid_stack.stack import load_stack

ROOT = Path(__file__).resolve().parents[1]


def test_the_description_comes_from_the_entrys_md(toy: Toy):
    toy.set_series(
        toy.entry_toml("one", overlay=("newfile.py",)).replace(
            'description = """Why: testing one."""\n', ""
        )
    )
    (toy.root / "overlay" / "newfile.py").write_text("x = 1\n")
    md = toy.root / "patches" / "one.md"
    md.write_text("## Purpose\n\nFrom the md file.\n")
    entry = load_stack(toy.root).entry("one")
    assert entry.description == md.read_text()
    assert "From the md file." in entry.commit_message()
    # the commit apply makes carries it
    assert toy.cli("apply") == 0
    body = subprocess.run(
        ["git", "-C", str(toy.work), "log", "-1", "--format=%B"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "From the md file." in body


def test_a_description_in_both_places_is_refused(toy: Toy):
    toy.set_series(toy.entry_toml("one", overlay=("newfile.py",)))
    (toy.root / "overlay" / "newfile.py").write_text("x = 1\n")
    (toy.root / "patches" / "one.md").write_text("other text\n")
    with pytest.raises(StackError, match="both in the series and in one.md"):
        load_stack(toy.root)


def test_the_real_series_keeps_metadata_only():
    text = (ROOT / "patches" / "series.toml").read_text()
    assert "description =" not in text
    stack = load_stack(ROOT)
    for e in stack.entries:
        md = ROOT / "patches" / f"{e.name}.md"
        assert md.is_file(), f"{e.name} has no {md.name}"
        assert e.description == md.read_text()
        # sized like a PR description: it says why (Purpose) unless upstreamed
        if e.carried:
            assert "## Purpose" in e.description, e.name

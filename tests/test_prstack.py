# SPDX-License-Identifier: Apache-2.0
"""pr-stack against the synthetic tiny upstream (tests/conftest.py), and the
repository's own results."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from conftest import CORE_V1, Toy, add_entry, git

REPO = Path(__file__).resolve().parents[1]

DESCRIPTION = '''description = """
## Purpose

Because core.py needs it.

## Test Plan

Run the new tests.

## Test Result

Retyped: 99 passed.
"""'''


def three_entries(toy: Toy) -> None:
    assert toy.cli("apply") == 0
    add_entry(toy, "first", {"vllm/core.py": CORE_V1.replace("x + 1\n", "x + 1  # a\n")})
    add_entry(
        toy,
        "second",
        {
            "vllm/op.py": "OP = 1\n",
            "tests/test_op.py": "def test_a():\n    pass\n\n\nclass TestOp:\n"
            "    def test_b(self):\n        pass\n\n    def helper(self):\n        pass\n",
        },
        overlay=("vllm/op.py", "tests/test_op.py"),
        patch=False,
    )
    core = (toy.work / "vllm/core.py").read_text()
    add_entry(toy, "third", {"vllm/core.py": core.replace("x + 2\n", "x + 2  # c\n")})
    # 'second' gets a sectioned description; apply + export take it into the tree
    series = (toy.root / "patches/series.toml").read_text()
    block = series.split('name = "second"', 1)
    block[1] = block[1].replace('description = """Why: testing second."""', DESCRIPTION, 1)
    (toy.root / "patches/series.toml").write_text('name = "second"'.join(block))
    assert toy.cli("apply") == 0 and toy.cli("export") == 0
    results = toy.root / "results"
    results.mkdir()
    row = {"case": {"dims": "toy"}, "metric": "tok/s", "baseline": 1.5, "value": 4.25}
    (results / "toy-cpu.json").write_text(
        json.dumps(
            {
                "bench": "toy",
                "gpu": "cpu",
                "vllm_base": "0.0.1",
                "entry": "second",
                "command": "python bench_toy.py --fast",
                "rows": [{**row, "ratio": 2.833}],
            }
        )
    )
    (results / "other-cpu.json").write_text(
        json.dumps({"bench": "other", "command": "x", "rows": [], "entry": "third"})
    )


def branches(toy: Toy) -> dict[str, str]:
    out = git(toy.work, "for-each-ref", "--format=%(refname:short) %(objectname)", "refs/heads/pr/")
    return dict(line.split() for line in out.splitlines())


def bodies(toy: Toy) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((toy.root / "results/pr-stack").glob("*"))}


def test_branches_stack_one_entry_each(toy: Toy):
    three_entries(toy)
    assert toy.cli("pr-stack") == 0
    got = branches(toy)
    assert list(got) == ["pr/01-first", "pr/02-second", "pr/03-third"]
    # entry N = base + entries 1..N: each branch's parent is the previous branch
    assert git(toy.work, "rev-parse", "pr/01-first~1") == git(toy.work, "rev-parse", "v0.0.1^{}")
    assert git(toy.work, "rev-parse", "pr/02-second~1") == got["pr/01-first"]
    assert git(toy.work, "rev-parse", "pr/03-third~1") == got["pr/02-second"]
    assert got["pr/03-third"] == git(toy.work, "rev-parse", "stack")
    for name, sha in got.items():
        entry = name.split("-", 1)[1]
        assert f"Stack-Entry: {entry}" in git(toy.work, "log", "-1", "--format=%B", sha)


def test_bodies_follow_the_template_from_the_series_and_results(toy: Toy):
    three_entries(toy)
    assert toy.cli("pr-stack") == 0
    second = (toy.root / "results/pr-stack/02-second.md").read_text()
    purpose, rest = second.split("## Purpose", 1)[1].split("## Test Plan", 1)
    plan, result = rest.split("## Test Result", 1)
    assert "test entry second" in purpose and "Because core.py needs it." in purpose
    assert "Run the new tests." in plan and "python bench_toy.py --fast" in plan
    # generated, never retyped: the description's own Test Result is left out
    assert "99 passed" not in second
    assert "| `tests/test_op.py` | 2 |" in result
    assert "| dims=toy | tok/s | 1.5 | 4.25 | 2.833 |" in result
    assert "`results/toy-cpu.json`" in result and "other-cpu" not in second
    assert "stacked on `pr/01-first`" in second
    assert "**AI assistance:**" in second
    first = (toy.root / "results/pr-stack/01-first.md").read_text()
    assert "No committed results file" in first and "stacked on vLLM `v0.0.1`" in first
    index = (toy.root / "results/pr-stack/index.md").read_text()
    assert "| 3 | `pr/03-third` | `pr/02-second` | [Test] third |" in index


def test_pr_stack_is_idempotent_and_local(toy: Toy, tmp_path: Path):
    three_entries(toy)
    remote = tmp_path / "fork.git"
    git(tmp_path, "init", "-q", "--bare", str(remote))
    assert toy.cli("pr-stack") == 0
    first_branches, first_bodies = branches(toy), bodies(toy)
    assert git(remote, "for-each-ref") == ""  # nothing left the machine
    stale = toy.root / "results/pr-stack/09-gone.md"
    stale.write_text("old\n")
    git(toy.work, "branch", "pr/09-gone", "stack")
    assert toy.cli("pr-stack") == 0
    assert branches(toy) == first_branches
    assert bodies(toy) == first_bodies
    assert toy.cli("pr-stack", "--push", str(remote)) == 0
    pushed = git(remote, "for-each-ref", "--format=%(refname:short) %(objectname)")
    assert dict(line.split() for line in pushed.splitlines()) == first_branches


def test_check_says_when_the_bodies_are_stale_and_writes_nothing(toy: Toy, capsys):
    three_entries(toy)
    assert toy.cli("pr-stack", "--check") == 2  # never written
    assert "is stale (01-first.md, 02-second.md, 03-third.md, index.md)" in capsys.readouterr().err
    assert branches(toy) == {} and not (toy.root / "results/pr-stack").exists()
    assert toy.cli("pr-stack") == 0
    written, made = bodies(toy), branches(toy)
    assert toy.cli("pr-stack", "--check") == 0
    # a PR body changes with its entry's description ...
    series = toy.root / "patches/series.toml"
    series.write_text(series.read_text().replace("Run the new tests.", "Run them all."))
    assert toy.cli("apply") == 0
    assert toy.cli("pr-stack", "--check") == 2
    assert "is stale (02-second.md):" in capsys.readouterr().err
    assert bodies(toy) == written and branches(toy) == made
    assert toy.cli("pr-stack") == 0 and toy.cli("pr-stack", "--check") == 0
    # ... and a body of an entry no longer carried is stale too
    (toy.root / "results/pr-stack/09-gone.md").write_text("old\n")
    assert toy.cli("pr-stack", "--check") == 2
    assert "is stale (09-gone.md)" in capsys.readouterr().err


def test_without_a_work_tree_it_says_to_apply(toy: Toy, capsys):
    three_entries(toy)
    shutil.rmtree(toy.work)
    assert toy.cli("pr-stack", "--check") == 2
    err = capsys.readouterr().err
    assert f"no work tree at {toy.work}: run hybrid-stack apply first" in err
    assert not (toy.root / "results/pr-stack").exists()


def test_every_committed_stack_result_reaches_an_entrys_body():
    """Each results/*.json that measures a stack kernel (`stack_kernel`) or
    names an entry belongs to some carried entry, so its rows reach that PR
    body; a kernel in an upstream module needs the result's `entry`."""
    from hybrid_stack.prstack import entry_results
    from hybrid_stack.stack import load_stack

    stack = load_stack(REPO)
    linked = {path for e in stack.entries for path, _ in entry_results(stack, e)}
    for path in sorted((REPO / "results").glob("*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and (data.get("stack_kernel") or data.get("entry")):
            assert path.relative_to(REPO).as_posix() in linked, path.name

# SPDX-License-Identifier: Apache-2.0
"""`hybrid-stack range-diff A B`: what changed in each entry between two
versions of the series.

A and B are commits of this repository (anything `git rev-parse` takes), or
`.` for the files on disk now. Each side's patches/ and overlay/ are applied
onto its own pin's base in a throwaway work tree; `git range-diff` then pairs
the entry commits of the two sides and shows, per entry, the diff of its diff:
the view a reviewer needs after a rebase (e.g. `range-diff HEAD~1 HEAD` over
the commit a rebase made).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import subprocess
import tempfile
from pathlib import Path

from hybrid_stack.apply import apply
from hybrid_stack.errors import StackError
from hybrid_stack.gitops import Repo
from hybrid_stack.rebase import range_diff, range_diff_markdown
from hybrid_stack.stack import Stack, load_stack


def materialize(stack: Stack, rev: str, dest: Path) -> Stack:
    """patches/ and overlay/ as of `rev` (`.`: the files on disk) under dest."""
    dest.mkdir(parents=True)
    if rev == ".":
        for sub in ("patches", "overlay"):
            src = stack.root / sub
            if src.is_dir():
                subprocess.run(["cp", "-a", str(src), str(dest / sub)], check=True)
        return load_stack(dest)
    repo = Repo(stack.root)
    if not repo.is_repo():
        raise StackError(f"{stack.root} is not a git repository: range-diff A B needs commits")
    repo.rev(rev)  # one clear error for an unknown commit
    paths = [p for p in ("patches", "overlay") if repo.run("ls-tree", rev, "--", p)]
    tar = repo._execute(("archive", "--format=tar", rev, *paths), stdout_as_string=False)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=tar, check=True)
    (dest / "overlay").mkdir(exist_ok=True)
    return load_stack(dest)


def series_tree(stack: Stack, rev: str, tmp: Path, label: str) -> tuple[Stack, Path]:
    side = materialize(stack, rev, tmp / label)
    work = tmp / label / "work" / "vllm"
    print(f"range-diff: applying {label} ({rev}, vLLM {side.pin.version})")
    with contextlib.redirect_stdout(io.StringIO()):
        apply(side, work)
    return side, work


def run(args: argparse.Namespace) -> int:
    stack = load_stack(args.root, check_files=False)
    with tempfile.TemporaryDirectory(prefix="hybrid-stack-range-diff-") as tmpdir:
        tmp = Path(tmpdir)
        a, work_a = series_tree(stack, args.a, tmp, "a")
        b, work_b = series_tree(stack, args.b, tmp, "b")
        repo = Repo(work_a)
        repo.run("fetch", "--quiet", "--no-tags", str(work_b), "+stack:refs/range-diff/b")
        repo.run(
            "fetch", "--quiet", "--no-tags", str(work_b), f"+{b.pin.tag}:refs/range-diff/b-base"
        )
        pairs = range_diff(repo, a.pin.tag, "stack", "refs/range-diff/b-base", "refs/range-diff/b")
    if args.entry:
        pairs = [p for p in pairs if p["entry"] == args.entry]
        if not pairs:
            raise StackError(f"no entry '{args.entry}' on either side: check the name")
    label_a = f"{args.a} (vLLM {a.pin.version})"
    label_b = f"{args.b} (vLLM {b.pin.version})"
    print(range_diff_markdown(pairs, [*b.entries, *a.entries], label_a, label_b))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("range-diff", help="per-entry range-diff between two versions of the series")
    p.add_argument("a", help="commit of this repository (or . for the files on disk)")
    p.add_argument("b", help="commit of this repository (or . for the files on disk)")
    p.add_argument("--entry", default="", help="only this entry")
    p.set_defaults(func=run)

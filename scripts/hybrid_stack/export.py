# SPDX-License-Identifier: Apache-2.0
"""`hybrid-stack export`: work tree commits -> patches/ and overlay/ (apply's inverse).

Each commit between the base tag and HEAD must carry a `Stack-Entry: <name>`
trailer naming a carried entry, in series order. For each entry:
- its overlay files are taken whole from the commit into overlay/<path>;
- its patch is `git format-patch` (fixed options, see gitops) of a commit with
  the same parent, the commit's tree minus the overlay files, and the entry's
  canonical message from series.toml (series.toml is the one source of
  messages: edit it, not the commit message).
Files in overlay/ owned by no carried entry, and patches/*.patch named by no
entry, are removed: after export, patches/ and overlay/ hold exactly the tree.
An unowned overlay file whose content the work tree does not hold (one that
never went through apply) stops export instead: removing it would lose it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hybrid_stack.errors import StackError, first_few
from hybrid_stack.gitops import Repo
from hybrid_stack.stack import load_stack
from hybrid_stack.workstate import (  # noqa: F401 - commit_entries, export_files: old home
    Files,
    commit_entries,
    current_files,
    edited_since_sync,
    export_files,
    files_digest,
    orphan_patches,
    read_state,
    write_files,
    write_state,
)


def unkept_overlay(
    repo: Repo,
    files: Files,
    now: Files,
) -> list[str]:
    """Files of overlay/ (in `now`, current_files) that export would delete
    (no carried entry owns them) and whose content the work tree's HEAD does
    not hold either."""
    unkept = []
    for rel, content in now.items():
        if not rel.startswith("overlay/") or rel in files:
            continue
        got = repo.blob("HEAD", rel.removeprefix("overlay/"))
        data = content[1] if isinstance(content, tuple) else content
        if got is None or got[1] != data:
            unkept.append(rel)
    return sorted(unkept)


def run(args: argparse.Namespace) -> int:
    stack = load_stack(args.root, check_files=False)
    work = (args.work or stack.default_work).resolve()
    files = export_files(stack, work)
    repo = Repo(work)
    state = read_state(repo)
    now = current_files(stack)  # read once: the checks below and write_files
    edited = [] if args.force else edited_since_sync(state.get("synced"), now)
    if edited:
        raise StackError(
            f"{len(edited)} file(s) of patches/ or overlay/ changed since the last apply "
            f"or export ({first_few(edited)}); export would overwrite them with {work}'s version. "
            "Run apply to take them into the work tree first, or export --force to "
            "drop them"
        )
    unkept = [] if args.force else unkept_overlay(repo, files, now)
    if unkept:
        raise StackError(
            f"export would delete {first_few(unkept)}: no carried entry owns it and {work}'s HEAD "
            "does not hold it; add it to an entry's overlay list in patches/series.toml "
            "and run apply, or remove it (export --force deletes it)"
        )
    changed = write_files(stack, files, now)
    if state:
        # write_files left patches/ and overlay/ equal to files
        state["synced"] = files_digest(files)
        write_state(repo, state)
    for rel in changed:
        print(f"export: wrote {rel}")
    print(f"export: {len(changed)} file(s) changed" if changed else "export: up to date")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="regenerate patches/ and overlay/ from the work tree")
    p.add_argument("--work", type=Path, default=None, help="work tree (default work/vllm)")
    p.add_argument(
        "--force",
        action="store_true",
        help="overwrite patches/ and overlay/ files edited since the last apply / export "
        "and delete overlay files no entry owns",
    )
    p.set_defaults(func=run)

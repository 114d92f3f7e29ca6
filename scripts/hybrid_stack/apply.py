# SPDX-License-Identifier: Apache-2.0
"""`hybrid-stack apply`: pinned base + series -> a git work tree.

The verb's command line; the work is done by ``applier`` (whose names this
module re-exports for callers that import them from here).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hybrid_stack.applier import (  # noqa: F401 - the engine's names, old home
    BRANCH,
    STATE,
    ApplyConflict,
    Conflict,
    _read_state,
    _write_state,
    apply,
    apply_entry,
    base_key,
    build_outputs,
    copy_overlay,
    create_work,
    ensure_base,
    entry_fingerprint,
    open_work,
    trial_apply,
)
from hybrid_stack.errors import StackError, first_few
from hybrid_stack.stack import load_stack, unowned_overlay


def run(args: argparse.Namespace) -> int:
    stack = load_stack(args.root)
    unowned = unowned_overlay(stack)
    if unowned:
        raise StackError(
            f"{first_few(unowned)}: owned by no "
            "carried entry of patches/series.toml, so apply would leave it out of the "
            "tree (and export would delete it); add it to an entry's overlay list, or "
            "remove it"
        )
    work = (args.work or stack.default_work).resolve()
    return apply(stack, work, source=args.source, cont=args.cont)


def add_parser(sub) -> None:
    p = sub.add_parser("apply", help="build the patched tree: base + every carried entry")
    p.add_argument("--work", type=Path, default=None, help="work tree (default work/vllm)")
    p.add_argument(
        "--source",
        choices=("sdist", "git", "local"),
        default="sdist",
        help="where the base comes from (default: the pinned sdist)",
    )
    p.add_argument(
        "--continue",
        dest="cont",
        action="store_true",
        help="after resolving a conflict by hand: keep HEAD's entries, apply the rest",
    )
    p.set_defaults(func=run)

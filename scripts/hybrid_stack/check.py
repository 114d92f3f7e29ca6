# SPDX-License-Identifier: Apache-2.0
"""`hybrid-stack check`: the series applies and patches/ + overlay/ are up to date.

Applies the series into a temporary work tree, exports it in memory, and fails
listing every entry whose patch or overlay files would change, every stray
file, and the first entry that does not apply. The CI guard.
"""

from __future__ import annotations

import argparse

from hybrid_stack.applier import trial_apply
from hybrid_stack.errors import StackError
from hybrid_stack.stack import Stack, load_stack
from hybrid_stack.workstate import current_files, export_files, orphan_patches


def stale_files(stack: Stack, source: str = "sdist") -> list[str]:
    """Paths (stack-relative) that export would change; raises if apply fails."""
    try:
        with trial_apply(stack, source) as work:
            want = export_files(stack, work)
    except StackError as e:
        raise StackError(f"the series does not apply: {e}") from None
    have = current_files(stack)
    stale = [p for p in sorted(set(want) | set(have)) if want.get(p) != have.get(p)]
    return sorted(set(stale) | set(orphan_patches(stack)))


def owner(stack: Stack, rel: str) -> str:
    for e in stack.entries:
        if rel == f"patches/{e.patch}" or rel.removeprefix("overlay/") in e.overlay:
            return e.name
    return "(no entry)"


def run(args: argparse.Namespace) -> int:
    stack = load_stack(args.root)
    stale = stale_files(stack, source=args.source)
    if stale:
        for rel in stale:
            print(f"check: stale {rel}  [{owner(stack, rel)}]")
        entries = sorted({owner(stack, rel) for rel in stale})
        raise StackError(
            f"patches not up to date for {', '.join(entries)}: run apply, fix, then "
            "hybrid-stack export and commit the result"
        )
    print(
        f"check: ok ({len(stack.carried)} carried entries apply; patches/ and "
        "overlay/ are up to date)"
    )
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("check", help="fail if the series does not apply or is stale")
    p.add_argument("--source", choices=("sdist", "git", "local"), default="sdist")
    p.set_defaults(func=run)

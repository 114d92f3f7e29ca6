# SPDX-License-Identifier: Apache-2.0
"""`hybrid-stack` command line: a thin dispatcher, one module per verb.

Each verb module defines ``add_parser(subparsers)`` (which registers the verb
and sets ``func``) and a function taking the parsed arguments and returning
an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from hybrid_stack.errors import StackError

VERBS = (
    "fetch",
    "apply",
    "export",
    "check",
    "status",
    "build",
    "testcmd",
    "bundle",
    "kstats",
    "rebase",
    "port",
    "rangediff",
    "prstack",
    "report",
)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybrid-stack",
        description="Apply, export and check the vllm-hybrid-stack patch series.",
    )
    parser.add_argument(
        "--root",
        type=Path,
        default=None,
        help="stack repository root (default: nearest folder with patches/series.toml)",
    )
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    for verb in VERBS:
        try:
            module = importlib.import_module(f"hybrid_stack.{verb}")
        except ModuleNotFoundError as e:
            if e.name != f"hybrid_stack.{verb}":
                raise
            continue  # verb not built yet
        module.add_parser(sub)
    parser.set_defaults(_verbs=sub.choices)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # the verb's own usage, not the top level's (exits 2)
        args._verbs[args.verb].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return int(args.func(args) or 0)
    except StackError as e:
        print(f"hybrid-stack {args.verb}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"hybrid-stack {args.verb}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

# SPDX-License-Identifier: Apache-2.0
"""`hybrid-stack fetch`: download the pinned sdist (and wheel) and verify sha256.

The work is in `downloads` (shared with apply, build and rebase): the files come
from the package index pip is configured with, and a cached file whose sha256
matches the pin is used without asking the network.
"""

from __future__ import annotations

import argparse

from hybrid_stack.downloads import (  # noqa: F401  (the names callers used from here)
    dist_dir,
    download,
    fetch_artifact,
    find_file_url,
    pip_indexes,
    sha256_file,
)
from hybrid_stack.stack import load_stack


def run(args: argparse.Namespace) -> int:
    stack = load_stack(args.root, check_files=False)
    kinds = ["sdist", "wheel"] if args.wheel else ["sdist"]
    for kind in kinds:
        path = fetch_artifact(stack, kind, offline=args.offline)
        print(f"fetch: {kind} ok  {path}  ({path.stat().st_size >> 20} MiB, sha256 verified)")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("fetch", help="download and verify the pinned vLLM sdist (and wheel)")
    p.add_argument("--wheel", action="store_true", help="also fetch the pinned wheel")
    p.add_argument("--offline", action="store_true", help="only use the cache")
    p.set_defaults(func=run)

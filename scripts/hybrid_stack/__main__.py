# SPDX-License-Identifier: Apache-2.0
"""`python -m hybrid_stack`: the `hybrid-stack` command without its entry point
script (a worktree's scripts/ on PYTHONPATH, the device machine)."""

import sys

from hybrid_stack.cli import main

sys.exit(main())

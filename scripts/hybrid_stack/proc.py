# SPDX-License-Identifier: Apache-2.0
"""Run a command with its output teed into a log file (build steps, test suites)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import TextIO


def tee(
    argv: list[str],
    *,
    cwd: Path,
    env: dict[str, str],
    log: TextIO,
    echo: Callable[[str], str | None] = lambda line: None,
) -> tuple[int, list[str]]:
    """Run argv (stderr merged into stdout), write every line to `log`, print
    what `echo(line)` returns for it (nothing for None); return (exit code, lines)."""
    lines: list[str] = []
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        log.write(line)
        lines.append(line)
        shown = echo(line)
        if shown is not None:
            print(shown, flush=True)
    return proc.wait(), lines

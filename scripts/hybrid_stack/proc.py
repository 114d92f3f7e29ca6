# SPDX-License-Identifier: Apache-2.0
"""Child processes and crash safety.

- ``tee``: run a command with its output teed into a log file (build steps,
  test suites).
- ``die_with_parent``: a ``preexec_fn`` that has the kernel kill the child
  when the tool dies, even by SIGKILL, so an interrupted verb never leaves a
  ``git clone`` or ``pip install`` running on its own.
- ``crash_point``: named points where the crash-safety tests kill the tool
  (``HYBRID_STACK_KILL_AT=<point>[:<n>]``, the n-th time the point is reached).
- ``pid_alive`` / ``sweep_stale``: temporary files and folders carry their
  maker's pid; a later run removes those whose maker is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

from hybrid_stack.errors import StackError

KILL_ENV = "HYBRID_STACK_KILL_AT"
_PR_SET_PDEATHSIG = 1
_reached: dict[str, int] = {}


def die_with_parent() -> None:  # pragma: no cover - runs in the child
    """preexec_fn: SIGKILL this child when the process that started it dies."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def crash_point(name: str) -> None:
    """Kill this process here if HYBRID_STACK_KILL_AT names this point (tests)."""
    want = os.environ.get(KILL_ENV, "")
    if not want:
        return
    point, _, nth = want.partition(":")
    if point != name:
        return
    _reached[name] = _reached.get(name, 0) + 1
    if _reached[name] == int(nth or 1):
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_PID_RE = re.compile(r"-(\d+)-")


def pid_tag() -> str:
    """The part of a temporary name that says which process made it."""
    return f"-{os.getpid()}-"


def sweep_stale(folder: Path, prefix: str, *, unmarked_after_s: float | None = None) -> None:
    """Remove files and folders named ``<prefix>...-<pid>-...`` in folder
    whose maker process is gone (left by a killed run); names without a pid
    (older versions of the tool) once they are `unmarked_after_s` old."""
    if not folder.is_dir():
        return
    for p in folder.iterdir():
        if not p.name.startswith(prefix):
            continue
        m = _PID_RE.search(p.name[len(prefix) - 1 :])
        if m is None:
            if unmarked_after_s is None:
                continue
            with contextlib.suppress(OSError):
                if time.time() - p.lstat().st_mtime < unmarked_after_s:
                    continue
        elif pid_alive(int(m.group(1))):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


@contextlib.contextmanager
def exclusive(lock: Path, what: str) -> Iterator[None]:
    """Hold an exclusive lock on the file `lock` (released when the process
    dies, however it dies); a second holder gets one clear error."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StackError(
                f"{what} is in use by another hybrid-stack process (lock {lock}): "
                "wait for it to finish, then run the command again"
            ) from None
        yield
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Write a file so that a reader (or a crash) sees the old or the new
    content, never a part."""
    tmp = path.with_name(f".{path.name}{pid_tag()}tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


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
        argv,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=die_with_parent,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        log.write(line)
        lines.append(line)
        shown = echo(line)
        if shown is not None:
            print(shown, flush=True)
    return proc.wait(), lines

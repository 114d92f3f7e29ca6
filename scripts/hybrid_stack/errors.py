# SPDX-License-Identifier: Apache-2.0
"""The one exception type the CLI turns into a one-line error, and how such a
line names a list of paths."""


class StackError(Exception):
    """A user-facing error: one line saying what went wrong and what to do."""


def first_few(paths: list[str]) -> str:
    """The first three of ``paths`` for a one-line error, " ..." if there are more."""
    return ", ".join(paths[:3]) + (" ..." if len(paths) > 3 else "")

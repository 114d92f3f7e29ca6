# SPDX-License-Identifier: Apache-2.0
"""The one exception type the CLI turns into a one-line error."""


class StackError(Exception):
    """A user-facing error: one line saying what went wrong and what to do."""

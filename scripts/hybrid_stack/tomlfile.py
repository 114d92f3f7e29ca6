# SPDX-License-Identifier: Apache-2.0
"""The one TOML loader of the tool: a missing or malformed file is one clear error."""

from __future__ import annotations

import sys
from pathlib import Path

from hybrid_stack.errors import StackError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def load(path: Path, *, missing: str = "") -> dict:
    """The parsed file; `missing` is what to do when it does not exist."""
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise StackError(f"{path} is missing" + (f": {missing}" if missing else "")) from None
    except tomllib.TOMLDecodeError as e:
        raise StackError(f"{path} is not valid TOML: {e}") from None

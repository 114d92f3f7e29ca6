# SPDX-License-Identifier: Apache-2.0
"""pytest plugin of the hybrid-stack GPU bundle: split a selection over calls.

``run.py --shard I/N`` runs pytest with ``-p hybrid_stack_shard`` and
``HYBRID_STACK_SHARD=I/N``: of the collected tests, in collection order, this
keeps the I-th, the (I+N)-th and so on and deselects the rest, so N calls (one
per shard, each within a device call's time limit) run the selection once
between them. Every pytest-xdist worker collects the same tests in the same
order, so all of them keep the same shard. Standard library only at import
(run.py checks ``--shard`` with ``parse``).
"""

from __future__ import annotations

import os
from typing import Any

ENV = "HYBRID_STACK_SHARD"


def parse(value: str) -> tuple[int, int]:
    """(I, N) of an ``I/N`` shard with 1 <= I <= N; ValueError otherwise."""
    i, sep, n = value.partition("/")
    if sep and i.isdigit() and n.isdigit() and 1 <= int(i) <= int(n):
        return int(i), int(n)
    raise ValueError(f"shard {value!r}: expected I/N with 1 <= I <= N, e.g. 1/2")


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    value = os.environ.get(ENV)
    if not value:
        return
    try:
        i, n = parse(value)
    except ValueError as e:
        import pytest

        raise pytest.UsageError(f"{ENV}: {e}") from None
    keep = [item for k, item in enumerate(items) if k % n == i - 1]
    drop = [item for k, item in enumerate(items) if k % n != i - 1]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Mamba "all" prefill chunk splitting (`_mamba_chunk_aligned_split`).

"all" mode checkpoints the state at every Mamba block boundary from the
prefill kernel's per-chunk states, which only exist on the kernel chunk grid
counted from the start of each scheduled chunk. Invariants checked here, over
random prompt lengths, budgets, block sizes and computed-token offsets:

- every block boundary strictly inside a chunk is on that chunk's kernel grid;
- every non-final prefill chunk ends on a kernel chunk boundary, except the
  realignment chunk of a request that started off the grid;
- a request either makes progress or is not scheduled (no empty chunk), and a
  lone request always makes progress when the budget is at least one kernel
  chunk (the startup validation).
"""

import random
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import get_mamba_chunk_aligned_prefill_end
from vllm.v1.request import Request

from .utils import create_requests

pytestmark = pytest.mark.cpu_test

HASH_BLOCK_SIZE = 16


def _inner_block_boundaries(start: int, end: int, block_size: int) -> range:
    """Block boundaries strictly inside ``(start, end)``."""
    return range((start // block_size + 1) * block_size, end, block_size)


def _check_chunk(
    start: int,
    end: int,
    prefill_end: int,
    chunk_size: int,
    block_size: int,
) -> None:
    assert start <= end
    # Checkpoints are taken from the kernel's per-chunk states.
    for boundary in _inner_block_boundaries(start, end, block_size):
        assert (boundary - start) % chunk_size == 0, (start, end, boundary)
    if start < end < prefill_end:
        # A non-final chunk ends on the grid (the only exception is a
        # misaligned start, which ends at the next grid point instead).
        assert end % chunk_size == 0, (start, end)


@settings(max_examples=400, deadline=None)
@given(
    chunk_size=st.sampled_from([16, 64, 128]),
    blocks_per_chunk=st.integers(1, 8),
    prefill_end=st.integers(1, 5000),
    start=st.integers(0, 5000),
    num_new_tokens=st.integers(0, 5000),
)
def test_chunk_aligned_prefill_end_properties(
    chunk_size: int,
    blocks_per_chunk: int,
    prefill_end: int,
    start: int,
    num_new_tokens: int,
) -> None:
    block_size = chunk_size * blocks_per_chunk
    query_end = start + num_new_tokens
    end = get_mamba_chunk_aligned_prefill_end(start, query_end, prefill_end, chunk_size)
    assert start <= end <= query_end
    if start >= prefill_end:
        # Decode / past the prompt: untouched.
        assert end == query_end
        return
    _check_chunk(start, end, prefill_end, chunk_size, block_size)
    next_grid_point = (start // chunk_size + 1) * chunk_size
    if query_end >= min(prefill_end, next_grid_point):
        # Enough budget to reach the prompt end or the next grid point: the
        # request must make progress.
        assert end > start
    if start % chunk_size == 0 and end < prefill_end:
        # Maximal: never clip more than down to the grid.
        assert end == query_end // chunk_size * chunk_size


@pytest.mark.parametrize(
    ("start", "num_new_tokens", "prefill_end", "expected_end"),
    [
        # Final chunk may end anywhere.
        (0, 1000, 1000, 1000),
        (128, 872, 1000, 1000),
        # Non-final chunks round down to the 64-token grid.
        (0, 700, 1000, 640),
        (64, 100, 1000, 128),
        # Not enough budget to reach the next grid point: not scheduled.
        (64, 63, 1000, 64),
        # Misaligned start (e.g. external KV load) realigns at the next point,
        # even if the chunk could otherwise reach the prompt end.
        (100, 500, 1000, 128),
        (100, 900, 1000, 128),
        (100, 28, 1000, 128),
        (100, 27, 1000, 100),
        # Misaligned start whose chunk ends before the next grid point at the
        # prompt end: the last chunk holds no block boundary, keep it.
        (100, 20, 120, 120),
        # Decode and resumed decode are untouched.
        (1000, 4, 1000, 1004),
    ],
)
def test_chunk_aligned_prefill_end_examples(
    start: int, num_new_tokens: int, prefill_end: int, expected_end: int
) -> None:
    assert (
        get_mamba_chunk_aligned_prefill_end(
            start, start + num_new_tokens, prefill_end, 64
        )
        == expected_end
    )


def _scheduler_stub(chunk_size: int | None) -> SimpleNamespace:
    stub = SimpleNamespace(mamba_all_mode_chunk_size=chunk_size)
    stub._mamba_chunk_aligned_split = (
        lambda *args: Scheduler._mamba_chunk_aligned_split(stub, *args)  # type: ignore[arg-type]
    )
    stub._mamba_block_aligned_split = lambda *args: -1
    return stub


def _make_request(prompt_len: int) -> Request:
    (request,) = create_requests(
        1, num_tokens=prompt_len, block_size=HASH_BLOCK_SIZE, max_tokens=8
    )
    return request


def test_dispatch_by_mode() -> None:
    request = _make_request(1000)
    all_stub = _scheduler_stub(64)
    assert Scheduler._mamba_aligned_split(all_stub, request, 700) == 640  # type: ignore[arg-type]
    # "align" keeps its own split.
    align_stub = _scheduler_stub(None)
    assert Scheduler._mamba_aligned_split(align_stub, request, 700) == -1  # type: ignore[arg-type]


def test_split_counts_local_and_external_hits() -> None:
    request = _make_request(1000)
    request.num_computed_tokens = 256
    stub = _scheduler_stub(64)
    # 256 computed + 64 local hit + 36 external (misaligned) -> start 356:
    # realign at 384.
    assert (
        Scheduler._mamba_chunk_aligned_split(stub, request, 400, 64, 36)  # type: ignore[arg-type]
        == 384 - 356
    )


def test_resumed_request_replays_output_tokens_aligned() -> None:
    request = _make_request(300)
    request.append_output_token_ids(list(range(200)))
    # A preempted request re-prefills prompt + outputs (minus the last).
    request.num_computed_tokens = 0
    stub = _scheduler_stub(64)
    assert Scheduler._mamba_chunk_aligned_split(stub, request, 450) == 448  # type: ignore[arg-type]
    request.num_computed_tokens = 448
    assert Scheduler._mamba_chunk_aligned_split(stub, request, 300) == 300  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(20))
def test_simulated_prefill_invariants(seed: int) -> None:
    """Run whole prefills through the real split with random per-step budgets
    (as left over by other requests) and random starting offsets."""
    rng = random.Random(seed)
    chunk_size = rng.choice([16, 64])
    block_size = chunk_size * rng.choice([1, 2, 4, 8, 16])
    max_budget = rng.randint(chunk_size, 4 * block_size)
    prompt_len = rng.randint(1, 12 * block_size)
    request = _make_request(prompt_len)
    # Offset as left by a prefix hit (block aligned) or an external KV load
    # (arbitrary).
    if rng.random() < 0.5:
        offset = rng.randint(0, prompt_len - 1) // block_size * block_size
    else:
        offset = rng.randint(0, prompt_len - 1)
    request.num_computed_tokens = offset
    stub = _scheduler_stub(chunk_size)

    chunks: list[tuple[int, int]] = []
    starved_steps = 0
    for _ in range(10 * prompt_len + 10):
        start = request.num_computed_tokens
        if start >= prompt_len:
            break
        # Decodes of other requests may eat part of the budget.
        budget = rng.randint(1, max_budget) if rng.random() < 0.5 else max_budget
        num_new = min(budget, prompt_len - start)
        scheduled = Scheduler._mamba_chunk_aligned_split(stub, request, num_new)  # type: ignore[arg-type]
        assert 0 <= scheduled <= num_new
        if scheduled == 0:
            # Not scheduled this step; with the full budget it must progress.
            assert budget < max_budget
            starved_steps += 1
            continue
        end = start + scheduled
        _check_chunk(start, end, prompt_len, chunk_size, block_size)
        chunks.append((start, end))
        request.num_computed_tokens = end
    assert request.num_computed_tokens == prompt_len
    # At most one realignment chunk, and only for a misaligned start.
    realigned = [(s, e) for s, e in chunks if s % chunk_size != 0]
    assert len(realigned) <= 1
    if realigned:
        assert realigned[0][0] == offset
    # Every chunk after the first starts on the grid.
    assert all(s % chunk_size == 0 for s, _ in chunks[1:])

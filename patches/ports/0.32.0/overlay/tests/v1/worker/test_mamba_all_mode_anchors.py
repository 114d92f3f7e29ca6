# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Model Runner V2 bookkeeping of mamba_cache_mode="all": each request's
previous-step write anchor (`MambaAllModeAnchors`), kept per persistent row on
the device, staged after a step and consumed once by the next, under
reordering, preemption, resume and finish."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.v1.attention.backends.gdn_attn import GDNAllModeSlotBuilder
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID
from vllm.v1.worker.gpu.model_states.mamba_hybrid import MambaAllModeAnchors

pytestmark = pytest.mark.cpu_test

DEVICE = torch.device("cpu")
MAX_NUM_REQS = 6
NUM_SPEC = 3


def _idx(rows: list[int]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int32)


def _slots(rows: list[int]) -> torch.Tensor:
    """Distinct spec slots per persistent row: 100 * row + column + 1."""
    return torch.tensor(
        [[100 * r + c + 1 for c in range(NUM_SPEC + 1)] for r in rows],
        dtype=torch.int32,
    )


def _accepted(per_row: dict[int, int]) -> torch.Tensor:
    acc = torch.ones(MAX_NUM_REQS, dtype=torch.int32)
    for row, n in per_row.items():
        acc[row] = n
    return acc


def test_nothing_staged_reads_minus_one() -> None:
    """Rows never staged, or staged only with a null write slot (a padded
    row whose slots the stage still overwrote), have no anchor."""
    anchors = MambaAllModeAnchors(MAX_NUM_REQS, NUM_SPEC, DEVICE)
    anchors.stage(_idx([1]), _slots([1]))
    anchors.stage(_idx([3]), torch.zeros((1, NUM_SPEC + 1), dtype=torch.int32))
    out = anchors.consume(_idx([0, 3, 5]), _accepted({}))
    assert out.tolist() == [-1, -1, -1]


def test_stage_then_consume_once() -> None:
    anchors = MambaAllModeAnchors(MAX_NUM_REQS, NUM_SPEC, DEVICE)
    anchors.stage(_idx([0, 3]), _slots([0, 3]))
    # Row 0 accepted 3 tokens (2 drafts): its state is in column 2.
    out = anchors.consume(_idx([0, 3]), _accepted({0: 3, 3: 1}))
    assert out.tolist() == [3, 301]
    assert anchors.consume(_idx([0, 3]), _accepted({0: 3})).tolist() == [-1, -1]


def test_reordered_batch_follows_persistent_rows() -> None:
    anchors = MambaAllModeAnchors(MAX_NUM_REQS, NUM_SPEC, DEVICE)
    anchors.stage(_idx([3, 1, 5]), _slots([3, 1, 5]))
    out = anchors.consume(_idx([5, 3, 1]), _accepted({5: 4, 3: 2, 1: 1}))
    assert out.tolist() == [504, 302, 101]


def test_unscheduled_request_keeps_its_anchor() -> None:
    anchors = MambaAllModeAnchors(MAX_NUM_REQS, NUM_SPEC, DEVICE)
    anchors.stage(_idx([0, 1]), _slots([0, 1]))
    assert anchors.consume(_idx([1]), _accepted({1: 2})).tolist() == [102]
    anchors.stage(_idx([1]), _slots([1]) + 1000)
    assert anchors.consume(_idx([0, 1]), _accepted({0: 1})).tolist() == [1, 1101]


def test_preempt_resume_and_finish_drop_the_anchor() -> None:
    anchors = MambaAllModeAnchors(MAX_NUM_REQS, NUM_SPEC, DEVICE)
    anchors.stage(_idx([0, 1, 2]), _slots([0, 1, 2]))
    # Row 1 preempted and resumed, row 2 finished and reused: both re-enter
    # through add_request, which resets; row 0 is untouched.
    anchors.reset(1)
    anchors.reset(2)
    out = anchors.consume(_idx([2, 1, 0]), _accepted({0: 2}))
    assert out.tolist() == [-1, -1, 2]


def test_padding_rows_stage_nothing_and_sink_rows_read_minus_one() -> None:
    anchors = MambaAllModeAnchors(MAX_NUM_REQS, NUM_SPEC, DEVICE)
    slots = _slots([0, 4])
    slots[1] = NULL_BLOCK_ID
    anchors.stage(_idx([0, 4]), slots)
    assert anchors.consume(_idx([4, 0]), _accepted({})).tolist() == [-1, 1]
    # -1 in idx_mapping (a row filtered under pipeline parallelism).
    anchors.stage(_idx([-1, 2]), _slots([5, 2]))
    assert anchors.consume(_idx([-1, 2]), _accepted({})).tolist() == [-1, 201]
    assert anchors.consume(_idx([5]), _accepted({})).tolist() == [-1]


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**16), st.integers(3, 12))
def test_steps_against_a_host_model(seed: int, num_steps: int) -> None:
    """Random steps through the builder and the tracker: requests join,
    decode with drafts, get preempted and resumed, finish, are reordered and
    skipped. The read slot of every step must be the slot holding the state
    after the last accepted token, tracked by a plain-Python model."""
    rng = random.Random(seed)
    block_size = 4
    builder = GDNAllModeSlotBuilder(MAX_NUM_REQS, NUM_SPEC, block_size, 3, DEVICE)
    anchors = MambaAllModeAnchors(MAX_NUM_REQS, NUM_SPEC, DEVICE)
    width = 16
    tables = {r: [100 * r + i + 1 for i in range(width)] for r in range(MAX_NUM_REQS)}
    computed: dict[int, int] = {}  # persistent row -> num_computed_tokens
    state_slot: dict[int, int] = {}  # row -> slot holding the current state
    accepted = torch.ones(MAX_NUM_REQS, dtype=torch.int32)
    for _ in range(num_steps):
        for row in list(computed):
            if rng.random() < 0.15:  # finish or preempt: freed
                del computed[row]
                state_slot.pop(row, None)
        for row in range(MAX_NUM_REQS):
            if row not in computed and rng.random() < 0.3:  # new or resumed
                # Resumed / prefix hit: the state of a cached block boundary,
                # named by the block table, not by the previous life's anchor.
                hit_blocks = rng.choice([0, 0, 1, 2])
                computed[row] = hit_blocks * block_size
                state_slot.pop(row, None)
                if hit_blocks:
                    state_slot[row] = tables[row][hit_blocks - 1]
                anchors.reset(row)
                accepted[row] = 1
        rows = [r for r in computed if rng.random() < 0.8]
        rng.shuffle(rows)
        if not rows:
            continue
        qlens, drafts = [], []
        for r in rows:
            if r not in state_slot or rng.random() < 0.2:  # (chunked) prefill
                qlens.append(rng.randint(1, 9))
                drafts.append(-1)
            else:
                d = rng.randint(0, NUM_SPEC)
                qlens.append(1 + d)
                drafts.append(d if d else -1)
        if max(computed[r] + q for r, q in zip(rows, qlens)) > block_size * (
            width - NUM_SPEC
        ):
            break
        idx = _idx(rows)
        read_anchors = anchors.consume(idx, accepted)
        md = builder.build(
            torch.tensor([tables[r] for r in rows], dtype=torch.int32),
            torch.tensor([computed[r] for r in rows], dtype=torch.int32),
            torch.tensor(qlens, dtype=torch.int32),
            torch.tensor(drafts, dtype=torch.int32),
            read_anchors=read_anchors,
        )
        anchors.stage(idx, md.spec_slots)
        for i, r in enumerate(rows):
            expect = state_slot.get(r, NULL_BLOCK_ID)
            assert int(md.read_slots[i]) == expect, (r, computed[r])
            n_drafts = max(drafts[i], 0)
            n_acc = rng.randint(1, n_drafts + 1)
            accepted[r] = n_acc
            state_slot[r] = int(md.spec_slots[i, n_acc - 1])
            computed[r] += qlens[i] - n_drafts + n_acc - 1

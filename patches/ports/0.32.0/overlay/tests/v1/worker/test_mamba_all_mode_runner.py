# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Model Runner V2 wiring of mamba_cache_mode="all": `MambaHybridModelState`
consumes each request's previous-step anchors in `preprocess_state` (real
batches only), hands them to the GDN metadata builders in `prepare_attn`,
stages the step's slots after the build, and drops a row's anchor in
`add_request`. Dummy, profile and capture runs get the untracked fallback and
leave the staged anchors alone."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.v1.attention.test_gdn_all_mode_metadata import _make_builder
from tests.v1.attention.utils import BatchSpec, create_common_attn_metadata
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.attention.backends.gdn_attn import GDNAllModeSlotBuilder
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID
from vllm.v1.worker.gpu.model_states import mamba_hybrid
from vllm.v1.worker.gpu.model_states.mamba_hybrid import (
    MambaAllModeAnchors,
    MambaHybridModelState,
)

pytestmark = pytest.mark.cpu_test

DEVICE = torch.device("cpu")
BLOCK = 16
MAX_NUM_REQS = 4
WIDTH = 12


def _table(group: int) -> torch.Tensor:
    """Distinct block ids per persistent row and group: a request's row of
    the block table is ``1000 * group + 100 * row + column + 1``."""
    rows = torch.arange(MAX_NUM_REQS)[:, None] * 100
    cols = torch.arange(WIDTH)[None, :] + 1
    return (1000 * group + rows + cols).to(torch.int32)


class _Runner:
    """`MambaHybridModelState` in all mode, driven the way `execute_model`
    drives it, with the real GDN metadata builders (one per Mamba group)
    behind a stand-in for `build_attn_metadata`."""

    def __init__(self, monkeypatch, num_spec: int, num_groups: int = 1):
        self.num_spec = num_spec
        state = object.__new__(MambaHybridModelState)
        state.vllm_config = SimpleNamespace(num_speculative_tokens=num_spec)
        state.model_config = SimpleNamespace(max_model_len=8192)
        state.max_num_reqs = MAX_NUM_REQS
        state.device = DEVICE
        state.rope_state = None
        state.prompt_embeds_state = None
        state.recoverssm = None
        state._align_mode = False
        state._all_mode = True
        state._all_mode_read_anchors = None
        state._all_mode_anchors = {
            g: MambaAllModeAnchors(MAX_NUM_REQS, num_spec, DEVICE)
            for g in range(num_groups)
        }
        state.num_accepted_tokens_gpu = torch.ones(MAX_NUM_REQS, dtype=torch.int32)
        self.state = state
        self.builders = []
        for _ in range(num_groups):
            builder = _make_builder(num_spec)
            builder.all_mode_slots = GDNAllModeSlotBuilder(
                MAX_NUM_REQS, num_spec, BLOCK, num_spec, DEVICE
            )
            self.builders.append(builder)
        self.attn_groups = [
            [SimpleNamespace(get_metadata_builder=lambda _, b=b: b)]
            for b in self.builders
        ]
        self.built: list = []
        monkeypatch.setattr(mamba_hybrid, "build_attn_metadata", self._build)

    def _build(self, **kw):
        """`build_attn_metadata` for the GDN groups only."""
        specific = kw["model_specific_attn_metadata"]
        num_reqs = kw["num_reqs"]
        self.built = []
        for group, groups in enumerate(kw["attn_groups"]):
            builder = groups[0].get_metadata_builder(0)
            common = self.common.replace(
                block_table_tensor=kw["block_tables"][group][:num_reqs]
            )
            if kw["for_cudagraph_capture"]:
                md = builder.build_for_cudagraph_capture(common)
            else:
                md = builder.build(
                    0, common, **specific.get_extra_attn_kwargs(builder, num_reqs)
                )
            self.built.append(md)
        return {}

    def step(
        self,
        rows: list[int],
        computed: list[int],
        query_lens: list[int],
        drafts: list[int],
        *,
        dummy: bool = False,
        padded_reqs: int | None = None,
        cudagraph_mode: CUDAGraphMode = CUDAGraphMode.NONE,
        for_capture: bool = False,
    ) -> list:
        """One step over persistent ``rows``; returns each group's
        `GDNAllModeMetadata`."""
        n = len(rows)
        num_reqs = padded_reqs or n
        pad = num_reqs - n
        qlens = query_lens + [0] * pad
        seq_lens = [c + q for c, q in zip(computed, query_lens)] + [0] * pad
        qsl = np.zeros(num_reqs + 1, dtype=np.int32)
        qsl[1:] = np.cumsum(qlens)
        is_prefilling = np.array([d < 0 for d in drafts])
        input_batch = SimpleNamespace(
            num_reqs=n,
            num_reqs_after_padding=num_reqs,
            num_tokens=int(qsl[n]),
            num_tokens_after_padding=int(qsl[-1]),
            idx_mapping=torch.tensor(rows, dtype=torch.int64),
            query_start_loc_np=qsl,
            query_start_loc=torch.from_numpy(qsl),
            num_scheduled_tokens=np.array(query_lens, dtype=np.int32),
            num_draft_tokens_per_req=np.array([max(d, 0) for d in drafts], np.int32),
            max_query_len=max(query_lens),
            seq_lens_cpu_upper_bound=torch.tensor(seq_lens, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            is_prefilling_np=is_prefilling,
            prefill_runs_as_decode_np=None,
            dcp_local_seq_lens=None,
            positions=torch.zeros(int(qsl[-1]), dtype=torch.int64),
            prompt_lens=None,
        )
        self.common = create_common_attn_metadata(
            BatchSpec(seq_lens=[max(s, 1) for s in seq_lens], query_lens=qlens),
            BLOCK,
            DEVICE,
        )
        tables = [
            _table(g)[torch.tensor(rows + [0] * pad)].clone()
            for g in range(len(self.builders))
        ]
        for t in tables:
            t[n:] = NULL_BLOCK_ID
        if not dummy:
            self.state.preprocess_state(input_batch, tuple(tables), None, None)
        self.state.prepare_attn(
            input_batch,
            cudagraph_mode,
            tuple(tables),
            torch.empty(0),
            self.attn_groups,
            None,
            for_capture=for_capture,
        )
        return [md.all_mode for md in self.built]

    def accept(self, per_row: dict[int, int]) -> None:
        """The previous step's accepted tokens per persistent row, as
        `postprocess_state` scatters them."""
        for row, n in per_row.items():
            self.state.num_accepted_tokens_gpu[row] = n


def _slot(group: int, row: int, col: int) -> int:
    return int(_table(group)[row, col])


def test_spec_step_anchors_follow_acceptance_and_reorder(monkeypatch) -> None:
    """Step 1 speculates for rows 2 and 0; step 2 runs them in the other
    order. Each reads its recurrent state from the scratch slot of its last
    accepted token and its conv window from step 1's write slot."""
    r = _Runner(monkeypatch, num_spec=2)
    # Row 2 at 40 computed tokens, row 0 at 47: both write into block 2
    # (tokens 32..47); row 0's scratch then runs into blocks 3 and 4.
    (md,) = r.step([2, 0], [40, 47], [3, 3], [2, 2])
    assert md.write_slots.tolist() == [_slot(0, 2, 2), _slot(0, 0, 2)]
    assert md.spec_slots[1].tolist() == [_slot(0, 0, c) for c in (2, 3, 4)]
    r.accept({2: 1, 0: 3})
    (md,) = r.step([0, 2], [50, 41], [3, 3], [2, 2])
    # Row 0 accepted both drafts: its state is in the second scratch slot.
    assert md.read_slots.tolist() == [_slot(0, 0, 4), _slot(0, 2, 2)]
    assert md.conv_read_slots.tolist() == [_slot(0, 0, 2), _slot(0, 2, 2)]


def test_anchor_is_consumed_once(monkeypatch) -> None:
    """A row scheduled again after a step that staged nothing for it (here: a
    dummy run in between does not count) reads its anchor once; a second
    consumption without a stage in between falls back to the block table."""
    r = _Runner(monkeypatch, num_spec=2)
    r.step([1], [40], [3], [2])
    r.accept({1: 3})
    consumed = r.state._all_mode_anchors[0].consume_with_conv(
        torch.tensor([1]), r.state.num_accepted_tokens_gpu
    )
    assert consumed.tolist() == [[_slot(0, 1, 4), _slot(0, 1, 2)]]
    (md,) = r.step([1], [43], [3], [2])
    # Block table read slot for 43 computed tokens: block 2.
    assert md.read_slots.tolist() == [_slot(0, 1, 2)]
    assert md.conv_read_slots.tolist() == [_slot(0, 1, 2)]


def test_dummy_and_capture_runs_are_untracked(monkeypatch) -> None:
    r = _Runner(monkeypatch, num_spec=1)
    r.step([0], [33], [2], [1])
    r.accept({0: 2})
    # A dummy run (no preprocess_state) on the same persistent row: read ==
    # write, nothing consumed, nothing staged.
    (md,) = r.step([0], [5], [2], [1], dummy=True)
    assert torch.equal(md.read_slots, md.write_slots)
    assert torch.equal(md.conv_read_slots, md.write_slots)
    (md,) = r.step(
        [0],
        [5],
        [2],
        [1],
        dummy=True,
        cudagraph_mode=CUDAGraphMode.FULL,
        for_capture=True,
    )
    assert torch.equal(md.read_slots, md.write_slots)
    # The real anchor survived both.
    (md,) = r.step([0], [35], [2], [1])
    assert md.read_slots.tolist() == [_slot(0, 0, 3)]
    assert md.conv_read_slots.tolist() == [_slot(0, 0, 2)]


def test_preempt_resume_and_finish_reset_the_row(monkeypatch) -> None:
    """`add_request` (a new request, or a preempted one resumed) drops the
    row's anchor: the prefill reads the block table's slot."""
    r = _Runner(monkeypatch, num_spec=2)
    r.step([3], [40], [3], [2])
    r.accept({3: 3})
    # Preempted, then resumed from a prefix hit at 32 tokens (add_request also
    # resets the row's accepted count).
    r.state.add_request(3, SimpleNamespace(num_computed_tokens=32))
    assert int(r.state.num_accepted_tokens_gpu[3]) == 1
    (md,) = r.step([3], [32], [20], [-1])
    assert md.read_slots.tolist() == [_slot(0, 3, 1)]
    assert md.write_slots.tolist() == [_slot(0, 3, 3)]
    # Finished, row reused by a new request with no cached prefix.
    r.state.add_request(3, SimpleNamespace(num_computed_tokens=0))
    (md,) = r.step([3], [0], [20], [-1])
    assert md.read_slots.tolist() == [NULL_BLOCK_ID]


def test_unscheduled_request_keeps_its_anchor(monkeypatch) -> None:
    r = _Runner(monkeypatch, num_spec=2)
    r.step([0, 1], [40, 40], [3, 3], [2, 2])
    r.accept({0: 2, 1: 3})
    r.step([1], [43], [3], [2])  # row 0 not scheduled
    (md,) = r.step([0], [42], [3], [2])
    assert md.read_slots.tolist() == [_slot(0, 0, 3)]
    assert md.conv_read_slots.tolist() == [_slot(0, 0, 2)]


def test_chunked_prefill_reads_its_own_previous_write(monkeypatch) -> None:
    """Without drafts the anchor is the previous write slot, which is also
    the block table's read slot."""
    r = _Runner(monkeypatch, num_spec=0)
    (md,) = r.step([1], [0], [40], [-1])
    assert md.write_slots.tolist() == [_slot(0, 1, 2)]
    (md,) = r.step([1], [40], [30], [-1])
    assert md.read_slots.tolist() == [_slot(0, 1, 2)]
    assert md.write_slots.tolist() == [_slot(0, 1, 4)]


def test_full_graph_padding_rows_have_no_anchor(monkeypatch) -> None:
    r = _Runner(monkeypatch, num_spec=1)
    r.step([2], [40], [2], [1])
    r.accept({2: 2})
    (md,) = r.step(
        [2], [42], [2], [1], padded_reqs=3, cudagraph_mode=CUDAGraphMode.FULL
    )
    assert md.read_slots.tolist() == [_slot(0, 2, 3), NULL_BLOCK_ID, NULL_BLOCK_ID]
    assert md.write_slots[1:].tolist() == [NULL_BLOCK_ID] * 2


def test_each_mamba_group_tracks_its_own_blocks(monkeypatch) -> None:
    r = _Runner(monkeypatch, num_spec=2, num_groups=2)
    r.step([1], [40], [3], [2])
    r.accept({1: 3})
    md0, md1 = r.step([1], [43], [3], [2])
    assert md0.read_slots.tolist() == [_slot(0, 1, 4)]
    assert md1.read_slots.tolist() == [_slot(1, 1, 4)]

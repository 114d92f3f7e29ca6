# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GDN metadata in mamba_cache_mode="all": the per-request read, write and
scratch slots of `GDNAllModeSlotBuilder` against
`get_mamba_all_mode_state_slots`, filled in place in persistent buffers."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.v1.attention.utils import (
    BatchSpec,
    create_common_attn_metadata,
    create_vllm_config,
)
from vllm.config import SpeculativeConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.attention.backends.gdn_attn import (
    GDNAllModeMetadata,
    GDNAllModeSlotBuilder,
    GDNAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID
from vllm.v1.kv_cache_interface import MambaSpec, get_mamba_all_mode_state_slots

pytestmark = pytest.mark.cpu_test

DEVICE = torch.device("cpu")
MAX_NUM_REQS = 8


def _random_block_table(
    gen: torch.Generator, num_reqs: int, width: int
) -> torch.Tensor:
    """Distinct non-null block ids, so a wrong column or row is always seen."""
    ids = torch.randperm(num_reqs * width, generator=gen, dtype=torch.int64) + 1
    return ids.to(torch.int32).reshape(num_reqs, width)


def _expected(
    md: GDNAllModeMetadata,
    row: int,
    block_table: torch.Tensor,
    num_computed: int,
    query_len: int,
    num_drafts: int,
    block_size: int,
    num_spec: int,
    num_speculative_blocks: int,
) -> None:
    """Assert row ``row`` of ``md`` against get_mamba_all_mode_state_slots."""
    width = block_table.shape[1]
    if query_len == 0:
        assert int(md.read_slots[row]) == NULL_BLOCK_ID
        assert int(md.write_slots[row]) == NULL_BLOCK_ID
        assert md.spec_slots[row].tolist() == [NULL_BLOCK_ID] * (num_spec + 1)
        assert int(md.num_checkpoints[row]) == 0
        return
    slots = get_mamba_all_mode_state_slots(
        num_computed,
        query_len,
        max(num_drafts, 0),
        block_size,
        num_speculative_blocks,
    )
    bt = block_table[row].tolist()
    read = NULL_BLOCK_ID if slots.read_block_idx < 0 else bt[slots.read_block_idx]
    assert int(md.read_slots[row]) == read
    assert int(md.write_slots[row]) == bt[slots.write_block_idx]
    spec = [bt[slots.write_block_idx]]
    spec += [bt[i] if i < width else NULL_BLOCK_ID for i in slots.spec_block_idxs]
    spec += [NULL_BLOCK_ID] * (num_spec + 1 - len(spec))
    assert md.spec_slots[row].tolist() == spec
    assert int(md.num_checkpoints[row]) == len(slots.checkpoint_block_idxs)
    assert int(md.num_computed_tokens[row]) == num_computed


@st.composite
def _batches(draw):
    block_size = draw(st.sampled_from([4, 8, 64]))
    num_spec = draw(st.integers(0, 3))
    num_speculative_blocks = draw(st.integers(0, num_spec))
    num_reqs = draw(st.integers(1, MAX_NUM_REQS))
    rows = []
    for _ in range(num_reqs):
        num_computed = draw(st.integers(0, 6 * block_size))
        query_len = draw(st.integers(0, 3 * block_size))
        drafts = -1
        if num_spec and query_len > 0 and draw(st.booleans()):
            drafts = draw(st.integers(0, min(num_spec, query_len - 1)))
        rows.append((num_computed, query_len, drafts))
    # Sometimes too narrow for the scratch blocks of the longest row.
    longest = max(c + q for c, q, _ in rows)
    width = -(-max(longest, 1) // block_size) + draw(st.integers(0, num_spec))
    seed = draw(st.integers(0, 2**16))
    return block_size, num_spec, num_speculative_blocks, rows, width, seed


@settings(max_examples=150, deadline=None)
@given(_batches())
def test_slots_match_get_mamba_all_mode_state_slots(batch) -> None:
    block_size, num_spec, num_spec_blocks, rows, width, seed = batch
    gen = torch.Generator().manual_seed(seed)
    block_table = _random_block_table(gen, len(rows), width)
    builder = GDNAllModeSlotBuilder(
        MAX_NUM_REQS, num_spec, block_size, num_spec_blocks, DEVICE
    )
    md = builder.build(
        block_table,
        torch.tensor([r[0] for r in rows], dtype=torch.int32),
        torch.tensor([r[1] for r in rows], dtype=torch.int32),
        torch.tensor([r[2] for r in rows], dtype=torch.int32) if num_spec else None,
    )
    assert md.block_table is block_table
    assert md.block_size == block_size
    for row, (num_computed, query_len, drafts) in enumerate(rows):
        _expected(
            md,
            row,
            block_table,
            num_computed,
            query_len,
            drafts,
            block_size,
            num_spec,
            num_spec_blocks,
        )


def test_buffers_are_persistent_and_filled_in_place() -> None:
    """A view taken at one build (a captured CUDA graph's input) sees the
    next build's values: every field is a slice of a fixed buffer."""
    builder = GDNAllModeSlotBuilder(MAX_NUM_REQS, 2, 4, 2, DEVICE)
    gen = torch.Generator().manual_seed(0)
    table1 = _random_block_table(gen, 4, 12)
    md1 = builder.build(
        table1,
        torch.tensor([4, 9, 15, 2]),
        torch.tensor([3, 3, 1, 3]),
        torch.tensor([2, 2, -1, 2]),
    )
    captured = (md1.read_slots, md1.write_slots, md1.spec_slots)
    for field, buf in zip(
        captured, (builder.read_slots, builder.write_slots, builder.spec_slots)
    ):
        assert field.data_ptr() == buf.data_ptr()
    table2 = _random_block_table(gen, 4, 12)
    md2 = builder.build(
        table2,
        torch.tensor([8, 1, 3, 7]),
        torch.tensor([3, 3, 3, 1]),
        torch.tensor([2, 2, 2, -1]),
    )
    for old, new in zip(captured, (md2.read_slots, md2.write_slots, md2.spec_slots)):
        assert old.data_ptr() == new.data_ptr()
        assert torch.equal(old, new)
    _expected(md2, 0, table2, 8, 3, 2, 4, 2, 2)
    _expected(md2, 3, table2, 7, 1, -1, 4, 2, 2)


def test_read_anchors_and_untracked_fallback() -> None:
    builder = GDNAllModeSlotBuilder(MAX_NUM_REQS, 3, 8, 3, DEVICE)
    table = _random_block_table(torch.Generator().manual_seed(1), 4, 8)
    args = (
        table,
        torch.tensor([9, 16, 20, 3]),
        torch.tensor([4, 4, 1, 0]),
        torch.tensor([3, 3, -1, -1]),
    )
    plain = builder.build(*args)
    plain_read = plain.read_slots.clone()
    anchors = torch.tensor([-1, 777, 555, 999], dtype=torch.int32)
    md = builder.build(*args, read_anchors=anchors)
    # Row 0 untracked: block table; rows 1-2 tracked: the anchor; row 3 is
    # padding: null whatever the anchor says.
    assert md.read_slots.tolist() == [int(plain_read[0]), 777, 555, NULL_BLOCK_ID]
    assert torch.equal(md.write_slots, plain.write_slots)
    dummy = builder.build(*args, untracked=True)
    assert torch.equal(dummy.read_slots, dummy.write_slots)


def _make_builder(num_spec: int) -> GDNAttentionMetadataBuilder:
    vllm_config = create_vllm_config(model_name="Qwen/Qwen3.5-0.8B", block_size=16)
    vllm_config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    if num_spec:
        vllm_config.speculative_config = SpeculativeConfig(
            method="ngram", num_speculative_tokens=num_spec
        )
    spec = MambaSpec(block_size=16, shapes=((16, 64),), dtypes=(torch.float16,))
    return GDNAttentionMetadataBuilder(spec, ["layer.0"], vllm_config, DEVICE)


def test_align_and_none_builders_carry_no_all_mode_fields() -> None:
    builder = _make_builder(2)
    assert builder.all_mode_slots is None
    common = create_common_attn_metadata(
        BatchSpec(seq_lens=[40, 30], query_lens=[3, 3]), 16, DEVICE
    )
    md = builder.build(
        0,
        common,
        num_accepted_tokens=torch.ones(2, dtype=torch.int32),
        num_decode_draft_tokens_cpu=torch.tensor([2, 2], dtype=torch.int32),
    )
    assert md.all_mode is None
    assert builder.build_for_cudagraph_capture(common).all_mode is None


@pytest.mark.parametrize("num_spec", [0, 2])
def test_builder_attaches_all_mode_slots(num_spec: int) -> None:
    """build() derives the slots from the common metadata (num_computed_tokens
    = seq_lens - query_lens, the request's own block-table row) and the draft
    counts; capture gets the untracked fallback."""
    builder = _make_builder(num_spec)
    builder.all_mode_slots = GDNAllModeSlotBuilder(
        MAX_NUM_REQS, num_spec, 16, num_spec, DEVICE
    )
    seq_lens = [40, 33, 100, 17]
    query_lens = [3, 3, 50, 1] if num_spec else [1, 1, 50, 1]
    drafts = [2, 2, -1, -1] if num_spec else [-1] * 4
    common = create_common_attn_metadata(
        BatchSpec(seq_lens=seq_lens, query_lens=query_lens),
        16,
        DEVICE,
        arange_block_indices=True,
    )
    table = common.block_table_tensor + 1
    common = common.replace(block_table_tensor=table)
    kwargs: dict = {}
    if num_spec:
        kwargs = dict(
            num_accepted_tokens=torch.ones(4, dtype=torch.int32),
            num_decode_draft_tokens_cpu=torch.tensor(drafts, dtype=torch.int32),
        )
    anchors = torch.tensor([-1, 4242, -1, -1], dtype=torch.int32)
    md = builder.build(0, common, mamba_read_anchors=anchors, **kwargs)
    assert md.all_mode is not None
    for row in range(4):
        if row == 1:
            assert int(md.all_mode.read_slots[row]) == 4242
            continue
        _expected(
            md.all_mode,
            row,
            table,
            seq_lens[row] - query_lens[row],
            query_lens[row],
            drafts[row],
            16,
            num_spec,
            num_spec,
        )
    capture = create_common_attn_metadata(
        BatchSpec(seq_lens=[1] * 4, query_lens=[1] * 4), 16, DEVICE
    )
    md = builder.build_for_cudagraph_capture(capture)
    assert md.all_mode is not None
    assert torch.equal(md.all_mode.read_slots, md.all_mode.write_slots)
    assert (
        md.all_mode.read_slots.data_ptr()
        == builder.all_mode_slots.read_slots.data_ptr()
    )

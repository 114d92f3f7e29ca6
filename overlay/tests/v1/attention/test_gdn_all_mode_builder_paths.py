# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the GDN layer gets from the metadata builder in mamba_cache_mode="all":
the kernels' write indices are the all-mode write / scratch slots, their read
indices the read slots (the conv window's anchor for speculative rows), per
decode, speculative and prefill row, through the FULL CUDA graph buffers; the
prefill's checkpoint slots (recurrent state through the chunk kernel, conv
window through the exporter) are exactly `get_mamba_all_mode_state_slots`'s
for chunk-aligned starts and none otherwise. Also what refuses all mode: a
GDN prefill backend that cannot write checkpoints, speculative decoding on the
V1 runner."""

import pytest
import torch

from tests.v1.attention.utils import (
    BatchSpec,
    create_common_attn_metadata,
    create_vllm_config,
)
from vllm.config import SpeculativeConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
    _resolve_gdn_prefill_backend,
)
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID
from vllm.v1.kv_cache_interface import MambaSpec, get_mamba_all_mode_state_slots

pytestmark = pytest.mark.cpu_test

DEVICE = torch.device("cpu")
BLOCK = 64


def _vllm_config(num_spec: int, v2: bool = True):
    cfg = create_vllm_config(model_name="Qwen/Qwen3.5-0.8B", block_size=BLOCK)
    cfg.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    cfg.cache_config.mamba_cache_mode = "all"
    cfg.cache_config.mamba_chunk_size = 64
    if num_spec:
        cfg.speculative_config = SpeculativeConfig(
            method="ngram", num_speculative_tokens=num_spec
        )
    return cfg


def _builder(num_spec: int, monkeypatch) -> GDNAttentionMetadataBuilder:
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    spec = MambaSpec(
        block_size=BLOCK,
        shapes=((16, 64),),
        dtypes=(torch.float16,),
        mamba_cache_mode="all",
        num_speculative_blocks=num_spec,
    )
    return GDNAttentionMetadataBuilder(
        spec, ["layer.0"], _vllm_config(num_spec), DEVICE
    )


def _common(seq_lens, query_lens):
    common = create_common_attn_metadata(
        BatchSpec(seq_lens=seq_lens, query_lens=query_lens),
        BLOCK,
        DEVICE,
        arange_block_indices=True,
    )
    # Wide enough for every scratch block; slot ids distinct and non-null.
    rows = torch.arange(len(seq_lens))[:, None] * 100
    table = (rows + torch.arange(10)[None, :] + 1).to(torch.int32)
    return common.replace(block_table_tensor=table), table


def test_builder_takes_all_mode_without_update_block_table(monkeypatch) -> None:
    builder = _builder(2, monkeypatch)
    assert builder.all_mode_slots is not None
    assert builder.all_mode_slots.block_size == BLOCK
    assert not builder.supports_update_block_table


def test_spec_decode_rows_read_anchors_and_write_slots(monkeypatch) -> None:
    """A pure speculative batch (FULL graph buffers): write indices = write
    slot then scratch, read = tracked anchor or block-table read slot, conv
    read = the conv anchor."""
    k = 2
    builder = _builder(k, monkeypatch)
    seq_lens, query_lens = [130, 70, 200], [3, 3, 3]
    common, table = _common(seq_lens, query_lens)
    anchors = torch.tensor([[-1, -1], [555, 444], [-1, -1]], dtype=torch.int32)
    md = builder.build(
        0,
        common,
        num_accepted_tokens=torch.tensor([1, 3, 1], dtype=torch.int32),
        num_decode_draft_tokens_cpu=torch.tensor([k, k, k], dtype=torch.int32),
        mamba_read_anchors=anchors,
    )
    assert md.num_spec_decodes == 3 and md.num_prefills == 0
    assert md.spec_state_indices_tensor is not None
    assert md.spec_state_read_indices is not None
    assert md.spec_conv_state_read_indices is not None
    assert builder.spec_state_read_indices is not None
    for row, (s, q) in enumerate(zip(seq_lens, query_lens)):
        slots = get_mamba_all_mode_state_slots(s - q, q, k, BLOCK, k)
        cols = [slots.write_block_idx, *slots.spec_block_idxs]
        assert md.spec_state_indices_tensor[row].tolist() == [
            int(table[row, c]) for c in cols
        ]
        read = int(table[row, slots.read_block_idx])
        want_read, want_conv = (555, 444) if row == 1 else (read, read)
        assert int(md.spec_state_read_indices[row]) == want_read
        assert int(md.spec_conv_state_read_indices[row]) == want_conv
    # The FULL graph buffers, in place.
    assert (
        md.spec_state_read_indices.data_ptr()
        == builder.spec_state_read_indices[0].data_ptr()
    )
    assert (
        md.spec_conv_state_read_indices.data_ptr()
        == builder.spec_state_read_indices[1].data_ptr()
    )


def test_mixed_batch_prefill_rows_and_checkpoints(monkeypatch) -> None:
    """Speculative rows plus two prefills: one from a chunk-aligned start
    (three block boundaries inside), one from a misaligned start (none)."""
    k = 1
    builder = _builder(k, monkeypatch)
    seq_lens, query_lens = [130, 64 + 200, 100 + 100], [2, 200, 100]
    drafts = [k, -1, -1]
    common, table = _common(seq_lens, query_lens)
    md = builder.build(
        0,
        common,
        num_accepted_tokens=torch.ones(3, dtype=torch.int32),
        num_decode_draft_tokens_cpu=torch.tensor(drafts, dtype=torch.int32),
    )
    assert md.num_spec_decodes == 1 and md.num_prefills == 2
    ap = md.all_mode_prefill
    assert ap is not None
    assert md.prefill_state_indices is not None
    assert md.prefill_state_read_indices is not None
    assert md.non_spec_query_start_loc is not None
    assert ap.num_computed_tokens.tolist() == [64, 100]
    assert torch.equal(ap.block_table, table[1:])
    for i, row in enumerate([1, 2]):
        start, q = seq_lens[row] - query_lens[row], query_lens[row]
        slots = get_mamba_all_mode_state_slots(start, q, 0, BLOCK, k)
        assert int(md.prefill_state_indices[i]) == int(
            table[row, slots.write_block_idx]
        )
        assert int(md.prefill_state_read_indices[i]) == int(
            table[row, slots.read_block_idx]
        )
    assert ap.conv is not None and ap.conv_query_starts is not None
    rows = ap.conv.checkpoint_offsets.numel() // 2
    offsets = ap.conv.checkpoint_offsets.view(2, rows)
    states = ap.conv.state_indices.view(2, rows)
    aligned = get_mamba_all_mode_state_slots(64, 200, 0, BLOCK, k)
    want = [int(table[1, c]) for c in aligned.checkpoint_block_idxs]
    got = [int(s) for s, o in zip(states[0], offsets[0]) if o > 0]
    assert got == want == [int(table[1, c]) for c in (1, 2, 3)]
    assert [int(o) for o in offsets[0] if o > 0] == list(
        aligned.checkpoint_token_offsets
    )
    # Misaligned start: no checkpoint (the chunk kernel writes none either).
    assert offsets[1].tolist() == [0] * rows
    assert states[1].tolist() == [NULL_BLOCK_ID] * rows
    # Each row's window comes from its own sequence's tokens.
    starts = md.non_spec_query_start_loc[:-1]
    assert ap.conv_query_starts.view(2, rows)[:, 0].tolist() == starts.tolist()


def test_decodes_and_prefill_without_drafts(monkeypatch) -> None:
    """No speculative decoding: decode rows read the block table's read slot
    and write the write slot; the peeled prefill keeps its own rows."""
    builder = _builder(0, monkeypatch)
    seq_lens, query_lens = [129, 65, 64 + 128], [1, 1, 128]
    common, table = _common(seq_lens, query_lens)
    md = builder.build(0, common)
    assert md.num_decodes == 2 and md.num_prefills == 1
    assert md.non_spec_state_indices_tensor is not None
    assert md.non_spec_state_read_indices is not None
    assert md.prefill_state_read_indices is not None
    assert md.all_mode_prefill is not None
    for row, (s, q) in enumerate(zip(seq_lens, query_lens)):
        slots = get_mamba_all_mode_state_slots(s - q, q, 0, BLOCK, 0)
        assert int(md.non_spec_state_indices_tensor[row]) == int(
            table[row, slots.write_block_idx]
        )
        assert int(md.non_spec_state_read_indices[row]) == int(
            table[row, slots.read_block_idx]
        )
    # Rows 0 and 1 cross a block boundary: read != write.
    assert int(md.non_spec_state_read_indices[0]) != int(
        md.non_spec_state_indices_tensor[0]
    )
    assert md.prefill_state_read_indices.tolist() == [int(table[2, 0])]
    assert md.all_mode_prefill.num_computed_tokens.tolist() == [64]


def test_align_builder_has_no_read_indices(monkeypatch) -> None:
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    cfg = create_vllm_config(model_name="Qwen/Qwen3.5-0.8B", block_size=16)
    spec = MambaSpec(block_size=16, shapes=((16, 64),), dtypes=(torch.float16,))
    builder = GDNAttentionMetadataBuilder(spec, ["layer.0"], cfg, DEVICE)
    common, _ = _common([40, 30], [1, 1])
    md = builder.build(0, common)
    assert builder.all_mode_slots is None
    assert md.non_spec_state_read_indices is None
    assert md.all_mode_prefill is None


@pytest.mark.parametrize("requested", ["flashinfer", "cutedsl", "aiter_flydsl"])
def test_backends_without_checkpoints_refuse_all_mode(requested) -> None:
    cfg = _vllm_config(0)
    cfg.additional_config = {"gdn_prefill_backend": requested}
    with pytest.raises(ValueError, match="only 'triton'"):
        _resolve_gdn_prefill_backend(cfg)


def test_all_mode_resolves_auto_to_the_triton_prefill() -> None:
    cfg = _vllm_config(0)
    assert _resolve_gdn_prefill_backend(cfg) == ("auto", "triton")


def test_v1_runner_with_drafts_refuses_all_mode(monkeypatch) -> None:
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    spec = MambaSpec(
        block_size=BLOCK,
        shapes=((16, 64),),
        dtypes=(torch.float16,),
        mamba_cache_mode="all",
        num_speculative_blocks=1,
    )
    with pytest.raises(NotImplementedError, match="Model Runner V2"):
        GDNAttentionMetadataBuilder(spec, ["layer.0"], _vllm_config(1), DEVICE)
    # Without drafts the V1 runner's block-table read slots are exact.
    spec0 = MambaSpec(
        block_size=BLOCK,
        shapes=((16, 64),),
        dtypes=(torch.float16,),
        mamba_cache_mode="all",
    )
    builder = GDNAttentionMetadataBuilder(spec0, ["layer.0"], _vllm_config(0), DEVICE)
    assert builder.all_mode_slots is not None

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
from vllm.config import (
    CacheConfig,
    ModelConfig,
    SpeculativeConfig,
    VllmConfig,
)
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
    slot then scratch (the third row's first draft is the last token of its
    write block and takes the write slot, whose conv window it checkpoints),
    read = tracked anchor or block-table read slot, conv read = the conv
    anchor."""
    k = 2
    builder = _builder(k, monkeypatch)
    seq_lens, query_lens = [130, 70, BLOCK + 1], [3, 3, 3]
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
    assert md.spec_conv_checkpoint_indices is not None
    assert md.spec_conv_checkpoint_offsets is not None
    assert builder.spec_state_read_indices is not None
    for row, (s, q) in enumerate(zip(seq_lens, query_lens)):
        slots = get_mamba_all_mode_state_slots(s - q, q, k, BLOCK, k)
        assert slots.boundary_draft == (1 if row == 2 else 0)
        assert md.spec_state_indices_tensor[row].tolist() == [
            int(table[row, c]) for c in slots.state_block_idxs
        ]
        read = int(table[row, slots.read_block_idx])
        want_read, want_conv = (555, 444) if row == 1 else (read, read)
        assert int(md.spec_state_read_indices[row]) == want_read
        assert int(md.spec_conv_state_read_indices[row]) == want_conv
        ckpt = int(table[row, slots.write_block_idx]) if row == 2 else NULL_BLOCK_ID
        assert int(md.spec_conv_checkpoint_indices[row]) == ckpt
        assert int(md.spec_conv_checkpoint_offsets[row]) == slots.boundary_draft
    # The FULL graph buffers, in place.
    assert (
        md.spec_state_read_indices.data_ptr()
        == builder.spec_state_read_indices[0].data_ptr()
    )
    assert (
        md.spec_conv_state_read_indices.data_ptr()
        == builder.spec_state_read_indices[1].data_ptr()
    )
    assert (
        md.spec_conv_checkpoint_indices.data_ptr()
        == builder.spec_state_read_indices[2].data_ptr()
    )


def test_spec_read_indices_of_padded_rows_are_null(monkeypatch) -> None:
    """The layer passes the speculative read indices untrimmed: a capture
    gives exactly one per speculative row, and the rows a FULL graph replay
    pads (zero-length, no drafts) read and write only the null block."""
    k = 2
    builder = _builder(k, monkeypatch)
    common, _ = _common([130, 70], [3, 3])
    md = builder.build_for_cudagraph_capture(common)
    assert md.spec_state_read_indices is not None
    assert md.spec_state_read_indices.shape == (md.num_spec_decodes,) == (2,)

    # Replay-time build: two real speculative rows, two padded ones.
    common, table = _common([130, 70, 0, 0], [3, 3, 0, 0])
    md = builder.build(
        0,
        common,
        num_accepted_tokens=torch.ones(4, dtype=torch.int32),
        num_decode_draft_tokens_cpu=torch.tensor([k, k, -1, -1], dtype=torch.int32),
        mamba_read_anchors=torch.tensor([7, 8, 9, 10], dtype=torch.int32),
    )
    assert md.num_spec_decodes == 2 and md.num_prefills == md.num_decodes == 0
    assert md.spec_state_indices_tensor is not None
    assert md.spec_state_read_indices is not None
    assert md.spec_conv_state_read_indices is not None
    assert md.spec_state_read_indices.tolist() == [7, 8, NULL_BLOCK_ID, NULL_BLOCK_ID]
    assert md.spec_conv_state_read_indices[2:].tolist() == [NULL_BLOCK_ID] * 2
    assert md.spec_state_indices_tensor[2:].tolist() == [[NULL_BLOCK_ID] * (k + 1)] * 2
    assert md.spec_query_start_loc is not None
    assert md.spec_query_start_loc.tolist() == [0, 3, 6, 6, 6]


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


def _all_mode_vllm_config(**kwargs) -> VllmConfig:
    return VllmConfig(
        model_config=ModelConfig(model="Qwen/Qwen3.5-0.8B", max_model_len=1024),
        cache_config=CacheConfig(
            block_size=BLOCK, enable_prefix_caching=True, mamba_cache_mode="all"
        ),
        **kwargs,
    )


@pytest.mark.parametrize("requested", ["flashinfer", "cutedsl", "aiter_flydsl", "sycl"])
def test_config_refuses_prefill_backends_without_checkpoints(requested) -> None:
    """At startup (VllmConfig), not when the layers are built."""
    with pytest.raises(ValueError, match="only 'triton'"):
        _all_mode_vllm_config(additional_config={"gdn_prefill_backend": requested})
    cfg = _all_mode_vllm_config(additional_config={"gdn_prefill_backend": "triton"})
    assert cfg.cache_config.mamba_cache_mode == "all"


def test_config_refuses_drafts_on_the_v1_runner(monkeypatch) -> None:
    """At startup (VllmConfig), not when the attention builders are built."""

    def drafts() -> SpeculativeConfig:
        return SpeculativeConfig(method="ngram", num_speculative_tokens=2)

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    with pytest.raises(ValueError, match="needs Model Runner V2"):
        _all_mode_vllm_config(speculative_config=drafts())
    assert _all_mode_vllm_config().speculative_config is None
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert _all_mode_vllm_config(speculative_config=drafts()).use_v2_model_runner


# The layer's kernel calls in all mode, through the real `_forward_core` (the
# Triton kernels under the interpreter on CPU), against the same step in the
# single-anchor form: each row's running state first copied from its read slot
# into its write slot, no read indices. Small GDN dims.
_H, _HV, _K, _V, _WIDTH = 1, 2, 32, 32, 4
_PREFIX = "model.layers.0.linear_attn"


def _core_layer(cfg, kv_cache):
    import types

    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.mamba.checkpoint import (
        MambaPrefillCheckpointExporter,
    )
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        ChunkGatedDeltaRule,
        QwenGatedDeltaNetAttention,
    )

    g = torch.Generator().manual_seed(1)
    conv_dim = 2 * _H * _K + _HV * _V
    layer = types.SimpleNamespace(
        prefix=_PREFIX,
        enable_packed_recurrent_decode=False,
        tp_size=1,
        num_k_heads=_H,
        num_v_heads=_HV,
        head_k_dim=_K,
        head_v_dim=_V,
        key_dim=_H * _K,
        value_dim=_HV * _V,
        activation="silu",
        A_log=torch.randn(_HV, generator=g) * 0.1,
        dt_bias=torch.randn(_HV, generator=g) * 0.1,
        conv1d=types.SimpleNamespace(
            weight=(torch.randn(conv_dim, 1, _WIDTH, generator=g) * 0.5).bfloat16(),
            bias=(torch.randn(conv_dim, generator=g) * 0.1).bfloat16(),
        ),
        kv_cache=kv_cache,
        _all_mode_conv_exporter=MambaPrefillCheckpointExporter(state_len=_WIDTH - 1),
    )
    with set_current_vllm_config(cfg):
        assert ChunkGatedDeltaRule().gdn_prefill_backend == "triton"
    layer.chunk_calls = []

    def chunk_stub(**kwargs):
        # The FLA chunk kernels do not run under the interpreter (their GPU
        # tests do): record the call, return a final state made from the
        # initial one and a zero output.
        layer.chunk_calls.append(kwargs)
        v = kwargs["v"]
        return torch.zeros_like(v), kwargs["initial_state"] * 2 + 1

    layer.chunk_gated_delta_rule = chunk_stub
    for name in ("rearrange_mixed_qkv", "_forward_core"):
        setattr(
            layer,
            name,
            types.MethodType(getattr(QwenGatedDeltaNetAttention, name), layer),
        )
    return layer


def _causal_conv1d_fn_ref(
    x,
    weight,
    bias,
    activation,
    conv_states,
    has_initial_state,
    cache_indices,
    query_start_loc,
    metadata,
):
    """`causal_conv1d_fn` in torch (its varlen Triton kernel does not run
    under the interpreter): per sequence, the window from its cache slot (or
    zeros), the convolution, the last `width - 1` inputs back to that slot."""
    del metadata
    out = torch.empty_like(x)
    width = weight.shape[1]
    starts = query_start_loc.tolist()
    for i in range(len(starts) - 1):
        s, e = starts[i], starts[i + 1]
        slot = int(cache_indices[i])
        # The window is the state's first width - 1 columns (the rest is the
        # speculative decode's room).
        init = conv_states[slot, :, : width - 1]
        if not bool(has_initial_state[i]):
            init = torch.zeros_like(init)
        full = torch.cat((init.to(x.dtype), x[:, s:e]), dim=1)
        y = torch.nn.functional.conv1d(
            full[None], weight[:, None], bias, groups=x.shape[0]
        )
        out[:, s:e] = torch.nn.functional.silu(y[0])
        conv_states[slot, :, : width - 1] = full[:, -(width - 1) :].to(
            conv_states.dtype
        )
    return out


def _run_core(layer, md, mixed_qkv, b, a, conv_update_calls=None, clone=True):
    import contextlib
    import types
    from unittest.mock import patch

    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn

    out = torch.zeros(mixed_qkv.shape[0], _HV, _V, dtype=mixed_qkv.dtype)
    ctx = types.SimpleNamespace(attn_metadata={_PREFIX: md})
    patches = [
        patch.object(qwen_gdn_linear_attn, "get_forward_context", return_value=ctx),
        patch.object(qwen_gdn_linear_attn, "causal_conv1d_fn", _causal_conv1d_fn_ref),
    ]
    if conv_update_calls is not None:
        # The varlen (speculative) form of `causal_conv1d_update` gives NaN
        # under the interpreter even with a single anchor: record its
        # indices, pass the inputs through.
        def conv_update_stub(x, *args, **kwargs):
            conv_update_calls.append(kwargs)
            return x

        patches.append(
            patch.object(qwen_gdn_linear_attn, "causal_conv1d_update", conv_update_stub)
        )
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        layer._forward_core(
            mixed_qkv=mixed_qkv.clone() if clone else mixed_qkv,
            b=b.clone(),
            a=a.clone(),
            core_attn_out=out,
        )
    return out


def _conv_cache_shape(num_slots: int, conv_dim: int, extra: int = 0):
    """The conv state cache in the layout the layer is built for, with
    ``extra`` columns past the window (a speculative decode's room)."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    if is_conv_state_dim_first():
        return (num_slots, conv_dim, _WIDTH - 1 + extra)
    return (num_slots, _WIDTH - 1 + extra, conv_dim)


def test_layer_core_mixed_decodes_and_prefill_read_anchors(monkeypatch) -> None:
    """A batch of decodes crossing a block boundary and a prefill (the decodes
    peeled off to the recurrent update, the prefill through the chunk kernel
    with checkpoints): the decodes read their read slots (one index per decode
    row, not per non-speculative row), the prefill its read slot; outputs and
    written states as in the single-anchor form, the conv window of the
    prefill's inner block boundary in that block's slot."""
    import dataclasses

    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    builder = _builder(0, monkeypatch)
    seq_lens, query_lens = [129, 65, 64 + 128], [1, 1, 128]
    common, table = _common(seq_lens, query_lens)
    md = builder.build(0, common)
    assert md.num_decodes == 2 and md.num_prefills == 1

    g = torch.Generator().manual_seed(0)
    conv_dim = 2 * _H * _K + _HV * _V
    num_slots = int(table.max()) + 1
    conv_shape = _conv_cache_shape(num_slots, conv_dim)
    conv0 = torch.randn(conv_shape, generator=g).bfloat16()
    ssm0 = torch.randn(num_slots, _HV, _V, _K, generator=g) * 0.1
    n = sum(query_lens)
    mixed_qkv = torch.randn(n, conv_dim, generator=g).bfloat16()
    b = torch.randn(n, _HV, generator=g).bfloat16()
    a = torch.randn(n, _HV, generator=g).bfloat16()

    kv = (conv0.clone(), ssm0.clone())
    layer = _core_layer(builder.vllm_config, kv)
    out = _run_core(layer, md, mixed_qkv, b, a)

    # Single-anchor reference: running states moved into the write slots.
    assert md.non_spec_state_indices_tensor is not None
    assert md.non_spec_state_read_indices is not None
    write = md.non_spec_state_indices_tensor.long()
    read = md.non_spec_state_read_indices.long()
    ref_kv = (conv0.clone(), ssm0.clone())
    ref_kv[0][write] = conv0[read]
    ref_kv[1][write] = ssm0[read]
    ref_md = dataclasses.replace(
        md,
        non_spec_state_read_indices=None,
        prefill_state_read_indices=None,
        all_mode_prefill=None,
    )
    ref_layer = _core_layer(builder.vllm_config, ref_kv)
    ref_out = _run_core(ref_layer, ref_md, mixed_qkv, b, a)

    # The prefill read its read slot, and its checkpoints name its own
    # block-table row from its start.
    (call,) = layer.chunk_calls
    torch.testing.assert_close(call["initial_state"], ssm0[int(table[2, 0])][None])
    ckpt = call["checkpoints"]
    assert ckpt.states is kv[1] and ckpt.block_size == BLOCK
    assert ckpt.block_table.tolist() == table[2:3].tolist()
    assert ckpt.num_computed_tokens.tolist() == [64]
    assert "checkpoints" not in ref_layer.chunk_calls[0]

    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(kv[1][write], ref_kv[1][write])
    torch.testing.assert_close(kv[0][write], ref_kv[0][write])
    # The prefill (start 64, 128 tokens) has one inner boundary, at 128: the
    # window of its last WIDTH - 1 raw tokens in block 1's slot.
    conv = kv[0] if is_conv_state_dim_first() else kv[0].transpose(-1, -2)
    first = 2 + (128 - 64) - (_WIDTH - 1)
    torch.testing.assert_close(
        conv[int(table[2, 1])], mixed_qkv[first : first + _WIDTH - 1].T
    )


def test_layer_core_spec_decodes_and_prefill_read_anchors(monkeypatch) -> None:
    """Speculative rows (one with a tracked anchor after 3 accepted tokens,
    one from the block table whose first draft is its write block's last
    token) beside a prefill: the recurrent state read from the read anchor,
    the conv window from the conv anchor at the accepted offset, the draft at
    the block's end written to the write block with its conv window; as in
    the single-anchor form."""
    import dataclasses

    k = 2
    builder = _builder(k, monkeypatch)
    seq_lens, query_lens = [65, 70, 64 + 128], [3, 3, 128]
    common, table = _common(seq_lens, query_lens)
    anchors = torch.tensor([[-1, -1], [150, 160], [-1, -1]], dtype=torch.int32)
    md = builder.build(
        0,
        common,
        num_accepted_tokens=torch.tensor([1, 3, 1], dtype=torch.int32),
        num_decode_draft_tokens_cpu=torch.tensor([k, k, -1], dtype=torch.int32),
        mamba_read_anchors=anchors,
    )
    assert md.num_spec_decodes == 2 and md.num_prefills == 1

    g = torch.Generator().manual_seed(0)
    conv_dim = 2 * _H * _K + _HV * _V
    num_slots = int(table.max()) + 1
    conv_shape = _conv_cache_shape(num_slots, conv_dim, k)
    conv0 = torch.randn(conv_shape, generator=g).bfloat16()
    ssm0 = torch.randn(num_slots, _HV, _V, _K, generator=g) * 0.1
    n = sum(query_lens)
    mixed_qkv = torch.randn(n, conv_dim, generator=g).bfloat16()
    b = torch.randn(n, _HV, generator=g).bfloat16()
    a = torch.randn(n, _HV, generator=g).bfloat16()

    kv = (conv0.clone(), ssm0.clone())
    layer = _core_layer(builder.vllm_config, kv)
    conv_calls: list[dict] = []
    out = _run_core(layer, md, mixed_qkv, b, a, conv_calls)

    assert md.spec_state_indices_tensor is not None
    assert md.spec_state_read_indices is not None
    assert md.spec_conv_state_read_indices is not None
    assert md.non_spec_state_indices_tensor is not None
    assert md.non_spec_state_read_indices is not None
    assert md.num_accepted_tokens is not None
    spec = md.spec_state_indices_tensor[:2].long()
    accepted = md.num_accepted_tokens[:2].long()
    ref_kv = (conv0.clone(), ssm0.clone())
    ref_kv[0][spec[:, 0]] = conv0[md.spec_conv_state_read_indices[:2].long()]
    ref_kv[1][spec[torch.arange(2), accepted - 1]] = ssm0[
        md.spec_state_read_indices[:2].long()
    ]
    write = md.non_spec_state_indices_tensor.long()
    ref_kv[0][write] = conv0[md.non_spec_state_read_indices.long()]
    ref_kv[1][write] = ssm0[md.non_spec_state_read_indices.long()]
    ref_md = dataclasses.replace(
        md,
        spec_state_read_indices=None,
        spec_conv_state_read_indices=None,
        non_spec_state_read_indices=None,
        prefill_state_read_indices=None,
        all_mode_prefill=None,
    )
    ref_layer = _core_layer(builder.vllm_config, ref_kv)
    ref_out = _run_core(ref_layer, ref_md, mixed_qkv, b, a, [])

    # The speculative rows' conv update: windows read from the conv anchors,
    # written to the write slots.
    (conv_call,) = conv_calls
    assert conv_call["conv_state_indices"].tolist() == spec[:, 0].tolist()
    assert conv_call["conv_state_read_indices"].tolist() == [1, 160]
    assert conv_call["num_accepted_tokens"][:2].tolist() == [1, 3]
    # Row 0 reaches its write block's end (token 63) at its first draft.
    assert spec[0].tolist() == [2, 1, 3]
    assert conv_call["conv_state_checkpoint_indices"].tolist() == [1, NULL_BLOCK_ID]
    assert conv_call["conv_state_checkpoint_offsets"].tolist() == [1, 0]
    assert int(md.spec_state_read_indices[1]) == 150
    assert int(md.spec_conv_state_read_indices[1]) == 160
    torch.testing.assert_close(out, ref_out)
    assert not out.isnan().any()
    written = torch.cat((spec.flatten(), write))
    torch.testing.assert_close(kv[1][written], ref_kv[1][written])
    torch.testing.assert_close(kv[0][write], ref_kv[0][write])


def test_layer_core_single_prefill_windows_at_every_boundary(monkeypatch) -> None:
    """The usual step of a long prompt: one prefill with several block
    boundaries inside it. The conv window ending at each boundary lands in
    that boundary's block slot. The exporter reads one sequence start per
    checkpoint row; the runner's ``query_start_loc`` is a view of a
    persistent buffer whose entries past the batch hold other values, and
    the step's projection a view of a larger buffer, as in the engine."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    builder = _builder(0, monkeypatch)
    n = 3 * BLOCK + 8  # from position 0: boundaries at 64, 128 and 192
    common, table = _common([n], [n])
    qsl = torch.full((8,), 5, dtype=torch.int32)
    qsl[:2] = common.query_start_loc
    common = common.replace(query_start_loc=qsl[:2])
    md = builder.build(0, common)
    assert md.num_decodes == 0 and md.num_prefills == 1

    g = torch.Generator().manual_seed(2)
    conv_dim = 2 * _H * _K + _HV * _V
    num_slots = int(table.max()) + 1
    conv_shape = _conv_cache_shape(num_slots, conv_dim)
    kv = (
        torch.randn(conv_shape, generator=g).bfloat16(),
        torch.randn(num_slots, _HV, _V, _K, generator=g) * 0.1,
    )
    projection = torch.randn(2 * n, conv_dim + 8, generator=g).bfloat16()
    mixed_qkv = projection[:n, :conv_dim]
    b = torch.randn(n, _HV, generator=g).bfloat16()
    a = torch.randn(n, _HV, generator=g).bfloat16()
    layer = _core_layer(builder.vllm_config, kv)
    _run_core(layer, md, mixed_qkv, b, a, clone=False)

    conv = kv[0] if is_conv_state_dim_first() else kv[0].transpose(-1, -2)
    for p in (64, 128, 192):
        torch.testing.assert_close(
            conv[int(table[0, p // BLOCK - 1])],
            mixed_qkv[p - (_WIDTH - 1) : p].T,
            msg=f"conv window at the boundary {p}",
        )


@pytest.mark.parametrize(
    "num_spec,num_speculative_blocks", [(0, 0), (1, 1), (3, 3), (3, 1)]
)
@pytest.mark.parametrize(
    "anchors", ["none", "one-column", "two-columns", "untracked", "table"]
)
def test_slots_kernel_matches_reference(
    num_spec, num_speculative_blocks, anchors
) -> None:
    """The one-launch slot kernel fills exactly what the PyTorch form fills,
    on random batches: prefills from chunk-aligned and misaligned starts,
    decodes and speculative rows crossing block boundaries at every offset,
    padding rows (query length 0), rows whose scratch columns fall past the
    table, anchors present, absent (negative) or not tracked, or Model
    Runner V2's anchor table (consumed and staged in the same launch: random
    staged rows and acceptance, -1 rows, padding past the real batch).
    Under TRITON_INTERPRET=1 on the CPU; natively on a GPU."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    from vllm.v1.attention.backends.gdn_attn import (
        GDNAllModeAnchorStep,
        GDNAllModeSlotBuilder,
    )

    gen = torch.Generator().manual_seed(1000 * num_spec + num_speculative_blocks)
    bs, width, num_reqs, max_reqs = 16, 9, 37, 40
    kernel, reference = (
        GDNAllModeSlotBuilder(max_reqs, num_spec, bs, num_speculative_blocks, device)
        for _ in range(2)
    )
    for buf in ("read_slots", "conv_read_slots", "write_slots", "spec_slots"):
        # stale values must not survive in either form
        getattr(kernel, buf).fill_(-7)
        getattr(reference, buf).fill_(-9)
    table = torch.randint(
        1, 10_000, (num_reqs, width), generator=gen, dtype=torch.int32
    )
    start = torch.randint(0, bs * (width - 1), (num_reqs,), generator=gen)
    start[::5] = start[::5] // 64 * 64  # some on the chunk grid
    drafts = torch.randint(-1, num_spec + 1, (num_reqs,), generator=gen)
    qlen = torch.where(
        drafts > 0, drafts + 1, torch.randint(1, 3 * bs, (num_reqs,), generator=gen)
    )
    qlen[::7] = 0  # padding rows
    qlen = torch.minimum(qlen, bs * width - start)
    num_drafts = drafts if num_spec else None
    read_anchors = None
    if anchors in ("one-column", "two-columns"):
        cols = 1 if anchors == "one-column" else 2
        read_anchors = torch.randint(-3, 10_000, (num_reqs, cols), generator=gen)
        read_anchors = read_anchors.to(torch.int32).squeeze(1)
    args = (
        table.to(device),
        start.to(device, torch.int32),
        qlen.to(device, torch.int32),
        None if num_drafts is None else num_drafts.to(device),
        None if read_anchors is None else read_anchors.to(device),
        anchors == "untracked",
    )
    steps: list = [None, None]
    if anchors == "table":
        # persistent rows 0..max_reqs-1 (+ the sink); the first num_real
        # batch rows are real, the rest padding
        num_real = num_reqs - 4
        idx = torch.randperm(max_reqs, generator=gen)[:num_real]
        idx[::9] = -1
        slots = torch.randint(-5, 10_000, (max_reqs + 1, num_spec + 1), generator=gen)
        staged = torch.rand(max_reqs + 1, generator=gen) < 0.7
        accepted = torch.randint(1, num_spec + 2, (max_reqs,), generator=gen)
        steps = [
            GDNAllModeAnchorStep(
                slots.to(device, torch.int32),
                staged.to(device).clone(),  # the kernel writes it
                idx.to(device),
                accepted.to(device, torch.int32),
            )
            for _ in range(2)
        ]
    kernel._fill(*args, steps[0])
    reference.fill_reference(*args, steps[1])
    if anchors == "table":
        # the sink row takes every -1 row's stage, in any order
        for name in ("slots", "staged"):
            got = getattr(steps[0], name)[:-1].cpu()
            want = getattr(steps[1], name)[:-1].cpu()
            assert torch.equal(got, want), (name, got, want)
        assert (idx == -1).any() and staged[idx[idx >= 0]].any()
    for buf in (
        "read_slots",
        "conv_read_slots",
        "write_slots",
        "spec_slots",
        "num_computed_tokens",
        "num_checkpoints",
    ):
        got = getattr(kernel, buf)[:num_reqs].cpu()
        want = getattr(reference, buf)[:num_reqs].cpu()
        assert torch.equal(got, want), (buf, got, want)
    # the draws reach every case the kernel branches on
    assert (qlen == 0).any() and (qlen > bs).any()
    if num_spec:
        assert (drafts > 0).any() and (drafts <= 0).any()

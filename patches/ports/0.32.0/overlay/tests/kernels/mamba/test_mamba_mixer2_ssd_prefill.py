# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""MambaMixer2 prefill with ``MambaConfig.ssd_prefill`` = "chain" vs "fused".

Two mixers with the same weights, one per implementation, run the same mixed
batch of prefills (fresh sequences and sequences resuming from cached conv and
SSM states, lengths below / above / not a multiple of the chunk) through
``MambaMixer2.forward`` with vLLM's Mamba2 attention metadata. Their outputs,
the SSM and conv states written into the cache slots, and the slots they must
not touch are compared, and the fused run is checked to have run the fused
kernel. GPU only: ``_causal_conv1d_fwd_kernel`` fails under the Triton
interpreter (AttributeError on its ``batch_ptr`` argument).
"""

import math
import os

import pytest
import torch

from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config
from vllm.config.mamba import MambaConfig
from vllm.distributed.parallel_state import (
    destroy_distributed_environment,
    destroy_model_parallel,
    init_distributed_environment,
    initialize_model_parallel,
)
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.mamba import mamba_mixer2
from vllm.model_executor.layers.mamba.ops import ssd_fused
from vllm.platforms import current_platform
from vllm.utils.network_utils import get_open_port
from vllm.utils.torch_utils import set_default_torch_dtype
from vllm.v1.attention.backends.mamba2_attn import (
    Mamba2AttentionMetadata,
    compute_varlen_chunk_metadata,
)
from vllm.v1.attention.backends.utils import (
    NULL_BLOCK_ID,
    compute_causal_conv1d_metadata,
)

pytestmark = pytest.mark.skipif(
    not current_platform.is_cuda_alike() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="MambaMixer2's prefill path needs a GPU (causal_conv1d's Triton kernel "
    "fails under the Triton interpreter)",
)

PREFIX = "model.layers.0.mixer"
HIDDEN = 256
HEADS, HEADDIM, GROUPS, DSTATE, CONV = 8, 32, 2, 32, 4
CHUNK = 64
# (prefill length, resumes from cached states)
BATCH = [(150, False), (64, True), (1, False), (200, True), (37, False)]


@pytest.fixture(scope="module")
def single_rank():
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{get_open_port()}",
            local_rank=0,
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
    yield
    destroy_model_parallel()
    destroy_distributed_environment()


def make_mixer(impl: str, dtype: torch.dtype, device: str):
    config = VllmConfig(
        mamba_config=MambaConfig(ssd_prefill=impl),
        cache_config=CacheConfig(mamba_ssm_cache_dtype="float32"),
    )
    with (
        set_current_vllm_config(config),
        set_default_torch_dtype(dtype),
        torch.device(device),
    ):
        mixer = mamba_mixer2.MambaMixer2(
            hidden_size=HIDDEN,
            ssm_state_size=DSTATE,
            conv_kernel_size=CONV,
            intermediate_size=HEADS * HEADDIM,
            use_conv_bias=True,
            use_bias=False,
            n_groups=GROUPS,
            num_heads=HEADS,
            head_dim=HEADDIM,
            cache_config=config.cache_config,
            prefix=PREFIX,
        )
    return config, mixer


def randomize(mixer: torch.nn.Module, gen: torch.Generator) -> None:
    """Random weights with a real model's value ranges."""
    with torch.no_grad():
        for name, p in mixer.named_parameters():
            r = torch.rand(p.shape, generator=gen, device=p.device)
            n = torch.randn(p.shape, generator=gen, device=p.device)
            if name == "A":
                p.copy_(-torch.exp(r * math.log(16.0)))
            elif name == "dt_bias":
                dt = torch.exp(r * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
            elif name == "norm.weight":
                p.copy_(1.0 + 0.1 * n)
            elif p.dim() == 1:
                p.copy_(0.1 * n)
            else:
                p.copy_(n / math.sqrt(p.shape[-1]))


def prefill_metadata(device: str) -> tuple[Mamba2AttentionMetadata, torch.Tensor]:
    lens = [n for n, _ in BATCH]
    qsl_cpu = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    qsl = qsl_cpu.to(device)
    cu_chunk, last_chunk, seq_idx = compute_varlen_chunk_metadata(qsl, CHUNK)
    nums_dict, batch_ptr, token_chunk_offset_ptr = compute_causal_conv1d_metadata(
        qsl_cpu, device=torch.device(device)
    )
    # permuted, non-contiguous cache slots; never NULL_BLOCK_ID (0), which
    # marks padding rows that the conv kernel skips
    slots = torch.tensor([7, 2, 9, 1, 4], dtype=torch.int32, device=device)
    assert NULL_BLOCK_ID not in slots.tolist()
    metadata = Mamba2AttentionMetadata(
        num_prefills=len(BATCH),
        num_prefill_tokens=sum(lens),
        num_decodes=0,
        num_decode_tokens=0,
        num_reqs=len(BATCH),
        has_initial_states_p=torch.tensor([r for _, r in BATCH], device=device),
        query_start_loc_p=qsl,
        state_indices_tensor_p=slots,
        state_indices_tensor_d=None,
        query_start_loc_d=None,
        num_accepted_tokens=None,
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        cu_chunk_seqlen_p=cu_chunk,
        last_chunk_indices_p=last_chunk,
        nums_dict=nums_dict,
        batch_ptr=batch_ptr,
        token_chunk_offset_ptr=token_chunk_offset_ptr,
        prep_initial_states=True,
        chunk_size=CHUNK,
        seq_idx_p=seq_idx,
    )
    return metadata, slots


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def test_mixer2_fused_prefill_matches_chain(single_rank, monkeypatch):
    device = current_platform.device_type
    dtype = torch.bfloat16
    tol = 3e-2
    gen = torch.Generator(device=device).manual_seed(0)
    metadata, slots = prefill_metadata(device)
    hidden = torch.randn(
        sum(n for n, _ in BATCH), HIDDEN, generator=gen, device=device
    ).to(dtype)

    fused_calls = []
    fused_fwd = ssd_fused._mamba_chunk_scan_fused_fwd

    def spy(*args, **kwargs):
        fused_calls.append(args[0].shape)
        return fused_fwd(*args, **kwargs)

    monkeypatch.setattr(ssd_fused, "_mamba_chunk_scan_fused_fwd", spy)

    weights = caches = None
    results = {}
    for impl in ("chain", "fused"):
        config, mixer = make_mixer(impl, dtype, device)
        want = {
            "chain": ssd_fused.mamba_chunk_scan_combined_varlen,
            "fused": ssd_fused.mamba_chunk_scan_fused_varlen,
        }[impl]
        assert mixer.mamba_chunk_scan_varlen is want
        if weights is None:
            randomize(mixer, gen)
            weights = mixer.state_dict()
            conv_shape, ssm_shape = mixer.get_state_shape()
            nslots = 11
            # resumed rows read these; fresh rows must ignore them
            conv = torch.randn(nslots, *conv_shape, generator=gen, device=device)
            ssm = torch.randn(nslots, *ssm_shape, generator=gen, device=device)
            caches = (conv.to(dtype), ssm)
        else:
            mixer.load_state_dict(weights)
        assert caches is not None
        mixer.kv_cache = tuple(c.clone() for c in caches)
        calls_before = len(fused_calls)
        with set_forward_context({PREFIX: metadata}, config):
            out = mixer(hidden)
        assert (len(fused_calls) > calls_before) == (impl == "fused")
        results[impl] = (out, *mixer.kv_cache)

    out_c, conv_c, ssm_c = results["chain"]
    out_f, conv_f, ssm_f = results["fused"]
    assert out_f.isfinite().all()
    assert rel_err(out_f, out_c) < tol
    used = slots.long()
    assert rel_err(ssm_f[used], ssm_c[used]) < tol
    assert torch.equal(conv_f, conv_c)
    assert caches is not None
    untouched = torch.ones(ssm_f.shape[0], dtype=torch.bool, device=device)
    untouched[used] = False
    assert torch.equal(ssm_f[untouched], caches[1][untouched])
    # every prefilled slot was written
    for i, slot in enumerate(used.tolist()):
        assert not torch.equal(ssm_f[slot], caches[1][slot]), f"slot of row {i}"

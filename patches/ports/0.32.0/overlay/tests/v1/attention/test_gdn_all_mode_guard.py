# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The GDN backend refuses mamba_cache_mode="all" until its kernels write the
per-block checkpoints the KV cache manager publishes."""

import pytest
import torch

from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
from vllm.v1.kv_cache_interface import MambaSpec

pytestmark = pytest.mark.cpu_test


def test_gdn_builder_rejects_all_mode() -> None:
    spec = MambaSpec(
        block_size=64,
        shapes=((16, 64),),
        dtypes=(torch.float16,),
        mamba_cache_mode="all",
    )
    with pytest.raises(NotImplementedError, match="mamba_cache_mode='all'"):
        GDNAttentionMetadataBuilder(
            spec,
            ["layer"],
            vllm_config=None,  # type: ignore[arg-type]
            device=torch.device("cpu"),
        )

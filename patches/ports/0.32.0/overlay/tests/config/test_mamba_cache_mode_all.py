# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Config side of `mamba_cache_mode="all"` (GDN all-mode prefix caching)."""

from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from vllm.config import CacheConfig, ModelConfig, VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.models.config import MambaModelConfig
from vllm.utils.argparse_utils import FlexibleArgumentParser

pytestmark = pytest.mark.cpu_test


def _vllm_config_stub(
    *,
    architecture: str = "Qwen3NextForCausalLM",
    supported: bool = True,
    kernel_chunk_size: int = 64,
    enable_prefix_caching: bool = True,
    enable_chunked_prefill: bool = True,
    mamba_cache_mode: str = "all",
    block_size: int = 256,
) -> SimpleNamespace:
    cache_config = CacheConfig(
        block_size=block_size,
        enable_prefix_caching=enable_prefix_caching,
        mamba_cache_mode=mamba_cache_mode,
    )
    model_config = SimpleNamespace(
        architecture=architecture,
        supports_mamba_cache_mode_all=supported,
        max_model_len=4096,
        get_mamba_chunk_size=lambda: kernel_chunk_size,
    )
    scheduler_config = SimpleNamespace(enable_chunked_prefill=enable_chunked_prefill)
    return SimpleNamespace(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
    )


def test_cache_config_accepts_all_and_rejects_unknown_modes():
    assert CacheConfig(mamba_cache_mode="all").mamba_cache_mode == "all"
    with pytest.raises(ValidationError, match="mamba_cache_mode"):
        CacheConfig(mamba_cache_mode="every")  # type: ignore[arg-type]


@pytest.mark.parametrize("kernel_chunk_size", [64, 128])
def test_all_mode_kept_and_chunk_size_resolved_for_supported_model(
    kernel_chunk_size: int,
):
    config = _vllm_config_stub(kernel_chunk_size=kernel_chunk_size)
    MambaModelConfig.verify_and_update_config(config)
    assert config.cache_config.mamba_cache_mode == "all"
    assert config.cache_config.mamba_chunk_size == kernel_chunk_size
    # Prefix-caching granularity follows the scheduler block, as in align mode.
    assert config.cache_config.mamba_block_size == config.cache_config.block_size


@pytest.mark.parametrize("architecture", ["NemotronHForCausalLM", "JambaForCausalLM"])
def test_all_mode_rejected_for_unsupported_model(architecture: str):
    config = _vllm_config_stub(architecture=architecture, supported=False)
    with pytest.raises(ValueError, match=f"not supported for {architecture}"):
        MambaModelConfig.verify_and_update_config(config)
    assert config.cache_config.mamba_chunk_size is None


def test_all_mode_requires_prefix_caching():
    config = _vllm_config_stub(enable_prefix_caching=False)
    with pytest.raises(ValueError, match="requires prefix caching"):
        MambaModelConfig.verify_and_update_config(config)


def test_all_mode_requires_chunked_prefill():
    config = _vllm_config_stub(enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="requires chunked prefill"):
        MambaModelConfig.verify_and_update_config(config)


@pytest.mark.parametrize("mode", ["none", "align"])
def test_other_modes_unchanged(mode: str):
    # "none" with prefix caching still resolves to "align"; no chunk resolved.
    config = _vllm_config_stub(supported=False, mamba_cache_mode=mode)
    MambaModelConfig.verify_and_update_config(config)
    assert config.cache_config.mamba_cache_mode == "align"
    assert config.cache_config.mamba_chunk_size is None


@pytest.mark.parametrize(
    ("kernel_chunk_size", "hf_attrs", "expected"),
    [
        # GDN: the declared FLA kernel chunk wins over Mamba1's default.
        (64, {}, 64),
        (64, {"chunk_size": 256}, 64),
        (None, {"mamba_chunk_size": 128}, 128),
        (None, {"chunk_size": 256}, 256),
        (None, {}, 2048),
    ],
)
def test_get_mamba_chunk_size(
    kernel_chunk_size: int | None, hf_attrs: dict[str, int], expected: int
):
    stub = SimpleNamespace(
        _model_info=SimpleNamespace(mamba_kernel_chunk_size=kernel_chunk_size),
        hf_text_config=SimpleNamespace(**hf_attrs),
    )
    assert ModelConfig.get_mamba_chunk_size(stub) == expected  # type: ignore[arg-type]


def _assert_declares_all_mode(model_cls: type) -> None:
    from vllm.model_executor.models.interfaces import supports_mamba_cache_mode_all
    from vllm.model_executor.models.registry import _ModelInfo
    from vllm.third_party.flash_linear_attention.ops.utils import FLA_CHUNK_SIZE

    assert supports_mamba_cache_mode_all(model_cls), model_cls.__name__
    info = _ModelInfo.from_model_cls(model_cls)
    assert info.supports_mamba_cache_mode_all
    assert info.mamba_kernel_chunk_size == FLA_CHUNK_SIZE


def test_qwen3_next_declares_all_mode_support():
    from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM

    _assert_declares_all_mode(Qwen3NextForCausalLM)


def test_qwen3_5_declares_all_mode_support():
    # Qwen3.5 shares Qwen3-VL's processors, which need torchvision.
    pytest.importorskip("torchvision")
    from vllm.model_executor.models.qwen3_5 import (
        Qwen3_5ForCausalLM,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeForConditionalGeneration,
    )

    for model_cls in (
        Qwen3_5ForCausalLM,
        Qwen3_5MoeForCausalLM,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeForConditionalGeneration,
    ):
        _assert_declares_all_mode(model_cls)


def test_non_gdn_mamba_models_do_not_declare_all_mode_support():
    from vllm.model_executor.models.interfaces import supports_mamba_cache_mode_all
    from vllm.model_executor.models.mamba2 import Mamba2ForCausalLM
    from vllm.model_executor.models.registry import _ModelInfo

    assert not supports_mamba_cache_mode_all(Mamba2ForCausalLM)
    info = _ModelInfo.from_model_cls(Mamba2ForCausalLM)
    assert not info.supports_mamba_cache_mode_all
    assert info.mamba_kernel_chunk_size is None


def _block_size_config_stub(
    *,
    block_size: int = 256,
    chunk_size: int | None = 64,
    max_num_batched_tokens: int = 8192,
    long_prefill_token_threshold: int = 0,
    enable_chunked_prefill: bool = True,
    disable_chunked_mm_input: bool = False,
) -> SimpleNamespace:
    config = SimpleNamespace(
        cache_config=SimpleNamespace(
            block_size=block_size,
            mamba_block_size=block_size,
            mamba_cache_mode="all",
            mamba_chunk_size=chunk_size,
        ),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        scheduler_config=SimpleNamespace(
            max_num_batched_tokens=max_num_batched_tokens,
            long_prefill_token_threshold=long_prefill_token_threshold,
            enable_chunked_prefill=enable_chunked_prefill,
            disable_chunked_mm_input=disable_chunked_mm_input,
        ),
        kv_transfer_config=None,
    )
    config._validate_mamba_cache_mode_all = (
        lambda: VllmConfig._validate_mamba_cache_mode_all(config)  # type: ignore[arg-type]
    )
    return config


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({}, None),
        ({"block_size": 1024, "max_num_batched_tokens": 64}, None),
        ({"block_size": 96}, r"mamba block size \(96\) to be a multiple"),
        ({"block_size": 544}, r"multiple of the prefill kernel chunk size \(64\)"),
        ({"chunk_size": None}, "was not resolved"),
        ({"max_num_batched_tokens": 48}, r"max_num_batched_tokens \(48\) >="),
        (
            {"long_prefill_token_threshold": 32},
            r"long_prefill_token_threshold \(32\) >=",
        ),
        ({"enable_chunked_prefill": False}, "requires chunked prefill"),
        ({"disable_chunked_mm_input": True}, "chunked multimodal input"),
    ],
)
def test_validate_block_size_all_mode(overrides: dict, match: str | None):
    config = _block_size_config_stub(**overrides)
    if match is None:
        VllmConfig.validate_block_size(config)  # type: ignore[arg-type]
    else:
        with pytest.raises(ValueError, match=match):
            VllmConfig.validate_block_size(config)  # type: ignore[arg-type]


def test_replayssm_rejects_all_mode():
    config = SimpleNamespace(
        cache_config=SimpleNamespace(
            use_replayssm=True,
            use_kda_recoverssm=False,
            mamba_cache_mode="all",
            replayssm_buffer_len=16,
        ),
        num_speculative_tokens=0,
        model_config=SimpleNamespace(
            supports_replayssm=True, architecture="Qwen3NextForCausalLM"
        ),
    )
    with pytest.raises(ValueError, match="does not support mamba_cache_mode='all'"):
        VllmConfig.validate_mamba_cached_kernel(config)  # type: ignore[operator]


def test_compute_hash_covers_all_mode_fields():
    base = CacheConfig(mamba_cache_mode="align")
    all_mode = CacheConfig(mamba_cache_mode="all")
    assert base.compute_hash() != all_mode.compute_hash()
    resolved = CacheConfig(mamba_cache_mode="all")
    resolved.mamba_chunk_size = 64
    assert resolved.compute_hash() != all_mode.compute_hash()
    other_chunk = CacheConfig(mamba_cache_mode="all")
    other_chunk.mamba_chunk_size = 128
    assert other_chunk.compute_hash() != resolved.compute_hash()


@pytest.mark.parametrize("mode", ["all", "align", "none"])
def test_cli_flag_parses(mode: str):
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--mamba-cache-mode", mode])
    assert args.mamba_cache_mode == mode


def test_cli_flag_rejects_unknown_mode():
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    with pytest.raises(SystemExit):
        parser.parse_args(["--mamba-cache-mode", "every"])

# SPDX-License-Identifier: Apache-2.0
"""tests/conftest.py of the hybrid-stack GPU bundle.

Replaces vLLM's own tests/conftest.py, which imports the whole engine (models,
tokenizers, the OpenAI server) to provide fixtures the kernel tests do not use.
It keeps the fixtures the bundled tests ask for, with upstream's behaviour.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest
import torch


@pytest.fixture
def default_vllm_config() -> Iterator[Any]:
    """A default VllmConfig for tests of CustomOps outside an engine (as upstream)."""
    from vllm.config import VllmConfig, set_current_vllm_config

    config = VllmConfig()
    with set_current_vllm_config(config):
        yield config


@pytest.fixture(autouse=True)
def _release_gpu_memory() -> Iterator[None]:
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def pytest_configure(config: pytest.Config) -> None:
    for marker in (
        "core_model: upstream marker",
        "cpu_model: upstream marker",
        "optional: upstream marker",
        "skip_global_cleanup: upstream marker",
        "slow_test: upstream marker",
        "distributed: upstream marker",
    ):
        config.addinivalue_line("markers", marker)

# SPDX-License-Identifier: Apache-2.0
"""pytest plugin: run vLLM's Triton kernel tests on CPU under Triton's interpreter.

Loaded by ``hybrid-stack test`` for interpreter-mode suites (``-p
hybridstack_triton_interp``) together with::

    TRITON_INTERPRET=1              Triton executes kernels in Python, on CPU tensors
    CUDA_VISIBLE_DEVICES=""         vLLM keeps Triton (no driver is expected)
    VLLM_TRITON_FORCE_FIRST_CONFIG=1  autotuners try one config, not all

vLLM's kernel tests skip unless ``current_platform.is_cuda_alike()`` and put
their tensors on ``current_platform.device_type``. This plugin installs, before
any conftest imports vLLM, a CPU platform that calls itself CUDA-alike while
keeping ``device_type == "cpu"``, so those tests run on CPU tensors through the
interpreter. Only fp32/fp16 are trustworthy there (bf16 ``tl.dot`` returns
garbage in the interpreter), so suites select their cases with ``-k``.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    raise pytest.UsageError(
        "hybridstack_triton_interp needs TRITON_INTERPRET=1 (run it through "
        "'hybrid-stack test --interpret')"
    )

# vLLM <= 0.32.0 installs VLLM_TRITON_FORCE_FIRST_CONFIG's autotuner patch during
# `import vllm` (vllm.env_override), importing vllm.triton_utils, which resolves
# the platform before this plugin can install its own. Hidden until then, it is
# installed below, once the platform is ours (0.33.0 moved it to triton_utils).
_FORCE_FIRST = "VLLM_TRITON_FORCE_FIRST_CONFIG"
_force_first = os.environ.pop(_FORCE_FIRST, None)

from vllm import platforms  # noqa: E402
from vllm.platforms.cpu import CpuPlatform  # noqa: E402


class CpuAsCudaAlikePlatform(CpuPlatform):
    """The CPU platform, taking the CUDA-alike (Triton) code paths.

    ``is_cuda_alike()`` is True so the kernel tests run; ``is_cpu()`` is False
    so ops dispatch to their Triton kernels, not to vLLM's compiled CPU ops
    (which the Python-only build does not have).
    """

    def is_cuda_alike(self) -> bool:
        return True

    def is_cpu(self) -> bool:
        return False


if platforms._current_platform is not None and not isinstance(
    platforms._current_platform, CpuAsCudaAlikePlatform
):
    raise pytest.UsageError(
        "vLLM's platform was resolved before hybridstack_triton_interp loaded: "
        "pass the plugin with -p, not from a conftest"
    )
platforms._current_platform = CpuAsCudaAlikePlatform()

if _force_first is not None:
    os.environ[_FORCE_FIRST] = _force_first
    if _force_first.strip().lower() in ("1", "true"):
        from vllm.triton_utils import force_first_config  # noqa: E402

        force_first_config.install()  # idempotent (0.33.0 did it on import)

if not torch.accelerator.is_available():
    # Interpreted kernels run synchronously on CPU tensors: the tests' and
    # conftest's synchronize()/empty_cache()/empty_host_cache() calls have nothing to act on (and
    # torch.accelerator raises without a device).
    def _noop(device: object = None) -> None:
        return None

    torch.accelerator.synchronize = _noop
    torch.accelerator.empty_cache = _noop
    torch.accelerator.empty_host_cache = _noop
    torch.cuda.synchronize = _noop


def pytest_report_header(config: pytest.Config) -> str:
    return "hybridstack: Triton interpreter on CPU (platform reports CUDA-alike)"

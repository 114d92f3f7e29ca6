# SPDX-License-Identifier: Apache-2.0
"""The Triton-interpreter pytest plugin (hybridstack_triton_interp) against
stand-ins for vLLM's import-time behaviour.

vLLM 0.32.0 installs VLLM_TRITON_FORCE_FIRST_CONFIG's autotuner patch from
vllm.env_override during `import vllm`, which imports vllm.triton_utils and so
resolves the platform before the plugin can install its CPU-as-CUDA-alike one;
0.33.0 installs it when vllm.triton_utils is first imported. With the variable
set (as `hybrid-stack test` sets it), the plugin must work under both, and the
patch must end up installed under both.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hybrid_stack.venvs import PLUGIN_DIR

TORCH = """
class _Accel:
    @staticmethod
    def is_available():
        return False

    synchronize = empty_cache = empty_host_cache = None


class _Cuda:
    synchronize = None


accelerator = _Accel()
cuda = _Cuda()
"""

PLATFORMS = """
_current_platform = None


def __getattr__(name):
    global _current_platform
    if name == "current_platform":
        if _current_platform is None:
            from vllm.platforms.cpu import CpuPlatform

            _current_platform = CpuPlatform()
        return _current_platform
    raise AttributeError(name)
"""

CPU = """
class CpuPlatform:
    def is_cuda_alike(self):
        return False

    def is_cpu(self):
        return True
"""

FORCE_FIRST = """
_installed = 0


def install():
    global _installed
    if not _installed:
        _installed += 1
"""

INSTALL_IF_SET = """
if os.environ.get("VLLM_TRITON_FORCE_FIRST_CONFIG", "0").strip().lower() in ("1", "true"):
    from vllm.triton_utils.force_first_config import install

    install()
"""

LAYOUTS = {
    # 0.32.0: env_override (imported by vllm/__init__) installs the patch
    "0.32.0": {
        "vllm/__init__.py": "import vllm.env_override  # noqa: F401\n",
        "vllm/env_override.py": "import os\n" + INSTALL_IF_SET,
        "vllm/triton_utils/__init__.py": (
            "from vllm.platforms import current_platform  # noqa: F401\n"
        ),
    },
    # 0.33.0: vllm.triton_utils installs it when first imported
    "0.33.0": {
        "vllm/__init__.py": "",
        "vllm/triton_utils/__init__.py": (
            "import os\nfrom vllm.platforms import current_platform  # noqa: F401\n"
            + INSTALL_IF_SET
        ),
    },
}

THE_TEST = """
def test_platform_and_force_first():
    from vllm.platforms import current_platform
    from vllm.triton_utils import force_first_config

    assert current_platform.is_cuda_alike() and not current_platform.is_cpu()
    assert force_first_config._installed == 1
"""


def fake_vllm(root: Path, version: str) -> None:
    files = {
        "torch/__init__.py": TORCH,
        "vllm/platforms/__init__.py": PLATFORMS,
        "vllm/platforms/cpu.py": CPU,
        "vllm/triton_utils/force_first_config.py": FORCE_FIRST,
        **LAYOUTS[version],
    }
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


@pytest.mark.parametrize("version", sorted(LAYOUTS))
def test_plugin_installs_its_platform_with_force_first_config(tmp_path, version):
    pkgs = tmp_path / "pkgs"
    fake_vllm(pkgs, version)
    tests = tmp_path / "t"
    tests.mkdir()
    (tests / "test_it.py").write_text(textwrap.dedent(THE_TEST))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "TRITON_"))}
    env.update(
        TRITON_INTERPRET="1",
        VLLM_TRITON_FORCE_FIRST_CONFIG="1",
        PYTHONPATH=os.pathsep.join([str(PLUGIN_DIR), str(pkgs)]),
        PYTHONDONTWRITEBYTECODE="1",
    )
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    argv += ["-p", "no:xdist", "-p", "hybridstack_triton_interp", str(tests)]
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout

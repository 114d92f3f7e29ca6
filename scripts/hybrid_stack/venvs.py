# SPDX-License-Identifier: Apache-2.0
"""The build venv and the patched tree it runs, as build, test and
kernel-stats share them: their default paths, the stamp build leaves in the
venv, the check that the venv holds the tree, the tree's version string, and
the environment the venv's processes run with.
"""

from __future__ import annotations

import json
from pathlib import Path

from hybrid_stack import hfcache
from hybrid_stack.errors import StackError
from hybrid_stack.gitops import Repo
from hybrid_stack.stack import Stack

STAMP_NAME = "hybrid-stack-build.json"
PLUGIN_DIR = Path(__file__).parent / "data" / "pytest_plugins"


def default_venv(stack: Stack) -> Path:
    return stack.root / "work" / "venv"


def venv_and_tree(
    stack: Stack, venv: Path | None = None, tree: Path | None = None
) -> tuple[Path, Path]:
    """--venv and --tree with their defaults (work/venv, the work tree), absolute."""
    return (venv or default_venv(stack)).absolute(), (tree or stack.default_work).absolute()


def read_stamp(venv: Path) -> dict:
    try:
        data = json.loads((venv / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def tree_version(stack: Stack, tree: Path) -> str:
    """``<pin>+hybridstack.<short commit>[.dirty]``: the installed vLLM's version."""
    repo = Repo(tree)
    status, head, _ = repo.status("rev-parse", "--short=10", "HEAD")
    if status != 0:
        return f"{stack.pin.version}+hybridstack.nogit"
    local = f"hybridstack.{head.strip()}"
    if repo.status("diff", "--quiet", "HEAD", "--")[0] == 1:
        local += ".dirty"
    return f"{stack.pin.version}+{local}"


def check_venv(stack: Stack, venv: Path, tree: Path) -> Path:
    """The venv's python, once the venv is known to hold an editable install
    of the tree (a note if the tree moved on since)."""
    py = venv / "bin" / "python"
    if not py.exists():
        raise StackError(f"no venv at {venv}: run 'hybrid-stack build' first")
    if not (tree / "tests" / "conftest.py").is_file():
        raise StackError(f"{tree} has no tests/conftest.py: run 'hybrid-stack apply' (or --tree)")
    built = read_stamp(venv).get("editable", {})
    if built.get("tree") != str(tree):
        raise StackError(
            f"the venv {venv} has no editable install of {tree}: run "
            f"'hybrid-stack build --venv {venv} --tree {tree}'"
        )
    if built.get("version") != tree_version(stack, tree):
        print(
            f"note: the venv was built at {built.get('version')}; the tree has moved on "
            "(sources are live, only the version string is stale: 'hybrid-stack build' "
            "refreshes it)"
        )
    return py


def test_env(
    base: dict[str, str], hf_home: Path, *, interpret: bool, native: bool = False
) -> dict[str, str]:
    """The environment of one process in the venv (a pytest suite, the probe).

    Inherited VLLM_* and TRITON_* variables are dropped: a developer's shell
    must not change results, and tests leak such variables between files.
    """
    env = {
        k: v
        for k, v in base.items()
        if not k.startswith(("VLLM_", "TRITON_")) and k != "PYTHONPATH"
    }
    env.update(hfcache.offline_env(hf_home))
    # vLLM's own cache (model-class inspection results, keyed by module hash)
    # beside the HF fixtures, not the user's ~/.cache/vllm: a stale entry
    # there could hide an import failure.
    env["VLLM_CACHE_ROOT"] = str(hf_home.parent / "vllm-cache")
    env["VLLM_TARGET_DEVICE"] = "cpu"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    if interpret:
        env["TRITON_INTERPRET"] = "1"
        env["CUDA_VISIBLE_DEVICES"] = ""
        env["VLLM_TRITON_FORCE_FIRST_CONFIG"] = "1"
        env["PYTHONPATH"] = str(PLUGIN_DIR)
    elif native:
        # With no GPU driver active vLLM swaps its placeholder module in for
        # triton, unless CUDA_VISIBLE_DEVICES is set and empty (as in a Ray
        # actor): then the real Triton stays, JIT objects and all.
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env

# SPDX-License-Identifier: Apache-2.0
"""The real pinned sdist: fetch (cached between runs) and apply the current series."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybrid_stack.apply import apply
from hybrid_stack.export import export_files
from hybrid_stack.fetch import fetch_artifact, sha256_file
from hybrid_stack.gitops import Repo
from hybrid_stack.stack import load_stack

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.network
def test_real_sdist_applies_current_series(tmp_path: Path):
    stack = load_stack(ROOT)
    sdist = fetch_artifact(stack, "sdist")
    assert sha256_file(sdist) == stack.pin.sdist.sha256
    work = tmp_path / "vllm"
    assert apply(stack, work) == 0
    repo = Repo(work)
    assert repo.dirty() == []
    # the base holds the sdist's files hidden by vLLM's own .gitignore
    tracked = set(repo.run("ls-files", stack.pin.tag, "--", "vllm/model_executor").split())
    assert "vllm/model_executor/kernels/linear/mxfp4/rdna3_hip.py" in tracked
    assert len(repo.commits(repo.rev(stack.pin.tag))) == len(stack.carried)
    # every carried entry's exported files equal what is committed in the stack
    want = export_files(stack, work)
    for rel, content in want.items():
        data = content[1] if isinstance(content, tuple) else content
        assert (ROOT / rel).read_bytes() == data, rel

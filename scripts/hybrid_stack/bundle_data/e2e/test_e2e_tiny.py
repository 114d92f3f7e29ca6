# SPDX-License-Identifier: Apache-2.0
"""GPU: the tiny Qwen3.5-style hybrid served end to end (bundle selection e2e-tiny).

Prefix caching off is the reference; with prefix caching on (align), MTP off and
k = 1..3, the greedy tokens of a cold prompt, the same prompt again and a prompt
sharing only a prefix must equal it, the warm prompt must hit the cache, and the
engine must not call a compiled op the bundle does not implement.

Engines take most of the GPU's memory, one at a time: the bundle runs this
selection in one process (run.py never gives it xdist workers).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import harness  # pytest puts this folder (e2e/, no __init__.py) on sys.path
import pytest

os.environ.update(harness.ENGINE_ENV)

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MODEL = "tiny-qwen3.5"
# Engine settings for sharing the GPU with other harness processes, as JSON of
# harness.Engine fields (e.g. {"kv_cache_gib": 4, "lock": "/tmp/gpu.lock"}).
SHARED_GPU_ENV = "HYBRID_STACK_E2E_ENGINE"


def base_engine() -> harness.Engine:
    fields = json.loads(os.environ.get(SHARED_GPU_ENV, "{}"))
    if "lock" in fields:
        fields["lock"] = Path(fields["lock"])
    return harness.Engine(MODEL, **fields)


@pytest.fixture(scope="module")
def shims():
    import compiled_ops

    compiled_ops.plugin()
    return compiled_ops


@pytest.mark.parametrize("mtp_k", [0, 1, 2, 3])
def test_tiny_identity_align(shims, mtp_k):
    failures: list = []
    plan = harness.PLANS[MODEL]["identity"]
    rows = harness.suite_identity(
        base_engine(),
        modes=["align"],
        ks=[mtp_k],
        length=plan["length"],
        shared=plan["shared"],
        failures=failures,
    )
    assert not failures, failures
    assert len(rows) == 3
    for r in rows:
        assert r["value"] == 1.0, (
            f"{r['case']}: greedy tokens differ from prefix caching off at "
            f"token {r['first_divergence']}"
        )
    warm = next(r for r in rows if r["case"]["scenario"] == "same-twice")
    assert 0 < warm["cached_tokens"] <= warm["ideal_cached_tokens"], warm
    called = {n for n, c in shims.COUNTS.items() if c}
    assert called <= set(shims.IMPLEMENTED), f"lookup-only ops called: {called}"

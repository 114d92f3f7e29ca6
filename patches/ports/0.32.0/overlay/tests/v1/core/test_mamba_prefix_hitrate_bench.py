# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""benchmarks/hybrid/bench_mamba_prefix_hitrate.py runs every Mamba cache mode,
with and without drafts, and writes its result."""

import json
import os
import runpy
from pathlib import Path

BENCH = (
    Path(__file__).resolve().parents[3]
    / "benchmarks"
    / "hybrid"
    / "bench_mamba_prefix_hitrate.py"
)


def test_every_mode_with_and_without_drafts(tmp_path, monkeypatch):
    # Without the variable a process with no Triton picks the V1 runner,
    # which refuses mamba_cache_mode="all" with drafts.
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    bench = runpy.run_path(str(BENCH))
    out = tmp_path / "hitrate.json"
    argv = [
        "--models",
        "qwen3.5-9b-like",
        "--workloads",
        "system_prompts",
        "--mtp-k",
        "0",
        "3",
        # vLLM 0.32.0 has no lookahead block hashes: with drafts each hit
        # loses its last block, the whole shared prefix at 0.25 (one block)
        "--scale",
        "0.5",
        "--budgets-gib",
        "16",
        "--output-json",
        str(out),
    ]
    assert bench["main"](argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["case"]["num_spec_tokens"] for r in rows] == [0, 3]
    for row in rows:
        assert set(row["per_mode"]) == {"none", "align", "all"}
        assert not any(m["stalled"] for m in row["per_mode"].values())
        # Four system prompts each shared by six requests: every mode with
        # prefix caching hits, and all mode at least as much as align.
        assert row["baseline"] > 0
        assert row["value"] >= row["baseline"]
    # The bench restores the environment it ran the scheduler under.
    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ

# SPDX-License-Identifier: Apache-2.0
"""The end-to-end harness's GDN prefill backend, on the CPU: the engine asks
for it (FLA Triton unless told otherwise), FlashInfer options need FlashInfer,
and merged results say which backend ran."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

E2E = Path(__file__).resolve().parents[1] / "scripts" / "hybrid_stack" / "bundle_data" / "e2e"
sys.path.insert(0, str(E2E))
import harness  # noqa: E402


def test_engine_asks_for_the_gdn_prefill_backend():
    assert harness.Engine("tiny-qwen3.5").kwargs()["gdn_prefill_backend"] == "triton"
    fi = harness.Engine("tiny-qwen3.5", gdn_prefill="flashinfer").kwargs()
    assert fi["gdn_prefill_backend"] == "flashinfer"
    # auto: vLLM's default, left unset
    assert "gdn_prefill_backend" not in harness.Engine("tiny-qwen3.5", gdn_prefill="auto").kwargs()
    # models without GDN layers never name it
    assert "gdn_prefill_backend" not in harness.Engine("mamba2-2.7b-like").kwargs()


def test_flashinfer_options_need_flashinfer(tmp_path: Path, capsys: pytest.CaptureFixture):
    assert harness.flashinfer_version() is None  # not on this machine
    for arg in (
        "--gdn-prefill-backend=flashinfer",
        "--gdn-prefill-backend=auto",
        "--flashinfer-sampler",
    ):
        with pytest.raises(SystemExit):
            harness.main(["--model", "tiny-qwen3.5", "--out", str(tmp_path), arg])
        assert "FlashInfer does not import here" in capsys.readouterr().err
    assert harness.ENGINE_ENV["VLLM_USE_FLASHINFER_SAMPLER"] == "0"


def part(model: str, settings: dict | None, rows_carry: bool = True) -> dict:
    row = {
        "suite": "identity",
        "metric": "identical",
        "case": {"model": model, "mode": "none", "mtp_k": 0, "scenario": "same"},
        "baseline": 1.0,
        "value": 1.0,
        "ratio": 1.0,
    }
    if settings and settings["gdn_prefill"] and rows_carry:
        row["gdn_prefill"] = settings["gdn_prefill"]
    if settings and "triton_autotune" in settings and rows_carry:
        row["triton_autotune"] = settings["triton_autotune"]
    got = {
        "model": model,
        "rows": [row],
        "failures": [],
        "compiled_ops": {},
        "env": {
            "gpu": "h200",
            "gpu_name": "NVIDIA H200",
            "torch": "2.11",
            "triton": "3.6.0",
            "vllm_base": "0.33.0",
            "cuda": "13.0",
        },
        "command": f"harness --model {model}",
        "created": "2026-12-02T00:00:00Z",
    }
    if settings is not None:
        got["settings"] = settings
    return got


def write_parts(out: Path, *parts: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for i, p in enumerate(parts):
        (out / f"e2e-part-{p['model']}--{i}.json").write_text(json.dumps(p))


def test_flashinfer_plan_needs_the_default_path(tmp_path: Path, capsys: pytest.CaptureFixture):
    """--plan flashinfer measures vLLM's default Hopper path: without its two
    settings it stops before any engine, with them it reaches the FlashInfer
    check (this machine has none); its result is e2e-flashinfer."""
    base = ["--model", "qwen3.5-9b-like", "--plan", "flashinfer", "--out", str(tmp_path)]
    for extra in ([], ["--gdn-prefill-backend=auto"], ["--flashinfer-sampler"]):
        with pytest.raises(SystemExit):
            harness.main(base + extra)
        err = capsys.readouterr().err
        assert "needs --gdn-prefill-backend auto --flashinfer-sampler" in err
    with pytest.raises(SystemExit):
        harness.main(base + ["--gdn-prefill-backend=auto", "--flashinfer-sampler"])
    assert "FlashInfer does not import here" in capsys.readouterr().err
    assert harness.NAMED_PLANS["flashinfer"]["qwen3.5-9b-like"] == harness.PLANS["qwen3.5-9b-like"]
    assert harness.bench_name("flashinfer") == "e2e-flashinfer"
    assert not list(tmp_path.iterdir())


def test_merged_settings_say_which_backend_ran(tmp_path: Path):
    fi = harness.part_settings("flashinfer", {"flashinfer"}, harness.SAMPLER_TORCH)
    assert fi["gdn_prefill"] == "FlashInfer (gdn_prefill_backend=flashinfer)"  # none importable
    auto = harness.gdn_label("auto", {"flashinfer", "triton"}, "0.7.2.post1")
    assert auto == "FlashInfer 0.7.2.post1 + FLA Triton (gdn_prefill_backend=auto)"
    tri = harness.part_settings("triton", {"triton"}, harness.SAMPLER_TORCH)
    none = harness.part_settings("triton", set(), harness.SAMPLER_TORCH)
    assert none["gdn_prefill"] is None
    # one backend (a model without GDN layers does not count; old parts ran FLA Triton)
    write_parts(tmp_path / "a", part("tiny-qwen3.5", fi), part("mamba2-2.7b-like", none))
    assert harness.merge(tmp_path / "a")["settings"]["gdn_prefill"] == fi["gdn_prefill"]
    write_parts(tmp_path / "b", part("tiny-qwen3.5", tri), part("qwen3.5-9b-like", None))
    assert harness.merge(tmp_path / "b")["settings"]["gdn_prefill"] == tri["gdn_prefill"]
    # two backends: refused unless the rows say which
    write_parts(tmp_path / "c", part("tiny-qwen3.5", fi), part("qwen3.5-9b-like", None))
    with pytest.raises(SystemExit, match="parts ran different gdn_prefill"):
        harness.merge(tmp_path / "c")
    write_parts(tmp_path / "d", part("tiny-qwen3.5", fi), part("qwen3.5-9b-like", tri))
    result = harness.merge(tmp_path / "d")
    assert result["settings"]["gdn_prefill"].startswith("per row: ")
    md = harness.markdown(result)
    assert "| gdn_prefill |" in md and "FlashInfer (gdn_prefill_backend=flashinfer) |" in md
    write_parts(tmp_path / "e", part("tiny-qwen3.5", fi, rows_carry=False), part("x", tri))
    with pytest.raises(SystemExit, match="rows do not say which"):
        harness.merge(tmp_path / "e")


def test_merged_settings_say_how_triton_autotuned(tmp_path: Path):
    """--triton-first-config parts say so; parts from before the setting
    autotuned by timing; parts of both merge only with rows that say which."""
    tri = harness.part_settings("triton", {"triton"}, harness.SAMPLER_TORCH)
    assert tri["triton_autotune"] == harness.AUTOTUNE_TIMED
    first = harness.part_settings(
        "triton", {"triton"}, harness.SAMPLER_TORCH, harness.AUTOTUNE_FIRST
    )
    legacy = {k: v for k, v in tri.items() if k != "triton_autotune"}
    write_parts(tmp_path / "a", part("tiny-qwen3.5", tri), part("qwen3.5-9b-like", legacy))
    assert harness.merge(tmp_path / "a")["settings"]["triton_autotune"] == harness.AUTOTUNE_TIMED
    write_parts(tmp_path / "b", part("tiny-qwen3.5", first), part("qwen3.5-9b-like", first))
    merged = harness.merge(tmp_path / "b")["settings"]["triton_autotune"]
    assert "VLLM_TRITON_FORCE_FIRST_CONFIG=1" in merged
    write_parts(tmp_path / "c", part("tiny-qwen3.5", first), part("qwen3.5-9b-like", tri))
    assert harness.merge(tmp_path / "c")["settings"]["triton_autotune"].startswith("per row: ")
    write_parts(tmp_path / "d", part("tiny-qwen3.5", first), part("qwen3.5-9b-like", legacy, False))
    with pytest.raises(SystemExit, match="parts ran different triton_autotune"):
        harness.merge(tmp_path / "d")

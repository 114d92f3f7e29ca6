# SPDX-License-Identifier: Apache-2.0
"""Checks of the bundled end-to-end harness that need torch and vLLM (CPU).

Run by tests/test_e2e.py::test_in_venv_checks in the lean build venv, with the
unpacked bundle's src/, e2e/ and bench/ on PYTHONPATH (so the bundled copies
are what is checked) and HYBRID_STACK_TREE naming the applied tree.
"""

from __future__ import annotations

import json
import math
import os
import runpy
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import compiled_ops
import harness
import pytest
import torch

TREE = Path(os.environ["HYBRID_STACK_TREE"])


@pytest.fixture(scope="module")
def shims():
    lib = compiled_ops.register()
    yield compiled_ops
    del lib


def test_weak_ref_tensor_aliases_without_owning(shims):
    base = torch.randn(6, 10)
    x = base[1:, 2:7]  # offset, non-contiguous
    uses = torch._C._storage_Use_Count(base.untyped_storage()._cdata)
    before = shims.COUNTS["weak_ref_tensor"]
    w = torch.ops._C.weak_ref_tensor(x)
    assert shims.COUNTS["weak_ref_tensor"] == before + 1
    assert (w.data_ptr(), w.shape, w.stride(), w.dtype) == (
        x.data_ptr(),
        x.shape,
        x.stride(),
        x.dtype,
    )
    assert w.storage_offset() == x.storage_offset()
    assert torch.equal(w, x)
    w[0, 0] = 123.0
    assert base[1, 2] == 123.0
    x[2, 3] = -7.0
    assert w[2, 3] == -7.0
    # the view does not own the memory: the original's storage has no new user
    assert torch._C._storage_Use_Count(base.untyped_storage()._cdata) == uses
    assert w.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


def test_lookup_only_ops_have_the_trees_schema_and_raise(shims):
    schemas = compiled_ops.load_schemas()
    for name in shims.LOOKUP_ONLY:
        op = getattr(torch.ops._C, name).default
        assert str(op._schema).replace("_C::", "") == str(torch._C.parse_schema(schemas[name])), (
            name
        )
    before = shims.COUNTS["silu_and_mul"]
    with pytest.raises(RuntimeError, match="torch.ops._C.silu_and_mul was called"):
        torch.ops._C.silu_and_mul(torch.empty(2, 4), torch.randn(2, 8))
    assert shims.COUNTS["silu_and_mul"] == before + 1


def test_vllm_loads_the_shims_as_a_general_plugin():
    """A fresh process (as a tensor-parallel worker is) gets the shims from
    vLLM's plugin loading alone."""
    code = (
        "import torch\n"
        "assert not hasattr(torch.ops._C, 'weak_ref_tensor')\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "print(hasattr(torch.ops._C, 'weak_ref_tensor'), hasattr(torch.ops._C, 'silu_and_mul'))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["True", "True"]


def test_register_refuses_an_op_without_schema():
    schemas = dict(compiled_ops.load_schemas())
    schemas.pop("rotary_embedding")
    with pytest.raises(RuntimeError, match="no _C op named rotary_embedding"):
        compiled_ops.register(schemas)


@pytest.mark.parametrize(
    "model, arch, hybrid, chunk",
    [
        ("tiny-qwen3.5", "Qwen3_5ForCausalLM", True, 64),
        ("qwen3.5-9b-like", "Qwen3_5ForCausalLM", True, 64),
        ("mamba2-2.7b-like", "Mamba2ForCausalLM", False, 256),
        ("nemotron-h-8b-like", "NemotronHForCausalLM", True, 128),
    ],
)
def test_configs_load_with_vllm_config_classes(model, arch, hybrid, chunk):
    from vllm.config import ModelConfig

    cfg = json.loads((harness.MODELS / model / "config.json").read_text())
    mc = ModelConfig(model=str(harness.MODELS / model), skip_tokenizer_init=True)
    assert mc.architectures == [arch]
    assert mc.is_hybrid is hybrid
    assert mc.get_mamba_chunk_size() == chunk
    assert mc.get_hidden_size() == cfg["hidden_size"]
    assert mc.hf_text_config.num_hidden_layers == cfg["num_hidden_layers"]


def test_qwen35_9b_like_has_the_hitrate_benchmarks_dims():
    bench = runpy.run_path(str(TREE / "benchmarks/hybrid/bench_mamba_prefix_hitrate.py"))
    shape = bench["MODELS"]["qwen3.5-9b-like"]
    cfg = json.loads((harness.MODELS / "qwen3.5-9b-like" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == shape.num_layers
    assert cfg["full_attention_interval"] == shape.full_attention_interval
    assert cfg["num_key_value_heads"] == shape.num_kv_heads
    assert cfg["head_dim"] == shape.head_dim
    assert cfg["linear_num_key_heads"] == shape.linear_num_key_heads
    assert cfg["linear_num_value_heads"] == shape.linear_num_value_heads
    assert cfg["linear_key_head_dim"] == shape.linear_key_head_dim
    assert cfg["linear_value_head_dim"] == shape.linear_value_head_dim
    assert getattr(torch, cfg["mamba_ssm_dtype"]) == shape.ssm_dtype


@pytest.mark.parametrize(
    "spec",
    [
        harness.Engine("tiny-qwen3.5"),
        harness.Engine("tiny-qwen3.5", mode="align", mtp_k=3, kv_cache_gib=2.5),
        harness.Engine("qwen3.5-9b-like", mode="all", eager=True),
        harness.Engine("mamba2-2.7b-like", ssd_prefill="fused"),
        harness.Engine("nemotron-h-8b-like", ssd_prefill="chain"),
        harness.Engine("tiny-qwen3.5", mode="align", mtp_k=1, tensor_parallel_size=2),
    ],
)
def test_engine_kwargs_are_vllm_engine_args(spec):
    from vllm.engine.arg_utils import EngineArgs

    kw = spec.kwargs()
    args = EngineArgs(**kw)  # unknown or mistyped names raise here
    assert args.enable_prefix_caching is (spec.mode != "none")
    assert args.mamba_cache_mode == (None if spec.mode == "none" else spec.mode)
    gdn = "linear_attention" in json.loads(
        (harness.MODELS / spec.model / "config.json").read_text()
    ).get("layer_types", [])
    assert (args.gdn_prefill_backend == "triton") is gdn
    assert args.mamba_ssd_prefill == spec.ssd_prefill
    k = (args.speculative_config or {}).get("num_speculative_tokens", 0)
    assert k == spec.mtp_k
    assert args.enforce_eager is spec.eager
    assert args.tensor_parallel_size == spec.tensor_parallel_size
    assert args.kv_cache_memory_bytes == (
        int(spec.kv_cache_gib * 2**30) if spec.kv_cache_gib else None
    )


class Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(512, 64)
        self.proj = torch.nn.Linear(64, 256)
        self.conv = torch.nn.Conv1d(256, 256, 4, groups=256)
        self.norm = torch.nn.LayerNorm(64)
        self.A_log = torch.nn.Parameter(torch.zeros(32))
        self.dt_bias = torch.nn.Parameter(torch.zeros(32))
        self.D = torch.nn.Parameter(torch.zeros(32))
        self.mixer = torch.nn.Module()
        self.mixer.A = torch.nn.Parameter(torch.zeros(32))  # Mamba2 holds A, not its log


def test_redraw_weights_is_seeded_and_shaped():
    a, b, c = Toy(), Toy(), Toy()
    assert harness.redraw_weights(a) == len(list(a.parameters()))
    harness.redraw_weights(b)
    harness.redraw_weights(c, seed=harness.WEIGHT_SEED + 1)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if name not in ("D", "norm.weight", "norm.bias", "proj.bias", "conv.bias"):
            assert not torch.equal(pa, pc), name
    for decay in (torch.exp(a.A_log), -a.mixer.A):
        assert decay.min() >= 1.0 and decay.max() <= 16.0 and decay.std() > 1.0
    dt = torch.nn.functional.softplus(a.dt_bias)
    assert dt.min() >= 0.99e-3 and dt.max() <= 1.01e-1
    assert torch.equal(a.D, torch.ones(32))
    assert torch.equal(a.norm.weight, torch.ones(64))
    assert torch.equal(a.norm.bias, torch.zeros(64))
    assert torch.equal(a.proj.bias, torch.zeros(256))
    assert abs(a.proj.weight.std().item() - 1 / math.sqrt(64)) < 0.01
    assert abs(a.conv.weight.std().item() - 1 / math.sqrt(4)) < 0.05
    assert abs(a.embed_tokens.weight.std().item() - 4 / math.sqrt(64)) < 0.02


def test_redraw_weights_residual_scale_scales_only_the_residual_writers():
    """residual_scale multiplies the matrices that write into the residual
    stream (o_proj / out_proj / down_proj) and leaves every other parameter
    as the plain redraw draws it, so the echo-prone model differs from the
    plain one in those matrices only."""
    plain, echo = Toy(), Toy()
    for m in (plain, echo):
        m.out_proj = torch.nn.Linear(256, 64, bias=False)
        m.mlp = torch.nn.Module()
        m.mlp.down_proj = torch.nn.Linear(256, 64, bias=False)
    harness.redraw_weights(plain)
    harness.redraw_weights(echo, residual_scale=0.25)
    for (name, p), e in zip(plain.named_parameters(), echo.parameters()):
        if name in ("out_proj.weight", "mlp.down_proj.weight"):
            # bfloat16-grid values times a power of two stay exact
            assert torch.equal(e, p * 0.25), name
        else:
            assert torch.equal(e, p), name


def test_a_float32_engine_holds_the_bfloat16_models_weights():
    """The prefill suite's float32 reference must run the weights the
    bfloat16 engines run: every value on the bfloat16 grid, except the decay
    parameters, which the models keep in float32 either way."""
    ref, low = Toy(), Toy()
    for name, p in low.named_parameters():
        if name.rsplit(".", 1)[-1] not in harness.FLOAT32_LEAVES:
            p.data = p.data.to(torch.bfloat16)
    harness.redraw_weights(ref)
    harness.redraw_weights(low)
    for (name, pr), pl in zip(ref.named_parameters(), low.parameters()):
        assert pr.dtype == torch.float32
        assert torch.equal(pr, pl.float()), name
    assert not torch.equal(ref.A_log, ref.A_log.bfloat16().float())


def part(model: str, torch_version: str, rows: list[dict]) -> dict:
    return {
        "model": model,
        "rows": rows,
        "failures": [],
        "compiled_ops": {"weak_ref_tensor": 3},
        "plan": {},
        "env": {
            "gpu": "h200",
            "gpu_name": "NVIDIA H200",
            "torch": torch_version,
            "triton": "3.6.0",
            "vllm_base": "0.33.0",
            "cuda": "13.0",
        },
        "command": f"python3 e2e/harness.py --model {model}",
        "created": "2026-12-01T00:00:00Z",
        "shared_gpu": model == "b",
    }


def test_merge_writes_one_result_in_the_common_schema(tmp_path):
    import common

    row = common.make_row(
        {"model": "a", "tokens": 16, "seqs": 1}, "prefill_tok_per_s", 2.0, 3.0, 8.0, 5.3
    )
    row["suite"] = "prefill"
    row2 = dict(row, case={"model": "b", "tokens": 16, "seqs": 1})
    for name, r in (("a", row), ("b", row2)):
        (tmp_path / f"e2e-part-{name}.json").write_text(json.dumps(part(name, "2.11", [r])))
    assert harness.main(["--merge", "--out", str(tmp_path), "--note", "n1"]) == 0
    result = json.loads((tmp_path / "e2e-h200.json").read_text())
    assert common.validate(result) == []
    assert [r["case"]["model"] for r in result["rows"]] == ["a", "b"]
    assert result["command"].split(" && ") == [part(m, "", [])["command"] for m in "ab"]
    assert result["shared_gpu"] == ["b"] and result["notes"] == ["n1"]
    assert result["entries"] == sorted(harness.SUITE_ENTRIES["prefill"])
    md = (tmp_path / "e2e-h200.md").read_text()
    assert "| a | 16 | 1 | 2 | 3 | 1.500x |" in md and "note: n1" in md


def test_merge_refuses_parts_of_other_software(tmp_path):
    for name, version in (("a", "2.11"), ("b", "2.14")):
        (tmp_path / f"e2e-part-{name}.json").write_text(json.dumps(part(name, version, [])))
    with pytest.raises(SystemExit, match="other torch"):
        harness.merge(tmp_path)


def test_counters_sum_every_series_of_a_metric():
    class Metric:
        def __init__(self, name: str, value: float) -> None:
            self.name, self.value = name, value

    class FakeLLM:
        def get_metrics(self):
            return [
                Metric("vllm:spec_decode_num_draft_tokens", 40),
                Metric("vllm:spec_decode_num_draft_tokens", 29),  # another label set
                Metric("vllm:prefix_cache_hits", 7),
                Metric("vllm:num_requests_running", 3),  # not one of ours
            ]

    runner = harness.Runner.__new__(harness.Runner)
    runner.llm = FakeLLM()
    assert runner.counters() == {"spec_decode_num_draft_tokens": 69.0, "prefix_cache_hits": 7.0}


def test_plans_name_existing_models_and_suites():
    models = {p.name for p in harness.MODELS.iterdir()}
    assert set(harness.PLANS) == models
    for plan in harness.PLANS.values():
        assert set(plan) <= set(harness.SUITES)
    engine = harness.Engine("tiny-qwen3.5")
    assert replace(engine, mode="align").label() == "tiny-qwen3.5/align/mtp0"


def test_serve_reads_each_generated_tokens_logprob():
    """Runner.serve(output_logprobs=True) asks vLLM for the sampled tokens'
    logprobs (logprobs=0) and returns each generated token's own, in order."""
    from vllm.logprobs import Logprob
    from vllm.sampling_params import SamplingParams

    params = harness.Runner._params(4, output_logprobs=True)
    assert isinstance(params, SamplingParams) and params.logprobs == 0
    assert harness.Runner._params(4).logprobs is None

    class Out:
        token_ids = [5, 9]
        # a top-1 entry that is not the sampled token must not be read
        logprobs = [
            {5: Logprob(-0.25), 7: Logprob(-0.5)},
            {3: Logprob(-0.125), 9: Logprob(-2.0)},
        ]

    class RequestOutput:
        outputs = [Out()]
        num_cached_tokens = 64
        prompt_logprobs = None

    class FakeLLM:
        def generate(self, prompts, params, use_tqdm):
            assert params.logprobs == 0
            return [RequestOutput()]

    runner = harness.Runner.__new__(harness.Runner)
    runner.llm = FakeLLM()
    runner.spec = harness.Engine("tiny-qwen3.5")
    (served,) = runner.serve([[1, 2, 3]], 2, output_logprobs=True)
    assert served.tokens == [5, 9] and served.cached == 64
    assert served.output_logprobs == [-0.25, -2.0]

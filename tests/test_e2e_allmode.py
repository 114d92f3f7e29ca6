# SPDX-License-Identifier: Apache-2.0
"""The end-to-end harness's all-mode plan (``--plan allmode``), on the CPU:
the matrix it covers, the rows its suite writes (with a stand-in engine), and
the result it merges into (``e2e-allmode-<gpu>.json``)."""

from __future__ import annotations

import json
import os
import sys
import types
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest

from hybrid_stack.bench import common

E2E = Path(__file__).resolve().parents[1] / "scripts" / "hybrid_stack" / "bundle_data" / "e2e"
sys.path.insert(0, str(E2E))
import harness  # noqa: E402

BLOCK = 528  # like an engine's hybrid block size: no prefix is a multiple of it


def test_allmode_plan_covers_the_matrix():
    plans = harness.NAMED_PLANS["allmode"]
    assert set(plans) == {"tiny-qwen3.5", "qwen3.5-9b-like"}
    for plan in plans.values():
        assert set(plan) <= set(harness.SUITES)
        m = plan["allmode"]
        assert m["modes"] == ["none", "align", "all"]
        assert m["ks"] == [0, 1, 2, 3]
        assert m["prefixes"] == [1072, 2000, 2144]
        # the GDN kernel chunk: all mode's blocks are multiples of it
        assert m["chunk"] == 64
    timed = plans["qwen3.5-9b-like"]["allmode-timed"]
    assert timed["ks"] == [0, 3] and 32768 in timed["prefixes"]
    assert harness.bench_name("allmode") == "e2e-allmode"
    assert harness.SUITE_ENTRIES["allmode"] and harness.SUITE_ENTRIES["allmode-timed"]


class FakeRunner:
    """Each greedy token is a function of the sequence before it (so a prompt
    continuing a request's own tokens gets the token the request got next);
    mode ``all`` with MTP 2 diverges on the shared-prefix prompt of 2000 tokens
    (a wrong cached state) and, for a prompt that hits a block its decode
    completed, moves that token's logprob (a wrong decode checkpoint); it
    decodes slower than align and prefills long prompts 3% slower."""

    def __init__(self, spec):
        self.spec, self.block_size, self.vocab = spec, spec.block_size or BLOCK, 1000
        self.seen: set[tuple[int, ...]] = set()
        self.decoded: set[tuple[int, ...]] = set()  # blocks decodes completed

    def serve(self, prompts, max_tokens, prompt_logprobs=False, output_logprobs=False):
        out = []
        for p in prompts:
            seq = list(p)
            for _ in range(max_tokens):
                seq.append((sum(seq) + len(seq)) % 97)
            toks = seq[len(p) :]
            key = tuple(p[: len(p) // BLOCK * BLOCK])
            from_decode = key in self.decoded
            cached = len(key) if key and (key in self.seen or from_decode) else 0
            self.seen.add(key)
            self.decoded.add(tuple(seq[: len(seq) // BLOCK * BLOCK]))
            bug = (self.spec.mode, self.spec.mtp_k) == ("all", 2)
            if bug and len(p) == 2200 and cached:
                toks[5] += 1
            out_lps = [-(t % 13) / 7 for t in toks] if output_logprobs else []
            if bug and from_decode and out_lps:
                out_lps[0] -= 2**-20
            ms = 100.0 if max_tokens > 100 and self.spec.mode == "align" else 125.0
            if len(p) >= 16384 and max_tokens == 1:
                ms = 1000.0 if self.spec.mode == "align" else 1030.0
            lps = []
            if prompt_logprobs:
                # all mode computes other bits from position 640 on (a step
                # boundary) for the 1072-token prefix
                lps = [-(t % 13) / 7 for t in p[1:]]
                if self.spec.mode == "all" and len(p) == 1272:
                    lps[639:] = [x - 2**-20 for x in lps[639:]]
            out.append(harness.Served(toks, cached, ms, lps, out_lps))
        return out

    def gpu_ms(self, prompts, max_tokens):
        # the same device work in both modes: all mode's slower decode is host time
        assert all(prompts) and max_tokens > 0
        return 90.0 if max_tokens > 100 else 800.0

    def reset_cache(self):
        self.seen.clear()
        self.decoded.clear()

    def counters(self):
        return {"prefix_cache_hits": 1.0}


@pytest.fixture
def fake_engines(monkeypatch):
    started = []

    @contextmanager
    def engine(spec, failures):
        started.append(spec)
        yield FakeRunner(spec)

    monkeypatch.setattr(harness, "engine", engine)
    return started


def test_allmode_suite_rows(fake_engines):
    m = dict(harness.ALLMODE_MATRIX, ks=[0, 2])
    rows = harness.suite_allmode(harness.Engine("tiny-qwen3.5"), **m, failures=[])
    # One engine per (k, mode), the reference first; the reference and all
    # mode cut prefills into chunk-token steps, align keeps its own.
    assert [(s.mode, s.mtp_k, s.max_num_batched_tokens) for s in fake_engines] == [
        (mode, k, None if mode == "align" else 64)
        for k in (0, 2)
        for mode in ("none", "align", "all")
    ]
    assert all(s.max_model_len >= 2144 + 200 for s in fake_engines)
    assert {r["metric"] for r in rows} == {"identical"}
    # 2 ks x 2 modes x 3 prefixes x 6 scenarios
    assert len(rows) == 72
    bad = [
        (r["case"]["mode"], r["case"]["mtp_k"], r["prefix_tokens"], r["case"]["scenario"])
        for r in rows
        if r["value"] != 1.0
    ]
    # the wrong cached state shows against caching off and against the cold run
    assert bad == [("all", 2, 2000, "same-twice"), ("all", 2, 2000, "same-twice-vs-cold")]
    shared = [r for r in rows if r["case"]["scenario"] == "shared-prefix"]
    assert {r["ideal_cached_tokens"] for r in shared} == {n // BLOCK * BLOCK for n in m["prefixes"]}
    assert {r["max_num_batched_tokens"] for r in rows if r["case"]["mode"] == "all"} == {64}


def test_allmode_reference_block_size(fake_engines):
    """--set ref_block_size=N starts only the reference at block N (to compare
    all mode with a reference that differs from it in nothing but the cache);
    every row names the block the reference ran at."""
    m = dict(harness.ALLMODE_MATRIX, ks=[3], modes=["none", "all"], prefixes=[1072])
    rows = harness.suite_allmode(harness.Engine("qwen3.5-9b-like"), **m, failures=[])
    assert {r["reference_block_size"] for r in rows} == {BLOCK}
    assert [s.block_size for s in fake_engines] == [None, None]
    fake_engines.clear()
    rows = harness.suite_allmode(
        harness.Engine("qwen3.5-9b-like"), **dict(m, ref_block_size=576), failures=[]
    )
    assert [(s.mode, s.block_size) for s in fake_engines] == [("none", 576), ("all", None)]
    assert {r["reference_block_size"] for r in rows} == {576}
    assert harness.Engine("qwen3.5-9b-like", block_size=576).kwargs()["block_size"] == 576
    assert "block_size" not in harness.Engine("qwen3.5-9b-like").kwargs()


def test_allmode_second_reference_engine_is_judged(fake_engines):
    """modes none, none: the second engine of the reference's configuration is
    judged against the first (what the reference reproduces across engines),
    with the reference's block size and step budget."""
    m = dict(harness.ALLMODE_MATRIX, ks=[0], modes=["none", "none"], prefixes=[1072])
    rows = harness.suite_allmode(
        harness.Engine("qwen3.5-9b-like"), **dict(m, ref_block_size=576), failures=[]
    )
    assert [(s.mode, s.block_size, s.max_num_batched_tokens) for s in fake_engines] == [
        ("none", 576, 64),
        ("none", 576, 64),
    ]
    assert len(rows) == len(harness.VS_COLD) + 3
    assert {(r["case"]["mode"], r["value"]) for r in rows} == {("none", 1.0)}
    assert {r["cached_tokens"] for r in rows if r["case"]["scenario"] == "cold"} == {0}


def test_allmode_prompt_logprobs_locate_the_first_difference(fake_engines):
    """--set prompt_logprobs=true: the cold request of each prefix returns its
    prompt logprobs in the reference and in each mode, and the cold row says
    from which prompt position the mode's prefill gives other bits; without
    it no request asks for them."""
    m = dict(harness.ALLMODE_MATRIX, ks=[3], modes=["none", "all"], prefixes=[1072, 2000])
    rows = harness.suite_allmode(harness.Engine("qwen3.5-9b-like"), **m, failures=[])
    assert not any("first_logprob_diff_position" in r for r in rows)
    rows = harness.suite_allmode(
        harness.Engine("qwen3.5-9b-like"), **dict(m, prompt_logprobs=True), failures=[]
    )
    cold = {r["prefix_tokens"]: r for r in rows if r["case"]["scenario"] == "cold"}
    assert cold[1072]["first_logprob_diff_position"] == 640
    assert cold[1072]["max_abs_logprob_diff"] == 2**-20
    assert cold[2000]["first_logprob_diff_position"] == -1
    assert cold[2000]["max_abs_logprob_diff"] == 0.0
    assert [r for r in rows if "max_abs_logprob_diff" in r] == list(cold.values())
    assert harness._logprob_diffs(cold[1072]).endswith("(from position 640)")
    assert "from position" not in harness._logprob_diffs(cold[2000])


def test_allmode_ngram_drafter_and_output_tokens(fake_engines):
    """--set drafter="ngram" --set output_tokens=N: the k > 0 engines draft by
    n-gram lookup (vLLM's prompt_lookup window), every request decodes N
    tokens, and the rows, their part label and the table say which drafter
    ran; k = 0 engines ask for no drafts at all."""
    m = dict(
        harness.ALLMODE_MATRIX,
        ks=[0, 2],
        modes=["none", "all"],
        prefixes=[1072],
        drafter="ngram",
        output_tokens=160,
    )
    rows = harness.suite_allmode(harness.Engine("qwen3.5-9b-like"), **m, failures=[])
    assert [(s.mode, s.mtp_k, s.drafter) for s in fake_engines] == [
        (mode, k, "ngram") for k in (0, 2) for mode in ("none", "all")
    ]
    # the longest request must fit: prefix + question + its decode
    assert all(s.max_model_len >= 1072 + 200 + 160 for s in fake_engines)
    assert {r["output_tokens"] for r in rows} == {160}
    assert {r["case"].get("drafter") for r in rows} == {"ngram"}
    spec = fake_engines[3].kwargs()["speculative_config"]
    assert spec == {
        "method": "ngram",
        "num_speculative_tokens": 2,
        "prompt_lookup_min": harness.NGRAM_LOOKUP[0],
        "prompt_lookup_max": harness.NGRAM_LOOKUP[1],
    }
    assert "speculative_config" not in fake_engines[0].kwargs()
    assert fake_engines[2].label() == "qwen3.5-9b-like/none/ngram2/chunk64"
    mtp = harness.Engine("qwen3.5-9b-like", mtp_k=3)
    assert mtp.kwargs()["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 3}
    # MTP rows keep the case they always had (merged with earlier results)
    assert harness.engine_case(mtp, scenario="cold") == {
        "model": "qwen3.5-9b-like",
        "mode": "none",
        "mtp_k": 3,
        "scenario": "cold",
    }
    with pytest.raises(ValueError, match="drafter 'eagle'"):
        harness.Engine("qwen3.5-9b-like", mtp_k=1, drafter="eagle").kwargs()
    # the table names the drafter where it is not MTP
    k2 = next(r for r in rows if r["case"]["mtp_k"] == 2)
    k0 = next(r for r in rows if r["case"]["mtp_k"] == 0)
    assert common.draft_k(k2["case"]) == "2 (ngram)" and common.draft_k(k0["case"]) == "0"
    _, plan, label = harness.select_plan(
        "tiny-qwen3.5", "allmode", ["allmode"], ['drafter="ngram"', "output_tokens=160"]
    )
    assert plan["allmode"]["drafter"] == "ngram" and plan["allmode"]["output_tokens"] == 160
    assert label == "allmode-drafter-ngram-output_tokens-160"


def test_allmode_timed_rows(fake_engines):
    """align then all at vLLM's default budget, per k: time to first token per
    prefix, decode and cold prefill with baseline = align, value = all."""
    m = dict(harness.ALLMODE_TIMED, ks=[3])
    rows = harness.suite_allmode_timed(harness.Engine("qwen3.5-9b-like"), **m, failures=[])
    assert [(s.mode, s.max_num_batched_tokens) for s in fake_engines] == [
        ("align", None),
        ("all", None),
    ]
    assert all(s.max_model_len >= 32768 + m["question"] for s in fake_engines)
    ttft = [r for r in rows if r["metric"] == "ttft_ms"]
    assert [(r["case"]["mode"], r["case"]["prefix_tokens"]) for r in ttft] == [
        ("align", 32768),
        ("all", 32768),
    ]
    (decode,) = [r for r in rows if r["metric"] == "decode_tok_per_s"]
    assert decode["case"]["mtp_k"] == 3 and decode["baseline"] > decode["value"]
    (prefill,) = [r for r in rows if r["metric"] == "cold_prefill_tok_per_s"]
    assert prefill["ratio"] == pytest.approx(1000 / 1030)
    assert prefill["case"]["tokens"] == m["prefill_tokens"]
    # GPU time beside wall time: equal device work, so the GPU ratio is 1 where
    # the wall ratio is not (host overhead), and the table shows both
    assert (decode["baseline_gpu_ms"], decode["value_gpu_ms"], decode["gpu_ratio"]) == (
        90.0,
        90.0,
        1.0,
    )
    assert (prefill["baseline_gpu_ms"], prefill["gpu_ratio"]) == (800.0, 1.0)
    md = harness.markdown(
        {
            "gpu_name": "H200",
            "vllm_base": "0.33.0",
            "torch": "2",
            "triton": "3",
            "cuda": "13",
            "created": "now",
            "command": "c",
            "settings": {},
            "compiled_ops_called": {},
            "shared_gpu": [],
            "failures": [],
            "rows": rows,
        }
    )
    assert "| all / align | align GPU ms | all GPU ms | GPU time align / all |" in md
    assert "| 0.800 | 90 | 90 | 1.000 |" in md


def test_merge_writes_the_allmode_result(tmp_path, fake_engines):
    rows = harness.suite_allmode(
        harness.Engine("tiny-qwen3.5"), **dict(harness.ALLMODE_MATRIX, ks=[1]), failures=[]
    )
    for r in rows:
        r["suite"] = "allmode"
    part = {
        "model": "tiny-qwen3.5",
        "rows": rows,
        "failures": [],
        "compiled_ops": {},
        "plan": harness.NAMED_PLANS["allmode"]["tiny-qwen3.5"],
        "env": {
            "gpu": "h200",
            "gpu_name": "NVIDIA H200",
            "torch": "2.11",
            "triton": "3.6.0",
            "vllm_base": "0.33.0",
            "cuda": "13.0",
        },
        "command": "python3 e2e/harness.py --model tiny-qwen3.5 --plan allmode",
        "created": "2026-12-01T00:00:00Z",
    }
    (tmp_path / "e2e-allmode-part-tiny-qwen3.5.json").write_text(json.dumps(part))
    # The default result's parts are not this one's.
    assert harness.main(["--merge", "--out", str(tmp_path), "--plan", "allmode"]) == 0
    result = json.loads((tmp_path / "e2e-allmode-h200.json").read_text())
    assert result["bench"] == "e2e-allmode"
    assert common.validate(result) == []
    assert result["entries"] == sorted(harness.SUITE_ENTRIES["allmode"])
    md = (tmp_path / "e2e-allmode-h200.md").read_text()
    assert "Greedy tokens against the reference" in md and "step budget" in md
    with pytest.raises(SystemExit, match="no e2e-part"):
        harness.merge(tmp_path)


def test_the_allmode_plan_splits_into_parts_per_mtp_k():
    """One named plan over several device calls: --suite / --set keep one
    suite or one MTP k, and the part is named after it (names a device call
    hands back: letters, digits, '.', '_', '+', '-')."""
    bench, plan, label = harness.select_plan("qwen3.5-9b-like", "allmode", [], ["ks=[1]"])
    assert bench == "e2e-allmode"
    # every suite with ks gets it; the named plan itself is left alone
    assert plan["allmode"]["ks"] == [1] and plan["allmode-timed"]["ks"] == [1]
    assert harness.NAMED_PLANS["allmode"]["qwen3.5-9b-like"]["allmode"]["ks"] == [0, 1, 2, 3]
    assert label == "ks-1"
    _, plan, label = harness.select_plan(
        "qwen3.5-9b-like", "allmode", ["allmode"], ["allmode.ks=[0, 3]"]
    )
    assert list(plan) == ["allmode"] and plan["allmode"]["ks"] == [0, 3]
    assert plan["allmode"]["prefixes"] == harness.ALLMODE_MATRIX["prefixes"]
    assert label == "allmode-allmode.ks-0_3"
    _, plan, label = harness.select_plan("qwen3.5-9b-like", "allmode", ["allmode-timed"], [])
    assert list(plan) == ["allmode-timed"] and label == "allmode-timed"
    assert harness.select_plan("tiny-qwen3.5", "allmode", [], [])[2] == ""
    path = harness.part_path(Path("o"), "e2e-allmode", "tiny-qwen3.5", "ks-1")
    assert path.name == "e2e-allmode-part-tiny-qwen3.5--ks-1.json"
    assert all(c.isalnum() or c in "._+-" for c in path.name)
    with pytest.raises(ValueError, match="no suite of the plan takes"):
        harness.select_plan("tiny-qwen3.5", "allmode", [], ["k=[1]"])
    with pytest.raises(ValueError, match="has no suite ttft"):
        harness.select_plan("tiny-qwen3.5", "allmode", ["ttft"], [])


def test_parts_of_one_model_merge_into_one_allmode_result(tmp_path, fake_engines):
    """Each MTP k in its own process (device call), the parts gathered in one
    folder: --merge --plan=allmode writes one e2e-allmode-<gpu>.json with
    every k's rows and the compiled-op calls summed per model."""
    env = {
        "gpu": "h200",
        "gpu_name": "NVIDIA H200",
        "torch": "2.11",
        "triton": "3.6.0",
        "vllm_base": "0.33.0",
        "cuda": "13.0",
    }
    for k in (0, 1, 2, 3):
        bench, plan, label = harness.select_plan("tiny-qwen3.5", "allmode", [], [f"ks=[{k}]"])
        rows = harness.suite_allmode(harness.Engine("tiny-qwen3.5"), **plan["allmode"], failures=[])
        for r in rows:
            r["suite"] = "allmode"
        part = {
            "model": "tiny-qwen3.5",
            "rows": rows,
            "failures": [],
            "compiled_ops": {"_C.weak_ref_tensor": 10},
            "plan": plan,
            "env": env,
            "command": f"python3 e2e/harness.py --model tiny-qwen3.5 --plan=allmode --set=ks=[{k}]",
            "created": f"2026-12-01T00:0{k}:00Z",
        }
        harness.part_path(tmp_path, bench, "tiny-qwen3.5", label).write_text(json.dumps(part))
    assert harness.main(["--merge", "--out", str(tmp_path), "--plan=allmode"]) == 0
    result = json.loads((tmp_path / "e2e-allmode-h200.json").read_text())
    assert common.validate(result) == []
    assert sorted({r["case"]["mtp_k"] for r in result["rows"]}) == [0, 1, 2, 3]
    # 4 ks x 2 modes x 3 prefixes x 6 scenarios
    assert len(result["rows"]) == 144
    assert result["compiled_ops_called"] == {"tiny-qwen3.5": {"_C.weak_ref_tensor": 40}}
    assert result["created"] == "2026-12-01T00:03:00Z"


class SplitRunner(FakeRunner):
    """Modes other than none compute in other arithmetic than the reference
    (a split prefill): every request leaves the reference's tokens at token
    3, cached or not; with ``corrupt``, a cache hit also changes token 9;
    with ``history``, every request's token 7 depends on how many the engine
    served before it."""

    corrupt = False
    history = False

    def __init__(self, spec):
        super().__init__(spec)
        self.calls: list[str] = []

    def reset_cache(self):
        self.calls.append("reset")
        super().reset_cache()

    def serve(self, prompts, max_tokens, prompt_logprobs=False, output_logprobs=False):
        self.calls.append("serve")
        out = super().serve(prompts, max_tokens, prompt_logprobs, output_logprobs)
        for s in out:
            if self.spec.mode != "none":
                s.tokens[3] += 1
                if self.corrupt and s.cached:
                    s.tokens[9] += 1
            if self.history:
                s.tokens[7] += self.calls.count("serve")
        return out


@pytest.mark.parametrize("corrupt,history", [(False, False), (True, False), (False, True)])
def test_identity_rows_separate_split_arithmetic_from_cache_hits(monkeypatch, corrupt, history):
    """The rows against prefix caching off show the split's arithmetic; the
    -vs-cold rows (the same engine, its cache reset) show only what a cache
    hit changes, and their cold run of the shared-prefix prompt hits nothing;
    repeat-vs-cold catches an engine whose results depend on its history."""
    runners = []

    @contextmanager
    def engine(spec, failures):
        runner = SplitRunner(spec)
        runner.corrupt, runner.history = corrupt, history
        runners.append(runner)
        yield runner

    monkeypatch.setattr(harness, "engine", engine)
    length, shared = 4 * BLOCK + 100, 2 * BLOCK + 10
    rows = harness.suite_identity(
        harness.Engine("tiny-qwen3.5"),
        modes=["align"],
        ks=[0],
        length=length,
        shared=shared,
        failures=[],
    )
    by = {r["case"]["scenario"]: r for r in rows}
    assert set(by) == {"cold", "same-twice", "shared-prefix", *harness.VS_COLD}
    for scenario in ("cold", "same-twice", "shared-prefix"):
        assert by[scenario]["value"] == 0.0 and by[scenario]["first_divergence"] == 3
    assert by["same-twice"]["cached_tokens"] == 4 * BLOCK
    # the fake caches whole-block prefixes of whole prompts only: the
    # shared-prefix prompt hits nothing, its cold run is the same computation
    # (unless the engine's history changes it)
    assert by["shared-prefix-vs-cold"]["value"] == (0.0 if history else 1.0)
    assert by["same-twice-vs-cold"]["value"] == (0.0 if corrupt or history else 1.0)
    if corrupt:
        assert by["same-twice-vs-cold"]["first_divergence"] == 9
    assert by["repeat-vs-cold"]["value"] == (0.0 if history else 1.0)
    # the cache was reset before each cold run of the shared-prefix prompt
    assert runners[-1].calls == ["serve"] * 3 + ["reset", "serve"] * 2


def test_first_config_makes_every_engine_compile_deterministically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """--triton-first-config puts Inductor's deterministic mode into every
    engine's own compile config (the environment variable reaches only the
    first engine of a process); eager engines and the default leave it out."""
    for key in [*harness.ENGINE_ENV, "TORCHINDUCTOR_DETERMINISTIC", "PYTHONPATH"]:
        monkeypatch.setenv(key, os.environ.get(key, ""))
    monkeypatch.setitem(sys.modules, "compiled_ops", types.SimpleNamespace(plugin=lambda: None))
    bases = []

    def run_model(base, plan):
        bases.append(base)
        raise SystemExit(0)

    monkeypatch.setattr(harness, "run_model", run_model)
    for extra in ([], ["--triton-first-config"]):
        with pytest.raises(SystemExit):
            harness.main(["--model", "tiny-qwen3.5", "--out", str(tmp_path), *extra])
    assert [b.deterministic_compile for b in bases] == [False, True]
    cfg = bases[1].kwargs()["compilation_config"]
    assert cfg == {"inductor_compile_config": {"deterministic": True}}
    assert "compilation_config" not in bases[0].kwargs()
    eager = replace(bases[1], eager=True).kwargs()["compilation_config"]
    assert "inductor_compile_config" not in eager


def test_allmode_continuation_rows(fake_engines):
    """--set continuation=true: for each mode and prefix whose cold request
    decodes past a block boundary, a next turn (the prompt and its own tokens
    one past the boundary) hits the block the decode completed; its token and
    that token's logprob against the cold request's. A logprob moved by one
    ulp-sized step with the same token fails the row."""
    m = dict(
        harness.ALLMODE_MATRIX,
        ks=[0, 2],
        modes=["none", "all"],
        prefixes=[1072, 2000],
        output_tokens=400,
        continuation=True,
    )
    rows = harness.suite_allmode(harness.Engine("tiny-qwen3.5"), **m, failures=[])
    cont = [r for r in rows if r["case"]["scenario"] == harness.CONTINUE]
    # 1272 tokens decode past 1584 (BLOCK 528) within 400; 2200 reach 2376 only
    assert [(r["case"]["mtp_k"], r["prefix_tokens"]) for r in cont] == [(0, 1072), (2, 1072)]
    for r in cont:
        assert r["continued_tokens"] == 3 * BLOCK - 1272 + 1
        assert r["cached_tokens"] == r["ideal_cached_tokens"] == 3 * BLOCK
    ok, bad = cont
    assert ok["value"] == 1.0 and ok["output_logprob_diff"] == 0
    assert bad["value"] == 0.0 and bad["output_logprob_diff"] == 2**-20
    assert bad["first_divergence"] == -1  # the same token: only the logprob moved
    # off by default: the matrix's rows stay what they were
    assert harness.ALLMODE_MATRIX["continuation"] is False

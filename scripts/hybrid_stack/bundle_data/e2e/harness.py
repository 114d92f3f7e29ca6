# SPDX-License-Identifier: Apache-2.0
"""End to end on a GPU: the patched vLLM engine serving the stack's test models.

Runs vLLM's own engine (``vllm.LLM``: V1 engine core in-process, Model Runner
V2, the default ``torch.compile`` + CUDA graph settings, vLLM's Triton
attention backend) on the bundle's sources, with the compiled ops of
``compiled_ops.py`` and nothing else replaced. Models come from ``models/``
(config.json only): ``load_format="dummy"``, then every weight is redrawn from
a fixed seed (``redraw_weights``) so that logits are peaked and the recurrent
states keep a long memory: a wrong cached state changes the greedy tokens
instead of fading within a few positions. Prompts are token ids; there is no
tokenizer.

Suites (one engine per configuration, engines run one after another in this
process):

``identity``  for each MTP k, prefix caching off (the reference) and each
              mamba cache mode: a prompt, the same prompt again, then a prompt
              sharing only a prefix with it. Greedy tokens must be identical to
              the reference's; rows ``identical`` (1 or 0) with the cached
              tokens the engine reports.
``ttft``      time to first token of prefix + question, cold (nothing cached)
              and warm (another question after the same prefix), per prefix
              length and MTP k: rows ``ttft_ms`` (baseline cold, value warm;
              lower is better).
``prefill``   Mamba2 models, ``--mamba-ssd-prefill chain`` against ``fused``:
              whole-model prefill throughput (``prefill_tok_per_s``), the prompt
              logprobs of one prompt and a greedy continuation compared
              (``identical``, with the largest logprob difference and the first
              diverging token): fused against chain, and each against a float32
              engine of the same weights (the chain's own error is the yardstick).

``allmode``   mamba_cache_mode="all" against align and prefix caching off: per
              MTP k and prefix length, ``identical`` (same prompt twice, a
              prompt sharing only the prefix), prefills cut into equal steps
              so that a cache hit is computed as it is cold.
``allmode-timed``  all mode against align at the default settings: ``ttft_ms``,
              ``decode_tok_per_s`` and ``cold_prefill_tok_per_s`` (baseline
              align, value all). Both run by the named plan ``--plan allmode``
              (result ``e2e-allmode-<gpu>``).

Each process writes ``<out>/e2e-part-<model>.json`` (``e2e-<plan>-part-...`` for
a named plan; ``<model>--<label>`` when ``--suite`` / ``--set`` run only part of
the plan, e.g. ``--plan allmode --set ks=[1]``, one MTP k per device call);
``--merge`` joins the parts into ``<out>/e2e-<gpu>.json`` and ``.md`` (the common
results schema).

GDN models run the FLA Triton prefill unless ``--gdn-prefill-backend flashinfer``
(or ``auto``, vLLM's default: FlashInfer on Hopper) is given, which needs
FlashInfer importable (``run.py --flashinfer``). Each part records which
backends its engines' layers resolved to (``settings``, and ``gdn_prefill`` on
each row); ``--merge`` names them and joins parts of different backends only
because their rows say which.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import statistics
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
try:  # the repository (tests)
    from hybrid_stack.bench import common
except ImportError:  # an unpacked bundle: bench/common.py beside e2e/
    sys.path.insert(0, str(HERE.parent / "bench"))
    import common  # type: ignore[no-redef]

MODELS = HERE / "models"
BENCH = "e2e"
# The series entries whose features a suite measures (their PR bodies quote
# the rows); align-mode identity and TTFT measure upstream's align mode.
SUITE_ENTRIES = {
    "prefill": ("mamba2-ssd-fused-prefill", "mamba2-ssd-fused-prefill-sm90"),
    "identity": (),
    "ttft": (),
    "allmode": ("gdn-all-mode-runner", "gdn-all-mode-layer"),
    "allmode-timed": ("gdn-all-mode-runner", "gdn-all-mode-layer"),
}
# Facts of a part that must agree for parts to be merged into one result.
ENV_KEYS = ("gpu", "torch", "triton", "vllm_base", "cuda")
# Set before vLLM is imported: the engine core runs in this process (so the
# harness reaches the model and the shims apply), and the Model Runner V2
# sampler takes its PyTorch path (FlashInfer is not on the GPU machine unless
# run.py --flashinfer carries it; --flashinfer-sampler then turns it on).
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    # Triton autotunes by timing unless --triton-first-config (the part says which)
    "VLLM_TRITON_FORCE_FIRST_CONFIG": "0",
    # several GPUs: never NVLink multicast (the GPU machines' rule)
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
# GDN prefill backends the harness can ask for (vLLM's gdn_prefill_backend;
# "auto" leaves it unset: FlashInfer on Hopper when importable, FLA Triton in
# mamba_cache_mode="all"). The default stays FLA Triton: FlashInfer is only on
# the GPU machine when run.py --flashinfer carries it.
GDN_BACKENDS = ("triton", "flashinfer", "auto")
GDN_NAMES = {"triton": "FLA Triton", "flashinfer": "FlashInfer"}
SAMPLER_TORCH = "PyTorch (VLLM_USE_FLASHINFER_SAMPLER=0)"
SAMPLER_FLASHINFER = "FlashInfer (VLLM_USE_FLASHINFER_SAMPLER=1)"
# Triton autotuning: by timing (vLLM's and Inductor's default), once per
# kernel, key and process, so two engines can run the same kernel in
# different configs (an autotuned kernel with and without all mode's
# checkpoints has two keys; Inductor times its reduction kernels' block sizes
# and warps, which set the summation order, in each engine's compile); or
# configs that are a function of the shapes only, for identity rows across
# engines: every vLLM autotuner's first valid config (vLLM's own switch) and
# Inductor's deterministic mode (no on-device benchmarking).
AUTOTUNE_TIMED = "by timing (vLLM's default)"
AUTOTUNE_FIRST = (
    "first valid config (VLLM_TRITON_FORCE_FIRST_CONFIG=1), Inductor without "
    "benchmarking (TORCHINDUCTOR_DETERMINISTIC=1)"
)
# Which GDN prefill backend the engines' layers ran (gdn_backends), per process.
GDN_RAN: set[str] = set()
# Mamba cache modes with prefix caching on; "none" is prefix caching off.
MODES = ("none", "align", "all")
OUTPUT_TOKENS = 24
# Speculative methods an engine's drafts can come from (Engine.drafter).
# "mtp": the model's own MTP module; with dummy weights it drafts tokens the
# model never accepts. "ngram": vLLM's n-gram prompt lookup (Model Runner V2's
# GPU form), whose drafts are accepted wherever the greedy output repeats its
# context, as randomly drawn models' outputs soon do: the drafter that puts
# accepted drafts, and block-boundary crossings after them, through a matrix.
DRAFTERS = ("mtp", "ngram")
# ngram's lookup window (prompt_lookup_min, prompt_lookup_max): short enough
# to match within a loop of a few tokens
NGRAM_LOOKUP = (2, 8)
WEIGHT_SEED = 1234
# Parameters Mamba2 / GDN layers keep in float32 in a bfloat16 model.
FLOAT32_LEAVES = ("A", "A_log")
# The projections that add a layer's output to the residual stream (attention,
# GDN and MLP outputs): redraw_weights' residual_scale scales them.
RESIDUAL_WRITERS = ("o_proj", "out_proj", "down_proj")


@dataclass(frozen=True)
class Engine:
    """One engine configuration."""

    model: str
    mode: str = "none"
    mtp_k: int = 0  # draft tokens a step (0: no speculative decoding)
    drafter: str = "mtp"  # where the drafts come from (DRAFTERS)
    ssd_prefill: str | None = None
    max_model_len: int = 32768
    eager: bool = False
    gpu_memory_utilization: float = 0.8
    # a fixed KV cache size instead of one sized by profiling (engines of
    # several processes side by side on one GPU)
    kv_cache_gib: float | None = None
    # One Mamba state per decode sequence must fit: vLLM's LLM default (1024)
    # does not beside Mamba2-2.7B's 168 MiB per sequence on one H200.
    max_num_seqs: int = 64
    lock: Path | None = None  # see gpu_lock
    # Each rank redraws its own shard from the seed, so engines of one
    # tensor-parallel size share weights; across sizes they differ.
    tensor_parallel_size: int = 1
    # None: the model's own dtype; "float32" for the prefill suite's reference
    dtype: str | None = None
    # The engine's token budget per step (max_num_batched_tokens); None: vLLM's
    # default. A small one chunks every prefill on a fixed grid (see
    # suite_allmode).
    max_num_batched_tokens: int | None = None
    # vLLM's gdn_prefill_backend for models with GDN layers (GDN_BACKENDS)
    gdn_prefill: str = "triton"
    # The KV cache block size; None: the one vLLM derives for the model and
    # mode (a smaller one given here is raised to it, a larger one is kept)
    block_size: int | None = None
    # Inductor's deterministic mode in this engine's own compile config
    # (--triton-first-config). The TORCHINDUCTOR_DETERMINISTIC environment
    # variable is not enough: vLLM derives benchmark_combo_kernel from
    # torch._inductor.config.deterministic each time it builds a
    # CompilationConfig, and only the first engine of a process was seen
    # with it off; the later ones chose their combo kernels by timing.
    deterministic_compile: bool = False
    # redraw_weights' residual_scale (1: the plain random model)
    residual_scale: float = 1.0

    def kwargs(self) -> dict[str, Any]:
        cfg = json.loads((MODELS / self.model / "config.json").read_text())
        kw: dict[str, Any] = {
            "model": str(MODELS / self.model),
            "load_format": "dummy",
            "skip_tokenizer_init": True,
            "attention_backend": "TRITON_ATTN",
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "tensor_parallel_size": self.tensor_parallel_size,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "seed": 0,
            "disable_log_stats": False,
            "enable_prefix_caching": self.mode != "none",
        }
        if self.dtype:
            kw["dtype"] = self.dtype
        if self.kv_cache_gib:
            kw["kv_cache_memory_bytes"] = int(self.kv_cache_gib * 2**30)
        if self.max_num_batched_tokens:
            kw["max_num_batched_tokens"] = self.max_num_batched_tokens
            kw["max_num_seqs"] = min(self.max_num_seqs, self.max_num_batched_tokens)
        if self.mode != "none":
            kw["mamba_cache_mode"] = self.mode
        if self.block_size:
            kw["block_size"] = self.block_size
        if "linear_attention" in cfg.get("layer_types", ()) and self.gdn_prefill != "auto":
            # FLA Triton unless asked otherwise (FlashInfer needs run.py --flashinfer);
            # "auto" leaves vLLM's default (unset).
            kw["gdn_prefill_backend"] = self.gdn_prefill
        if self.ssd_prefill:
            kw["mamba_ssd_prefill"] = self.ssd_prefill
        if self.mtp_k:
            if self.drafter not in DRAFTERS:
                raise ValueError(f"drafter {self.drafter!r}: expected one of {DRAFTERS}")
            spec: dict[str, Any] = {"method": self.drafter, "num_speculative_tokens": self.mtp_k}
            if self.drafter == "ngram":
                spec["prompt_lookup_min"], spec["prompt_lookup_max"] = NGRAM_LOOKUP
            kw["speculative_config"] = spec
        if self.eager:
            # eager runs the layers' custom-op forms unless told otherwise
            kw["enforce_eager"] = True
            kw["compilation_config"] = {"custom_ops": ["none"]}
        elif self.deterministic_compile:
            kw["compilation_config"] = {"inductor_compile_config": {"deterministic": True}}
        return kw

    def label(self) -> str:
        parts = [self.model, self.mode, f"{self.drafter}{self.mtp_k}"]
        if self.ssd_prefill:
            parts.append(self.ssd_prefill)
        if self.dtype:
            parts.append(self.dtype)
        if self.max_num_batched_tokens:
            parts.append(f"chunk{self.max_num_batched_tokens}")
        if self.block_size:
            parts.append(f"block{self.block_size}")
        if self.residual_scale != 1.0:
            parts.append(f"residual{self.residual_scale:g}")
        return "/".join(parts)


def gdn_backends(model: Any) -> list[str]:
    """The GDN prefill backends ``model``'s layers resolved to (their
    ``ChunkGatedDeltaRule.gdn_prefill_backend``); empty without GDN layers."""
    return sorted(
        {m.gdn_prefill_backend for m in model.modules() if hasattr(m, "gdn_prefill_backend")}
    )


def gdn_label(requested: str, ran: list[str] | set[str], flashinfer: str | None = None) -> str:
    """What a part says of its GDN prefill: the backends that ran and the one asked for."""
    names = [
        f"{GDN_NAMES.get(b, b)}{' ' + flashinfer if b == 'flashinfer' and flashinfer else ''}"
        for b in sorted(ran)
    ]
    return f"{' + '.join(names) or 'none ran'} (gdn_prefill_backend={requested})"


def flashinfer_version() -> str | None:
    """The importable FlashInfer's version, or None."""
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec("flashinfer") is None:
        return None
    try:
        return importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def part_settings(
    requested: str, ran: set[str], sampler: str, autotune: str = AUTOTUNE_TIMED
) -> dict[str, Any]:
    """A part's engine settings merge compares: the GDN prefill (None for a
    model without GDN layers), the sampler and Triton's autotuning."""
    gdn = gdn_label(requested, ran, flashinfer_version() if "flashinfer" in ran else None)
    return {"gdn_prefill": gdn if ran else None, "sampler": sampler, "triton_autotune": autotune}


# What parts written before parts carried a setting ran.
LEGACY_SETTINGS = {
    "gdn_prefill": gdn_label("triton", ["triton"]),
    "sampler": SAMPLER_TORCH,
    "triton_autotune": AUTOTUNE_TIMED,
}


def part_setting(part: dict[str, Any], key: str) -> Any:
    """``part``'s setting ``key`` (LEGACY_SETTINGS' where the part predates it)."""
    settings = part.get("settings", {})
    return settings[key] if key in settings else LEGACY_SETTINGS[key]


def redraw_weights(model: Any, seed: int = WEIGHT_SEED, residual_scale: float = 1.0) -> int:
    """Redraw every parameter of ``model`` in place from ``seed``.

    Matrices get N(0, 1/fan_in) (embeddings and the LM head N(0, 16/hidden), so
    logits have a standard deviation of about 4 and greedy choices are not
    near-ties); norm scales 1, other vectors (biases) 0; Mamba2 / GDN decay parameters
    as their models initialise them (-A in [1, 16], dt in [1e-3, 1e-1]; Mamba2
    holds A itself, GDN its log), which
    gives some heads a memory of hundreds of tokens. Parameters are visited in
    name order, so equal configs get equal weights. Values are rounded to the
    bfloat16 grid except the decay parameters (which the models keep in
    float32), so a float32 engine of a bfloat16 model's config holds the same
    weights: the reference the prefill suite measures errors against. Returns
    the count.

    ``residual_scale`` < 1 scales the RESIDUAL_WRITERS' matrices, so that in a
    model with tied embeddings the input token's own embedding weighs more in
    the last hidden state and the greedy output often repeats its last token:
    a model whose n-gram drafts are accepted part of the time, while the
    layers (and so the recurrent states) still decide where a run of repeats
    ends. 1: every matrix as above.
    """
    import torch

    gen = None
    count = 0
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if gen is None:
            gen = torch.Generator(device=p.device).manual_seed(seed)
        leaf = name.rsplit(".", 1)[-1]
        data = p.data
        rand = torch.rand(data.shape, generator=gen, device=data.device, dtype=torch.float32)
        if leaf == "A_log":
            new = torch.log(1.0 + 15.0 * rand)
        elif leaf == "A":  # Mamba2 keeps A = -exp(A_log) itself
            new = -(1.0 + 15.0 * rand)
        elif leaf == "dt_bias":
            dt = torch.exp(math.log(1e-3) + (math.log(1e-1) - math.log(1e-3)) * rand)
            new = dt + torch.log(-torch.expm1(-dt))  # softplus^-1(dt)
        elif leaf == "D":
            new = torch.ones_like(rand)
        elif data.dim() == 1:
            scale = leaf == "weight" and "norm" in name
            new = torch.ones_like(rand) if scale else torch.zeros_like(rand)
        else:
            normal = torch.randn(data.shape, generator=gen, device=data.device)
            fan_in = data.shape[-1] if data.dim() == 2 else math.prod(data.shape[1:])
            scale = 4.0 if ("embed" in name or "lm_head" in name) else 1.0
            if name.rsplit(".", 2)[-2] in RESIDUAL_WRITERS:
                scale *= residual_scale
            new = normal * (scale / math.sqrt(fan_in))
        if leaf not in FLOAT32_LEAVES:
            new = new.to(torch.bfloat16)
        data.copy_(new.to(data.dtype))
        count += 1
    return count


def prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(16, vocab - 16) for _ in range(n)]


@dataclass
class Served:
    tokens: list[int]
    cached: int
    ms: float
    logprobs: list[float] = field(default_factory=list)
    # the logprob of each generated token (Runner.serve's output_logprobs)
    output_logprobs: list[float] = field(default_factory=list)


@contextmanager
def gpu_lock(path: Path | None) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (when given) around a timed section,
    so harness processes sharing one GPU never time their requests at once."""
    if path is None:
        yield
        return
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class Runner:
    """An engine of one configuration, with its weights redrawn."""

    def __init__(self, spec: Engine) -> None:
        from vllm import LLM

        self.spec = spec
        t0 = time.perf_counter()
        self.llm = LLM(**spec.kwargs())
        self.startup_s = time.perf_counter() - t0
        self.llm.apply_model(partial(redraw_weights, residual_scale=spec.residual_scale))
        for ran in self.llm.apply_model(gdn_backends):
            GDN_RAN.update(ran)
        cfg = self.llm.llm_engine.vllm_config
        self.block_size = cfg.cache_config.block_size
        self.vocab = cfg.model_config.get_vocab_size()
        print(
            f"[e2e] engine {spec.label()}: up in {self.startup_s:.0f} s, block size "
            f"{self.block_size}",
            flush=True,
        )

    @staticmethod
    def _params(
        max_tokens: int, prompt_logprobs: bool = False, output_logprobs: bool = False
    ) -> Any:
        from vllm import SamplingParams

        return SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=True,
            detokenize=False,
            prompt_logprobs=0 if prompt_logprobs else None,
            logprobs=0 if output_logprobs else None,
        )

    def serve(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        prompt_logprobs: bool = False,
        output_logprobs: bool = False,
    ) -> list[Served]:
        from vllm.inputs import TokensPrompt

        params = self._params(max_tokens, prompt_logprobs, output_logprobs)
        with gpu_lock(self.spec.lock):
            t0 = time.perf_counter()
            outs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
            )
            ms = (time.perf_counter() - t0) * 1e3
        served = []
        for p, o in zip(prompts, outs):
            lps = []
            if prompt_logprobs:
                for tok, pos in zip(p[1:], o.prompt_logprobs[1:]):
                    lps.append(pos[tok].logprob)
            toks = list(o.outputs[0].token_ids)
            out_lps = []
            if output_logprobs:
                out_lps = [pos[t].logprob for t, pos in zip(toks, o.outputs[0].logprobs)]
            served.append(Served(toks, o.num_cached_tokens or 0, ms, lps, out_lps))
        return served

    def gpu_ms(self, prompts: list[list[int]], max_tokens: int) -> float:
        """GPU time of serving ``prompts``: the summed duration of every kernel
        and copy on the device (CUDA-graph replays included), from a profiled
        repeat that is not itself timed. Beside a wall time it tells host
        overhead (launches, Python) from device work."""
        import torch
        from torch.profiler import ProfilerActivity, profile
        from vllm.inputs import TokensPrompt

        with gpu_lock(self.spec.lock), profile(activities=[ProfilerActivity.CUDA]) as prof:
            self.llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in prompts],
                self._params(max_tokens),
                use_tqdm=False,
            )
        return (
            sum(
                e.time_range.elapsed_us()
                for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA
            )
            / 1e3
        )

    def reset_cache(self) -> None:
        """Drop every cached prefix (the engine must be idle)."""
        if not self.llm.reset_prefix_cache():
            raise RuntimeError(f"{self.spec.label()}: the prefix cache could not be reset")

    def counters(self) -> dict[str, float]:
        """Prometheus counters of interest (spec decode, prefix cache)."""
        want = (
            "vllm:spec_decode_num_accepted_tokens",
            "vllm:spec_decode_num_draft_tokens",
            "vllm:prefix_cache_hits",
            "vllm:prefix_cache_queries",
        )
        out: dict[str, float] = {}
        for m in self.llm.get_metrics():
            if m.name in want and hasattr(m, "value"):
                key = m.name.split(":", 1)[1]
                out[key] = out.get(key, 0.0) + float(m.value)
        return out

    def close(self) -> None:
        import torch
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        core = getattr(self.llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        del self.llm
        gc.collect()
        cleanup_dist_env_and_memory()
        torch.cuda.empty_cache()


@contextmanager
def engine(spec: Engine, failures: list[dict[str, Any]]) -> Iterator[Runner | None]:
    """A Runner, or None (with the error recorded) when the engine fails."""
    try:
        runner = Runner(spec)
    except Exception as e:  # an engine that cannot start is a result
        traceback.print_exc()
        failures.append({"engine": spec.label(), "error": f"{type(e).__name__}: {e}"[:500]})
        yield None
        return
    try:
        yield runner
    finally:
        runner.close()


def first_divergence(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))


def engine_case(spec: Engine, **more: Any) -> dict[str, Any]:
    """A row's case: model, mode, draft tokens a step and, when they come from
    another drafter than MTP, which."""
    case: dict[str, Any] = {"model": spec.model, "mode": spec.mode, "mtp_k": spec.mtp_k}
    if spec.drafter != "mtp":
        case["drafter"] = spec.drafter
    if spec.residual_scale != 1.0:
        case["residual_scale"] = spec.residual_scale
    return {**case, **more}


def identity_row(
    spec: Engine, scenario: str, got: Served, ref: Served, ideal: int, block: int
) -> dict[str, Any]:
    same = got.tokens == ref.tokens
    return common.make_row(
        engine_case(spec, scenario=scenario),
        "identical",
        1.0,
        1.0 if same else 0.0,
        ref.ms,
        got.ms,
        cached_tokens=got.cached,
        ideal_cached_tokens=ideal,
        block_size=block,
        first_divergence=first_divergence(got.tokens, ref.tokens),
    )


# Scenarios against the reference engine (prefix caching off), then against
# the same engine's own cold run of the prompt (its prefix cache reset before
# it). A mode that splits prefills where caching off does not (align: at block
# boundaries, which need not lie on the GDN kernel's 64-token chunk grid)
# computes even a cold prompt in other arithmetic than the reference, so a
# bfloat16 model with random weights may leave the reference's greedy tokens
# without any cache hit; the "-vs-cold" rows compare a cache hit with the
# computation it replaces. "repeat-vs-cold" is their control: the cold prompt
# once more after another reset, which only an engine whose results depend on
# what it served before can fail. (Align also cuts the shared-prefix prompt's
# prefill at the block boundary below the prefix it shares with a cached
# prompt, to keep a state there; its cold run has no such cut, so for align
# shared-prefix-vs-cold compares different arithmetic too.)
VS_COLD = ("same-twice-vs-cold", "shared-prefix-vs-cold", "repeat-vs-cold")
# continuation_row: a next turn against the request it continues
CONTINUE = "continue-vs-cold"


def cache_rows(
    run: Runner,
    spec: Engine,
    a: list[int],
    b: list[int],
    refs: tuple[Served, Served],
    shared: int,
    prompt_logprobs: bool = False,
    output_tokens: int = OUTPUT_TOKENS,
    continuation: bool = False,
) -> list[dict[str, Any]]:
    """Serve ``a`` cold, ``a`` again and ``b`` (sharing a prefix of ``a``) on an
    engine whose cache holds nothing of them, then ``b`` cold (cache reset),
    twice: the rows of `identity_row` for the scenarios against the
    reference's ``refs`` = (a, b) and of ``VS_COLD``; ``b`` shares the first
    ``shared`` tokens of ``a``. With ``prompt_logprobs`` the cold ``a`` also
    returns its prompt logprobs, compared with the reference's (`logprob_diff`).
    Each request generates ``output_tokens`` greedy tokens. With
    ``continuation``, also `continuation_row` (before the cache resets), when
    the cold ``a``'s tokens cross a block boundary."""
    bs = run.block_size
    # cached tokens were every block kept (a request's last token is computed)
    ideal = ((len(a) - 1) // bs * bs, shared // bs * bs)
    cold = run.serve(
        [a], output_tokens, prompt_logprobs=prompt_logprobs, output_logprobs=continuation
    )[0]
    warm, part = (run.serve([p], output_tokens)[0] for p in (a, b))
    more = continuation_row(run, spec, a, cold) if continuation else []
    cold_b = []
    for _ in range(2):
        run.reset_cache()
        cold_b.append(run.serve([b], output_tokens)[0])
    ref_a, ref_b = refs
    rows = [
        identity_row(spec, "cold", cold, ref_a, 0, bs),
        identity_row(spec, "same-twice", warm, ref_a, ideal[0], bs),
        identity_row(spec, "shared-prefix", part, ref_b, ideal[1], bs),
        identity_row(spec, VS_COLD[0], warm, cold, ideal[0], bs),
        identity_row(spec, VS_COLD[1], part, cold_b[0], ideal[1], bs),
        identity_row(spec, VS_COLD[2], cold_b[1], cold_b[0], 0, bs),
        *more,
    ]
    if cold.logprobs and ref_a.logprobs:
        rows[0].update(logprob_diff(cold.logprobs, ref_a.logprobs))
    return rows


def continuation_row(run: Runner, spec: Engine, a: list[int], cold: Served) -> list[dict[str, Any]]:
    """A prompt that continues ``a`` with its own greedy tokens (``cold``, served
    with output logprobs) one token past the first block boundary the decode
    crossed, as a chat's next turn does: it hits the state the decode left at
    that boundary and computes one token. On Model Runner V2 that token runs
    as a decode step of the generating step's shape, so its greedy token and
    that token's logprob must equal the generating request's bit for bit; a
    block cached with the state of other tokens changes them. No row when the
    tokens cross no boundary."""
    bs = run.block_size
    boundary = (len(a) // bs + 1) * bs
    m = boundary - len(a) + 1
    if m >= len(cold.tokens):
        return []
    got = run.serve([a + cold.tokens[:m]], 1, output_logprobs=True)[0]
    want = Served(cold.tokens[m : m + 1], 0, cold.ms, [], cold.output_logprobs[m : m + 1])
    row = identity_row(spec, CONTINUE, got, want, boundary, bs)
    diff = abs(got.output_logprobs[0] - want.output_logprobs[0])
    if diff:
        row["value"] = row["ratio"] = 0.0
    row["output_logprob_diff"] = diff
    row["continued_tokens"] = m
    return [row]


def logprob_diff(got: list[float], ref: list[float]) -> dict[str, Any]:
    """Prompt logprobs (of prompt positions 1, 2, ...) against the reference's:
    max / mean absolute difference, and the first position whose logprob is
    not bit-identical (-1: none), which tells where two engines' prefills
    start to compute differently (a step boundary, a block boundary, the
    first token). NaN differences where either side has none."""
    diffs = [abs(x - y) for x, y in zip(got, ref)]
    first = next((i + 1 for i, (x, y) in enumerate(zip(got, ref)) if x != y), -1)
    return dict(
        max_abs_logprob_diff=max(diffs) if diffs else math.nan,
        mean_abs_logprob_diff=statistics.fmean(diffs) if diffs else math.nan,
        first_logprob_diff_position=first,
    )


def suite_identity(
    base: Engine, modes: list[str], ks: list[int], length: int, shared: int, failures: list
) -> list[dict[str, Any]]:
    """Same prompt twice, then a prompt sharing only ``shared`` tokens with it."""
    rows = []
    for k in ks:
        ref_spec = replace(base, mode="none", mtp_k=k)
        with engine(ref_spec, failures) as ref:
            if ref is None:
                continue
            rng = random.Random(1000 + length)
            a = prompt(rng, length, ref.vocab)
            b = a[:shared] + prompt(rng, length - shared, ref.vocab)
            ref_a, ref_b = (ref.serve([p], OUTPUT_TOKENS)[0] for p in (a, b))
        for mode in modes:
            spec = replace(base, mode=mode, mtp_k=k)
            with engine(spec, failures) as run:
                if run is None:
                    continue
                got = cache_rows(run, spec, a, b, (ref_a, ref_b), shared)
                acc = run.counters()
                for r in got:
                    r["prompt_tokens"] = length
                    r.update({f"engine_{n}": v for n, v in acc.items()})
                rows += got
    return rows


def ttft_row(
    run: Runner, spec: Engine, rng: random.Random, n: int, question: int
) -> dict[str, Any]:
    """Time to first token of a fresh ``n``-token prefix + question, cold, then
    warm (the same prefix, another question)."""
    shared = prompt(rng, n, run.vocab)
    cold = run.serve([shared + prompt(rng, question, run.vocab)], 1)[0]
    warm = run.serve([shared + prompt(rng, question, run.vocab)], 1)[0]
    return common.make_row(
        engine_case(spec, prefix_tokens=n),
        "ttft_ms",
        cold.ms,
        warm.ms,
        cold.ms,
        warm.ms,
        question_tokens=question,
        cached_tokens=warm.cached,
        ideal_cached_tokens=n // run.block_size * run.block_size,
        block_size=run.block_size,
    )


def suite_ttft(
    base: Engine, mode: str, ks: list[int], prefixes: list[int], question: int, failures: list
) -> list[dict[str, Any]]:
    rows = []
    for k in ks:
        spec = replace(base, mode=mode, mtp_k=k, max_model_len=max(prefixes) + 2 * question + 64)
        with engine(spec, failures) as run:
            if run is None:
                continue
            rng = random.Random(2000 + k)
            run.serve([prompt(rng, 512, run.vocab)], 4)  # first-request costs
            for n in prefixes:
                rows.append(ttft_row(run, spec, rng, n, question))
    return rows


def suite_allmode(
    base: Engine,
    modes: list[str],
    ks: list[int],
    prefixes: list[int],
    question: int,
    chunk: int | None,
    failures: list,
    ref_block_size: int | None = None,
    prompt_logprobs: bool = False,
    drafter: str = "mtp",
    output_tokens: int = OUTPUT_TOKENS,
    residual_scale: float = 1.0,
    continuation: bool = False,
) -> list[dict[str, Any]]:
    """The all-mode identity matrix: per MTP k, one engine per mode (``none``,
    prefix caching off, first: the reference). For each prefix length, a
    prompt of prefix + question served cold, the same prompt again and a
    prompt sharing only the prefix (`cache_rows`), with the cached tokens the
    engine reports.

    ``chunk``: the token budget per step of the ``none`` and ``all`` engines
    (a multiple of the GDN kernel chunk). Matrix multiplications round each
    row differently for different numbers of rows, so a cache hit, which
    computes fewer tokens in its step than the cold prompt did, could not be
    compared with the cold computation bit for bit; with every prefill cut
    into ``chunk``-token steps from position 0, and all mode's hits on block
    boundaries (multiples of ``chunk``), a hit's remaining tokens run in the
    same steps as they do cold and with caching off, so only the cached state
    can make them differ. ``align`` keeps its own splits (it cannot cut a
    prefill finer than its block); its same-twice-vs-cold row is the one that
    judges it (see VS_COLD). None: vLLM's default budget for every engine.

    ``ref_block_size``: the reference's KV cache block size (None: vLLM's
    own, which for a hybrid model depends on the mode: all mode aligns its
    blocks to the GDN chunk, so the two engines can differ); set it to all
    mode's block size to compare a cold all-mode request with a reference
    that differs from it in nothing but the cache.

    ``prompt_logprobs``: the cold request of each prefix (reference and
    modes) also returns its prompt logprobs; the cold row then says from which
    prompt position the mode's prefill computes other bits than the
    reference's (`logprob_diff`).

    A second ``none`` in ``modes`` is judged like the other modes: two engines
    of one configuration, which says what the reference itself reproduces
    across engines.

    ``drafter``: where the k > 0 engines' drafts come from (DRAFTERS); with
    "ngram" drafts are accepted, so a step can end anywhere in its k + 1
    tokens and cross a block boundary after accepted drafts. Every request
    generates ``output_tokens`` tokens: more than a prompt's distance to its
    next block boundary makes its decode cross one. ``residual_scale``: every
    engine's weights (redraw_weights); below 1 the random model repeats
    tokens often enough for n-gram drafts to be accepted. ``continuation``:
    each mode's `continuation_row` too (the state a decode leaves at a block
    boundary, read as a next turn reads it)."""
    assert modes[0] == "none", "the reference engine comes first"
    rows: list[dict[str, Any]] = []
    longest = max(prefixes) + question + output_tokens + 64
    base = replace(base, max_model_len=max(base.max_model_len, longest))
    for k in ks:
        refs: dict[int, tuple[Served, Served]] = {}
        ref_block: int | None = None
        for i, mode in enumerate(modes):
            spec = replace(base, mode=mode, mtp_k=k, drafter=drafter, residual_scale=residual_scale)
            if chunk and mode != "align":
                spec = replace(spec, max_num_batched_tokens=chunk)
            if mode == "none" and ref_block_size:
                spec = replace(spec, block_size=ref_block_size)
            with engine(spec, failures) as run:
                if run is None:
                    continue
                run.serve([prompt(random.Random(7), 256, run.vocab)], 4)  # first-request costs
                if i == 0:
                    ref_block = run.block_size
                for n in prefixes:
                    rng = random.Random(3000 + n)
                    a = prompt(rng, n + question, run.vocab)
                    b = a[:n] + prompt(rng, question, run.vocab)
                    if i == 0:
                        refs[n] = (
                            run.serve([a], output_tokens, prompt_logprobs=prompt_logprobs)[0],
                            run.serve([b], output_tokens)[0],
                        )
                        continue
                    if n not in refs:
                        continue  # the reference engine failed
                    got = cache_rows(
                        run, spec, a, b, refs[n], n, prompt_logprobs, output_tokens, continuation
                    )
                    acc = run.counters()
                    for r in got:
                        r["prompt_tokens"] = n + question
                        r["prefix_tokens"] = n
                        r["output_tokens"] = output_tokens
                        r["max_num_batched_tokens"] = spec.max_num_batched_tokens
                        r["reference_block_size"] = ref_block
                        r.update({f"engine_{c}": v for c, v in acc.items()})
                    rows += got
    return rows


def gpu_fields(baseline_gpu_ms: float, value_gpu_ms: float) -> dict[str, float]:
    """A timed row's GPU time beside its wall time (`Runner.gpu_ms`), and their
    ratio oriented like a throughput ratio: baseline over value, higher is
    better. A wall ratio far below the GPU ratio is host overhead."""
    return dict(
        baseline_gpu_ms=baseline_gpu_ms,
        value_gpu_ms=value_gpu_ms,
        gpu_ratio=baseline_gpu_ms / value_gpu_ms if value_gpu_ms else math.nan,
    )


def suite_allmode_timed(
    base: Engine,
    ks: list[int],
    prefixes: list[int],
    question: int,
    decode_tokens: int,
    prefill_tokens: int,
    failures: list,
    prefill_reps: int = 3,
) -> list[dict[str, Any]]:
    """All mode against align, timed, at vLLM's default token budget: per MTP
    k, cold against warm time to first token of each prefix + question
    (``ttft_ms``), decode throughput of one request (``decode_tok_per_s``)
    and the prefill of fresh prompts of ``prefill_tokens``, nothing cached
    (``cold_prefill_tok_per_s``: what all mode's block checkpoints cost inside
    the engine); the last two with baseline = align, value = all, and the GPU
    time of a profiled repeat of the same request beside the wall time
    (`gpu_fields`)."""
    rows: list[dict[str, Any]] = []
    longest = max(max(prefixes) + question, prefill_tokens) + OUTPUT_TOKENS + 64
    base = replace(base, max_model_len=max(base.max_model_len, longest))
    for k in ks:
        decode: dict[str, tuple[float, float]] = {}
        prefill: dict[str, float] = {}
        for mode in ("align", "all"):
            spec = replace(base, mode=mode, mtp_k=k)
            with engine(spec, failures) as run:
                if run is None:
                    continue
                run.serve([prompt(random.Random(7), 256, run.vocab)], 4)  # first-request costs
                for n in prefixes:
                    rows.append(ttft_row(run, spec, random.Random(3000 + n), n, question))
                p = prompt(random.Random(4000 + k), 64, run.vocab)
                out = run.serve([p], decode_tokens)
                decode[mode] = (
                    len(out[0].tokens) / (out[0].ms / 1e3),
                    out[0].ms,
                    run.gpu_ms([p], decode_tokens),
                )
                rng = random.Random(5000 + k)
                fresh = [prompt(rng, prefill_tokens, run.vocab) for _ in range(prefill_reps + 2)]
                ms = [run.serve([f], 1)[0].ms for f in fresh[:-1]]  # the first is a warm-up
                prefill[mode] = (statistics.median(ms[1:]), run.gpu_ms([fresh[-1]], 1))
        case = {"model": base.model, "mtp_k": k}
        if len(decode) == 2:
            (align_tps, align_ms, align_gpu), (all_tps, all_ms, all_gpu) = (
                decode["align"],
                decode["all"],
            )
            rows.append(
                common.make_row(
                    {**case, "decode_tokens": decode_tokens},
                    "decode_tok_per_s",
                    align_tps,
                    all_tps,
                    align_ms,
                    all_ms,
                    **gpu_fields(align_gpu, all_gpu),
                )
            )
        if len(prefill) == 2:
            (align_ms, align_gpu), (all_ms, all_gpu) = prefill["align"], prefill["all"]
            rows.append(
                common.make_row(
                    {**case, "tokens": prefill_tokens},
                    "cold_prefill_tok_per_s",
                    prefill_tokens / align_ms * 1e3,
                    prefill_tokens / all_ms * 1e3,
                    align_ms,
                    all_ms,
                    reps=prefill_reps,
                    **gpu_fields(align_gpu, all_gpu),
                )
            )
    return rows


CHECK_TOKENS = 2100
# GPU share of the prefill suite's float32 reference engine (see suite_prefill)
REFERENCE_GPU_SHARE = 0.6


def suite_prefill(
    base: Engine,
    tokens: list[int],
    seqs: list[int],
    reps: int,
    failures: list,
    reference: bool = True,
) -> list[dict[str, Any]]:
    """chain vs fused SSD prefill: throughput, prompt logprobs, continuation.

    With ``reference``, a float32 engine of the same weights (the chain) serves
    the check prompt too, and each bfloat16 form's prompt logprobs and greedy
    tokens are compared with it: the chain's own error is the yardstick for
    the fused kernel's."""
    times: dict[str, dict[tuple[int, int], list[float]]] = {}
    checks: dict[str, Served] = {}
    forms = [("chain", None), ("fused", None)] + ([("chain", "float32")] if reference else [])
    for impl, dtype in forms:
        spec = replace(base, ssd_prefill=impl, dtype=dtype, max_model_len=max(tokens) + 64)
        if dtype:
            # the engines before it in this process leave memory held (CUDA graph
            # pools, compile caches): a fixed share it can still get
            util = min(base.gpu_memory_utilization, REFERENCE_GPU_SHARE)
            spec = replace(spec, gpu_memory_utilization=util)
        with engine(spec, failures) as run:
            if run is None:
                continue
            key = f"{impl}-{dtype}" if dtype else impl
            rng = random.Random(3000)
            checks[key] = run.serve([prompt(rng, CHECK_TOKENS, run.vocab)], 32, True)[0]
            if dtype:
                continue  # the reference is not timed
            run.serve([prompt(rng, 1024, run.vocab)], 1)
            times[impl] = {}
            for n in tokens:
                for s in seqs:
                    rng = random.Random(4000 + n + s)
                    ms = []
                    for _ in range(reps + 1):  # the first is a warm-up
                        batch = [prompt(rng, n, run.vocab) for _ in range(s)]
                        ms.append(run.serve(batch, 1)[0].ms)
                    times[impl][(n, s)] = ms[1:]
                    print(f"[e2e] prefill {impl} {n} x {s}: {ms[1:]} ms", flush=True)
    rows = []
    if len(times) == 2:
        for (n, s), chain_ms in times["chain"].items():
            b_ms, v_ms = statistics.median(chain_ms), statistics.median(times["fused"][(n, s)])
            rows.append(
                common.make_row(
                    {"model": base.model, "tokens": n, "seqs": s},
                    "prefill_tok_per_s",
                    n * s / b_ms * 1e3,
                    n * s / v_ms * 1e3,
                    b_ms,
                    v_ms,
                    reps=reps,
                )
            )
    pairs = [("fused", "chain"), ("chain", "chain-float32"), ("fused", "chain-float32")]
    for got, ref in pairs:
        if got in checks and ref in checks:
            rows.append(logprob_row(base.model, f"{got}-vs-{ref}", checks[got], checks[ref]))
    return rows


def logprob_row(model: str, scenario: str, got: Served, ref: Served) -> dict[str, Any]:
    """Greedy tokens and prompt logprobs of ``got`` against ``ref``."""
    diff = logprob_diff(got.logprobs, ref.logprobs)
    return common.make_row(
        {"model": model, "mode": "none", "mtp_k": 0, "scenario": scenario},
        "identical",
        1.0,
        1.0 if got.tokens == ref.tokens else 0.0,
        ref.ms,
        got.ms,
        first_divergence=first_divergence(got.tokens, ref.tokens),
        prompt_tokens=CHECK_TOKENS,
        max_abs_logprob_diff=diff["max_abs_logprob_diff"],
        mean_abs_logprob_diff=diff["mean_abs_logprob_diff"],
    )


# The default plan of each model: suite -> arguments.
PLANS: dict[str, dict[str, dict[str, Any]]] = {
    "tiny-qwen3.5": {
        "identity": {"modes": ["align"], "ks": [0, 1, 2, 3], "length": 2000, "shared": 1500},
    },
    "qwen3.5-9b-like": {
        "identity": {"modes": ["align"], "ks": [0, 3], "length": 2144, "shared": 1072},
        "ttft": {"mode": "align", "ks": [0, 3], "prefixes": [8192, 32768, 100000], "question": 200},
    },
    "mamba2-2.7b-like": {
        "prefill": {"tokens": [1024, 16384, 65536], "seqs": [1, 8], "reps": 3},
    },
    "nemotron-h-8b-like": {
        "prefill": {"tokens": [16384], "seqs": [1], "reps": 3},
    },
}
SUITES = {
    "identity": suite_identity,
    "ttft": suite_ttft,
    "prefill": suite_prefill,
    "allmode": suite_allmode,
    "allmode-timed": suite_allmode_timed,
}
# Named plans beside each model's default one (``--plan NAME``), each written
# to ``<out>/<bench>-<gpu>.json``. "allmode": the identity matrix of
# mamba_cache_mode none / align / all, MTP off and k = 1..3, prefixes that are
# not multiples of the engines' block sizes (prefills cut into 64-token steps,
# see suite_allmode); then, for the 9B-like model, all mode against align at
# vLLM's default settings: time to first token after a 32k prefix, decode,
# prefill.
ALLMODE_MATRIX = {
    "modes": ["none", "align", "all"],
    "ks": [0, 1, 2, 3],
    "prefixes": [1072, 2000, 2144],
    "question": 200,
    "chunk": 64,
    "ref_block_size": None,
    "prompt_logprobs": False,
    "drafter": "mtp",
    "output_tokens": OUTPUT_TOKENS,
    "residual_scale": 1.0,
    "continuation": False,
}
ALLMODE_TIMED = {
    "ks": [0, 3],
    "prefixes": [32768],
    "question": 200,
    "decode_tokens": 256,
    "prefill_tokens": 16384,
}
NAMED_PLANS: dict[str, dict[str, dict[str, dict[str, Any]]]] = {
    "allmode": {
        "tiny-qwen3.5": {"allmode": ALLMODE_MATRIX},
        "qwen3.5-9b-like": {"allmode": ALLMODE_MATRIX, "allmode-timed": ALLMODE_TIMED},
    },
    # vLLM's default path on Hopper: the GDN models' own plans with FlashInfer's
    # GDN prefill and sampler (DEFAULT_PATH_PLANS says which arguments)
    "flashinfer": {m: PLANS[m] for m in ("tiny-qwen3.5", "qwen3.5-9b-like")},
}
# Named plans that measure a path, not only a matrix: the harness refuses
# them without these arguments (option -> value), so that their result cannot
# silently hold another path's rows.
DEFAULT_PATH_PLANS = {
    "flashinfer": {"--gdn-prefill-backend": "auto", "--flashinfer-sampler": True},
}


def run_model(base: Engine, plan: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Run ``plan``'s suites on engines made from ``base`` (model, eager, memory)."""
    from compiled_ops import COUNTS

    failures: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    for suite, kwargs in plan.items():
        t0 = time.perf_counter()
        print(f"[e2e] {base.model}: {suite} {kwargs}", flush=True)
        got = SUITES[suite](base, **kwargs, failures=failures)
        for r in got:
            r["suite"] = suite
            r["eager"] = base.eager
        rows += got
        print(f"[e2e] {base.model}: {suite} done in {time.perf_counter() - t0:.0f} s", flush=True)
    return {"model": base.model, "rows": rows, "failures": failures, "compiled_ops": dict(COUNTS)}


def bench_name(plan_name: str | None) -> str:
    """The result's name: ``e2e``, or ``e2e-<plan>`` for a named plan."""
    return BENCH if plan_name is None else f"{BENCH}-{plan_name}"


def _label_value(v: Any) -> str:
    items = v if isinstance(v, list) else [v]
    return "_".join(str(x) for x in items)


def select_plan(
    model: str, plan_arg: str | None, suites: list[str], sets: list[str]
) -> tuple[str, dict[str, dict[str, Any]], str]:
    """The bench name, the plan a process runs and its part's label.

    ``plan_arg``: a named plan, a JSON plan, or None (the model's own).
    ``suites`` keeps only those suites; each of ``sets`` (``KEY=JSON`` or
    ``SUITE.KEY=JSON``) replaces that argument in every kept suite that has it
    (or in SUITE only), so that one named plan runs over several processes
    (device calls), e.g. ``--plan allmode --set ks=[1]``. The label (empty
    for the whole plan) names the part, so the parts of one model sit side by
    side and ``--merge`` joins them into the named plan's one result."""
    plan_name = plan_arg if plan_arg in NAMED_PLANS else None
    if plan_name is not None:
        if model not in NAMED_PLANS[plan_name]:
            raise ValueError(
                f"plan {plan_name} covers {', '.join(NAMED_PLANS[plan_name])}, not {model}"
            )
        plan = NAMED_PLANS[plan_name][model]
    else:
        plan = json.loads(plan_arg) if plan_arg else PLANS[model]
    label: list[str] = []
    if suites:
        missing = [x for x in suites if x not in plan]
        if missing:
            raise ValueError(f"{model}'s plan has no suite {', '.join(missing)}: {sorted(plan)}")
        plan = {x: plan[x] for x in suites}
        label.append("+".join(suites))
    plan = {x: dict(kw) for x, kw in plan.items()}
    for item in sets:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item}: expected KEY=JSON or SUITE.KEY=JSON")
        suite, _, key = key.rpartition(".")
        value = json.loads(raw)
        hit = [x for x, kw in plan.items() if (not suite or x == suite) and key in kw]
        if not hit:
            raise ValueError(f"--set {item}: no suite of the plan takes {key}")
        for x in hit:
            plan[x][key] = value
        label.append(f"{suite + '.' if suite else ''}{key}-{_label_value(value)}")
    text = "-".join(label)
    text = "".join(c if c.isalnum() or c in "._+-" else "_" for c in text)
    return bench_name(plan_name), plan, text


def part_path(out: Path, bench: str, model: str, label: str = "") -> Path:
    """``<out>/<bench>-part-<model>[--<label>].json``."""
    return out / f"{bench}-part-{model}{'--' + label if label else ''}.json"


def merge(out: Path, bench: str = BENCH) -> dict[str, Any]:
    """One result (the common schema) from the parts in ``out``. The parts carry
    the facts of the machine they ran on (so this needs no GPU); parts of
    different machines or software are not merged."""
    parts = [json.loads(p.read_text()) for p in sorted(out.glob(f"{bench}-part-*.json"))]
    if not parts:
        raise SystemExit(f"e2e: no {bench}-part-*.json in {out}: run a model first")
    env = parts[0]["env"]
    for p in parts[1:]:
        differ = [k for k in ENV_KEYS if p["env"].get(k) != env.get(k)]
        if differ:
            raise SystemExit(
                f"e2e: part {p['model']} ran with other {', '.join(differ)} than part "
                f"{parts[0]['model']}: merge parts of one machine and software only"
            )
    settings = merged_settings(parts)
    rows = [r for p in parts for r in p["rows"]]
    result: dict[str, Any] = {
        "bench": bench,
        **{k: env[k] for k in ("gpu", "torch", "triton", "vllm_base")},
        "command": " && ".join(p["command"] for p in parts),
        "rows": rows,
        "entries": sorted({e for r in rows for e in SUITE_ENTRIES[r["suite"]]}),
        "gpu_name": env["gpu_name"],
        "cuda": env["cuda"],
        "created": max(p["created"] for p in parts),
        "settings": {
            "engine": "V1 engine core in-process, Model Runner V2",
            "attention": "TRITON_ATTN",
            **settings,
            "weights": f"dummy, redrawn from seed {WEIGHT_SEED} (harness.redraw_weights)",
        },
        "failures": [f for p in parts for f in p["failures"]],
        "compiled_ops_called": _compiled_ops_per_model(parts),
        # models whose engines ran beside other harness processes on the GPU
        # (their timed requests serialized by --gpu-lock, their start-ups not)
        "shared_gpu": sorted(p["model"] for p in parts if p.get("shared_gpu")),
        "legend": (
            "`prefill_tok_per_s`: baseline = chain (upstream SSD kernels), value = "
            "fused; higher is better. `identical`: value 1 when the greedy tokens "
            "equal the reference's (prefix caching off; for X-vs-Y, Y: the chain, or "
            "the chain in a float32 engine of the same weights), baseline 1. "
            "`ttft_ms`: baseline = cold, value = warm, lower is better. "
            "`decode_tok_per_s`: one request's output tokens per second, baseline = "
            "align, value = all; higher is better. `cold_prefill_tok_per_s`: a fresh "
            "prompt's prefill, nothing cached (median of reps), baseline = align, "
            "value = all; higher is better. Times are "
            "wall-clock per generate() call (medians where reps > 1)."
        ),
    }
    return result


def merged_settings(parts: list[dict[str, Any]]) -> dict[str, str]:
    """The parts' settings (LEGACY_SETTINGS for parts without them) as one:
    a value all parts share, or, where they differ, "per row" when every row
    of those parts carries it (the tables then get a column), else refused."""
    out: dict[str, str] = {}
    for key in LEGACY_SETTINGS:
        values = {part_setting(p, key) for p in parts} - {None}
        if len(values) <= 1:
            out[key] = values.pop() if values else f"none ran (no model with {key})"
            continue
        ran = [p for p in parts if part_setting(p, key) is not None]
        if not all(key in r for p in ran for r in p["rows"]):
            raise SystemExit(
                f"e2e: parts ran different {key} ({'; '.join(sorted(values))}) and their "
                "rows do not say which: merge the parts of one setting only"
            )
        out[key] = "per row: " + "; ".join(sorted(values))
    return out


def _compiled_ops_per_model(parts: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Each model's compiled-op calls, summed over its parts."""
    got: dict[str, dict[str, int]] = {}
    for p in parts:
        mine = got.setdefault(p["model"], {})
        for op, n in p["compiled_ops"].items():
            mine[op] = mine.get(op, 0) + n
    return got


def _cell(x: Any) -> str:
    if isinstance(x, float):
        return "nan" if math.isnan(x) else f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"
    return "" if x is None else str(x)


# GPU time beside the wall time of a timed row (gpu_fields); empty cells for
# rows measured before it was recorded
_GPU_COLUMNS = (
    ("align GPU ms", lambda r: r.get("baseline_gpu_ms")),
    ("all GPU ms", lambda r: r.get("value_gpu_ms")),
    (
        "GPU time align / all",
        lambda r: f"{r['gpu_ratio']:.3f}" if "gpu_ratio" in r else None,
    ),
)
# metric -> (title, [(column, row -> value)])
TABLES: dict[str, tuple[str, list[tuple[str, Any]]]] = {
    "prefill_tok_per_s": (
        "Whole-model prefill, --mamba-ssd-prefill chain vs fused (higher is better)",
        [
            ("model", lambda r: r["case"]["model"]),
            ("tokens", lambda r: r["case"]["tokens"]),
            ("seqs", lambda r: r["case"]["seqs"]),
            ("chain tok/s", lambda r: r["baseline"]),
            ("fused tok/s", lambda r: r["value"]),
            ("fused / chain", lambda r: f"{r['ratio']:.3f}x"),
            ("chain ms", lambda r: r["baseline_ms"]),
            ("fused ms", lambda r: r["value_ms"]),
        ],
    ),
    "ttft_ms": (
        "Time to first token, prefix + 200-token question: cold vs warm (lower is better)",
        [
            ("model", lambda r: r["case"]["model"]),
            ("mode", lambda r: r["case"]["mode"]),
            ("MTP k", lambda r: common.draft_k(r["case"])),
            ("prefix", lambda r: r["case"]["prefix_tokens"]),
            ("cold ms", lambda r: r["baseline"]),
            ("warm ms", lambda r: r["value"]),
            ("warm / cold", lambda r: f"{r['ratio']:.3f}"),
            ("cached", lambda r: r.get("cached_tokens")),
            ("ideal", lambda r: r.get("ideal_cached_tokens")),
            ("block", lambda r: r.get("block_size")),
        ],
    ),
    "decode_tok_per_s": (
        "Decode throughput of one request, align vs all (higher is better)",
        [
            ("model", lambda r: r["case"]["model"]),
            ("MTP k", lambda r: r["case"]["mtp_k"]),
            ("tokens", lambda r: r["case"]["decode_tokens"]),
            ("align tok/s", lambda r: r["baseline"]),
            ("all tok/s", lambda r: r["value"]),
            ("all / align", lambda r: f"{r['ratio']:.3f}"),
            *_GPU_COLUMNS,
        ],
    ),
    "cold_prefill_tok_per_s": (
        "Prefill of a fresh prompt, nothing cached, align vs all: what all mode's "
        "block checkpoints cost inside the engine (higher is better)",
        [
            ("model", lambda r: r["case"]["model"]),
            ("MTP k", lambda r: r["case"]["mtp_k"]),
            ("tokens", lambda r: r["case"]["tokens"]),
            ("align tok/s", lambda r: r["baseline"]),
            ("all tok/s", lambda r: r["value"]),
            ("all / align", lambda r: f"{r['ratio']:.3f}"),
            ("align ms", lambda r: r["baseline_ms"]),
            ("all ms", lambda r: r["value_ms"]),
            *_GPU_COLUMNS,
        ],
    ),
    "identical": (
        "Greedy tokens against the reference (prefix caching off; for X-vs-Y, Y)",
        [
            ("model", lambda r: r["case"]["model"]),
            ("mode", lambda r: r["case"]["mode"]),
            ("MTP k", lambda r: common.draft_k(r["case"])),
            ("scenario", lambda r: r["case"]["scenario"]),
            ("prefix", lambda r: r.get("prefix_tokens")),
            ("identical", lambda r: "yes" if r["value"] == 1.0 else "no"),
            ("first diverging token", lambda r: r.get("first_divergence")),
            ("cached", lambda r: r.get("cached_tokens")),
            ("ideal", lambda r: r.get("ideal_cached_tokens")),
            ("block", lambda r: r.get("block_size")),
            ("step budget", lambda r: r.get("max_num_batched_tokens")),
            ("output tokens", lambda r: r.get("output_tokens")),
            (
                "accepted / drafted",
                lambda r: (
                    f"{r['engine_spec_decode_num_accepted_tokens']:.0f} / "
                    f"{r['engine_spec_decode_num_draft_tokens']:.0f}"
                    if "engine_spec_decode_num_draft_tokens" in r
                    else None
                ),
            ),
            ("max / mean abs prompt-logprob diff", lambda r: _logprob_diffs(r)),
        ],
    ),
}


def _logprob_diffs(r: dict[str, Any]) -> str | None:
    if "max_abs_logprob_diff" not in r:
        return None
    text = f"{r['max_abs_logprob_diff']:.3g} / {r['mean_abs_logprob_diff']:.3g}"
    first = r.get("first_logprob_diff_position")
    return text if first is None or first < 0 else f"{text} (from position {first})"


def markdown(result: dict[str, Any]) -> str:
    """The result as one table per metric, with its settings and provenance."""
    lines = [
        f"# End to end through the patched engine on {result['gpu_name']}",
        "",
        f"- vLLM base {result['vllm_base']} (patched, Python sources of the GPU bundle), "
        f"torch {result['torch']}, triton {result['triton']}, CUDA {result['cuda']}",
        f"- created {result['created']}; command(s): `{result['command']}`",
        *(f"- {k}: {v}" for k, v in result["settings"].items()),
        f"- compiled ops called: {json.dumps(result['compiled_ops_called'])}",
        f"- engines beside other harness processes: {', '.join(result['shared_gpu']) or 'none'}",
        *(f"- engine failed: {f['engine']}: {f['error']}" for f in result["failures"]),
        *(f"- note: {n}" for n in result.get("notes", [])),
    ]
    per_row = [k for k, v in result["settings"].items() if str(v).startswith("per row")]
    for metric, (title, cols) in TABLES.items():
        cols = [*cols, *((k, lambda r, k=k: r.get(k)) for k in per_row)]
        rows = [r for r in result["rows"] if r["metric"] == metric]
        if not rows:
            continue
        lines += ["", f"## {title}", "", "| " + " | ".join(c for c, _ in cols) + " |"]
        lines.append("|" + "---|" * len(cols))
        lines += ["| " + " | ".join(_cell(f(r)) for _, f in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(PLANS), help="run this model's plan")
    p.add_argument("--suite", action="append", default=[], help="only these suites")
    p.add_argument(
        "--plan",
        help="a named plan (" + ", ".join(NAMED_PLANS) + "; written to e2e-<name>-<gpu>.json) "
        "or a JSON object overriding the model's plan (suite -> args)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="[SUITE.]KEY=JSON",
        help="replace a suite argument of the plan (e.g. ks=[1]: one MTP k), to split a "
        "plan over several processes; the part is named after it, --merge joins them",
    )
    p.add_argument("--part", help="the part's label (default: from --suite and --set)")
    p.add_argument("--eager", action="store_true", help="enforce_eager engines (say why)")
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=Engine.gpu_memory_utilization,
        help="each engine's share of the GPU",
    )
    p.add_argument("--gpu-lock", type=Path, help="lock file shared by side-by-side harnesses")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per engine")
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        help="fixed KV cache size per engine (to run harnesses side by side)",
    )
    p.add_argument(
        "--gdn-prefill-backend",
        choices=GDN_BACKENDS,
        default=Engine.gdn_prefill,
        help="vLLM's GDN prefill backend (flashinfer or auto need FlashInfer: run.py "
        "--flashinfer; all mode always runs FLA Triton)",
    )
    p.add_argument(
        "--flashinfer-sampler",
        action="store_true",
        help="the FlashInfer sampler (VLLM_USE_FLASHINFER_SAMPLER=1; needs FlashInfer)",
    )
    p.add_argument(
        "--triton-first-config",
        action="store_true",
        help="every vLLM Triton autotuner runs its first valid config instead of timing "
        "them (VLLM_TRITON_FORCE_FIRST_CONFIG=1) and Inductor picks its kernels' configs "
        "without benchmarking (TORCHINDUCTOR_DETERMINISTIC=1 and every engine's "
        "inductor_compile_config): identity rows across engines then compare the "
        "same kernel configs",
    )
    p.add_argument("--merge", action="store_true", help="join the parts in --out")
    p.add_argument("--note", action="append", default=[], help="with --merge: a note to keep")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    plan_name = args.plan if args.plan in NAMED_PLANS else None
    bench = bench_name(plan_name)
    if args.merge:
        result = merge(args.out, bench)
        result["notes"] = args.note
        problems = common.validate(result)
        if problems:
            raise SystemExit(f"e2e: result breaks the schema: {problems}")
        stem = args.out / f"{bench}-{result['gpu']}"
        stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        text = markdown(result)
        stem.with_suffix(".md").write_text(text)
        print(text)
        return 0
    if not args.model:
        p.error("--model or --merge is required")
    try:
        bench, plan, label = select_plan(args.model, args.plan, args.suite, args.set)
    except ValueError as e:
        p.error(str(e))
    if args.part is not None:
        label = args.part
    needs = DEFAULT_PATH_PLANS.get(args.plan or "", {})
    if any(getattr(args, o[2:].replace("-", "_")) != v for o, v in needs.items()):
        wanted = (o if v is True else f"{o} {v}" for o, v in needs.items())
        p.error(f"--plan {args.plan} needs {' '.join(wanted)}")
    wants_fi = args.gdn_prefill_backend != "triton" or args.flashinfer_sampler
    if wants_fi and flashinfer_version() is None:
        p.error(
            "FlashInfer does not import here: --gdn-prefill-backend "
            f"{args.gdn_prefill_backend} / --flashinfer-sampler need run.py --flashinfer DIR"
        )
    os.environ.update(ENGINE_ENV)
    if args.flashinfer_sampler:
        os.environ["VLLM_USE_FLASHINFER_SAMPLER"] = "1"
    if args.triton_first_config:
        # read when vllm.triton_utils and torch._inductor are first imported
        os.environ["VLLM_TRITON_FORCE_FIRST_CONFIG"] = "1"
        os.environ["TORCHINDUCTOR_DETERMINISTIC"] = "1"
    # tensor-parallel workers are processes of their own: they import this
    # module (redraw_weights travels by name) and the shims
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p
    )
    import compiled_ops

    compiled_ops.plugin()  # vLLM also calls it (general plugin) in every process
    base = Engine(
        args.model,
        eager=args.eager,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_gib=args.kv_cache_gib,
        lock=args.gpu_lock,
        tensor_parallel_size=args.tensor_parallel_size,
        gdn_prefill=args.gdn_prefill_backend,
        deterministic_compile=args.triton_first_config,
    )
    part = run_model(base, plan)
    part["settings"] = part_settings(
        args.gdn_prefill_backend,
        GDN_RAN,
        SAMPLER_FLASHINFER if args.flashinfer_sampler else SAMPLER_TORCH,
        AUTOTUNE_FIRST if args.triton_first_config else AUTOTUNE_TIMED,
    )
    for r in part["rows"]:
        if part["settings"]["gdn_prefill"] is not None:
            r["gdn_prefill"] = part["settings"]["gdn_prefill"]
        r["triton_autotune"] = part["settings"]["triton_autotune"]
    part["plan"] = plan
    part["env"] = common.versions()
    part["command"] = common.command_line()
    part["created"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    part["shared_gpu"] = args.gpu_lock is not None
    part_path(args.out, bench, args.model, label).write_text(json.dumps(part, indent=1) + "\n")
    bad = [r for r in part["rows"] if r["metric"] == "identical" and r["value"] != 1.0]
    print(
        f"[e2e] {args.model}: {len(part['rows'])} rows, {len(bad)} not identical, "
        f"{len(part['failures'])} engine failures, compiled ops called "
        f"{part['compiled_ops']}",
        flush=True,
    )
    return 1 if part["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())

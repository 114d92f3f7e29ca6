# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Prefix-cache hit rate of the Mamba cache modes (none / align / all) for GDN
hybrid models, on CPU, without a model.

Drives the real vLLM `Scheduler` and KV cache manager (block pool, prefix
cache, eviction, chunked prefill split, speculative decoding bookkeeping) with
synthetic model outputs. The KV cache layout (one full-attention group and
several GDN groups sharing one block pool, Mamba pages padded to the attention
page) follows Qwen3-Next-like and Qwen3.5-9B-like layer and state sizes, and
every mode gets the same KV cache memory budget.

Per request, `cached` is the prefix-cache hit the scheduler found and `ideal`
is the longest prefix shared with any earlier request's tokens (prompt and
generated), rounded down to a block and capped at the prompt minus one token.

Example:
    python benchmarks/hybrid/bench_mamba_prefix_hitrate.py \\
        --output-json results.json --output-md results.md

"""

import argparse
import copy
import json
import math
import os
import random
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch

from vllm.config import (
    CacheConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.utils.math_utils import cdiv
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

GiB = 1 << 30
MODES = ("none", "align", "all")
MAX_MODEL_LEN = 65536


@dataclass(frozen=True)
class ModelShape:
    """Layer and recurrent-state sizes of a GDN hybrid (TP=1)."""

    name: str
    num_layers: int
    full_attention_interval: int
    num_kv_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    conv_kernel_size: int
    ssm_dtype: torch.dtype
    kv_dtype: torch.dtype = torch.bfloat16
    conv_dtype: torch.dtype = torch.bfloat16

    @property
    def num_attn_layers(self) -> int:
        return self.num_layers // self.full_attention_interval

    @property
    def num_gdn_layers(self) -> int:
        return self.num_layers - self.num_attn_layers

    @property
    def group_size(self) -> int:
        # vLLM groups hybrid layers into groups of equal size.
        return math.gcd(self.num_attn_layers, self.num_gdn_layers)

    @property
    def attn_bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.kv_dtype.itemsize

    def gdn_state(self) -> tuple[tuple[tuple[int, ...], ...], tuple[torch.dtype, ...]]:
        conv_dim = (
            2 * self.linear_num_key_heads * self.linear_key_head_dim
            + self.linear_num_value_heads * self.linear_value_head_dim
        )
        shapes = (
            (conv_dim, self.conv_kernel_size - 1),
            (
                self.linear_num_value_heads,
                self.linear_key_head_dim,
                self.linear_value_head_dim,
            ),
        )
        return shapes, (self.conv_dtype, self.ssm_dtype)

    def gdn_page_bytes(self) -> int:
        shapes, dtypes = self.gdn_state()
        return sum(math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes))

    def natural_block_size(self, alignment: int = 64) -> int:
        """Smallest block (multiple of the FLA chunk) whose attention page
        holds a GDN state, as the platform's block-size alignment picks."""
        return alignment * cdiv(
            self.gdn_page_bytes(), alignment * self.attn_bytes_per_token
        )


MODELS = {
    # 48 layers, 3 GDN : 1 attention, 2 KV heads x 256, GDN 16 K / 32 V heads.
    "qwen3-next-like": ModelShape(
        name="qwen3-next-like",
        num_layers=48,
        full_attention_interval=4,
        num_kv_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        conv_kernel_size=4,
        ssm_dtype=torch.bfloat16,
    ),
    # 32 layers, 3 GDN : 1 attention, 4 KV heads x 256, fp32 SSM state.
    "qwen3.5-9b-like": ModelShape(
        name="qwen3.5-9b-like",
        num_layers=32,
        full_attention_interval=4,
        num_kv_heads=4,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        conv_kernel_size=4,
        ssm_dtype=torch.float32,
    ),
}


@dataclass
class Turn:
    """One request of a workload. `prompt` is either a token list or a
    callable building it from the finished requests (multi-turn chat)."""

    request_id: str
    prompt: list[int] | Callable[[dict[str, Request]], list[int]]
    max_tokens: int
    arrival_step: int = 0
    # Requests that must finish before this one arrives.
    after: tuple[str, ...] = ()


@dataclass
class Workload:
    name: str
    turns: list[Turn]
    num_spec_tokens: int = 0
    description: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


_token_counter = [10_000]


def _fresh_tokens(rng: random.Random, n: int) -> list[int]:
    # Distinct, non-EOS token ids so unrelated text never shares blocks.
    base = _token_counter[0]
    _token_counter[0] += n
    return [base + i for i in range(n)]


def _spec_name(name: str, num_spec_tokens: int) -> str:
    return name if not num_spec_tokens else f"{name}_mtp{num_spec_tokens}"


def workload_system_prompts(
    rng: random.Random, scale: float, num_spec_tokens: int = 0
) -> Workload:
    """(a) N system prompts x M user turns, interleaved."""
    num_sys, num_users = 4, 6
    systems = [
        _fresh_tokens(rng, int(rng.randint(2000, 6000) * scale)) for _ in range(num_sys)
    ]
    turns = []
    for u in range(num_users):
        for s in range(num_sys):
            user = _fresh_tokens(rng, int(rng.randint(100, 1200) * scale))
            turns.append(
                Turn(
                    f"sys{s}-u{u}", systems[s] + user, max_tokens=32, arrival_step=u * 4
                )
            )
    return Workload(
        _spec_name("system_prompts", num_spec_tokens),
        turns,
        num_spec_tokens=num_spec_tokens,
        description=f"{num_sys}x{num_users}",
    )


def workload_multi_turn(
    rng: random.Random, scale: float, num_spec_tokens: int = 0
) -> Workload:
    """(b) Conversations where each turn extends the previous one (prompt +
    generated answer + new user message)."""
    num_convs, num_turns = 4, 6
    turns: list[Turn] = []
    for c in range(num_convs):
        first = _fresh_tokens(rng, int(rng.randint(1500, 3000) * scale))
        turns.append(Turn(f"c{c}-t0", first, max_tokens=96, arrival_step=c))
        for t in range(1, num_turns):
            user = _fresh_tokens(rng, int(rng.randint(200, 900) * scale))
            prev = f"c{c}-t{t - 1}"

            def build(done: dict[str, Request], prev=prev, user=user) -> list[int]:
                return list(done[prev].all_token_ids) + user

            turns.append(Turn(f"c{c}-t{t}", build, max_tokens=96, after=(prev,)))
    return Workload(
        _spec_name("multi_turn", num_spec_tokens),
        turns,
        num_spec_tokens=num_spec_tokens,
        description=f"{num_convs}x{num_turns}",
    )


def workload_shared_doc(
    rng: random.Random, scale: float, num_spec_tokens: int = 0
) -> Workload:
    """(c) Many questions about the same long document; (d) with MTP."""
    num_docs, num_questions = 2, 12
    docs = [
        _fresh_tokens(rng, int(rng.randint(12000, 20000) * scale))
        for _ in range(num_docs)
    ]
    turns = []
    for q in range(num_questions):
        for d in range(num_docs):
            question = _fresh_tokens(rng, int(rng.randint(20, 400) * scale))
            turns.append(
                Turn(
                    f"doc{d}-q{q}",
                    docs[d] + question,
                    max_tokens=48,
                    arrival_step=q * 3,
                )
            )
    return Workload(
        _spec_name("shared_doc", num_spec_tokens),
        turns,
        num_spec_tokens=num_spec_tokens,
        description=f"{num_docs} docs x {num_questions} questions",
    )


def workload_agent_branching(
    rng: random.Random, scale: float, num_spec_tokens: int = 0
) -> Workload:
    """(e) Agent-style conversations: a shared tool/system prompt, a
    trajectory that grows by model output plus a tool result per step, and
    branch points where two to three continuations (retries, tree search) fork
    from the same state."""
    num_agents, num_steps = 3, 5
    system = _fresh_tokens(rng, int(3000 * scale))
    turns: list[Turn] = []
    for a in range(num_agents):
        task = _fresh_tokens(rng, int(rng.randint(300, 900) * scale))
        turns.append(
            Turn(f"ag{a}-s0", system + task, max_tokens=64, arrival_step=2 * a)
        )
        frontier = [f"ag{a}-s0"]
        for t in range(1, num_steps):
            nxt = []
            for parent in frontier:
                # A branch point every other step, else one continuation.
                for b in range(2 if t % 2 else 1):
                    tool = _fresh_tokens(rng, int(rng.randint(200, 1500) * scale))
                    rid = f"{parent}.{t}{b}"

                    def build(done: dict[str, Request], parent=parent, tool=tool):
                        return list(done[parent].all_token_ids) + tool

                    turns.append(Turn(rid, build, max_tokens=64, after=(parent,)))
                    nxt.append(rid)
            frontier = nxt[:3]
    return Workload(
        _spec_name("agent_branching", num_spec_tokens),
        turns,
        num_spec_tokens=num_spec_tokens,
        description=f"{num_agents} agents x {num_steps} steps, branching",
    )


def workload_many_readers(
    rng: random.Random, scale: float, num_spec_tokens: int = 0
) -> Workload:
    """(f) Many readers of one long document arriving in bursts, so that the
    document's states compete with the readers' own blocks."""
    doc = _fresh_tokens(rng, int(rng.randint(28000, 36000) * scale))
    turns = []
    for r in range(24):
        question = _fresh_tokens(rng, int(rng.randint(50, 600) * scale))
        turns.append(
            Turn(f"rd{r}", doc + question, max_tokens=32, arrival_step=(r // 8) * 6)
        )
    return Workload(
        _spec_name("many_readers", num_spec_tokens),
        turns,
        num_spec_tokens=num_spec_tokens,
        description="1 doc x 24 readers in bursts of 8",
    )


def workload_mixed_lengths(
    rng: random.Random, scale: float, num_spec_tokens: int = 0
) -> Workload:
    """(g) Short chats on one system prompt interleaved with long requests on
    a few shared documents (mixed prompt lengths)."""
    system = _fresh_tokens(rng, int(1500 * scale))
    docs = [_fresh_tokens(rng, int(rng.randint(6000, 24000) * scale)) for _ in range(3)]
    turns = []
    for i in range(30):
        if i % 3 == 2:
            doc = docs[rng.randrange(len(docs))]
            tail = _fresh_tokens(rng, int(rng.randint(100, 800) * scale))
            prompt = doc + tail
        else:
            prompt = system + _fresh_tokens(rng, int(rng.randint(20, 2500) * scale))
        turns.append(Turn(f"mx{i}", prompt, max_tokens=32, arrival_step=i))
    return Workload(
        _spec_name("mixed_lengths", num_spec_tokens),
        turns,
        num_spec_tokens=num_spec_tokens,
        description="20 chats + 10 long, 3 docs",
    )


WORKLOADS: dict[str, Callable[[random.Random, float, int], Workload]] = {
    "system_prompts": workload_system_prompts,
    "multi_turn": workload_multi_turn,
    "shared_doc": workload_shared_doc,
    "agent_branching": workload_agent_branching,
    "many_readers": workload_many_readers,
    "mixed_lengths": workload_mixed_lengths,
}


def build_kv_cache_config(
    shape: ModelShape,
    mode: str,
    block_size: int,
    budget_bytes: int,
    num_spec_tokens: int,
    retention_interval: int | None,
) -> KVCacheConfig:
    page = block_size * shape.attn_bytes_per_token
    assert page >= shape.gdn_page_bytes(), (block_size, shape)
    # One block id spans one page in each of the `group_size` layers of every
    # group (the groups share the block pool).
    num_blocks = budget_bytes // (page * shape.group_size)
    gdn_shapes, gdn_dtypes = shape.gdn_state()
    groups = [
        KVCacheGroupSpec(
            [f"attn.{i}" for i in range(shape.group_size)],
            FullAttentionSpec(
                block_size=block_size,
                num_kv_heads=shape.num_kv_heads,
                head_size=shape.head_dim,
                dtype=shape.kv_dtype,
            ),
        )
    ]
    for g in range(shape.num_gdn_layers // shape.group_size):
        groups.append(
            KVCacheGroupSpec(
                [f"gdn{g}.{i}" for i in range(shape.group_size)],
                MambaSpec(
                    # Without prefix caching one state covers the whole request.
                    block_size=MAX_MODEL_LEN if mode == "none" else block_size,
                    shapes=gdn_shapes,
                    dtypes=gdn_dtypes,
                    page_size_padded=page,
                    mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
                    mamba_cache_mode=mode,
                    num_speculative_blocks=num_spec_tokens,
                ),
            )
        )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        prefix_cache_retention_interval=retention_interval,
    )


class _ConfigFactory:
    """Builds VllmConfigs for a Qwen3-Next-shaped local HF config so that the
    real config path (capability check, chunk-size resolution, validation)
    runs for every mode."""

    def __init__(self) -> None:
        from transformers import Qwen3NextConfig

        self._dir = tempfile.TemporaryDirectory()
        hf_config = Qwen3NextConfig(
            num_hidden_layers=4,
            hidden_size=256,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            intermediate_size=256,
            vocab_size=2_000_000,
            max_position_embeddings=MAX_MODEL_LEN,
        )
        hf_config.architectures = ["Qwen3NextForCausalLM"]
        hf_config.save_pretrained(self._dir.name)
        self._model_config = ModelConfig(
            model=self._dir.name,
            skip_tokenizer_init=True,
            max_model_len=MAX_MODEL_LEN,
            dtype="bfloat16",
        )

    def make(
        self,
        mode: str,
        block_size: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        num_spec_tokens: int,
    ) -> VllmConfig:
        model_config = copy.deepcopy(self._model_config)
        model_config.config_updated = False
        cache_config = CacheConfig(
            block_size=block_size,
            enable_prefix_caching=mode != "none",
            mamba_cache_mode="all" if mode == "all" else "none",
        )
        scheduler_config = SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=MAX_MODEL_LEN,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            watermark=0.0,
        )
        speculative_config = None
        if num_spec_tokens:
            # MTP is modelled as an EAGLE-style drafter: the scheduler gets
            # `num_spec_tokens` drafts per step and the prefix cache applies
            # the drafter's last-block drop.
            speculative_config = SpeculativeConfig(
                model="ngram", num_speculative_tokens=num_spec_tokens
            )
        vllm_config = VllmConfig(
            model_config=model_config,
            cache_config=cache_config,
            scheduler_config=scheduler_config,
            speculative_config=speculative_config,
        )
        if vllm_config.speculative_config is not None:
            for name in ("use_eagle", "use_eagle_block_drop"):
                object.__setattr__(vllm_config.speculative_config, name, lambda: True)
        vllm_config.validate_block_size()
        expected = "none" if mode == "none" else mode
        assert cache_config.mamba_cache_mode == expected, (
            cache_config.mamba_cache_mode,
            mode,
        )
        return vllm_config


def _lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    # Compare in slices first: prompts share long prefixes.
    step = 256
    while i + step <= n and a[i : i + step] == b[i : i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


def run_workload(
    workload: Workload,
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    seed: int,
) -> dict[str, Any]:
    rng = random.Random(seed)
    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    scheduler_block, hash_block = resolve_kv_cache_block_sizes(
        kv_cache_config, vllm_config
    )
    scheduler = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=scheduler_block,
        hash_block_size=hash_block,
        log_stats=False,
    )
    block_pool = scheduler.kv_cache_manager.block_pool
    block_hasher = get_request_block_hasher(hash_block, sha256)
    block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
    k = workload.num_spec_tokens

    pending = list(workload.turns)
    live: dict[str, Request] = {}
    done: dict[str, Request] = {}
    history: list[list[int]] = []
    stats: dict[str, dict[str, int]] = {}
    drafts: dict[str, list[int]] = {}
    peak_blocks = 0
    step = 0
    preempted: set[str] = set()
    idle_steps = 0
    stalled = False
    while pending or live:
        for turn in list(pending):
            if turn.arrival_step > step or any(a not in done for a in turn.after):
                continue
            pending.remove(turn)
            prompt = turn.prompt(done) if callable(turn.prompt) else turn.prompt
            params = SamplingParams(max_tokens=turn.max_tokens, ignore_eos=True)
            params.update_from_generation_config({}, eos_token_id=1)
            request = Request(
                request_id=turn.request_id,
                prompt_token_ids=prompt,
                sampling_params=params,
                pooling_params=None,
                block_hasher=block_hasher,
            )
            shared = max((_lcp(prompt, h) for h in history), default=0)
            ideal = min(shared, len(prompt) - 1) // block_size * block_size
            stats[turn.request_id] = {"prompt": len(prompt), "ideal": ideal}
            history.append(prompt)
            live[turn.request_id] = request
            scheduler.add_request(request)

        output: SchedulerOutput = scheduler.schedule()
        step += 1
        # Blocks held by running requests (cached but unreferenced blocks are
        # free and evictable).
        used = block_pool.num_gpu_blocks - block_pool.get_num_free_blocks()
        peak_blocks = max(peak_blocks, used)
        for new_req in output.scheduled_new_reqs:
            # The prefix-cache hit of the request's first scheduling.
            stats[new_req.req_id].setdefault("cached", new_req.num_computed_tokens)
        req_ids = list(output.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for req_id in req_ids:
            request = live[req_id]
            spec = output.scheduled_spec_decode_tokens.get(req_id, [])
            # schedule() already advanced num_computed_tokens; the step
            # samples once it covers every token (drafts excluded).
            reaches_end = request.num_computed_tokens - len(spec) >= request.num_tokens
            if not reaches_end:
                sampled.append([])
                continue
            accepted = spec[: rng.randint(0, len(spec))] if spec else []
            sampled.append(accepted + [2 + rng.randrange(1_000_000)])
        model_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
        )
        scheduler.update_from_output(output, model_output)
        if k:
            draft_ids = [r for r in req_ids if r in live and not live[r].is_finished()]
            drafts = {
                r: [2 + rng.randrange(1_000_000) for _ in range(k)] for r in draft_ids
            }
            if draft_ids:
                scheduler.update_draft_token_ids(
                    DraftTokenIds(draft_ids, [drafts[r] for r in draft_ids])
                )
        for req_id, request in list(live.items()):
            if request.is_finished():
                done[req_id] = request
                history.append(list(request.all_token_ids))
                del live[req_id]
            elif request.status == RequestStatus.PREEMPTED:
                preempted.add(req_id)
        if output.total_num_scheduled_tokens == 0 and not scheduler.running:
            idle_steps += 1
            if idle_steps > 100:
                # A waiting request needs more blocks than the whole pool
                # (the engine's startup check would reject this budget).
                stalled = True
                break
        else:
            idle_steps = 0
        if step > 200_000:
            raise RuntimeError(f"{workload.name}: no progress after {step} steps")

    if stalled:
        return {
            "cached_over_ideal": None,
            "hit_rate": None,
            "within_one_block": None,
            "peak_blocks_used": peak_blocks,
            "blocks_used": peak_blocks,
            "num_blocks": kv_cache_config.num_blocks,
            "stalled": True,
            "steps": step,
            "num_requests": len(stats),
        }
    cached = sum(s.get("cached", 0) for s in stats.values())
    ideal = sum(s["ideal"] for s in stats.values())
    prompt_tokens = sum(s["prompt"] for s in stats.values())
    deficits = [
        (s["ideal"] - min(s.get("cached", 0), s["ideal"])) / block_size
        for s in stats.values()
    ]
    return {
        "cached_tokens": cached,
        "ideal_tokens": ideal,
        "prompt_tokens": prompt_tokens,
        "cached_over_ideal": cached / ideal if ideal else None,
        "hit_rate": cached / prompt_tokens if prompt_tokens else 0.0,
        "within_one_block": sum(d <= 1 for d in deficits) / len(deficits),
        "max_deficit_blocks": max(deficits, default=0.0),
        "peak_blocks_used": peak_blocks,
        "blocks_used": peak_blocks,
        "eagle_block_drop": scheduler.use_eagle_block_drop,
        "num_hash_lookahead_tokens": 0,  # vLLM 0.32.0 has no lookahead hashes
        "num_blocks": kv_cache_config.num_blocks,
        "steps": step,
        "num_requests": len(stats),
        "num_preempted_requests": len(preempted),
        # "all" mode: checkpoints evicted from the checkpoint tier and
        # checkpoints not written for want of a spare block.
        "mamba_state_evictions": getattr(block_pool, "num_checkpoint_evictions", 0),
        "mamba_checkpoints_skipped": getattr(block_pool, "num_checkpoints_skipped", 0),
        "stalled": False,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument(
        "--budgets-gib",
        nargs="+",
        type=float,
        default=[16.0, 6.0, 3.0],
        help="KV cache memory budgets (same for every mode).",
    )
    parser.add_argument(
        "--block-size-multipliers",
        nargs="+",
        type=int,
        default=[1],
        help="Block sizes as multiples of the smallest page-equal block.",
    )
    parser.add_argument(
        "--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS)
    )
    parser.add_argument(
        "--mtp-k",
        nargs="+",
        type=int,
        default=[0, 1, 2, 3],
        help="MTP draft tokens; every workload runs with each.",
    )
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--output-md", default=None)
    args = parser.parse_args(argv)

    init_none_hash(sha256)
    t0 = time.perf_counter()
    factory = _ConfigFactory()
    print(f"# config setup {time.perf_counter() - t0:.1f}s", file=sys.stderr)

    def workloads() -> list[Workload]:
        # The same token streams for every model, block size and budget; each
        # MTP variant of a workload has its own.
        rng = random.Random(args.seed)
        _token_counter[0] = 10_000
        return [
            WORKLOADS[name](rng, args.scale, k)
            for name in args.workloads
            for k in args.mtp_k
        ]

    rows = []
    # The scheduler as Model Runner V2 (0.33.0's default on GPUs) drives it:
    # it may skip drafts under pressure (can_skip_drafts), and all mode with
    # drafts is served on Model Runner V2 only (VllmConfig refuses it on the
    # V1 runner, which a process without Triton would otherwise pick).
    # vLLM 0.32.0 refuses Model Runner V2 in VllmConfig where Triton is off
    # (a CPU-only process; 0.33.0 checks in the GPU worker): the bench builds
    # no model runner, so the config is checked as on a GPU.
    with (
        mock.patch.dict(os.environ, {"VLLM_USE_V2_MODEL_RUNNER": "1"}),
        mock.patch("vllm.config.vllm.HAS_TRITON", True),
    ):
        for model_name in args.models:
            shape = MODELS[model_name]
            for multiplier in args.block_size_multipliers:
                block_size = shape.natural_block_size() * multiplier
                for budget in args.budgets_gib:
                    for workload in workloads():
                        results = {}
                        for mode in MODES:
                            vllm_config = factory.make(
                                mode,
                                block_size,
                                args.max_num_batched_tokens,
                                args.max_num_seqs,
                                workload.num_spec_tokens,
                            )
                            kv_cache_config = build_kv_cache_config(
                                shape,
                                mode,
                                block_size,
                                int(budget * GiB),
                                workload.num_spec_tokens,
                                vllm_config.cache_config.prefix_cache_retention_interval,
                            )
                            t = time.perf_counter()
                            results[mode] = run_workload(
                                workload, vllm_config, kv_cache_config, args.seed
                            )
                            results[mode]["seconds"] = round(time.perf_counter() - t, 2)
                        # None: the mode cannot hold one request in this budget.
                        base = results["align"]["cached_over_ideal"]
                        value = results["all"]["cached_over_ideal"]
                        rows.append(
                            {
                                "case": {
                                    "workload": workload.name,
                                    "model": model_name,
                                    # `value` is this mode, `baseline` is "align".
                                    "mode": "all",
                                    "baseline_mode": "align",
                                    "block_size": block_size,
                                    "kv_budget_gib": budget,
                                    "num_spec_tokens": workload.num_spec_tokens,
                                    "shape": workload.description,
                                },
                                "metric": "cached_over_ideal",
                                "baseline": base,
                                "value": value,
                                "ratio": value / base
                                if base and value is not None
                                else None,
                                "hit_rate": results["all"]["hit_rate"],
                                "blocks_used": results["all"]["blocks_used"],
                                "baseline_hit_rate": results["align"]["hit_rate"],
                                "baseline_blocks_used": results["align"]["blocks_used"],
                                "per_mode": results,
                            }
                        )
                        print(
                            f"# {model_name} B={block_size} {budget}GiB "
                            f"{workload.name}: "
                            + " ".join(
                                f"{m}={results[m]['cached_over_ideal']}" for m in MODES
                            ),
                            file=sys.stderr,
                        )

    env = [
        f"{k}={shlex.quote(os.environ[k])}"
        for k in ("VLLM_TARGET_DEVICE", "HF_HUB_OFFLINE", "PYTHONPATH")
        if k in os.environ
    ]
    command = " ".join(env + [shlex.quote(a) for a in [sys.executable, *sys.argv]])
    try:
        import triton

        triton_version: str | None = triton.__version__
    except Exception:
        triton_version = None
    report = {
        "bench": "hitrate",
        "gpu": "cpu",
        "torch": torch.__version__,
        "triton": triton_version,
        "vllm_base": "0.33.0",
        "command": command,
        "rows": rows,
    }
    table = render_table(rows)
    summary = summarize(rows)
    print(table)
    print(summary)
    print(f"# total {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=1)
    if args.output_md:
        with open(args.output_md, "w") as f:
            f.write(
                f"Command: `{command}`\n\n"
                "Per mode: `cached/ideal` = prefix-cache hit tokens over the "
                "longest prefix shared with an earlier request (rounded down "
                "to a block), summed over requests; `hit` = hit tokens over "
                "prompt tokens; `<=1 blk` = fraction of requests within one "
                "block of their ideal; `peak blk` = most blocks held by "
                "running requests (cached-but-free blocks excluded); `blocks` "
                "= pool size at this KV cache budget, equal for all modes. "
                "`no fit`: one request needs more blocks than the pool.\n\n"
                f"{summary}\n\n{render_breakdown(rows)}\n\n{table}\n"
            )
    return 0


def summarize(rows: list[dict[str, Any]]) -> str:
    """The issue's targets: all >= align - 0.02 in every row, no row where
    all stalls and align does not, and the mean over rows."""
    both = [r for r in rows if r["value"] is not None and r["baseline"] is not None]
    stalls = [
        r
        for r in rows
        if r["per_mode"]["all"]["stalled"] and not r["per_mode"]["align"]["stalled"]
    ]
    if not both:
        return "No comparable rows."
    diffs = [r["value"] - r["baseline"] for r in both]
    worst = min(both, key=lambda r: r["value"] - r["baseline"])
    below = sum(d < -0.02 for d in diffs)
    mean_all = sum(r["value"] for r in both) / len(both)
    mean_align = sum(r["baseline"] for r in both) / len(both)
    c = worst["case"]
    return (
        f"Rows: {len(rows)} ({len(both)} with both modes defined). "
        f"min(all - align) = {min(diffs):+.3f} "
        f"({c['model']} B={c['block_size']} {c['kv_budget_gib']:g} GiB "
        f"{c['workload']}); rows below align - 0.02: {below}; "
        f"rows where all stalls and align does not: {len(stalls)}; "
        f"mean cached/ideal: all {mean_all:.3f}, align {mean_align:.3f}; "
        f"rows above align: {sum(d > 0 for d in diffs)}, equal (+-0.02): "
        f"{sum(abs(d) <= 0.02 for d in diffs)}."
    )


def render_breakdown(rows: list[dict[str, Any]]) -> str:
    """The summary split by budget, block size, MTP k and workload, and the
    rows where all mode is more than 0.02 below align."""
    both = [r for r in rows if r["value"] is not None and r["baseline"] is not None]
    natural = min((r["case"]["block_size"] for r in both), default=0)
    splits: list[tuple[str, list[dict[str, Any]]]] = []
    for key, label in (
        ("kv_budget_gib", "budget {:g} GiB"),
        ("block_size", "B = {}"),
        ("num_spec_tokens", "MTP k = {}"),
    ):
        for value in sorted(
            {r["case"][key] for r in both}, reverse=key == "kv_budget_gib"
        ):
            name = label.format(value)
            if key == "block_size" and natural:
                name = f"B = {value // natural}x ({value})"
            splits.append((name, [r for r in both if r["case"][key] == value]))
    for workload in WORKLOADS:
        splits.append(
            (
                f"workload {workload}",
                [
                    r
                    for r in both
                    if r["case"]["workload"] == workload
                    or r["case"]["workload"].startswith(workload + "_mtp")
                ],
            )
        )
    splits.append(("all rows", both))
    header = (
        "| rows | n | align mean | all mean | min(all-align) "
        "| rows < align-0.02 | rows > align+0.02 |"
    )
    lines = [header, "|---|---|---|---|---|---|---|"]
    for name, group in splits:
        if not group:
            continue
        diffs = [r["value"] - r["baseline"] for r in group]
        lines.append(
            f"| {name} | {len(group)} "
            f"| {sum(r['baseline'] for r in group) / len(group):.3f} "
            f"| {sum(r['value'] for r in group) / len(group):.3f} "
            f"| {min(diffs):+.3f} | {sum(d < -0.02 for d in diffs)} "
            f"| {sum(d > 0.02 for d in diffs)} |"
        )
    below = sorted(
        (r for r in both if r["value"] < r["baseline"] - 0.02),
        key=lambda r: r["value"] - r["baseline"],
    )
    lines.append(
        f"\nRows where all < align - 0.02: {len(below)} (`evicted`: checkpoint-tier "
        "and protected states evicted in the all-mode run; `skipped`: "
        "checkpoints not written for want of a spare block)."
    )
    if below:
        lines += [
            "",
            "| model | B | GiB | workload | align | all | evicted | skipped |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in below:
            c, run = r["case"], r["per_mode"]["all"]
            lines.append(
                f"| {c['model']} | {c['block_size']} | {c['kv_budget_gib']:g} "
                f"| {c['workload']} | {r['baseline']:.3f} | {r['value']:.3f} "
                f"| {run.get('mamba_state_evictions', 0)} "
                f"| {run.get('mamba_checkpoints_skipped', 0)} |"
            )
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def render_table(rows: list[dict[str, Any]]) -> str:
    header = (
        "| model | B | budget GiB | workload | blocks | "
        + " | ".join(
            f"{m} cached/ideal | {m} hit | {m} <=1 blk | {m} peak blk" for m in MODES
        )
        + " |"
    )
    lines = [header, "|" + "---|" * (5 + 4 * len(MODES))]
    for row in rows:
        case, per_mode = row["case"], row["per_mode"]
        cells = [
            case["model"],
            str(case["block_size"]),
            f"{case['kv_budget_gib']:g}",
            case["workload"],
            str(per_mode["all"]["num_blocks"]),
        ]
        for m in MODES:
            r = per_mode[m]
            if r["stalled"]:
                # One request needs more blocks than the whole pool.
                cells += ["no fit"] * 3 + [str(r["peak_blocks_used"])]
                continue
            cells += [
                _fmt(r["cached_over_ideal"]),
                _fmt(r["hit_rate"]),
                _fmt(r["within_one_block"]),
                str(r["peak_blocks_used"]),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

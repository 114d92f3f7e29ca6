# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Mamba "all" cache mode: checkpoints are cache, not working set.

Property tests over random workloads, driven through `KVCacheManager` the way
the scheduler drives it (allocate, then `fill_checkpoint_slots` after the
step's admissions, then `new_step_starts`), with a shadow model runner that
writes each step's states into the slots `get_mamba_all_mode_state_slots`
names, through the block ids the scheduler output would carry:

- admission is never worse than align mode;
- every hit resumes from a state written for exactly that prefix;
- no block is freed while a request or the cache references it;
- eviction follows the documented order.
"""

import random
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    KVCacheBlock,
    init_none_hash,
    make_block_hash_with_group_id,
)
from vllm.v1.core.single_type_kv_cache_manager import MambaManager
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    get_mamba_all_mode_state_slots,
    get_mamba_chunk_aligned_prefill_end,
)
from vllm.v1.request import Request, RequestStatus

from .test_prefix_caching import make_request

pytestmark = pytest.mark.cpu_test

BLOCK_SIZE = 128
KERNEL_CHUNK = 64
NUM_MAMBA_GROUPS = 2
SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(autouse=True)
def _init_none_hash() -> None:
    init_none_hash(sha256)


def _make_manager(mode: str, num_blocks: int, num_spec: int) -> KVCacheManager:
    groups = [
        KVCacheGroupSpec(
            ["full_attn"],
            FullAttentionSpec(
                block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32
            ),
        )
    ] + [
        KVCacheGroupSpec(
            [f"gdn{g}"],
            MambaSpec(
                block_size=BLOCK_SIZE,
                shapes=((1, 1),),
                dtypes=(torch.float32,),
                mamba_cache_mode=mode,
                num_speculative_blocks=num_spec,
            ),
        )
        for g in range(NUM_MAMBA_GROUPS)
    ]
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        prefix_cache_retention_interval=0,
    )
    return KVCacheManager(
        config,
        max_model_len=1 << 16,
        scheduler_block_size=BLOCK_SIZE,
        hash_block_size=BLOCK_SIZE,
        enable_caching=True,
        log_stats=True,
    )


def _mamba_managers(manager: KVCacheManager) -> list[MambaManager]:
    return [
        m
        for m in manager.coordinator.single_type_managers
        if isinstance(m, MambaManager)
    ]


@dataclass
class _Running:
    request: Request
    num_decode: int
    # The block table the model runner sees: the admission's blocks, then
    # every step's new block ids appended.
    worker_rows: list[list[int]] = field(default_factory=list)
    decoded: int = 0


class _Driver:
    """A small FCFS scheduler over `KVCacheManager` plus a shadow runner."""

    def __init__(
        self,
        mode: str,
        num_blocks: int,
        budget: int,
        num_spec: int,
        seed: int,
    ) -> None:
        self.mode = mode
        self.manager = _make_manager(mode, num_blocks, num_spec)
        self.budget = budget
        self.num_spec = num_spec
        self.rng = random.Random(seed)
        self.waiting: list[tuple[Request, int]] = []
        self.running: list[_Running] = []
        # Shadow state contents: (group, block id) -> the token prefix the
        # state held after the runner's last write.
        self.contents: dict[tuple[int, int], tuple[int, ...]] = {}
        self.hits: list[tuple[Request, int]] = []
        self.failed_steps = 0
        # Most Mamba blocks one group of a running request took from the pool
        # in one step after the step that admitted it.
        self.max_new_mamba_blocks = 0

    def add(self, request: Request, num_decode: int) -> None:
        self.waiting.append((request, num_decode))

    def _chunk_end(self, start: int, request: Request) -> int:
        end = min(start + self.budget, request.num_prompt_tokens)
        if self.mode == "all":
            return get_mamba_chunk_aligned_prefill_end(
                start, end, request.num_prompt_tokens, KERNEL_CHUNK
            )
        if end < request.num_prompt_tokens:
            end = end // BLOCK_SIZE * BLOCK_SIZE
        return end

    def _write_states(
        self, run: _Running, start: int, num_scheduled: int, num_draft: int
    ) -> None:
        """The runner: states after each boundary inside the step, after the
        step's verified tokens, and the drafts' states."""
        tokens = run.request.all_token_ids
        slots = get_mamba_all_mode_state_slots(
            start, num_scheduled, num_draft, BLOCK_SIZE, self.num_spec
        )
        end = start + num_scheduled - num_draft
        for g, row in enumerate(run.worker_rows[1:], start=1):
            for idx, offset in zip(
                slots.checkpoint_block_idxs, slots.checkpoint_token_offsets
            ):
                if row[idx] != 0:  # 0: the null block, not written
                    self.contents[(g, row[idx])] = tuple(tokens[: start + offset])
            self.contents[(g, row[slots.write_block_idx])] = tuple(tokens[:end])
            for idx in slots.spec_block_idxs:
                self.contents[(g, row[idx])] = ("draft",)  # type: ignore[assignment]

    def _mamba_blocks_held(self, request_id: str) -> list[set[int]]:
        """Per Mamba group, the blocks the request holds: its table and the
        speculative blocks reserved for it."""
        return [
            {b.block_id for b in m.req_to_blocks.get(request_id, []) if not b.is_null}
            | {b.block_id for b in m._spec_reserve.get(request_id, [])}
            for m in _mamba_managers(self.manager)
        ]

    def step(self) -> None:
        manager = self.manager
        manager.new_step_starts()
        scheduled: list[tuple[_Running, int, int, int]] = []
        budget = self.budget
        for run in self.running:
            request = run.request
            start = request.num_computed_tokens
            held_before = self._mamba_blocks_held(request.request_id)
            if start < request.num_prompt_tokens:
                end = self._chunk_end(start, request)
                num_new, num_draft = end - start, 0
                new = manager.allocate_slots(
                    request, num_new, num_lookahead_tokens=self.num_spec
                )
            else:
                num_draft = self.num_spec
                num_new = 1 + num_draft
                new = manager.allocate_slots(
                    request, num_new, num_lookahead_tokens=self.num_spec
                )
            if new is None:
                self.failed_steps += 1
                continue
            for before, after in zip(
                held_before, self._mamba_blocks_held(request.request_id)
            ):
                self.max_new_mamba_blocks = max(
                    self.max_new_mamba_blocks, len(after - before)
                )
            scheduled.append((run, start, num_new, num_draft))
            run.new_blocks = new  # type: ignore[attr-defined]
            budget -= num_new
        while self.waiting and budget > 0:
            request, num_decode = self.waiting[0]
            blocks, num_hit, junction = manager.get_computed_blocks(request)
            request.shared_prefix_boundary = junction
            end = self._chunk_end(num_hit, request)
            new = manager.allocate_slots(
                request,
                end - num_hit,
                num_hit,
                blocks,
                num_lookahead_tokens=self.num_spec,
            )
            if new is None:
                break
            self.waiting.pop(0)
            # As the scheduler does: a waiting request's admission may not
            # take a running request's protected states, its later steps may.
            request.status = RequestStatus.RUNNING
            manager.record_prefix_cache_stats(request, num_hit)
            self.hits.append((request, num_hit))
            request.num_computed_tokens = num_hit
            run = _Running(request, num_decode)
            run.new_blocks = None  # type: ignore[attr-defined]
            self.running.append(run)
            scheduled.append((run, num_hit, end - num_hit, 0))
            budget -= end - num_hit
        # After every admission of the step, as the scheduler does.
        manager.fill_checkpoint_slots()
        for run, start, num_new, num_draft in scheduled:
            rid = run.request.request_id
            if run.new_blocks is None:  # type: ignore[attr-defined]
                run.worker_rows = [list(r) for r in manager.get_block_ids(rid)]
            else:
                for row, ids in zip(
                    run.worker_rows,
                    run.new_blocks.get_block_ids(allow_none=True)  # type: ignore
                    or [[] for _ in run.worker_rows],
                ):
                    row.extend(ids or [])
            self._write_states(run, start, num_new, num_draft)
            request = run.request
            if start < request.num_prompt_tokens:
                request.num_computed_tokens = start + num_new
                if request.num_computed_tokens == request.num_prompt_tokens:
                    request.append_output_token_ids([1 + request.num_tokens])
            else:
                accepted = self.rng.randint(0, num_draft)
                request.num_computed_tokens += 1 + accepted
                request.append_output_token_ids(
                    [1 + request.num_tokens + i for i in range(1 + accepted)]
                )
                run.decoded += 1
        for run in list(self.running):
            if run.decoded >= run.num_decode:
                self.running.remove(run)
                self.manager.free(run.request)

    def run(self, max_steps: int = 400) -> None:
        for _ in range(max_steps):
            if not self.waiting and not self.running:
                return
            self.step()
            check_block_accounting(self.manager, self.running)


def check_block_accounting(manager: KVCacheManager, running: list[_Running]) -> None:
    """Every block is either referenced (ref_cnt = number of request table
    entries holding it) or free in exactly one of the LRU queue, the
    checkpoint tier and the protected states; never both."""
    pool = manager.block_pool
    refs: dict[int, int] = {}
    for m in manager.coordinator.single_type_managers:
        held = list(m.req_to_blocks.values())
        if isinstance(m, MambaManager):
            # Speculative blocks reserved for a request's first drafts.
            held += list(m._spec_reserve.values())
        for blocks in held:
            for block in blocks:
                if not block.is_null:
                    refs[block.block_id] = refs.get(block.block_id, 0) + 1
    queued: set[int] = set()
    node: KVCacheBlock | None = pool.free_block_queue.fake_free_list_head
    while True:
        node = node.next_free_block  # type: ignore[union-attr]
        if node is None or node is pool.free_block_queue.fake_free_list_tail:
            break
        queued.add(node.block_id)
    tier = set(pool._checkpoint_tier)
    protected = set(pool._protected)
    assert not (queued & tier) and not (queued & protected) and not (tier & protected)
    for b in pool.blocks[1:]:
        num_refs = refs.get(b.block_id, 0)
        assert b.ref_cnt == num_refs, (b.block_id, b.ref_cnt, num_refs)
        is_free = b.block_id in queued | tier | protected
        assert is_free == (num_refs == 0), (b.block_id, num_refs)
    assert pool.get_num_free_blocks() == len(queued) + len(tier) + len(protected)


def _prompts(seed: int, num: int, max_blocks: int) -> list[list[int]]:
    """Prompts sharing prefixes of random lengths (a tree of documents)."""
    rng = random.Random(seed)
    roots = [
        [10_000 * (r + 1) + i for i in range(rng.randint(1, max_blocks) * BLOCK_SIZE)]
        for r in range(2)
    ]
    prompts: list[list[int]] = []
    for i in range(num):
        base = rng.choice(roots + prompts) if prompts else rng.choice(roots)
        keep = rng.randint(0, len(base))
        tail = [1_000_000 * (i + 1) + j for j in range(rng.randint(1, 3 * BLOCK_SIZE))]
        prompts.append(base[:keep] + tail)
    return prompts


# ----- admission never worse than align --------------------------------------


def _fits_alone(
    mode: str, num_blocks: int, prompt_len: int, budget: int, num_spec: int
) -> bool:
    driver = _Driver(mode, num_blocks, budget, num_spec, seed=0)
    request = make_request("r", list(range(prompt_len)), BLOCK_SIZE, sha256)
    request.sampling_params.max_tokens = 1 << 20
    driver.add(request, num_decode=2 * BLOCK_SIZE // (1 + num_spec) + 3)
    for _ in range(200):
        if not driver.waiting and not driver.running:
            return True
        driver.step()
        if driver.failed_steps or (driver.waiting and not driver.running):
            return False
    return False


@SETTINGS
@given(
    prompt_blocks=st.integers(1, 24),
    extra=st.integers(1, BLOCK_SIZE - 1),
    budget_blocks=st.integers(1, 8),
    num_spec=st.integers(0, 3),
)
def test_admission_never_worse_than_align(
    prompt_blocks: int, extra: int, budget_blocks: int, num_spec: int
) -> None:
    """At align mode's smallest pool for a request (prefill, then decode
    across block boundaries), all mode serves it too."""
    prompt_len = prompt_blocks * BLOCK_SIZE + extra
    budget = budget_blocks * BLOCK_SIZE
    num_blocks = 2
    limit = 2 * (prompt_blocks + 8) * (1 + NUM_MAMBA_GROUPS)
    while not _fits_alone("align", num_blocks, prompt_len, budget, num_spec):
        num_blocks += 1
        # Align mode cannot serve some chunkings at all (a budget of one
        # block with a one-token remainder); nothing to compare then.
        assume(num_blocks < limit)
    assert _fits_alone("all", num_blocks, prompt_len, budget, num_spec)


@SETTINGS
@given(
    prompt_blocks=st.integers(1, 24),
    extra=st.integers(1, BLOCK_SIZE - 1),
    budget_blocks=st.integers(1, 8),
    num_spec=st.integers(0, 3),
    num_requests=st.integers(1, 3),
)
def test_admission_reserves_the_mamba_footprint(
    prompt_blocks: int,
    extra: int,
    budget_blocks: int,
    num_spec: int,
    num_requests: int,
) -> None:
    """After the step that admitted it, a request takes at most one Mamba
    block per group and step from the pool (its next write slot), as in
    align mode: its first drafts use the speculative blocks reserved at
    admission. Otherwise admitted requests would grow past what admission
    counted and evict cached states (or each other) to make room."""
    prompt_len = prompt_blocks * BLOCK_SIZE + extra
    driver = _Driver("all", 400, budget_blocks * BLOCK_SIZE, num_spec, seed=0)
    for i in range(num_requests):
        request = make_request(
            f"r{i}", [i * 100_000 + t for t in range(prompt_len)], BLOCK_SIZE, sha256
        )
        request.sampling_params.max_tokens = 1 << 20
        driver.add(request, num_decode=2 * BLOCK_SIZE // (1 + num_spec) + 3)
    driver.run()
    assert not driver.waiting and not driver.running
    assert driver.max_new_mamba_blocks <= 1


# ----- hits resume from exactly their prefix; accounting ---------------------


@SETTINGS
@given(
    seed=st.integers(0, 10_000),
    num_blocks=st.integers(40, 160),
    budget_blocks=st.integers(1, 6),
    num_spec=st.integers(0, 3),
)
def test_hits_resume_from_their_prefix_and_blocks_are_accounted(
    seed: int, num_blocks: int, budget_blocks: int, num_spec: int
) -> None:
    """Random prompts sharing prefixes, pools from ample to tight: each hit's
    Mamba state (in every group) was written after exactly the hit's tokens
    of this prompt, and after every step each block is referenced by exactly
    its ref count or free in exactly one free structure (`_Driver.run`)."""
    driver = _Driver(
        "all", num_blocks, budget_blocks * BLOCK_SIZE + KERNEL_CHUNK, num_spec, seed
    )
    for i, prompt in enumerate(_prompts(seed, 10, 8)):
        request = make_request(f"q{i}", prompt, BLOCK_SIZE, sha256)
        request.sampling_params.max_tokens = 1 << 20
        driver.add(request, num_decode=driver.rng.randint(1, 6))
    hits_before = 0
    for _ in range(400):
        if not driver.waiting and not driver.running:
            break
        driver.step()
        check_block_accounting(driver.manager, driver.running)
        for request, num_hit in driver.hits[hits_before:]:
            if num_hit == 0:
                continue
            rows = driver.manager.get_block_ids(request.request_id)
            for g in range(1, 1 + NUM_MAMBA_GROUPS):
                block_id = rows[g][num_hit // BLOCK_SIZE - 1]
                assert driver.contents[(g, block_id)] == tuple(
                    request.prompt_token_ids[:num_hit]
                )
        hits_before = len(driver.hits)
    assert not driver.waiting and not driver.running
    # Everything is free again once every request finished.
    pool = driver.manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


def test_written_checkpoints_leave_the_request() -> None:
    """A checkpoint written during prefill is a cached block the request no
    longer references from the next step on."""
    driver = _Driver("all", 200, 6 * BLOCK_SIZE, 0, seed=0)
    request = make_request("r", list(range(13 * BLOCK_SIZE + 5)), BLOCK_SIZE, sha256)
    request.sampling_params.max_tokens = 1 << 20
    driver.add(request, num_decode=3)
    driver.step()
    first_rows = [list(r) for r in driver.running[0].worker_rows]
    driver.step()
    table = driver.manager.get_blocks("r").blocks
    pool = driver.manager.block_pool
    num_checkpoints = 0
    for g in range(1, 1 + NUM_MAMBA_GROUPS):
        # Boundaries strictly inside the first step, on the grid of its end.
        for idx in range(5):
            block = pool.blocks[first_rows[g][idx]]
            if first_rows[g][idx] == 0:
                continue
            num_checkpoints += 1
            assert table[g][idx].is_null
            assert block.ref_cnt == 0 and block.block_hash is not None
    assert num_checkpoints > 0


# ----- eviction order ----------------------------------------------------------


def test_checkpoint_priority_is_the_ruler_level() -> None:
    """Documented policy: level = trailing zero bits of the boundary's block
    count; lower level evicted first, then older."""
    rng = random.Random(0)
    for _ in range(2000):
        a, b = rng.randint(0, 4095), rng.randint(0, 4095)
        sa, sb = rng.randint(0, 99), rng.randint(0, 99)
        pa = MambaManager.checkpoint_priority(a, sa)
        pb = MambaManager.checkpoint_priority(b, sb)
        # A boundary on a coarser power-of-two grid outranks a finer one.
        if (a + 1) % (2 * ((b + 1) & -(b + 1))) == 0:
            assert pa > pb
        if (a + 1) & -(a + 1) == (b + 1) & -(b + 1):
            assert (pa < pb) == (sa < sb) or sa == sb


@SETTINGS
@given(data=st.data())
def test_eviction_order_follows_policy(data) -> None:
    """`get_new_blocks` evicts, in order: empty blocks, checkpoint-tier
    blocks by ascending priority, the LRU queue from its head, protected
    states oldest first. `take_checkpoint_blocks` takes only empty blocks and
    lower-priority tier blocks, all or nothing."""
    manager = _make_manager("all", 64, 0)
    pool = manager.block_pool
    blocks = pool.get_new_blocks(60)
    for i, block in enumerate(blocks):
        pool._insert_block_hash(  # a distinct cached key per block
            make_block_hash_with_group_id(BlockHash((i + 1).to_bytes(32, "little")), 1),
            block,
            num_tokens=BLOCK_SIZE,
        )
    kinds = data.draw(
        st.lists(
            st.sampled_from(["lru", "tier", "protected", "empty"]),
            min_size=60,
            max_size=60,
        )
    )
    priorities = data.draw(
        st.lists(
            st.tuples(st.integers(0, 5), st.integers(0, 50)), min_size=60, max_size=60
        )
    )
    lru, tier, protected, empty = [], [], [], []
    for block, kind, priority in zip(blocks, kinds, priorities):
        if kind == "lru":
            pool.free_blocks([block])
            lru.append(block)
        elif kind == "tier":
            pool.free_checkpoint_blocks([(block, priority)])
            tier.append((priority, block.block_id))
        elif kind == "protected":
            pool.free_protected_blocks([block], "owner")
            protected.append(block.block_id)
        else:
            pool._maybe_evict_cached_block(block)
            pool.free_blocks([block])
            empty.append(block.block_id)
    new_priority = data.draw(st.tuples(st.integers(0, 5), st.integers(0, 50)))
    num_free_before = pool.get_num_free_blocks()
    taken = pool.take_checkpoint_blocks(2, new_priority)
    spare = 3 + len(empty) + sum(p < new_priority for p, _ in tier)  # 3 never used
    if spare < 2:
        assert taken is None and pool.get_num_free_blocks() == num_free_before
    else:
        assert taken is not None
        for block in taken:
            was_tier = [p for p, b in tier if b == block.block_id]
            assert not was_tier or was_tier[0] < new_priority
            assert block.block_id not in {b.block_id for b in lru}
            assert block.block_id not in protected
        pool.free_blocks(taken)  # back as empty blocks, at the queue head
        taken_ids = {b.block_id for b in taken}
        tier = [(p, b) for p, b in tier if b not in taken_ids]
        empty = [b for b in empty if b not in taken_ids]
    # Drain the pool: empty blocks first, then the tier in priority order,
    # then the LRU queue, then protected states in age order.
    order = [b.block_id for b in pool.get_new_blocks(pool.get_num_free_blocks())]
    tier_ids = {b for _, b in tier}
    lru_ids = {b.block_id for b in lru}
    phase = [
        0
        if b not in tier_ids | lru_ids | set(protected)
        else 1
        if b in tier_ids
        else 2
        if b in lru_ids
        else 3
        for b in order
    ]
    assert phase == sorted(phase)
    tier_order = [b for b in order if b in tier_ids]
    assert tier_order == [b for _, b in sorted(tier)]
    assert [b for b in order if b in lru_ids] == [b.block_id for b in lru]
    assert [b for b in order if b in set(protected)] == protected


def test_mamba_state_stats() -> None:
    """Hits, misses (attention cached further than any state) and
    evictions of Mamba states reach PrefixCacheStats."""
    driver = _Driver("all", 60, 4 * BLOCK_SIZE, 0, seed=0)
    doc = list(range(12 * BLOCK_SIZE))
    for i in range(6):
        request = make_request(
            f"q{i}",
            doc + [5_000_000 * (i + 1) + j for j in range(40)],
            BLOCK_SIZE,
            sha256,
        )
        request.sampling_params.max_tokens = 1 << 20
        driver.add(request, num_decode=2)
    driver.run()
    stats = driver.manager.make_prefix_cache_stats()
    assert stats is not None
    num_hits = sum(1 for _, n in driver.hits if n)
    assert stats.mamba_state_hits == num_hits > 0
    pool = driver.manager.block_pool
    assert stats.mamba_state_evictions == pool.num_checkpoint_evictions
    assert stats.mamba_checkpoints_skipped == pool.num_checkpoints_skipped


def test_resumed_state_is_protected_while_its_request_runs() -> None:
    """The cached state a request resumed from (its prefix hit, a proven
    branch point) is protected while the request runs once the request no
    longer references it, and joins the LRU queue when the request finishes."""
    driver = _Driver("all", 200, 4 * BLOCK_SIZE, 0, seed=0)
    doc = list(range(6 * BLOCK_SIZE))
    first = make_request(
        "a", doc + [7_000_000 + j for j in range(40)], BLOCK_SIZE, sha256
    )
    first.sampling_params.max_tokens = 1 << 20
    driver.add(first, num_decode=1)
    driver.run()
    reader = make_request(
        "b", doc + [8_000_000 + j for j in range(3 * BLOCK_SIZE)], BLOCK_SIZE, sha256
    )
    reader.sampling_params.max_tokens = 1 << 20
    driver.add(reader, num_decode=2)
    driver.step()
    ((_, num_hit),) = driver.hits[-1:]
    assert num_hit == len(doc)
    pool = driver.manager.block_pool
    hit_ids = [
        row[num_hit // BLOCK_SIZE - 1] for row in driver.running[0].worker_rows[1:]
    ]
    while driver.running:
        driver.step()
        if driver.running and all(pool.blocks[b].ref_cnt == 0 for b in hit_ids):
            assert all(pool._protected.get(b) == "b" for b in hit_ids)
    assert not any(b in pool._protected for b in hit_ids)
    assert all(pool.blocks[b].block_hash is not None for b in hit_ids)


def test_admission_does_not_take_protected_states() -> None:
    """A running request's protected states are free for its own steps but
    not for an admission: a waiting request that would only fit by evicting
    them waits (align mode's running request holds those states)."""
    driver = _Driver("all", 40, 16 * BLOCK_SIZE, 0, seed=0)
    first = make_request("r", list(range(6 * BLOCK_SIZE + 5)), BLOCK_SIZE, sha256)
    first.sampling_params.max_tokens = 1 << 20
    driver.add(first, num_decode=100)
    pool = driver.manager.block_pool
    for _ in range(3):
        driver.step()
    assert pool._protected and driver.running
    num_unprotected = pool.get_num_unprotected_free_blocks()
    # Attention blocks plus, per Mamba group, one write block and the prompt
    # checkpoint's block: one more block than the unprotected free ones.
    num_tokens = (num_unprotected + 1 - 2 * NUM_MAMBA_GROUPS) * BLOCK_SIZE - 1
    assert num_tokens > 2 * BLOCK_SIZE
    assert num_unprotected + 1 <= pool.get_num_free_blocks()

    def waiting_request(request_id: str) -> Request:
        tokens = [900_000 + t for t in range(num_tokens)]
        return make_request(request_id, tokens, BLOCK_SIZE, sha256)

    assert driver.manager.allocate_slots(waiting_request("w"), num_tokens) is None
    running = waiting_request("x")
    running.status = RequestStatus.RUNNING
    assert driver.manager.allocate_slots(running, num_tokens) is not None


def test_admission_reserves_the_chunk_end_state() -> None:
    """A prefill chunk that ends inside a block (on the kernel-chunk grid)
    leaves its last block boundary's state, which align mode keeps (align
    ends the chunk there, in its write block), in a checkpoint slot: its
    admission counts one block per Mamba group for it. Two admissions in one
    step that fill the pool must not leave the first's chunk-end state without
    a block (without the reserve both fit and neither state is kept)."""
    chunk = 3 * BLOCK_SIZE + KERNEL_CHUNK
    # Attention blocks of the chunk plus, per Mamba group, the write block and
    # the chunk-end block: room for one request with the reserve, for two
    # without it and nothing left for their chunk-end states.
    per_request = -(-chunk // BLOCK_SIZE) + 2 * NUM_MAMBA_GROUPS
    num_free = per_request + 4
    # The step's token budget admits a second request after a first chunk.
    driver = _Driver("all", 1 + num_free, chunk + 1, 0, seed=0)
    for i in range(3):
        request = make_request(
            f"r{i}",
            [(i + 1) * 100_000 + t for t in range(4 * chunk)],
            BLOCK_SIZE,
            sha256,
        )
        request.sampling_params.max_tokens = 1 << 20
        driver.add(request, num_decode=1)
    driver.step()
    check_block_accounting(driver.manager, driver.running)
    assert driver.running
    anchor_idx = chunk // BLOCK_SIZE - 1
    for run in driver.running:
        assert run.request.num_computed_tokens == chunk
        for manager in _mamba_managers(driver.manager):
            blocks = manager.req_to_blocks[run.request.request_id]
            assert not blocks[anchor_idx].is_null, run.request.request_id
            assert blocks[anchor_idx].block_hash is not None


def test_admission_reserves_the_prompt_checkpoint() -> None:
    """An admission whose step holds the prompt's checkpoint (align mode's
    prefill checkpoint, which align allocates with the chunk) counts one
    block per Mamba group for it. Two admissions in one step that fill the
    pool must not leave the first's prompt checkpoint without a block
    (without the reserve both fit and the first's checkpoint is skipped, so
    a request sharing that prompt resumes a block lower)."""
    num_prompt = 3 * BLOCK_SIZE + 5
    prompt_idx = (num_prompt - 1) // BLOCK_SIZE - 1
    num_attn = -(-num_prompt // BLOCK_SIZE)
    # Two admissions without the reserve (attention blocks and a write block
    # per Mamba group each) leave one block too few for a checkpoint; with
    # the reserve the second does not fit.
    num_free = 2 * (num_attn + NUM_MAMBA_GROUPS) + NUM_MAMBA_GROUPS - 1
    driver = _Driver("all", 1 + num_free, 2 * num_prompt, 0, seed=0)
    for i in range(2):
        request = make_request(
            f"r{i}",
            [(i + 1) * 100_000 + t for t in range(num_prompt)],
            BLOCK_SIZE,
            sha256,
        )
        request.sampling_params.max_tokens = 1 << 20
        driver.add(request, num_decode=1)
    driver.step()
    check_block_accounting(driver.manager, driver.running)
    assert driver.running
    for run in driver.running:
        assert run.request.num_computed_tokens == num_prompt
        for manager in _mamba_managers(driver.manager):
            blocks = manager.req_to_blocks[run.request.request_id]
            assert not blocks[prompt_idx].is_null, run.request.request_id
            assert blocks[prompt_idx].block_hash is not None


def test_unwritten_prompt_checkpoint_protects_the_read_slot() -> None:
    """A running request's final prefill chunk takes its prompt checkpoint
    from spare blocks only. When a same-step admission leaves none, the
    checkpoint is skipped; the request's read slot, which the step writes up
    to its block boundary (the highest state below the skipped one), is then
    protected in its place until the request finishes, as align mode holds
    its checkpoint, instead of joining the LRU queue for the next admission
    to evict. A reader of the prompt resumes from it afterwards."""
    num_prompt = 4 * BLOCK_SIZE + 40
    prompt_idx = (num_prompt - 1) // BLOCK_SIZE - 1
    # First chunk: two blocks and a kernel chunk, so the final chunk starts
    # inside block 2 and writes its boundary into the read slot in place.
    budget = 2 * BLOCK_SIZE + KERNEL_CHUNK
    read_idx = budget // BLOCK_SIZE
    # With 18 blocks the final chunk of "a" and the admission of "b" (in the
    # budget left over) leave one unprotected block, fewer than the Mamba
    # groups need for the prompt checkpoint.
    driver = _Driver("all", 18, budget, 0, seed=0)
    tokens = list(range(num_prompt))
    first = make_request("a", tokens, BLOCK_SIZE, sha256)
    other = make_request(
        "b", [500_000 + t for t in range(3 * BLOCK_SIZE)], BLOCK_SIZE, sha256
    )
    for request in (first, other):
        request.sampling_params.max_tokens = 1 << 20
        driver.add(request, num_decode=4)
    pool = driver.manager.block_pool
    managers = _mamba_managers(driver.manager)
    driver.step()
    assert first.num_computed_tokens == budget
    read_ids = [m.req_to_blocks["a"][read_idx].block_id for m in managers]
    driver.step()
    check_block_accounting(driver.manager, driver.running)
    assert first.num_computed_tokens == num_prompt
    assert [run.request.request_id for run in driver.running] == ["a", "b"]
    # The prompt checkpoint was not written for want of a block.
    assert pool.num_checkpoints_skipped > 0
    assert all(m.req_to_blocks["a"][prompt_idx].is_null for m in managers)
    # The next step retires the read slot: protected, owned by "a".
    driver.step()
    check_block_accounting(driver.manager, driver.running)
    assert all(m.req_to_blocks["a"][read_idx].is_null for m in managers)
    assert all(pool._protected.get(b) == "a" for b in read_ids)
    while driver.running:
        driver.step()
    assert not any(b in pool._protected for b in read_ids)
    assert all(pool.blocks[b].block_hash is not None for b in read_ids)
    reader = make_request(
        "r",
        tokens[: (read_idx + 1) * BLOCK_SIZE] + [900_000 + t for t in range(40)],
        BLOCK_SIZE,
        sha256,
    )
    reader.sampling_params.max_tokens = 1 << 20
    driver.add(reader, num_decode=1)
    driver.step()
    assert driver.hits[-1] == (reader, (read_idx + 1) * BLOCK_SIZE)
